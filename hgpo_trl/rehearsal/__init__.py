"""A rehearsal of a GPU run on CPUs: the same config, accelerate file and processes, a tiny model of the real
one's architecture with its real tokenizer, and a projection of the real run's memory and time."""
