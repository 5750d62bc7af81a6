"""From a rollout's steps to the tensors TRL's loss reads: which steps become samples, in which micro-batches.

Two modes (`HGPOConfig.step_batching`):
- `fixed_budget`: M = per_device_train_batch_size x steps_per_generation samples per process and iteration,
  drawn uniformly when there are more steps (not from forced steps under `train_forced_steps=False`), padded
  with masked rows when fewer; one pass of TRL's buffer.
- `all_steps` (as released): every step is a sample once, in micro-batches of per_device_train_batch_size, as
  many optimizer steps (windows of gradient_accumulation_steps micro-batches) as the busiest process's steps fill.

Pure functions of step records and arrays; the trainer adds the log-probabilities and runs them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from trl.trainer.utils import pad

from hgpo_trl.rollout.lockstep import Completion

STEP_BATCHINGS = ("fixed_budget", "all_steps")
FILLS = ("pad", "duplicate")


def select_budget(num_steps: int, budget: int, rng: np.random.Generator,
                  eligible: np.ndarray | None = None) -> np.ndarray:
    """fixed_budget: the indices of the steps that become samples, `budget` of them drawn uniformly (sorted)
    when there are more steps, else all of them; only among the `eligible` ones (a boolean mask) when given."""
    candidates = np.arange(num_steps) if eligible is None else np.flatnonzero(eligible)
    if len(candidates) <= budget:
        return candidates
    return np.sort(rng.choice(candidates, size=budget, replace=False))


def plan_micro_batches(num_steps: int, micro_batch_size: int, fill: str, shuffle: bool,
                       rng: np.random.Generator) -> list[np.ndarray]:
    """all_steps: this process's micro-batches as step indices, every step exactly once, in rollout order (or a
    random order when `shuffle`). The last micro-batch is left short (`fill="pad"`) or filled with copies of
    steps drawn at random without replacement (`fill="duplicate"`, as released: `adjust_batch(mode="copy")`
    makes the batch divisible by duplicating rows)."""
    if fill not in FILLS:
        raise ValueError(f"fill must be one of {FILLS}, got {fill!r}")
    order = rng.permutation(num_steps) if shuffle else np.arange(num_steps)
    short = -num_steps % micro_batch_size
    if fill == "duplicate" and num_steps and short:
        copies = rng.choice(num_steps, size=short, replace=short > num_steps)
        order = np.concatenate([order, copies])
    return [order[i:i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]


def windows_for(busiest_micro_batches: int, accumulation: int) -> int:
    """Optimizer steps of an iteration: the busiest process's micro-batches in windows of `accumulation`. Every
    window holds a real row on that process, so no optimizer step runs on padding alone."""
    return math.ceil(busiest_micro_batches / accumulation)


def sample_tensors(completions: Sequence[Completion], advantages: np.ndarray, padding: int, pad_token_id: int,
                   eos_token_id: int, device: torch.device | str, mask_truncated: bool = False,
                   eos_token_ids: Sequence[int] = ()) -> dict[str, torch.Tensor]:
    """The loss's inputs for `completions` (one row each) plus `padding` masked rows (a one-token prompt and a
    one-token completion, completion_mask 0, advantage 0): prompts left-padded, completions right-padded to the
    widest row of this batch. `mask_truncated` masks completions that do not end in one of `eos_token_ids`."""
    prompts = [torch.tensor(c.prompt_ids) for c in completions] + [torch.tensor([pad_token_id])] * padding
    real = [1] * len(completions) + [0] * padding
    completions = [torch.tensor(c.completion_ids) for c in completions] + [torch.tensor([eos_token_id])] * padding
    prompt_ids = pad(prompts, padding_value=pad_token_id, padding_side="left").to(device)
    prompt_mask = pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left").to(device)
    completion_ids = pad(completions, padding_value=pad_token_id, padding_side="right").to(device)
    completion_mask = pad([torch.full_like(c, r) for c, r in zip(completions, real, strict=True)],
                          padding_value=0, padding_side="right").to(device)
    if mask_truncated:
        truncated = torch.tensor([c[-1].item() not in eos_token_ids for c in completions], device=device)
        completion_mask = completion_mask * (~truncated).unsqueeze(1).int()
    advantage = torch.tensor(np.r_[np.asarray(advantages, dtype=np.float64), np.zeros(padding)],
                             dtype=torch.float32, device=device)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantage}


IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_sampling_ratio(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str,
                              low: float | None, high: float | None) -> torch.Tensor:
    """The vLLM / trainer mismatch correction exp(old - sampling), per token or summed per sequence, truncated
    to [low, high] (`*_truncate`) or zeroed outside it (`*_mask`), as TRL computes it. Tokens vLLM could not
    score (NaN) get a ratio of exactly 1."""
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {IMPORTANCE_SAMPLING_MODES}, got {mode!r}")
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high)
    outside = (ratio < (-math.inf if low is None else low)) | (ratio > (math.inf if high is None else high))
    return ratio.masked_fill(outside, 0.0)


def sampling_metrics(old: torch.Tensor, sampling: torch.Tensor, ratio: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """TRL's `sampling/*` diagnostics of one batch: how far vLLM's log-probabilities are from the trainer's
    (tokens vLLM could not score, NaN, left out) and the importance ratio's range (NaN where nothing applies)."""
    delta = (old - sampling).abs()[mask.bool()]
    delta = delta[~torch.isnan(delta)]
    flat = ratio.flatten() if ratio.size(-1) == 1 else ratio[mask.bool()]

    def stat(values: torch.Tensor, fn) -> float:
        return float(fn(values)) if values.numel() else float("nan")

    return {"sampling/sampling_logp_difference/mean": stat(delta, torch.mean),
            "sampling/sampling_logp_difference/max": stat(delta, torch.max),
            "sampling/importance_sampling_ratio/min": stat(flat, torch.min),
            "sampling/importance_sampling_ratio/mean": stat(flat, torch.mean),
            "sampling/importance_sampling_ratio/max": stat(flat, torch.max)}
