"""Time every advantage estimator on realistic synthetic rollout batches, against the plain-Python reference.

    python benchmarks/advantages.py                 # 16 groups x 8 rollouts x <= 50 steps (~6,400 rows), and 8x
    python benchmarks/advantages.py --json out.json

A batch looks like ALFWorld's: each task group walks a small room graph whose observation texts repeat (so
anchor groups are large and deeper levels split them), the few episodes that succeed end early with reward 10,
about 5% of outputs are invalid.

Each implementation gets the batch in its natural form: the vectorised estimators get numpy columns with
observations as int64 keys (`observation_keys`, what the trainer passes); the plain-Python reference gets
Python lists. The "text" column times the vectorised estimators on Python lists of observation text, as a
user's own batch may come.
Targets (issue 2): HGPO K = 4 on ~6,400 rows >= 50x faster than the reference; 8x the rows within 10x the time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a checkout's run, nothing installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hgpo_trl.advantages import StepBatch, compute_advantages, observation_keys
from tests import reference

CASES = [
    ("grpo", {}),
    ("gigpo", {}),
    ("hgpo K=2", {"depth": 2}),
    ("hgpo K=4", {"depth": 4}),
    ("hgpo K=4 inverse_mse", {"depth": 4, "weighting": "inverse_mse"}),
    ("hgpo K=4 base_group", {"depth": 4, "base_group": True}),
    ("progpo K=2", {"depth": 2}),
    ("progpo K=4", {"depth": 4}),
]


def synthetic_batch(groups: int, rollouts: int, max_steps: int, seed: int = 0) -> StepBatch:
    rng = np.random.default_rng(seed)
    cols = {k: [] for k in ("group", "traj", "step", "obs", "reward", "valid", "action")}
    traj = 0
    for g in range(groups):
        rooms = [f"You arrive at {place} {i}. On the {place} {i}, you see a {item}."
                 for i, (place, item) in enumerate(zip(rng.choice(["cabinet", "countertop", "drawer", "shelf"], 12),
                                                       rng.choice(["mug", "apple", "nothing", "knife"], 12),
                                                       strict=True))]
        goal = int(rng.integers(len(rooms)))
        for _ in range(rollouts):
            room, t = 0, 0
            while True:
                valid = rng.random() > 0.05
                action = f"go to room {int(rng.integers(len(rooms)))}" if valid else None
                cols["group"].append(g)
                cols["traj"].append(traj)
                cols["step"].append(t)
                cols["obs"].append(rooms[room])
                cols["valid"].append(valid)
                cols["action"].append(action)
                won = room == goal and rng.random() < 0.02
                done = won or t == max_steps - 1
                cols["reward"].append(10.0 if won else 0.0)
                if done:
                    break
                room = int(rng.integers(len(rooms))) if valid and rng.random() < 0.6 else room
                t += 1
            traj += 1
    return StepBatch(**cols)


def as_arrays(batch: StepBatch) -> StepBatch:
    """The batch as the trainer hands it over: numpy columns, observations and actions as int64 keys."""
    return StepBatch(group=np.asarray(batch.group), traj=np.asarray(batch.traj), step=np.asarray(batch.step),
                     obs=observation_keys(batch.obs), reward=np.asarray(batch.reward, dtype=np.float64),
                     valid=np.asarray(batch.valid),
                     action=observation_keys([a if a is not None else "" for a in batch.action]))


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 8],
                        help="batch sizes as multiples of 16 groups x 8 rollouts x <= 50 steps")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per estimator (the best is kept)")
    parser.add_argument("--reference-max-rows", type=int, default=60_000,
                        help="skip the plain-Python reference on batches larger than this")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args()

    print(f"numpy {np.__version__}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    results = []
    for scale in args.scales:
        text_batch = synthetic_batch(groups=16 * scale, rollouts=8, max_steps=50)
        array_batch = as_arrays(text_batch)
        n = len(text_batch)
        print(f"\nbatch: {16 * scale} groups x 8 rollouts, {n} steps")
        print(f"{'estimator':<22} {'ms/call':>8} {'rows/s':>11} {'text ms':>8} {'reference ms':>13} {'speed-up':>9}")
        for label, options in CASES:
            name = label.split()[0]

            def timed(batch, fn=compute_advantages, name=name, options=options, repeats=args.repeats):
                return best_time(lambda: fn(name, batch, **options), repeats)

            seconds = timed(array_batch)
            text_seconds = timed(text_batch)
            ref_seconds = None
            if n <= args.reference_max_rows:
                ref_seconds = timed(text_batch, fn=lambda name, b, **o: reference.REFERENCES[name](b, **o), repeats=1)
            row = {"estimator": label, "rows": n, "seconds": seconds, "rows_per_second": n / seconds,
                   "text_seconds": text_seconds, "reference_seconds": ref_seconds,
                   "speedup": None if ref_seconds is None else ref_seconds / seconds}
            results.append(row)
            ref_ms = "-" if ref_seconds is None else f"{1e3 * ref_seconds:.0f}"
            speedup = "-" if ref_seconds is None else f"{ref_seconds / seconds:.0f}x"
            print(f"{label:<22} {1e3 * seconds:>8.2f} {n / seconds:>11,.0f} {1e3 * text_seconds:>8.2f} "
                  f"{ref_ms:>13} {speedup:>9}")

    if len(args.scales) > 1:
        small, large = min(args.scales), max(args.scales)
        print(f"\nscaling from x{small} to x{large} rows (linear = {large // small}x):")
        for label, _ in CASES:
            t = {r["rows"]: r["seconds"] for r in results if r["estimator"] == label}
            rows = sorted(t)
            print(f"  {label:<22} {t[rows[-1]] / t[rows[0]]:.1f}x the time for {rows[-1] / rows[0]:.1f}x the rows")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
