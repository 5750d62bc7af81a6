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

Similarity-based anchor groups (issue 35): GiGPO with `similarity_threshold=0.95` against the released rule
(`reference.released_similarity_groups`, build_step_group with enable_similarity) on an ALFWorld-worded text
batch with near-duplicate observations (`alfworld_text_batch`, rows in rollout order as the release's batch):
both times, the speed-up (target >= 20x) and whether the groups are identical; then HGPO K = 4 with and without
the option (ours), its cost and how many steps have peers per level. `--no-similarity` skips it (~30 s).
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
from hgpo_trl.advantages import StepBatch, compute_advantages, hgpo_level_stats, observation_keys
from hgpo_trl.advantages.batch import sort_steps
from hgpo_trl.advantages.similarity import similar_observations
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


# An ALFWorld kitchen: receptacle kinds, how many of each at most, and whether they open.
RECEPTACLES = [("cabinet", 12, True), ("countertop", 3, False), ("drawer", 10, True), ("fridge", 1, True),
               ("microwave", 1, True), ("shelf", 4, False), ("sinkbasin", 1, False), ("stoveburner", 4, False),
               ("garbagecan", 1, False), ("coffeemachine", 1, False), ("diningtable", 1, False), ("toaster", 1, False)]
OBJECTS = ["apple", "bread", "butterknife", "cup", "dishsponge", "egg", "fork", "knife", "lettuce", "mug", "pan",
           "peppershaker", "plate", "pot", "potato", "saltshaker", "soapbottle", "spatula", "spoon", "tomato"]


def listing(things: list[str]) -> str:
    """ALFWorld's "a mug 1, a cup 2, and a knife 1" (or "nothing")."""
    named = [f"a {thing}" for thing in things] or ["nothing"]
    return named[0] if len(named) == 1 else ", ".join(named[:-1]) + ", and " + named[-1]


def alfworld_text_batch(groups: int, rollouts: int, max_steps: int, seed: int = 0) -> StepBatch:
    """Random walks in ALFWorld-worded kitchens, observations as text with ALFWorld's near-duplicates: the same
    place after an object was taken or put back ("you see a apple 1, a mug 2" / "you see a apple 1"), places
    that differ by a number ("cabinet 1" / "cabinet 11"), listings over 200 characters (where difflib's autojunk
    acts), and the game's banner, shared by a task group's rollouts. Rewards and invalid outputs as in
    `synthetic_batch`; a rollout wins when it puts the goal object on the goal place."""
    rng = np.random.default_rng(seed)
    cols = {k: [] for k in ("group", "traj", "step", "obs", "reward", "valid", "action")}
    for g in range(groups):
        places = {f"{kind} {i}": opens for kind, most, opens in RECEPTACLES for i in range(1, rng.integers(most) + 2)}
        # Tables and countertops hold up to 14 objects (listings over 200 characters), cabinets and drawers 6.
        stock = {p: [f"{o} {rng.integers(1, 4)}" for o in rng.choice(OBJECTS, rng.integers(7 if opens else 15),
                                                                      replace=False)] for p, opens in places.items()}
        goal_object = str(rng.choice([o for things in stock.values() for o in things] or ["mug 1"]))
        goal_place = str(rng.choice(list(places)))
        banner = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around "
                  f"you, you see {listing(list(places)[::-1])}.\n\nYour task is to: put some "
                  f"{goal_object.split()[0]} on {goal_place.split()[0]}.")
        for _ in range(rollouts):
            traj, items, opened = len(set(cols["traj"])), {p: list(t) for p, t in stock.items()}, set()
            here, held, obs = None, None, banner
            for t in range(max_steps):
                valid, u, won = bool(rng.random() > 0.05), rng.random(), False
                cols["group"].append(g), cols["traj"].append(traj), cols["step"].append(t)
                cols["obs"].append(obs), cols["valid"].append(valid)
                if not valid:
                    action, obs = None, "Nothing happens."
                elif u < 0.55 or here is None:
                    # Holding the goal object, half the walks head for the goal place (a few rollouts win).
                    here = goal_place if held == goal_object and u < 0.3 else str(rng.choice(list(places)))
                    action = f"go to {here}"
                    obs = (f"You arrive at {here}. The {here} is closed." if places[here] and here not in opened else
                           f"You arrive at {here}. " + (f"The {here} is open. In it, you see" if places[here] else
                                                        f"On the {here}, you see") + f" {listing(items[here])}.")
                elif u < 0.65 and places[here] and here not in opened:
                    opened.add(here)
                    action, obs = f"open {here}", f"You open the {here}. The {here} is open. In it, you see " \
                                                  f"{listing(items[here])}."
                elif u < 0.8 and held is None and items[here]:
                    pick = items[here].index(goal_object) if goal_object in items[here] else rng.integers(len(items[here]))
                    held = items[here].pop(pick)
                    action, obs = f"take {held} from {here}", f"You pick up the {held} from the {here}."
                elif u < 0.9 and held is not None:
                    items[here].append(held)
                    action, obs = f"move {held} to {here}", f"You move the {held} to the {here}."
                    won, held = (held, here) == (goal_object, goal_place), None
                else:
                    action = "inventory"
                    obs = f"You are carrying: a {held}." if held else "You are not carrying anything."
                cols["action"].append(action)
                cols["reward"].append(10.0 if won else 0.0)
                if won:
                    break
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


def same_partition(a: list, b: list) -> bool:
    """Whether two labellings of the same rows group them alike."""
    pairs = set(zip(a, b, strict=True))
    return len(pairs) == len(set(a)) == len(set(b))


def similarity_rows(repeats: int, threshold: float = 0.95) -> list[dict]:
    """GiGPO's similarity grouping, ours against the released rule, and HGPO with the option (ours)."""
    batch = alfworld_text_batch(groups=16, rollouts=8, max_steps=50)
    n = len(batch)
    start = time.perf_counter()
    released = reference.released_similarity_groups(batch.group, batch.obs, threshold)
    released_seconds = time.perf_counter() - start
    seconds = best_time(lambda: compute_advantages("gigpo", batch, similarity_threshold=threshold), repeats)
    steps = sort_steps(batch)
    identical = same_partition(steps.unsort(similar_observations(steps, batch.obs, threshold)).tolist(), released)
    exact = len(set(zip(batch.group, batch.obs, strict=True)))
    print(f"\nsimilarity-based anchor groups, threshold {threshold}: ALFWorld-worded text batch, 16 groups x 8 "
          f"rollouts, {n} steps, {exact} distinct (task group, observation) pairs -> {len(set(released))} clusters")
    print(f"  released rule (build_step_group)     {1e3 * released_seconds:>9.0f} ms")
    print(f"  gigpo similarity_threshold={threshold}    {1e3 * seconds:>9.1f} ms   (the whole estimator)")
    print(f"  speed-up {released_seconds / seconds:.0f}x, identical groups: {identical}")
    rows = [{"estimator": f"gigpo similarity_threshold={threshold}", "rows": n, "seconds": seconds,
             "rows_per_second": n / seconds, "text_seconds": seconds, "reference_seconds": released_seconds,
             "speedup": released_seconds / seconds, "identical_groups": identical}]
    for options in ({}, {"similarity_threshold": threshold}):
        hgpo_seconds = best_time(lambda o=options: compute_advantages("hgpo", batch, depth=4, **o), repeats)
        peers = [s.with_peers for s in hgpo_level_stats(batch, depth=4, **options)]
        label = f"hgpo K=4 {'similarity_threshold=' + str(threshold) if options else 'exact'}"
        print(f"  {label:<36} {1e3 * hgpo_seconds:>9.1f} ms   steps with peers at levels 0..4: {peers}")
        rows.append({"estimator": label, "rows": n, "seconds": hgpo_seconds, "rows_per_second": n / hgpo_seconds,
                     "text_seconds": hgpo_seconds, "reference_seconds": None, "speedup": None, "with_peers": peers})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 8],
                        help="batch sizes as multiples of 16 groups x 8 rollouts x <= 50 steps")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per estimator (the best is kept)")
    parser.add_argument("--reference-max-rows", type=int, default=60_000,
                        help="skip the plain-Python reference on batches larger than this")
    parser.add_argument("--no-similarity", action="store_true",
                        help="skip the similarity-based anchor groups' comparison with the released rule (~30 s)")
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
    if not args.no_similarity:
        results += similarity_rows(args.repeats)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
