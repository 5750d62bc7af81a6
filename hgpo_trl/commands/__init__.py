"""The command line: `train.py` / `hgpo-train` (`train`), `evaluate.py` / `hgpo-eval` (`evaluate`, with the players
it evaluates in `players`), their entry points that refuse a bad config before the heavy imports (`entry_points`,
`quick_check`), and the YAML + command-line parsing they share (`arguments`, `parser`)."""
