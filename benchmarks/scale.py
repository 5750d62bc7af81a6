"""One HGPO iteration at a real model's size on this CPU: a Qwen2.5-0.5B-shaped model (24 layers, hidden 896, 14
heads / 2 KV heads, intermediate 4864, tied embeddings, 151,936 rows; random weights) with the Qwen2.5 tokenizer
plays and trains on real ALFWorld games, and the figures a GPU user plans with.

    python benchmarks/scale.py [--settings gc nogc] [--samples 8] [--prompt-tokens 512] [--completion-tokens 64]

Each setting (gradient checkpointing on, then off) runs in its own subprocess, so each peak RSS is its own. One
task x 2 rollouts x 4 steps = 8 samples; prompts capped at 512 tokens (max_prompt_tokens), completions at 64
(random weights never emit <|im_end|>, so every completion runs to the cap); step_batching all_steps with
micro- and mini-batches of 4 (two optimizer steps, old log-probabilities taken), the paper's KL (beta 0.01, a
reference copy) and AdamW in float32. Printed per setting: tokens per sample, the time split (generation,
environments, old/ref log-probabilities, forward + backward, optimizer), peak RSS and bytes per trained token;
then what the 1.5B and 7B shapes would need.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", str(min(os.cpu_count() or 1, 4)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a checkout's run, nothing installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
# The model trained here, then the ones whose needs are printed: rows of hgpo_trl/rehearsal/shapes.py's table.
MODELS = ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct")
GIB = 2**30


def run_setting(gradient_checkpointing: bool, options) -> dict:
    """One iteration in this process; its figures."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM, TrainerCallback

    from hgpo_trl.config import HGPOConfig
    from hgpo_trl.envs import make_tasks
    from hgpo_trl.rehearsal.shapes import SHAPES, model_config
    from hgpo_trl.trainer import HGPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(options.tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(model_config(SHAPES[MODELS[0]], tokenizer))
    timings = {"logprobs": 0.0, "optimizer": 0.0}

    class OptimizerClock(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.tick = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            timings["optimizer"] += time.perf_counter() - self.tick

    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        args = HGPOConfig(
            output_dir=f"{tmp}/run", env_name="alfworld", env_workers=0,
            env_kwargs={"data_path": options.alfworld, "cache_dir": str(cache)}, tasks_per_device=1,
            num_generations=2, max_env_steps=options.samples // 2, history_length=2, max_prompt_tokens=options.prompt_tokens,
            max_completion_length=options.completion_tokens, step_batching="all_steps", per_device_train_batch_size=4,
            mini_batch_size=4, train_iterations=1, beta=0.01, learning_rate=1e-6, gradient_checkpointing=gradient_checkpointing,
            report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", logging_steps=1, seed=0)
        trainer = HGPOTrainer(model=model, args=args, processing_class=tokenizer, callbacks=[OptimizerClock()],
                              train_dataset=make_tasks("alfworld", "valid_seen", data_path=options.alfworld,
                                                       num_tasks=1))
        passes = trainer._get_per_token_logps_and_entropies

        def timed_logprobs(*a, **k):
            if torch.is_grad_enabled():  # the loss's own forward: part of forward + backward
                return passes(*a, **k)
            tick = time.perf_counter()
            out = passes(*a, **k)
            timings["logprobs"] += time.perf_counter() - tick
            return out

        trainer._get_per_token_logps_and_entropies = timed_logprobs
        samples = []
        build = trainer._samples

        def recording(steps, advantages, padding):
            samples.extend(steps)
            return build(steps, advantages, padding)

        trainer._samples = recording
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        trainer.close_environments()
    log = next(h for h in trainer.state.log_history if "time/generation" in h)
    # trainer._training_seconds, reset at each rollout, now holds the one iteration's forward + backward.
    prompt = [len(s.completion.prompt_ids) for s in samples]
    completion = [len(s.completion.completion_ids) for s in samples]
    trained = sum(prompt) + sum(completion)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"gradient_checkpointing": gradient_checkpointing, "samples": len(samples),
            "prompt_tokens_mean": sum(prompt) / len(prompt), "completion_tokens_mean": sum(completion) / len(completion),
            "generation_s": log["time/generation"], "env_s": log["time/env"], "logprobs_s": timings["logprobs"],
            "forward_backward_s": trainer._training_seconds, "optimizer_s": timings["optimizer"],
            "wall_s": wall, "peak_rss_gib": peak / GIB, "bytes_per_trained_token": peak / trained,
            "trained_tokens": trained}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=["gc", "nogc"], choices=["gc", "nogc"])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--tokenizer", default=str(SHARED / "qwen2.5-tokenizer"))
    parser.add_argument("--alfworld", default=os.environ.get("ALFWORLD_DATA") or str(SHARED / "alfworld"))
    parser.add_argument("--child", choices=["gc", "nogc"], help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        print(json.dumps(run_setting(options.child == "gc", options)))
        return
    from hgpo_trl.rehearsal.shapes import SHAPES

    results = []
    for setting in options.settings:
        command = [sys.executable, __file__, "--child", setting, "--samples", str(options.samples),
                   "--prompt-tokens", str(options.prompt_tokens), "--completion-tokens", str(options.completion_tokens),
                   "--tokenizer", options.tokenizer, "--alfworld", options.alfworld]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"setting {setting} failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    n = SHAPES[MODELS[0]].parameters
    print(f"{MODELS[0]}'s shape: {n / 1e6:.0f}M parameters; "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    for r in results:
        print(f"\ngradient checkpointing {'on' if r['gradient_checkpointing'] else 'off'}: {r['samples']} samples, "
              f"prompt {r['prompt_tokens_mean']:.0f} + completion {r['completion_tokens_mean']:.0f} tokens each")
        print(f"  generation {r['generation_s']:.1f} s | environments {r['env_s']:.1f} s | old/ref log-probs "
              f"{r['logprobs_s']:.1f} s | forward+backward {r['forward_backward_s']:.1f} s | optimizer "
              f"{r['optimizer_s']:.1f} s | wall {r['wall_s']:.0f} s")
        print(f"  peak RSS {r['peak_rss_gib']:.1f} GiB, {r['bytes_per_trained_token'] / 2**20:.2f} MiB per trained "
              f"token ({r['trained_tokens']} tokens)")
    print("\nWhat the real shapes need for their weights and optimizer (activations come on top, per trained token):")
    for name in MODELS:
        p = SHAPES[name].parameters
        print(f"  {name}: {p / 1e9:.2f}B parameters; fp32 AdamW (weights, gradients, two moments) "
              f"{16 * p / GIB:.1f} GiB; bf16 compute over fp32 master (ZeRO: shards of the 16, plus bf16 weights) "
              f"{18 * p / GIB:.1f} GiB in all; the KL reference in bf16 {2 * p / GIB:.1f} GiB")


if __name__ == "__main__":
    main()
