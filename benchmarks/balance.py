"""What `balance_steps` changes on real ALFWorld episode lengths, how its two partitions split the rows, and what
its row exchange costs.

    python benchmarks/balance.py [--tasks 16] [--resamples 500] [--rows 2000]

1. Plays `--tasks` real ALFWorld train games x 8 rollouts with an expert-mixed player (each step the handcoded
   expert's action with probability 1/2, else a uniform admissible one; up to 50 steps), then, over `--resamples`
   draws of 16 of those task groups (with replacement), counts for the paper configs' batching (ALFWorld 1.5B: 2
   processes x 8 tasks, micro-batches of 16, mini-batches of 256; 7B: 4 x 4, micro-batches of 8, mini-batches of
   256; fill_last_micro_batch duplicate) the optimizer steps and the padding rows per iteration with task groups
   kept on their process and with rows balanced, and how unbalanced the processes are (the busiest one's rows
   over the mean).
2. On the same draws, each row's tokens (its prompt in Qwen2.5's chat template, plus a completion of 64-512
   tokens drawn at random: the scripted player writes none), filled and split by each `balance_partition`: the
   processes' token spread (global_seqlen/balanced_max - balanced_min), how alike the two partitions' optimizer
   steps are (the Jaccard index of each step's rows over all processes), and the milliseconds a split takes.
3. Launches 2 CPU processes (`accelerate launch`) that exchange `--rows` rows each, ALFWorld-sized (1,300 prompt
   and 100 completion tokens), through `hgpo_trl.training.balance.balanced_rows`, and prints the seconds it takes.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # a checkout's run, nothing installed
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402  (after the path set-up)

GROUP = 8
CONFIGS = {"ALFWorld 1.5B": dict(processes=2, micro=16, mini=256), "ALFWorld 7B": dict(processes=4, micro=8, mini=256)}


def play(num_tasks: int, seed: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """Real ALFWorld train games under the expert-mixed player: (num_tasks, GROUP) episode lengths, and per task
    group its rows' token counts in the released batch order (each trajectory's steps in turn)."""
    import random

    from transformers import AutoTokenizer

    from hgpo_trl.envs import make_env, make_tasks
    from hgpo_trl.envs.pool import WorkerPoolEnvs
    from hgpo_trl.rollout.actions import format_action
    from hgpo_trl.rollout.generation import encode_prompt
    from hgpo_trl.rollout.lockstep import Completion, RolloutSettings, run_rollout

    data = os.environ.get("ALFWORLD_DATA") or str(ROOT.parent / "shared" / "data" / "alfworld")
    tasks = make_tasks("alfworld", "train", data_path=data)
    rows = [tasks[int(i)] for i in np.random.default_rng(seed).choice(len(tasks), num_tasks, replace=False)]
    rng = random.Random(seed)

    def mixed(prompts, infos):
        return [Completion(format_action(info["expert_action"] if rng.random() < 0.5 else
                                         rng.choice(info["admissible_actions"]), "tags")) for info in infos]

    envs = WorkerPoolEnvs(partial(make_env, "alfworld", data_path=data, expert=True), num_tasks * GROUP,
                          num_workers=os.cpu_count() or 1)
    try:
        rollout = run_rollout(envs, rows, GROUP, mixed, RolloutSettings(max_steps=50, format_instruction=""),
                              scripted=True)
    finally:
        envs.close()
    tokenizer = AutoTokenizer.from_pretrained(ROOT.parent / "shared" / "data" / "qwen2.5-tokenizer")
    completions = np.random.default_rng(seed).integers(64, 513, len(rollout.steps))
    steps = sorted(zip(rollout.steps, completions, strict=True), key=lambda sc: (sc[0].traj, sc[0].step))
    rows = [[] for _ in range(num_tasks)]
    for s, completion in steps:
        rows[s.group].append(len(encode_prompt(tokenizer, s.prompt)) + int(completion))
    return np.array([e.steps for e in rollout.episodes]).reshape(num_tasks, GROUP), [np.array(r) for r in rows]


def iteration_counts(rows_per_process: list[int], micro: int, mini: int, balanced: bool) -> tuple[int, int]:
    """(optimizer steps, padding rows) of one iteration, fill_last_micro_batch duplicate, as the trainer plans it."""
    processes = len(rows_per_process)
    accumulation = mini // (micro * processes)
    if balanced:  # the fill over all processes to micro x processes, then equal shares
        total = sum(rows_per_process)
        filled = total + (-total % (micro * processes))
        per_process = [filled // processes] * processes
    else:  # each process fills its own last micro-batch
        per_process = [n + (-n % micro) for n in rows_per_process]
    windows = math.ceil(math.ceil(max(per_process) / micro) / accumulation)
    slots = windows * accumulation * micro * processes
    return windows, slots - sum(per_process)


def counts_report(lengths: np.ndarray, resamples: int) -> None:
    rng = np.random.default_rng(0)
    print(f"{lengths.shape[0]} ALFWorld train games x {GROUP} rollouts, expert-mixed player: episode length mean "
          f"{lengths.mean():.1f}, min {lengths.min()}, max {lengths.max()}; per task group "
          f"{lengths.sum(1).min()}-{lengths.sum(1).max()} steps")
    for name, config in CONFIGS.items():
        processes, per = config["processes"], 16 // config["processes"]
        results = {False: np.zeros((resamples, 2)), True: np.zeros((resamples, 2))}
        ratios = np.zeros(resamples)
        for r in range(resamples):
            groups = lengths.sum(1)[rng.integers(0, len(lengths), 16)]
            rows = [int(groups[p * per:(p + 1) * per].sum()) for p in range(processes)]
            ratios[r] = max(rows) / np.mean(rows)
            for balanced in (False, True):
                results[balanced][r] = iteration_counts(rows, config["micro"], config["mini"], balanced)
        kept, shared = results[False].mean(0), results[True].mean(0)
        print(f"{name} ({processes} processes x {per} tasks, micro {config['micro']}, mini {config['mini']}): "
              f"busiest process / mean rows {ratios.mean():.2f} (p95 {np.percentile(ratios, 95):.2f}); per "
              f"iteration, groups kept: {kept[0]:.2f} optimizer steps, {kept[1]:.0f} padding rows; balanced: "
              f"{shared[0]:.2f} steps, {shared[1]:.0f} padding rows; balancing removes "
              f"{100 * (1 - shared[0] / kept[0]):.0f} % of the optimizer steps and "
              f"{100 * (1 - shared[1] / max(kept[1], 1e-9)):.0f} % of the padding rows")


def partition_report(group_rows: list[np.ndarray], resamples: int) -> None:
    from hgpo_trl.training.balance import PARTITIONS, fill_rows, token_spread

    rng = np.random.default_rng(0)
    for name, config in CONFIGS.items():
        processes, micro, mini = config["processes"], config["micro"], config["mini"]
        spread, seconds, jaccard = {p: [] for p in PARTITIONS}, {p: 0.0 for p in PARTITIONS}, []
        tokens = 0
        for _ in range(resamples):
            lengths = np.concatenate([group_rows[g] for g in rng.integers(0, len(group_rows), 16)])
            lengths = lengths[fill_rows(len(lengths), micro * processes, "duplicate", rng)]
            tokens += int(lengths.sum())
            windows = {}
            for partition, split in PARTITIONS.items():
                tick = time.perf_counter()
                sets = split(lengths, processes)
                seconds[partition] += time.perf_counter() - tick
                stats = token_spread(lengths, sets)
                spread[partition].append(stats["global_seqlen/balanced_max"] - stats["global_seqlen/balanced_min"])
                share = mini // processes  # each process's rows of one optimizer step
                windows[partition] = [set(np.concatenate([s[w:w + share] for s in sets]).tolist())
                                      for w in range(0, len(sets[0]), share)]
            jaccard += [len(a & b) / len(a | b) for a, b in zip(*windows.values(), strict=True)]
        per_process = tokens / resamples / processes
        print(f"{name}: token spread over the processes (balanced_max - balanced_min), mean / max: " + "; ".join(
            f"{p} {np.mean(v):.0f} / {np.max(v)} tokens ({seconds[p] / resamples * 1e3:.1f} ms a split)"
            for p, v in spread.items()) + f" (a process holds ~{per_process:,.0f}); optimizer steps' rows, "
              f"greedy vs karmarkar_karp: Jaccard {np.mean(jaccard):.2f} (min {np.min(jaccard):.2f})")


def exchange_worker(rows: int, repeats: int) -> None:
    """One process of the 2-process exchange timing (run under accelerate launch)."""
    from accelerate import PartialState

    from hgpo_trl.rollout.lockstep import Completion, StepRecord
    from hgpo_trl.training.balance import balanced_rows

    state = PartialState(cpu=True)  # the launch says use_cpu; a bare PartialState would not know it
    rng = np.random.default_rng(state.process_index)
    steps = [StepRecord(group=0, traj=0, step=0, observation="", prompt="",
                        completion=Completion("", rng.integers(0, 151_000, 1_300).tolist(),
                                              rng.integers(0, 151_000, 100).tolist()),
                        action="", reward=0.0, shown_history=0) for _ in range(rows)]
    seconds = []
    for repeat in range(repeats + 1):
        state.wait_for_everyone()
        start = time.perf_counter()
        balanced_rows(state, steps, np.zeros(rows), fill_multiple=32, fill="duplicate", seed=(0, repeat))
        seconds.append(time.perf_counter() - start)
    if state.is_main_process:
        megabytes = rows * (1_400 * 4 + 8) / 1e6
        print(f"row exchange, 2 CPU processes x {rows} rows of 1,300 + 100 tokens ({megabytes:.1f} MB each): "
              f"{np.mean(seconds[1:]):.2f} s per iteration (min {min(seconds[1:]):.2f}, {repeats} repeats)")
    state.wait_for_everyone()


def exchange_report(rows: int) -> None:
    accelerate = Path(sys.executable).with_name("accelerate")
    with tempfile.TemporaryDirectory():
        command = [str(accelerate), "launch", "--config_file", str(ROOT / "configs/accelerate/cpu_2proc.yaml"),
                   __file__, "--exchange-worker", "--rows", str(rows)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1_200)
    if result.returncode:
        sys.exit(f"the exchange launch failed:\n{result.stderr[-3000:]}")
    print(result.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--resamples", type=int, default=500)
    parser.add_argument("--rows", type=int, default=2_000)
    parser.add_argument("--exchange-worker", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.exchange_worker:
        exchange_worker(options.rows, repeats=5)
        return
    start = time.perf_counter()
    lengths, group_rows = play(options.tasks)
    counts_report(lengths, options.resamples)
    print(f"(played in {time.perf_counter() - start:.0f} s)")
    partition_report(group_rows, options.resamples)
    exchange_report(options.rows)


if __name__ == "__main__":
    main()
