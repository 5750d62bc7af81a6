"""The GPU check: a few HGPO iterations of a Qwen2.5-1.5B-shaped model on one CUDA GPU, offline, in minutes.

    python benchmarks/gpu_check.py --tokenizer PATH/qwen2.5-tokenizer [--alfworld PATH] [--iterations 3]

No hub and no internet: the model is built from Qwen2.5-1.5B's config with random weights, the tokenizer folder
comes from the command line. It trains on keydoor (and one iteration on ALFWorld when the alfworld package and
--alfworld games are there) with transformers generation, and once more with vLLM colocated when vllm imports;
bf16 compute over fp32 master weights, gradient checkpointing, step_batching all_steps, the paper's KL. Random
weights never emit <|im_end|>, so every completion runs to --completion-tokens and every episode to --env-steps.
Prints per backend: generation tokens/s, the iteration's time split, peak GPU memory beside what the rehearsal's
projection (hgpo_trl.rehearsal.projection, docs/rehearsal.md) says for this run, the loss (must be finite),
and with vLLM the mean importance ratio between vLLM's and the trainer's log-probabilities (near 1 when the
weights are synced). Without CUDA it says so and exits 0. docs/gpu.md's "GPU check" says how to bring the packages.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a checkout's run, nothing installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The model's shape: a row of hgpo_trl/rehearsal/shapes.py's table.
MODEL = "Qwen/Qwen2.5-1.5B-Instruct"


def check(model_folder: Path, tokenizer, *, env_name: str, env_kwargs: dict | None, tasks, iterations: int,
          completion_tokens: int, env_steps: int, use_vllm: bool, device: str = "cuda") -> dict:
    """Train `iterations` HGPO iterations; the figures of the last one (the first warms up)."""
    import torch

    from hgpo_trl.config import HGPOConfig
    from hgpo_trl.rehearsal.projection import Placement, Workload, project_memory
    from hgpo_trl.rehearsal.report import token_lengths
    from hgpo_trl.rehearsal.shapes import model_shape
    from hgpo_trl.trainer import HGPOTrainer

    on_gpu = device == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        args = HGPOConfig(
            output_dir=out, env_name=env_name, env_kwargs=env_kwargs, tasks_per_device=4, num_generations=4,
            max_env_steps=env_steps, history_length=2, max_completion_length=completion_tokens, temperature=1.0,
            step_batching="all_steps", per_device_train_batch_size=8, mini_batch_size=32,
            train_iterations=iterations, learning_rate=1e-6, beta=0.01, bf16=on_gpu,
            gradient_checkpointing=True, use_vllm=use_vllm, vllm_mode="colocate",
            vllm_gpu_memory_utilization=0.3, report_to="none", disable_tqdm=True, save_strategy="no",
            logging_steps=1, use_cpu=not on_gpu, seed=0, trajectory_dump_every=1)
        trainer = HGPOTrainer(model=str(model_folder), args=args, processing_class=tokenizer, train_dataset=tasks)
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        trainer.close_environments()
        lengths = token_lengths(Path(out))  # the rehearsal's reading of the trajectory dumps
    # What the rehearsal's projection says this run needs, beside what CUDA measured (its runtime aside: CUDA's
    # peak counts PyTorch's allocations only): the projection's check on a GPU.
    work = Workload(micro_batch=args.per_device_train_batch_size, prompt_tokens=lengths["prompt"]["max"],
                    completion_tokens=completion_tokens, reference=True, vllm_share=0.3 if use_vllm else 0.0)
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if on_gpu else 80.0
    projected = project_memory(model_shape(str(model_folder)), Placement(1, bf16=on_gpu, deepspeed=False), work, gpu_gib)
    history = trainer.state.log_history
    rollout = [h for h in history if "time/generation" in h][-1]
    losses = [h["loss"] for h in history if "loss" in h]
    completion_tokens_played = rollout["steps/collected"] * rollout["completions/mean_length"]
    return {"backend": "vllm" if use_vllm else "transformers", "env": env_name, "iterations": iterations,
            "wall_s": wall, "generation_s": rollout["time/generation"], "env_s": rollout["time/env"],
            "advantages_s": rollout["time/advantages"], "training_s": rollout["time/training"],
            "generation_tokens_per_s": completion_tokens_played / max(rollout["time/generation"], 1e-9),
            "steps": rollout["steps/collected"], "optimizer_steps": rollout["steps/optimizer_steps"],
            "loss": losses[-1], "loss_finite": all(math.isfinite(v) for v in losses),
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
            "projected_gpu_gib": projected.gpu_total - projected.gpu["runtime"],
            "importance_ratio_mean": rollout.get("sampling/importance_sampling_ratio/mean")}


def report(result: dict) -> str:
    ratio = result["importance_ratio_mean"]
    peak = result["peak_gpu_gib"]
    return (f"{result['backend']:<13}{result['env']:<9} {result['generation_tokens_per_s']:>9.0f} tok/s  "
            f"gen {result['generation_s']:.1f}s env {result['env_s']:.1f}s adv {1e3 * result['advantages_s']:.0f}ms "
            f"train {result['training_s']:.1f}s ({result['optimizer_steps']:.0f} optimizer steps, "
            f"{result['steps']:.0f} steps)  peak {'-' if peak is None else f'{peak:.1f} GiB'} (projected "
            f"{result['projected_gpu_gib']:.1f})  "
            f"loss {result['loss']:.4g} ({'finite' if result['loss_finite'] else 'NOT FINITE'})"
            + ("" if ratio is None else f"  importance ratio {ratio:.3f}"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a Qwen2.5 tokenizer folder (tokenizer.json, ...)")
    parser.add_argument("--alfworld", default=os.environ.get("ALFWORLD_DATA"), help="ALFWorld games (optional)")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--env-steps", type=int, default=4)
    options = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here: skipped (it runs on a GPU machine; see docs/gpu.md, GPU check)")
        return 0
    from transformers import AutoTokenizer

    from hgpo_trl.envs import make_tasks
    from hgpo_trl.rehearsal.shapes import SHAPES, build_model_folder

    tokenizer = AutoTokenizer.from_pretrained(options.tokenizer)
    print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}; {MODEL}'s shape, "
          "random weights")
    backends = [False] + ([True] if find_spec("vllm") is not None else [])
    if len(backends) == 1:
        print("gpu_check: vllm does not import: transformers generation only")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        # Built on the GPU (fast) and saved: vLLM and the KL reference load it from the folder.
        folder = build_model_folder(SHAPES[MODEL], tokenizer, Path(tmp) / "model", device="cuda")
        runs = [("keydoor", None, make_tasks("keydoor", "train", num_tasks=64), options.iterations)]
        if options.alfworld and find_spec("alfworld") is not None and Path(options.alfworld).is_dir():
            runs.append(("alfworld", {"data_path": options.alfworld, "cache_dir": f"{tmp}/alfworld"},
                         make_tasks("alfworld", "valid_seen", data_path=options.alfworld, num_tasks=8), 1))
        else:
            print("gpu_check: no alfworld package or games (--alfworld): keydoor only")
        for use_vllm in backends:
            for env_name, env_kwargs, tasks, iterations in runs:
                result = check(folder, tokenizer, env_name=env_name, env_kwargs=env_kwargs, tasks=tasks,
                               iterations=iterations, completion_tokens=options.completion_tokens,
                               env_steps=options.env_steps, use_vllm=use_vllm)
                results.append(result)
                print(report(result), flush=True)
    return 0 if all(r["loss_finite"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
