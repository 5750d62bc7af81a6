"""The weight push to a vLLM engine on this CPU, piece by piece, as `sync_server_by_file` and the server's
`WeightFileLoader` do it: the trainer copies its weights and writes them to one safetensors file in shared memory,
the engine reads the file and loads it (`reload_into`: vLLM's reload_weights, the LM head packed again), for a real
model into a float32 or a bfloat16 engine, all on one core.

    .venv/vllm-cpu/bin/python benchmarks/weight_push.py [--model smollm2-135m-instruct] [--dtype float32] [--repeats 3]
        [--core 1]

The engine runs in this process (the server's worker does the same load); the best of `--repeats` counts.
(A real model by name is converted once by the project's venv: `.venv/bin/python -c "from hgpo_trl.models.pretrained
import pretrained_folder; pretrained_folder('smollm2-135m-instruct')"`.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a checkout's run, nothing installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hgpo_trl.models.pretrained import pretrained_or_same
from hgpo_trl.rollout.vllm_cpu import cpu_engine_args, reload_into, shared_folder, vllm_starting


def timed_push(model, runner, path: Path) -> dict[str, float]:
    """One push's pieces, in seconds."""
    tick = time.perf_counter()
    weights = {name: p.detach().to("cpu", copy=True).contiguous() for name, p in model.named_parameters()}
    copied = time.perf_counter()
    try:
        save_file(weights, str(path))
        written = time.perf_counter()
        with safe_open(str(path), framework="pt") as file:
            reload_into(runner, ((name, file.get_tensor(name)) for name in file.keys()))
        loaded = time.perf_counter()
    finally:
        path.unlink(missing_ok=True)
    return {"copy": copied - tick, "write": written - copied, "load": loaded - written, "total": loaded - tick}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--core", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the engine's precision (one engine a process: run it once for each)")
    options = parser.parse_args()
    os.sched_setaffinity(0, {options.core})
    torch.set_num_threads(1)
    source = pretrained_or_same(options.model)
    with vllm_starting(True):
        from vllm import LLM

        llm = LLM(model=source, dtype=options.dtype, enforce_eager=True, **cpu_engine_args(source, None, None))
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    path = shared_folder(size) / f"hgpo-push-benchmark-{os.getpid()}.safetensors"
    pushes = [timed_push(model, runner, path) for _ in range(options.repeats)]
    best = min(pushes, key=lambda push: push["total"])
    print(f"{options.model}: {size / 2**20:.0f} MiB of float32 weights into a {options.dtype} engine on core "
          f"{options.core} (best of {options.repeats}): " + ", ".join(f"{k} {v:.2f} s" for k, v in best.items()))


if __name__ == "__main__":
    main()
