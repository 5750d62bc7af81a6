"""hgpo-serve: a vLLM server for the trainer's `vllm_mode: server`, started with what the trainer needs of it.

    hgpo-serve --model smollm2-135m-instruct --port 8000 --cores 1
    python train.py --config ... --use_vllm true --vllm_mode server --vllm_server_base_url http://127.0.0.1:8000

It runs vLLM's OpenAI-compatible server (the module `vllm.entrypoints.openai.api_server`: vLLM's own CLI does not
start on its CPU build, which reads its version under another distribution's name) in this Python, with:
- the log-probabilities of the sampled tokens as sampled, and as many as TRL's client asks (`--logprobs-mode
  processed_logprobs --max-logprobs -1`, as TRL's docs start it);
- on a GPU, vLLM's NCCL weight transfer (TRL's sync);
- on a CPU, vLLM's development API and our worker extension, which loads the trainer's weights from a file
  (`hgpo_trl.rollout.vllm_cpu.WeightFileLoader`), every prompt prefilled whole (a seeded request fails a chunked
  prefill there: `cpu_engine_args`), and float32 unless `--dtype` says otherwise (a CPU trainer's precision;
  `--dtype bfloat16` on a CPU with bfloat16 units: 3x float32's prefill on an AMX Xeon, its log-probabilities a rounding
  away from the trainer's, which the trainer's importance-sampling correction reweights: docs/results.md);
- a model the project knows by name, or a .gguf file, as its converted folder (`hgpo_trl.models.pretrained`);
- `--cores`: the CPU cores it runs on (a list as taskset reads it, "1" or "2-5,8"), so that the server and the
  trainer each have their own.
Any other argument goes to vLLM as it is (`--enforce-eager`, `--max-num-seqs 64`, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse_cores(text: str) -> set[int]:
    """A CPU list as taskset reads it ("0", "2-5,8") as its core ids."""
    cores = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise argparse.ArgumentTypeError(f"a list of cores as taskset reads it ('1', '0-3,6'), got {text!r}")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def serve_command(model: str, host: str, port: int, dtype: str | None, max_model_len: int | None,
                  extra: list[str], on_gpu: bool) -> tuple[list[str], dict[str, str]]:
    """The server's command line and the environment variables it adds."""
    from hgpo_trl.rollout.vllm_cpu import LOADER, cpu_engine_args

    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
               "--port", str(port), "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    if on_gpu:
        command += ["--weight-transfer-config", json.dumps({"backend": "nccl"}), "--dtype", dtype or "auto"]
    else:
        engine = cpu_engine_args(model, max_model_len, None)
        command += ["--worker-extension-cls", LOADER, "--dtype", dtype or "float32"]
        if engine:
            command += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(engine["max_num_batched_tokens"])]
    return command + extra, {"VLLM_SERVER_DEV_MODE": "1"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hgpo-serve", description=__doc__.split("\n\n")[0],
                                     epilog="Any other argument goes to vLLM's server as it is.")
    parser.add_argument("--model", required=True, help="a model folder, a name the project knows, or a .gguf file")
    parser.add_argument("--host", default="127.0.0.1", help="the address it listens on (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="its port (TRL's default: 8000)")
    parser.add_argument("--dtype", default=None, help="vLLM's dtype (default: float32 on a CPU, vLLM's 'auto' on a GPU)")
    parser.add_argument("--max_model_len", type=int, default=None, help="the context (default: the model's)")
    parser.add_argument("--cores", type=parse_cores, default=None, help="the CPU cores it runs on, as taskset lists them ('1', '2-5')")
    args, extra = parser.parse_known_args(argv)
    from hgpo_trl.rollout.vllm_cpu import cpu_build_command, vllm_runs_here

    if not vllm_runs_here():
        raise SystemExit(f"hgpo-serve: vLLM cannot run in this Python ({sys.executable}): {cpu_build_command()}")
    import torch

    from hgpo_trl.models.pretrained import pretrained_or_same

    model = pretrained_or_same(args.model)
    if not os.path.isdir(model) and (model.startswith((".", "/", "~")) or os.environ.get("HF_HUB_OFFLINE") == "1"):
        parser.error(f"--model {args.model}: no model folder there (a folder, a name the project knows, or a .gguf file)")
    command, variables = serve_command(model, args.host, args.port, args.dtype,
                                       args.max_model_len, extra, on_gpu=torch.cuda.is_available())
    if args.cores is not None:
        os.sched_setaffinity(0, args.cores)  # (its processes inherit it)
        variables["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(args.cores)))  # (vLLM binds its threads itself)
    print(f"hgpo-serve: {' '.join(command)}", flush=True)
    os.execve(sys.executable, command, {**os.environ, **variables})


if __name__ == "__main__":
    main()
