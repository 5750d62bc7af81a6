"""`make demo` from a fresh clone, once per seed: its set-up and its run timed apart, and what it learned.

    python benchmarks/demo_seeds.py                    # seeds 0-4, one fresh clone each (~25 min on 2 cores)
    python benchmarks/demo_seeds.py --seeds 3 --keep   # one seed; the clone stays for a look at its output

Each seed clones this repository's HEAD (commit first: the working tree's changes are not in a clone) into a
temporary folder and runs the README's command there: `make demo DEMO_ARGS="--seed N"`. The set-up is the
Makefile's install step (creating .venv, installing the project) and is timed on its own; with uv's cache warm,
as on a user's second try, it takes seconds. Prints one row per seed (wall time without and with the set-up,
validation success before and after, iterations, why the run stopped), the median and the worst, and writes the
rows as JSON (`--json`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_SECONDS, TARGET_SUCCESS = 300, 0.95


def timed(command: list[str], cwd: Path, log: Path) -> float:
    start = time.time()
    with log.open("a") as out:
        done = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"demo_seeds: {' '.join(command)} failed in {cwd} (exit {done.returncode}); see {log}")
    return time.time() - start


def one_seed(seed: int, folder: Path) -> dict:
    clone = folder / f"seed{seed}"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    log = clone / "demo.log"
    setup = timed(["make", ".venv/.installed-dev"], clone, log)
    run = timed(["make", "demo", f"DEMO_ARGS=--seed {seed}"], clone, log)
    summary = json.loads((clone / "outputs" / "quickstart" / "summary.json").read_text())
    return {"seed": seed, "setup_s": round(setup, 1), "run_s": round(run, 1), "total_s": round(setup + run, 1),
            "success_before": summary["success_rate_start"], "success_after": summary["success_rate_end"],
            "iterations": summary["iterations"], "stopped_early": summary["stopped_early"], "log": str(log)}


def table(rows: list[dict]) -> str:
    lines = ["| seed | run (s) | with set-up (s) | validation success | iterations | stop |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        stop = "early stop" if r["stopped_early"] else "train_iterations"
        lines.append(f"| {r['seed']} | {r['run_s']:.0f} | {r['total_s']:.0f} | {r['success_before']:.2f} -> "
                     f"{r['success_after']:.2f} | {r['iterations']} | {stop} |")
    totals, after = [r["total_s"] for r in rows], [r["success_after"] for r in rows]
    lines.append(f"\nWith set-up: median {statistics.median(totals):.0f} s, worst {max(totals):.0f} s "
                 f"(target <= {TARGET_SECONDS} s); validation success after: median {statistics.median(after):.2f}, "
                 f"worst {min(after):.2f} (target >= {TARGET_SUCCESS}).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--json", type=Path, default=ROOT / "outputs" / "demo_seeds.json", help="where the rows go")
    parser.add_argument("--keep", action="store_true", help="keep the clones (their paths are printed)")
    options = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="hgpo-demo-seeds-"))
    rows = []
    for seed in options.seeds:
        rows.append(one_seed(seed, folder))
        print(json.dumps(rows[-1]), flush=True)
    options.json.parent.mkdir(parents=True, exist_ok=True)
    options.json.write_text(json.dumps(rows, indent=2))
    print(table(rows))
    if options.keep:
        print(f"clones kept under {folder}")
    else:
        subprocess.run(["rm", "-rf", str(folder)], check=True)


if __name__ == "__main__":
    main()
