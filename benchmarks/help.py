"""How long the commands take to answer before any training: each command's `--help` (our sections; no torch,
Transformers or TRL trainer imported), `--help-all` (every field: the whole parser, as `--help` was before it was
split) and a config file the parser refuses (a misspelt key, a word for a number: `hgpo_trl.commands.quick_check`, before the
training stack is imported), in fresh processes.

    python benchmarks/help.py [--runs 5]

Prints the median and the slowest wall time of each command over --runs runs, and the lines it prints.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (script, its options, the config file's text or None); a config is refused with exit code 2.
COMMANDS = (("train.py", ["--help"], None), ("train.py", ["--help-all"], None), ("evaluate.py", ["--help"], None),
            ("evaluate.py", ["--help-all"], None),
            ("train.py", ["--config", "bad.yaml"], "model_name_or_path: tiny\ntrain_iterations: twenty\n"),
            ("train.py", ["--config", "bad.yaml"], "model_name_or_path: tiny\nhistory_lenght: 4\n"),
            ("evaluate.py", ["--config", "bad.yaml"], "model_name_or_path: tiny\nhistory_lenght: 4\n"))


def timed(script: str, options: list[str], folder: Path) -> tuple[float, int]:
    """Seconds one fresh `python script options` takes (in `folder`, which holds its config), and the lines it
    prints (its error line for a refused config)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / script), *options], cwd=folder, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    if done.returncode != (2 if "--config" in options else 0):
        raise SystemExit(f"{script} {' '.join(options)} exited {done.returncode}: {done.stderr[-2000:]}")
    return time.perf_counter() - start, len((done.stdout + done.stderr).splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="Runs of each command.")
    runs = parser.parse_args().runs
    print(f"{'command':<54} {'median s':>9} {'max s':>7} {'lines':>6}")
    with tempfile.TemporaryDirectory() as scratch:
        for script, options, config in COMMANDS:
            if config is not None:
                (Path(scratch) / "bad.yaml").write_text(config)
            results = [timed(script, options, Path(scratch)) for _ in range(runs)]
            seconds = [s for s, _ in results]
            name = f"{script} {' '.join(options)}" + (f" ({config.splitlines()[-1]})" if config else "")
            print(f"{name:<54} {statistics.median(seconds):>9.2f} {max(seconds):>7.2f} {results[0][1]:>6}")


if __name__ == "__main__":
    main()
