"""The inputs of TRL's loss for one iteration, in each `step_batching` mode: the rows `hgpo_trl.training.step_batches`
chooses, as tensors, with the token count the loss divides by and the log-probabilities it reads beside them: old
(the policy before this iteration's updates), reference (the KL term), sampling (vLLM's own) and vLLM's
importance-sampling ratio, computed with GRPOTrainer's own forward pass (`_get_per_token_logps_and_entropies`)
when, and as, the parent computes them. Each function takes the trainer whose batches it builds."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import pad, use_adapter

from hgpo_trl.rollout.lockstep import Completion, Rollout
from hgpo_trl.training.balance import TrainingRows, balanced_rows, own_rows
from hgpo_trl.training.metrics import SampleCounts
from hgpo_trl.training.step_batches import importance_sampling_ratio, sampling_metrics, select_budget

# The keys of the generation dict that GRPOTrainer's loss reads (tests/test_trainer.py pins them).
LOSS_INPUT_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                   "num_items_in_batch", "old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps",
                   "importance_sampling_ratio")


def budget_inputs(trainer, rollout: Rollout, advantages: np.ndarray) -> tuple[dict, np.ndarray, SampleCounts]:
    """fixed_budget: the loss's inputs for one pass of TRL's buffer (per_device_train_batch_size x
    steps_per_generation rows), the indices of the steps drawn into it, and how the steps became samples."""
    args = trainer.args
    budget = args.per_device_train_batch_size * args.steps_per_generation
    per_generation = args.steps_per_generation * trainer.num_iterations
    # A forced step took the one action its environment listed: its row teaches no decision. (An invalid output
    # on such a step is no forced step: its penalty is trained.)
    eligible = None if args.train_forced_steps else np.array([not s.forced for s in rollout.steps], dtype=bool)
    selected = select_budget(len(rollout.steps), budget, trainer._sample_rng, eligible)
    steps, padding = [rollout.steps[i] for i in selected], budget - len(selected)
    # Padding rows are masked out of the loss (completion_mask 0, advantage 0): every process keeps the same
    # number of samples, so forward passes stay in step (ZeRO-3) and TRL's batch split drops nothing.
    output = trainer._samples([s.completion for s in steps], advantages[selected], padding)
    output["num_items_in_batch"] = trainer.accelerator.gather(output["completion_mask"].sum()).sum()
    with torch.no_grad(), disable_gradient_checkpointing(trainer.model, args.gradient_checkpointing_kwargs):
        output.update(logprob_inputs(trainer, output, [s.completion for s in steps],
                                     old=args.gradient_accumulation_steps % per_generation != 0))
    samples = SampleCounts(kept=len(selected), padded_fraction=padding / budget,
                           optimizer_steps=per_generation // args.gradient_accumulation_steps)
    return output, selected, samples


def all_steps_counts(collected: int, rows: TrainingRows, plan: list[np.ndarray], windows: int, args,
                     num_iterations: int) -> SampleCounts:
    """all_steps: how this process's `collected` steps became samples: `rows` (its own or, balanced, its share of
    all), planned as `plan` in `windows` optimizer steps (per pass over the iteration; `num_iterations` passes)."""
    trained = sum(len(chunk) for chunk in plan)
    slots = windows * args.gradient_accumulation_steps * args.per_device_train_batch_size
    return SampleCounts(kept=collected, duplicated=rows.copies + trained - len(rows.completions),
                        padded_fraction=1.0 - trained / max(slots, 1), optimizer_steps=windows * num_iterations,
                        token_spread=rows.token_spread)


def all_steps_inputs(trainer, rows: TrainingRows, plan: list[np.ndarray], windows: int) -> list[dict]:
    """all_steps: the loss's inputs of every micro-batch of `plan` (positions in `rows`), then micro-batches of
    padding alone up to `windows` windows of gradient_accumulation_steps (the busiest process's count, run by
    every process), the whole repeated `num_iterations` times. Log-probabilities are taken here, before the first
    update."""
    args, micro, accumulation = trainer.args, trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps
    plan = plan + [np.zeros(0, dtype=np.int64)] * (windows * accumulation - len(plan))
    chunks = [[rows.completions[i] for i in positions] for positions in plan]
    # Every micro-batch holds `micro` rows on every process (TRL gathers per-row loss metrics): a short one is
    # filled with masked rows, and one of padding alone is 2 tokens wide.
    micro_batches = [trainer._samples(chunk, rows.advantages[positions], padding=micro - len(positions))
                     for chunk, positions in zip(chunks, plan, strict=True)]
    for micro_batch, positions in zip(micro_batches, plan, strict=True):  # which steps each row trains (-1: padding)
        micro_batch["step_rows"] = torch.from_numpy(
            np.r_[rows.ids[positions], np.full(micro - len(positions), -1)].astype(np.int64))
    # dapo divides by num_items_in_batch / processes x accumulation / steps_per_generation: make that the
    # mini-batch's mean token count per process, so the summed micro-batch losses are its token mean.
    tokens = torch.stack([sum(m["completion_mask"].sum() for m in micro_batches[w * accumulation:(w + 1) * accumulation])
                          for w in range(windows)]).float()
    tokens = trainer.accelerator.reduce(tokens, reduction="sum") * args.steps_per_generation / accumulation
    old = windows * trainer.num_iterations > 1
    with torch.no_grad(), disable_gradient_checkpointing(trainer.model, args.gradient_checkpointing_kwargs):
        for k, (micro_batch, chunk) in enumerate(zip(micro_batches, chunks, strict=True)):
            micro_batch["num_items_in_batch"] = tokens[k // accumulation]
            micro_batch.update(logprob_inputs(trainer, micro_batch, chunk, old=old))
    return micro_batches * trainer.num_iterations


def training_rows(trainer, rollout: Rollout, advantages: np.ndarray) -> TrainingRows:
    """all_steps: the rows this process trains in the iteration: the steps it played, or with `balance_steps`
    its share of every process's (filled as `fill_last_micro_batch` says, over all processes)."""
    args, processes = trainer.args, trainer.accelerator.num_processes
    if not args.balance_steps:
        return own_rows(rollout.steps, advantages)
    return balanced_rows(trainer.accelerator, rollout.steps, advantages, fill=args.fill_last_micro_batch,
                         fill_multiple=args.fill_multiple or args.per_device_train_batch_size * processes,
                         seed=(args.seed, trainer._iteration), partition=args.balance_partition)


def logprob_inputs(trainer, samples: dict[str, torch.Tensor], completions: list[Completion],
                   old: bool) -> dict[str, torch.Tensor]:
    """The log-probability inputs of `samples` (whose real rows are `completions`; the rest padding). `old`: the
    loss needs the old log-probabilities (more than one optimizer step per generation); with them, under vLLM's
    importance-sampling correction, its ratio and TRL's `sampling/*` metrics (logged). Call under no_grad, with
    gradient checkpointing off.

    At one optimizer step per generation the old log-probabilities are the loss's own, detached (TRL's loss takes
    them so), and so are the correction's: TRL runs a no-grad forward for them all the same (about a fifth of a
    CPU trainer's iteration); here the loss's own forward gives them (`with_loss_ratio`), the same ratio."""
    out: dict[str, torch.Tensor] = {}
    input_ids = torch.cat([samples["prompt_ids"], samples["completion_ids"]], dim=1)
    attention_mask = torch.cat([samples["prompt_mask"], samples["completion_mask"]], dim=1)
    width = samples["completion_ids"].size(1)

    def per_token_logps(model) -> torch.Tensor:
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, width, batch_size=trainer.args.per_device_train_batch_size)
        return logps

    if old:
        out["old_per_token_logps"] = per_token_logps(trainer.model)
    if trainer.beta != 0.0:
        if trainer.ref_model is not None:
            out["ref_per_token_logps"] = per_token_logps(trainer.ref_model)
        else:  # PEFT, as TRL: a new adapter's reference is the base model (adapter disabled); a model passed
            # in with its adapter already trained has TRL's frozen copy of it, the "ref" adapter
            model = trainer.accelerator.unwrap_model(trainer.model)
            with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
                out["ref_per_token_logps"] = per_token_logps(trainer.model)
    if trainer.use_vllm and completions and all(c.logprobs is not None for c in completions):
        # Passed whenever the backend gave them, as TRL does (its off-policy mask reads them).
        sampled = [torch.tensor([float("nan") if x is None else x for x in c.logprobs]) for c in completions]
        sampled += [torch.zeros(1)] * (input_ids.size(0) - len(completions))
        out["sampling_per_token_logps"] = pad(sampled, padding_value=0.0, padding_side="right").to(input_ids.device)
    if old and importance_corrected(trainer):
        add_importance_ratio(trainer, out, out["old_per_token_logps"], samples["completion_mask"])
    return out


def importance_corrected(trainer) -> bool:
    """Whether the loss reweights by vLLM's importance-sampling correction."""
    return trainer.use_vllm and trainer.vllm_importance_sampling_correction


def add_importance_ratio(trainer, inputs: dict[str, torch.Tensor], old: torch.Tensor, mask: torch.Tensor) -> None:
    """vLLM's importance-sampling correction of a batch whose old log-probabilities are `old`, put in `inputs` (its
    ratio, and `old` as the sampling log-probabilities of a batch of padding alone, without vLLM's), and TRL's
    `sampling/*` metrics of it logged."""
    sampling = inputs.get("sampling_per_token_logps", old)
    inputs["importance_sampling_ratio"] = importance_sampling_ratio(
        old, sampling, mask, trainer.vllm_importance_sampling_mode, trainer.vllm_importance_sampling_clip_min,
        trainer.vllm_importance_sampling_clip_max)
    inputs["sampling_per_token_logps"] = sampling
    trainer._log_gathered("train", sampling_metrics(old, sampling, inputs["importance_sampling_ratio"], mask))


@contextmanager
def ratio_from_loss_forward(trainer, inputs: dict) -> Iterator[None]:
    """Around a loss on `inputs`: where vLLM's correction is on and they hold no ratio yet (`logprob_inputs` took no
    old log-probabilities), the loss's forward gives it (`with_loss_ratio`); after the loss, whatever ended it, no
    other forward does."""
    trainer._ratio_inputs = inputs if importance_corrected(trainer) and "importance_sampling_ratio" not in inputs else None
    try:
        yield
    finally:
        trainer._ratio_inputs = None


def with_loss_ratio(trainer, forward: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """`forward` (the trainer's `_get_per_token_logps_and_entropies` outputs) as it is; if it is the first forward
    of a loss that `ratio_from_loss_forward` marked (TRL's loss reads the ratio after it), the ratio from its
    log-probabilities, detached, put in the loss's inputs."""
    if trainer._ratio_inputs is not None:
        inputs, trainer._ratio_inputs = trainer._ratio_inputs, None
        add_importance_ratio(trainer, inputs, forward[0].detach(), inputs["completion_mask"])
    return forward


@contextmanager
def completion_positions_only() -> Iterator[None]:
    """TRL's fused LM head scores only the completion positions where Triton runs, and every position elsewhere,
    to keep tile shapes fixed for compilers such as Neuron's. A CPU compiles nothing: there it scores the
    completions only too, with the same log-probabilities (a micro-batch of 5 x 800 tokens over Qwen's 151,936
    rows: 39 s of forward and backward on one core, 0.5 s this way)."""
    import trl.trainer.utils as trl_utils

    original = getattr(trl_utils, "_use_triton", None)
    if original is None:  # a TRL that decides otherwise
        yield
        return
    trl_utils._use_triton = lambda device: torch.device(device).type == "cpu" or original(device)
    try:
        yield
    finally:
        trl_utils._use_triton = original
