"""How long `--help` takes: each command's `--help` (our sections; no torch, Transformers or TRL trainer imported)
and `--help-all` (every field: the whole parser, as `--help` was before it was split), in fresh processes.

    python benchmarks/help.py [--runs 5]

Prints the median and the slowest wall time of each command over --runs runs, and the lines it prints.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = (("train.py", "--help"), ("train.py", "--help-all"), ("evaluate.py", "--help"),
            ("evaluate.py", "--help-all"))


def timed(script: str, option: str) -> tuple[float, int]:
    """Seconds one fresh `python script option` takes, and the lines it prints."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, script, option], cwd=ROOT, capture_output=True, text=True, check=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    return time.perf_counter() - start, len(done.stdout.splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="Runs of each command.")
    runs = parser.parse_args().runs
    print(f"{'command':<28} {'median s':>9} {'max s':>7} {'lines':>6}")
    for script, option in COMMANDS:
        results = [timed(script, option) for _ in range(runs)]
        seconds = [s for s, _ in results]
        print(f"{script + ' ' + option:<28} {statistics.median(seconds):>9.2f} {max(seconds):>7.2f} "
              f"{results[0][1]:>6}")


if __name__ == "__main__":
    main()
