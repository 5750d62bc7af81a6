"""What HGPOTrainer adds on top of TRL's GRPOTrainer, on the same samples and tokens (tiny model, CPU).

    python benchmarks/trainer_overhead.py [--iterations 10] [--samples 64] [--repeats 3] [--profile 12]

1. Training phase: HGPOTrainer trains on M step samples per iteration; GRPOTrainer trains on the very tensors
   HGPOTrainer built (its `_generate_and_score_completions` hands back HGPO's, iteration by iteration: the same
   prompts, completions, padding and advantages). Both are timed without their generation
   (`_generate_and_score_completions` is timed and subtracted). An iteration's training phase is one forward and
   backward of ~0.5 s, and a trainer timed after another in the same process ran up to a third slower than
   timed first: so each measurement is a process of its own, HGPO's and GRPO's alternate (which goes first
   alternates too), each figure is the median over a run's iterations (the first left out), and the ratio printed
   last is the median of the repeats'. Target: HGPO <= 1.05x GRPO. `--profile N`: the N functions of each
   training phase with the most time of their own (cProfile, generation left out, first repeat).
2. Rollout: the share of a rollout spent in generation, in the environments, and in the loop's own Python
   (prompt building, parsing, records).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a checkout's run, nothing installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_tasks
from hgpo_trl.models.tiny import build_tiny_model, build_tiny_tokenizer
from hgpo_trl.trainer import HGPOTrainer
from tests.conftest import keydoor_corpus


class Timed:
    """Wraps a trainer's generation method to time it and keep what it returned."""

    def __init__(self, trainer):
        self.seconds = []
        self.outputs = []
        original = trainer._generate_and_score_completions

        def timed(inputs):
            tick = time.perf_counter()
            out = original(inputs)
            self.seconds.append(time.perf_counter() - tick)
            self.outputs.append(out)
            return out

        trainer._generate_and_score_completions = timed


def run(trainer, timer, profile: cProfile.Profile | None) -> tuple[list[float], list[float]]:
    """(training seconds of each iteration, generation seconds of each iteration), the first left out; `profile`
    records the training phase (generation left out) after the first iteration."""
    steps = []
    original = trainer.training_step
    generate = trainer._generate_and_score_completions

    def timed_step(*args, **kwargs):
        on = profile is not None and len(timer.seconds) > 0
        tick = time.perf_counter()
        if on:
            profile.enable()
        try:
            return original(*args, **kwargs)
        finally:
            if on:
                profile.disable()
            steps.append(time.perf_counter() - tick)

    def generate_unprofiled(inputs):
        if profile is not None:
            profile.disable()
        try:
            return generate(inputs)
        finally:
            if profile is not None and len(timer.seconds) > 1:
                profile.enable()

    trainer.training_step = timed_step
    trainer._generate_and_score_completions = generate_unprofiled
    trainer.train()
    per_iteration = len(steps) // len(timer.seconds)
    totals = np.add.reduceat(np.array(steps), np.arange(0, len(steps), per_iteration))
    training = totals - np.array(timer.seconds)
    return training[1:].tolist(), timer.seconds[1:]


def top_entries(profile: cProfile.Profile, count: int) -> str:
    """The `count` functions with the most time of their own."""
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(count)
    lines = text.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    return "\n".join(line.replace(str(Path(sys.prefix)), "<venv>") for line in lines[start:start + count + 1])


def common_options(args) -> dict:
    """Both trainers' options. bf16 off for both: HGPOConfig's default on a CPU. GRPOConfig's own default is bf16
    autocast, whose forward on a CPU with AMX (this machine's) ran 2-3x faster than float32's: left to the defaults,
    the ratio compared precisions, not trainers (1.22-1.31x on 2026-12-04)."""
    return dict(per_device_train_batch_size=args.samples, num_generations=8, log_level="error",
                max_completion_length=args.completion_length, learning_rate=1e-4, logging_steps=10_000,
                report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0, disable_tqdm=True)


def hgpo_role(args, tokenizer, profile: cProfile.Profile | None) -> dict:
    """HGPOTrainer's run; its batches saved to `args.batches` for GRPO's."""
    config = HGPOConfig(output_dir=os.path.join(args.scratch, "hgpo"), tasks_per_device=4, max_env_steps=8,
                        action_mode="plain", train_iterations=args.iterations, **common_options(args))
    trainer = HGPOTrainer(model=build_tiny_model(tokenizer, hidden_size=args.hidden, num_layers=args.layers),
                          args=config, processing_class=tokenizer,
                          train_dataset=make_tasks("keydoor", "train", num_rooms=4, num_colors=4))
    timer, rollouts = Timed(trainer), []
    original_play = trainer._play
    trainer._play = lambda *a: rollouts.append(original_play(*a)) or rollouts[-1]
    training, generation = run(trainer, timer, profile)
    trainer.close_environments()
    torch.save([{k: v for k, v in out.items()} for out in timer.outputs], args.batches)
    later = rollouts[1:]
    total = sum(r.seconds for r in later)
    return {"training": training, "generation": generation, "tokens": tokens(timer.outputs),
            "prompts": [s.prompt for r in rollouts for s in r.steps], "rollout_split": [
                sum(r.generation_seconds for r in later) / total, sum(r.env_seconds for r in later) / total],
            "steps": float(np.mean([len(r.steps) for r in later])), "turns": float(np.mean([r.turns for r in later]))}


def grpo_role(args, tokenizer, profile: cProfile.Profile | None) -> dict:
    """GRPOTrainer's run on HGPO's saved batches (its dataset: HGPO's prompts, which its sampler needs; the batch
    its generation would build is replaced by HGPO's)."""
    batches = torch.load(args.batches, weights_only=False)
    prompts = json.loads(Path(args.batches).with_suffix(".json").read_text())
    config = GRPOConfig(output_dir=os.path.join(args.scratch, "grpo"), max_steps=args.iterations,
                        **common_options(args))
    trainer = GRPOTrainer(model=build_tiny_model(tokenizer, hidden_size=args.hidden, num_layers=args.layers),
                          reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=config,
                          processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": p}]
                                                                      for p in prompts]}))
    replay = iter(batches)
    trainer._generate_and_score_completions = lambda inputs: next(replay)
    timer = Timed(trainer)
    training, generation = run(trainer, timer, profile)
    return {"training": training, "generation": generation, "tokens": tokens(timer.outputs)}


def tokens(outputs) -> tuple[float, float]:
    """Prompt and completion tokens per batch, and the padded positions the forward pass computes."""
    prompt = np.mean([o["prompt_mask"].sum().item() for o in outputs])
    completion = np.mean([o["completion_mask"].sum().item() for o in outputs])
    padded = np.mean([o["prompt_mask"].numel() + o["completion_mask"].numel() for o in outputs])
    return float(prompt), float(completion), float(padded)


def role_main(args) -> None:
    """One measurement, in this process: its figures as a JSON line, then its profile."""
    tokenizer = build_tiny_tokenizer(keydoor_corpus())
    profile = cProfile.Profile() if args.profile else None
    result = (hgpo_role if args.role == "hgpo" else grpo_role)(args, tokenizer, profile)
    print("RESULT " + json.dumps(result))
    if profile is not None:
        print(top_entries(profile, args.profile))


def measure(args, role: str, profile: int, scratch: str) -> tuple[dict, str]:
    """One role's run in a process of its own: its result and its profile's text."""
    command = [sys.executable, __file__, "--role", role, "--scratch", scratch, "--batches",
               os.path.join(scratch, "batches.pt"), "--profile", str(profile), *(
                   f"--{name.replace('_', '-')}={getattr(args, name)}" for name in
                   ("iterations", "samples", "hidden", "layers", "completion_length"))]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the {role} run failed: {done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), done.stdout.split(line, 1)[1].strip("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--samples", type=int, default=64, help="M: step samples per iteration")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--completion-length", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="Runs of both trainers; the median ratio is printed.")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="Print the N costliest functions of each training phase (cProfile, first repeat).")
    parser.add_argument("--role", choices=("hgpo", "grpo"), help=argparse.SUPPRESS)  # one measurement's process
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("--batches", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        return role_main(args)

    print(f"model: hidden {args.hidden}, {args.layers} layers; M = {args.samples} samples per iteration; "
          f"{args.iterations} iterations (first left out), {args.repeats} repeats, a process each")
    ratios, profiles = [], {}
    with tempfile.TemporaryDirectory(prefix="hgpo-overhead-") as scratch:
        hgpo, profiles["HGPOTrainer"] = measure(args, "hgpo", args.profile, scratch)
        Path(scratch, "batches.json").write_text(json.dumps(hgpo["prompts"]))
        grpo, profiles["GRPOTrainer"] = measure(args, "grpo", args.profile, scratch)
        prompt, completion, padded = hgpo["tokens"]
        print(f"tokens per iteration (both trainers, the same batches): prompt {prompt:.0f} / completion "
              f"{completion:.0f}, {padded:.0f} positions with padding (GRPO's: {grpo['tokens'][2]:.0f})")
        print(f"generation phase per iteration: HGPO rollout + advantages {np.median(hgpo['generation']):.3f} s "
              f"(multi-turn)")
        generation, env = hgpo["rollout_split"]
        print(f"rollout split: generation {generation:.1%}, environments {env:.1%}, the loop's own Python "
              f"{1 - generation - env:.1%} ({hgpo['steps']:.0f} steps, {hgpo['turns']:.1f} turns per rollout)")
        for repeat in range(args.repeats):
            if repeat:  # (the first repeat's runs are those above)
                first, second = ("grpo", "hgpo") if repeat % 2 else ("hgpo", "grpo")
                results = {role: measure(args, role, 0, scratch)[0] for role in (first, second)}
                hgpo, grpo = results["hgpo"], results["grpo"]
            hgpo_s, grpo_s = statistics.median(hgpo["training"]), statistics.median(grpo["training"])
            ratios.append(hgpo_s / grpo_s)
            print(f"repeat {repeat + 1} ({'GRPO' if repeat % 2 else 'HGPO'} first): training phase per iteration "
                  f"(median) HGPO {hgpo_s:.3f} s, GRPO {grpo_s:.3f} s, ratio {ratios[-1]:.2f}x")
    print(f"training phase ratio, median of {args.repeats}: {statistics.median(ratios):.2f}x (target <= 1.05x)")
    for name, text in profiles.items():
        if text:
            print(f"\n{name}'s training phase, the {args.profile} costliest functions (own time, repeat 1):\n{text}")


if __name__ == "__main__":
    main()
