"""Training time per trained step: step_batching="all_steps" (every step once, in mini-batches) against
"fixed_budget" (one pass of TRL's buffer), on the same rollouts (tiny model, CPU).

    python benchmarks/step_batching.py [--iterations 6] [--micro 16] [--mini 64]

Both trainers replay the same recorded rollouts (keydoor, 4 tasks x 8 rollouts, episodes of up to 8 steps, an
invalid output ending its episode, so lengths vary), so they train the same steps; fixed_budget's budget M is the
largest rollout, so it trains every step too (padding the rest). The clock runs over the training steps with the rollout itself left out (`time/training`). Also
printed: all_steps' share of padded sample slots and its optimizer steps per iteration.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a checkout's run, nothing installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_tasks
from hgpo_trl.models.tiny import build_tiny_model, build_tiny_tokenizer
from hgpo_trl.trainer import HGPOTrainer
from tests.conftest import keydoor_corpus

COMMON = dict(num_generations=8, tasks_per_device=4, max_completion_length=8, max_env_steps=8, action_mode="plain",
              invalid_action="end_episode", learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True, seed=0,
              disable_tqdm=True, loss_type="bnpo")


def trainer_for(tokenizer, output_dir: str, iterations: int, **batching) -> HGPOTrainer:
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=4, seed=0)
    args = HGPOConfig(output_dir=output_dir, train_iterations=iterations, **COMMON, **batching)
    return HGPOTrainer(model=model, args=args, processing_class=tokenizer,
                       train_dataset=make_tasks("keydoor", "train", num_tasks=64))


def replaying(trainer: HGPOTrainer, rollouts: list) -> HGPOTrainer:
    """Make `trainer` play `rollouts` in turn instead of its own (the same steps for both modes)."""
    queue = list(rollouts)
    trainer._play = lambda tasks, group_size, temperature, description="rollout": queue.pop(0)
    return trainer


def training_seconds(trainer: HGPOTrainer) -> tuple[float, list[dict]]:
    """Seconds spent training iterations 2 .. N-1 (the first warms up; time/training is logged with the next
    rollout, so the last has none), and the iteration logs: logs[k] holds iteration k+1's steps and iteration
    k's training time."""
    trainer.train()
    logs = [h for h in trainer.state.log_history if "steps/collected" in h]
    return sum(h["time/training"] for h in logs[2:]), logs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--micro", type=int, default=16, help="per_device_train_batch_size (micro-batch rows)")
    parser.add_argument("--mini", type=int, default=64, help="all_steps: mini_batch_size")
    options = parser.parse_args()
    tokenizer = build_tiny_tokenizer(keydoor_corpus())
    with tempfile.TemporaryDirectory() as tmp:
        recorder = trainer_for(tokenizer, f"{tmp}/record", options.iterations + 1)
        rollouts = []
        play = recorder._play

        def record(*args, **kwargs):
            rollouts.append(play(*args, **kwargs))
            return rollouts[-1]

        recorder._play = record
        recorder.train()
        largest = max(len(r.steps) for r in rollouts)
        steps_per_generation = -(-largest // options.micro)
        while options.micro * steps_per_generation % COMMON["num_generations"]:  # TRL's check
            steps_per_generation += 1
        fixed = replaying(trainer_for(tokenizer, f"{tmp}/fixed", options.iterations + 1,
                                      per_device_train_batch_size=options.micro,
                                      steps_per_generation=steps_per_generation,
                                      gradient_accumulation_steps=steps_per_generation), rollouts)
        every = replaying(trainer_for(tokenizer, f"{tmp}/all", options.iterations + 1, step_batching="all_steps",
                                      per_device_train_batch_size=options.micro, mini_batch_size=options.mini),
                          rollouts)
        fixed_seconds, fixed_logs = training_seconds(fixed)
        all_seconds, all_logs = training_seconds(every)
    trained = sum(h["steps/kept"] for h in all_logs[1:-1])
    print(f"same rollouts: {options.iterations - 1} timed iterations, {trained:.0f} steps trained "
          f"(mean {trained / max(len(all_logs) - 2, 1):.0f} per iteration, largest {largest})")
    print(f"{'mode':<14}{'ms / trained step':>18}{'padded share':>14}{'optimizer steps / it':>22}")
    for name, seconds, logs in (("fixed_budget", fixed_seconds, fixed_logs), ("all_steps", all_seconds, all_logs)):
        padded = np.mean([h["steps/padded_fraction"] for h in logs[1:-1]])
        optimizer_steps = np.mean([h["steps/optimizer_steps"] for h in logs[1:-1]])
        print(f"{name:<14}{1e3 * seconds / trained:>18.2f}{padded:>14.2f}{optimizer_steps:>22.1f}")
    print(f"all_steps / fixed_budget: {all_seconds / fixed_seconds:.2f}")


if __name__ == "__main__":
    main()
