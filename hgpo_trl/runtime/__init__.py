"""What every stage shares while a run runs: the decisions all processes take together (`collective`), what the
console shows of progress (`progress`) and the random streams, one per (seed, rank, purpose) (`seeds`)."""
