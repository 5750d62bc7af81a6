"""Environment throughput: ALFWorld stepped in-process and by worker pools; memory per ALFWorld environment.

    python benchmarks/envs.py [--envs 8] [--steps 10] [--data PATH]

Plays `--envs` valid_unseen games with the handcoded expert's actions for `--steps` steps, timing resets and
steps with 1 worker and with 2 workers (the target: 2 workers at least 1.6x the steps per second of 1), and
reports the resident memory one ALFWorld environment adds; times a task group's resets into one game with
fast-downward's translations remembered and afresh. Also times keydoor and WebShop in-process.
Data: --data, else $ALFWORLD_DATA, else the packed games in ../shared/data/alfworld.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a checkout's run, nothing installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil

from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.pool import InProcessEnvs, WorkerPoolEnvs

PACKED = Path(__file__).resolve().parents[2] / "shared" / "data" / "alfworld"


def play(batch, tasks, steps: int) -> tuple[float, float, int]:
    """(reset seconds, step seconds, steps taken) for one episode per environment, expert actions."""
    tick = time.perf_counter()
    results = batch.reset(tasks)
    reset_seconds = time.perf_counter() - tick
    infos = {i: r.info for i, r in enumerate(results) if r.fault is None}
    taken, step_seconds = 0, 0.0
    for _ in range(steps):
        actions = {i: info.get("expert_action") or info["admissible_actions"][0] for i, info in infos.items()}
        if not actions:
            break
        tick = time.perf_counter()
        out = batch.step(actions)
        step_seconds += time.perf_counter() - tick
        taken += len(actions)
        infos = {i: r.info for i, r in out.items() if not (r.terminated or r.truncated or r.fault)}
    return reset_seconds, step_seconds, taken


def alfworld(args) -> None:
    data = args.data or os.environ.get("ALFWORLD_DATA") or str(PACKED)
    tasks = list(make_tasks("alfworld", "valid_unseen", data_path=data, num_tasks=args.envs))
    factory = partial(make_env, "alfworld", split="valid_unseen", data_path=data, expert=True)

    process = psutil.Process()
    before = process.memory_info().rss
    env = factory()
    env.reset(tasks[0])
    per_env = (process.memory_info().rss - before) / 2**20
    env.close()
    print(f"ALFWorld: one environment adds {per_env:.0f} MiB resident (after its first reset)")

    rates = {}
    for workers in (1, 2):
        batch = InProcessEnvs(factory, len(tasks)) if workers == 1 and args.in_process else \
            WorkerPoolEnvs(factory, len(tasks), num_workers=workers)
        with batch:
            play(batch, tasks, 1)  # warm up: workers start, games are unpacked and grounded once
            reset_seconds, step_seconds, taken = play(batch, tasks, args.steps)
        rates[workers] = taken / step_seconds
        print(f"ALFWorld, {workers} worker(s), {len(tasks)} envs: reset {reset_seconds:.1f} s for all, "
              f"{rates[workers]:.1f} steps/s ({1e3 * step_seconds / taken:.0f} ms a step per env)")
    print(f"speed-up of 2 workers over 1: {rates[2] / rates[1]:.2f}x (target >= 1.6x)")


def group_resets(args) -> None:
    """A task group's resets: `--envs` environments in this process reset into one game, then into another (as
    the G rollouts of a task do each iteration), with fast-downward's translations remembered (the default)
    and made afresh each time."""
    import fast_downward

    from hgpo_trl.envs.alfworld import _translated

    data = args.data or os.environ.get("ALFWORLD_DATA") or str(PACKED)
    tasks = list(make_tasks("alfworld", "valid_unseen", data_path=data, num_tasks=3))
    factory = partial(make_env, "alfworld", split="valid_unseen", data_path=data)
    with InProcessEnvs(factory, args.envs) as batch:
        batch.reset([tasks[0]] * args.envs)  # engines started, games unpacked
        remembered = fast_downward.pddl2sas
        timings = {}
        for label, translate, task in (("remembered", remembered, tasks[1]), ("afresh", remembered.original, tasks[2])):
            fast_downward.pddl2sas = translate
            _translated.cache_clear()
            tick = time.perf_counter()
            batch.reset([task] * args.envs)
            timings[label] = time.perf_counter() - tick
        fast_downward.pddl2sas = remembered
    print(f"ALFWorld, {args.envs} envs reset into one new game: {timings['remembered']:.1f} s with translations "
          f"remembered, {timings['afresh']:.1f} s afresh ({timings['afresh'] / timings['remembered']:.1f}x)")


def fast_envs() -> None:
    """keydoor and the generated WebShop in-process, each environment taking its first admissible action."""
    for name in ("keydoor", "webshop"):
        tasks = list(make_tasks(name, "train", num_tasks=64))
        with InProcessEnvs(partial(make_env, name), len(tasks)) as batch:
            reset_seconds, step_seconds, taken = play(batch, tasks, 4)
        print(f"{name}: {taken / step_seconds:,.0f} steps/s in-process ({1e6 * step_seconds / taken:.0f} us a "
              f"step; reset {1e6 * reset_seconds / len(tasks):.0f} us)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=8, help="ALFWorld environments (games) stepped together")
    parser.add_argument("--steps", type=int, default=10, help="expert steps per environment")
    parser.add_argument("--data", help="ALFWorld data: a json_2.1.1 tree or the folder of packed games")
    parser.add_argument("--in-process", action="store_true", help="the 1-worker case steps in this process")
    args = parser.parse_args()
    fast_envs()
    group_resets(args)
    alfworld(args)


if __name__ == "__main__":
    main()
