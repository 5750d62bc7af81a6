"""What HGPOTrainer adds on top of TRL's GRPOTrainer, on the same samples and tokens (tiny model, CPU).

    python benchmarks/trainer_overhead.py [--iterations 6] [--samples 64]

1. Training phase: HGPOTrainer trains on M step samples per iteration; plain GRPOTrainer trains on M samples of
   the same prompts (taken from HGPO's own rollouts) with the same completion length. Both are timed without
   their generation (`_generate_and_score_completions` is timed and subtracted). Target: HGPO <= 1.15x GRPO.
2. Rollout: the share of a rollout spent in generation, in the environments, and in the loop's own Python
   (prompt building, parsing, records).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a checkout's run, nothing installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_tasks
from hgpo_trl.tiny import build_tiny_model, build_tiny_tokenizer
from hgpo_trl.trainer import HGPOTrainer
from tests.conftest import keydoor_corpus


class Timed:
    """Wraps a trainer's generation method to time it."""

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


def run(trainer, timer) -> tuple[float, float]:
    """(training seconds per iteration, generation seconds per iteration), first iteration left out."""
    steps = []
    original = trainer.training_step

    def timed_step(*args, **kwargs):
        tick = time.perf_counter()
        out = original(*args, **kwargs)
        steps.append(time.perf_counter() - tick)
        return out

    trainer.training_step = timed_step
    trainer.train()
    per_iteration = len(steps) // len(timer.seconds)
    totals = np.add.reduceat(np.array(steps), np.arange(0, len(steps), per_iteration))
    training = totals - np.array(timer.seconds)
    return float(np.mean(training[1:])), float(np.mean(timer.seconds[1:]))


def tokens(outputs) -> tuple[float, float]:
    prompt = np.mean([o["prompt_mask"].sum().item() for o in outputs])
    completion = np.mean([o["completion_mask"].sum().item() for o in outputs])
    return float(prompt), float(completion)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--samples", type=int, default=64, help="M: step samples per iteration")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--completion-length", type=int, default=8)
    args = parser.parse_args()

    tokenizer = build_tiny_tokenizer(keydoor_corpus())
    common = dict(per_device_train_batch_size=args.samples, num_generations=8, log_level="error",
                  max_completion_length=args.completion_length, learning_rate=1e-4, logging_steps=10_000,
                  report_to="none", use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)
    hgpo_args = HGPOConfig(output_dir="/tmp/hgpo_bench/hgpo", tasks_per_device=4, max_env_steps=8,
                           action_mode="plain", train_iterations=args.iterations, **common)
    hgpo = HGPOTrainer(model=build_tiny_model(tokenizer, hidden_size=args.hidden, num_layers=args.layers),
                       args=hgpo_args, processing_class=tokenizer,
                       train_dataset=make_tasks("keydoor", "train", num_rooms=4, num_colors=4))
    hgpo_timer = Timed(hgpo)
    rollouts = []
    original_play = hgpo._play
    hgpo._play = lambda *a: rollouts.append(original_play(*a)) or rollouts[-1]
    hgpo_train, hgpo_rollout = run(hgpo, hgpo_timer)

    prompts = [s.prompt for r in rollouts for s in r.steps]
    grpo_args = GRPOConfig(output_dir="/tmp/hgpo_bench/grpo", max_steps=args.iterations, **common)
    grpo = GRPOTrainer(model=build_tiny_model(tokenizer, hidden_size=args.hidden, num_layers=args.layers),
                       reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=grpo_args,
                       processing_class=tokenizer,
                       train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]}))
    grpo_timer = Timed(grpo)
    grpo_train, grpo_generation = run(grpo, grpo_timer)

    hgpo_tokens, grpo_tokens = tokens(hgpo_timer.outputs), tokens(grpo_timer.outputs)
    print(f"model: hidden {args.hidden}, {args.layers} layers; M = {args.samples} samples per iteration; "
          f"{args.iterations} iterations (first left out)")
    print(f"tokens per iteration: HGPO prompt {hgpo_tokens[0]:.0f} / completion {hgpo_tokens[1]:.0f}; "
          f"GRPO prompt {grpo_tokens[0]:.0f} / completion {grpo_tokens[1]:.0f}")
    print(f"training phase per iteration: HGPO {hgpo_train:.3f} s, GRPO {grpo_train:.3f} s, "
          f"ratio {hgpo_train / grpo_train:.2f}x (target <= 1.15x)")
    print(f"generation phase per iteration: HGPO rollout + advantages {hgpo_rollout:.3f} s "
          f"(multi-turn), GRPO single-turn generation {grpo_generation:.3f} s")
    later = rollouts[1:]
    total = sum(r.seconds for r in later)
    generation = sum(r.generation_seconds for r in later)
    env = sum(r.env_seconds for r in later)
    print(f"rollout split: generation {generation / total:.1%}, environments {env / total:.1%}, "
          f"the loop's own Python {(total - generation - env) / total:.1%} "
          f"({np.mean([len(r.steps) for r in later]):.0f} steps, {np.mean([r.turns for r in later]):.1f} turns "
          f"per rollout)")


if __name__ == "__main__":
    main()
