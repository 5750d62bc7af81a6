"""What one training iteration logs (`env/`, `adv/`, `steps/`, `prompt/`, `hgpo/`, `diag/`, `time/`; balanced,
`global_seqlen/`): the same keys on every process, always, because the values are gathered as one vector (a
process whose episodes all failed still sends every key)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from hgpo_trl.advantages import LevelStats, StepBatch
from hgpo_trl.diagnostics import Bias, advantage_bias
from hgpo_trl.rollout.lockstep import Rollout
from hgpo_trl.rollout.outcomes import episode_totals, success_and_score


@dataclass(frozen=True)
class SampleCounts:
    """How an iteration's steps became training samples on this process."""

    kept: int  # distinct steps trained
    duplicated: int = 0  # extra copies (all_steps, fill_last_micro_batch="duplicate")
    padded_fraction: float = 0.0  # share of the sample slots that are masked padding
    optimizer_steps: int = 1  # optimizer steps the iteration makes
    token_spread: Mapping[str, float] = field(default_factory=dict)  # balance_steps: global_seqlen/*, as released


class TrainedSteps:
    """How often each step of the current all_steps iteration went through the loss, counted in `compute_loss`
    from the micro-batches' `step_rows` (-1: a padding row): the check that every collected step was trained,
    from the run's own counters rather than from the plan. Under `balance_steps` the rows count every process's
    steps (a process trains steps others played): the counts are summed over processes at the end."""

    def __init__(self):
        self.passes: np.ndarray | None = None
        self.shared = False

    def start(self, num_steps: int, shared: bool = False) -> None:
        self.passes, self.shared = np.zeros(num_steps, dtype=np.int64), shared

    def count(self, step_rows) -> None:
        if self.passes is not None:
            rows = np.asarray(step_rows)
            np.add.at(self.passes, rows[rows >= 0], 1)

    def finish(self, accelerator) -> dict[str, float] | None:
        """This process's `steps/trained` (distinct steps trained), `steps/max_untrained` (collected, never
        trained: 0 in a sound run) and `steps/trained_passes` (rows trained, copies and epochs included); shared,
        every process's share of the totals (and the total untrained). None when no iteration was counted since
        the last call. Every process must call it (a shared count is summed over them)."""
        passes, self.passes = self.passes, None
        if passes is None:
            return None
        share = 1
        if self.shared:
            from hgpo_trl.runtime.collective import elementwise_process_sum

            passes, share = np.asarray(elementwise_process_sum(accelerator, passes.tolist())), accelerator.num_processes
        return {"steps/trained": float((passes > 0).sum()) / share, "steps/max_untrained": float((passes == 0).sum()),
                "steps/trained_passes": float(passes.sum()) / share}


def iteration_metrics(rollout: Rollout, batch: StepBatch, advantages: np.ndarray, samples: SampleCounts, args,
                      levels: list[LevelStats] | None, *, eos_token_ids, diagnostics: bool,
                      advantage_seconds: float, training_seconds: float) -> dict[str, float]:
    """This process's metrics of one iteration (`args`: the HGPOConfig; `levels`: HGPO's level statistics of
    the batch, under estimator hgpo). `diagnostics`: add each estimator's bias against whole-history oracle
    groups (diag/*). A value that does not apply on this process is NaN."""
    episodes, steps = rollout.episodes, rollout.steps
    outcome = success_and_score(episode_totals(episodes))
    local = {
        "env/success_rate": np.mean([e.won for e in episodes]),
        "env/episode_reward": np.mean([e.total_reward for e in episodes]),
        "env/episode_length": np.mean([e.steps for e in episodes]),
        "env/invalid_rate": np.mean([not s.valid for s in steps]) if steps else 0.0,
        "env/faults": sum(e.fault is not None for e in episodes),
        # Environments that grade outcomes (WebShop's purchase score), over every episode as hgpo-eval reports it;
        # NaN where none does (gathered by nanmean).
        "env/score": outcome.get("score", float("nan")),
        "adv/mean": float(np.mean(advantages)) if steps else 0.0,
        "adv/std": float(np.std(advantages)) if steps else 0.0,
        "steps/collected": len(steps),
        "steps/kept": samples.kept,
        "steps/kept_fraction": samples.kept / max(len(steps), 1),
        "steps/duplicated": samples.duplicated,
        "steps/padded_fraction": samples.padded_fraction,
        "steps/optimizer_steps": samples.optimizer_steps,
        "time/generation": rollout.generation_seconds,
        "time/env": rollout.env_seconds,
        "time/rollout": rollout.seconds,
        "time/advantages": advantage_seconds,
        "time/training": training_seconds,
        "throughput/env_steps_per_second": len(steps) / max(rollout.seconds, 1e-9),
        **rollout.prompt_stats(),
        **completion_metrics(steps, eos_token_ids),
        **samples.token_spread,
    }
    if diagnostics:
        estimators = args.diagnostic_estimators()
        report = advantage_bias(batch, estimators, gamma=args.gamma, norm=args.advantage_norm,
                                invalid_penalty=args.invalid_penalty) if steps else {}
        for label in estimators:
            bias = report.get(label, Bias(0.0, 0.0, 0.0, 0))
            local[f"diag/{label}_bias"], local[f"diag/{label}_spread"] = bias.bias, bias.spread
            local["diag/oracle_steps"] = bias.steps
    if levels is not None:
        for level in levels:
            local[f"hgpo/level{level.level}_with_peers"] = level.with_peers / max(len(steps), 1)
    return {name: float(value) for name, value in local.items()}


def completion_metrics(steps, eos_token_ids) -> dict[str, float]:
    """TRL's `completions/*` over this process's steps: lengths in tokens, and `clipped_ratio`, the share that
    hit max_completion_length without an end token (NaN where it does not apply)."""
    lengths = np.array([len(s.completion.completion_ids) for s in steps], dtype=float)
    ended = np.array([bool(s.completion.completion_ids) and s.completion.completion_ids[-1] in eos_token_ids
                      for s in steps], dtype=bool)
    terminated = lengths[ended]

    def stat(values: np.ndarray, fn) -> float:
        return float(fn(values)) if values.size else float("nan")

    return {"completions/mean_length": stat(lengths, np.mean), "completions/min_length": stat(lengths, np.min),
            "completions/max_length": stat(lengths, np.max), "completions/clipped_ratio": stat(~ended, np.mean),
            "completions/mean_terminated_length": stat(terminated, np.mean),
            "completions/min_terminated_length": stat(terminated, np.min),
            "completions/max_terminated_length": stat(terminated, np.max)}


def gathered_metrics(accelerator, local: dict[str, float]) -> dict[str, float]:
    """Every process's `local` metrics (the same keys everywhere: one gather), combined (`combine_processes`)."""
    import torch

    names = sorted(local)
    gathered = accelerator.gather(torch.tensor([local[k] for k in names], device=accelerator.device)[None])
    return combine_processes(names, gathered.reshape(-1, len(names)).cpu().numpy())


def log_completions(trainer, steps, advantages: np.ndarray) -> None:
    """The samples of an iteration (prompt, completion, reward, advantage) of every process into TRL's
    completions table (`trainer._logs`), when `log_completions` asks for it: an ALFWorld iteration holds
    thousands of prompts of thousands of tokens. Every process must call it."""
    if not trainer.args.log_completions:
        return
    from accelerate.utils import gather_object

    logs = trainer._logs
    logs["prompt"].extend(gather_object([s.prompt for s in steps]))
    logs["completion"].extend(gather_object([s.completion.text for s in steps]))
    logs["rewards"]["env_reward"].extend(gather_object([s.reward for s in steps]))
    logs["advantages"].extend(gather_object(advantages.tolist()))


def combine_processes(names: list[str], rows: np.ndarray) -> dict[str, float]:
    """Per metric, its value over processes (`rows`: one row per process, columns in `names` order): the
    minimum for a `min` metric (`.../min`, `.../min_length`), the maximum for a `max` one, else the mean,
    ignoring the processes where it does not apply (NaN); a metric that applies nowhere is left out."""
    combined = {}
    for name, column in zip(names, rows.T, strict=True):
        if np.all(np.isnan(column)):
            continue
        last = name.rsplit("/", 1)[-1]
        reduce = (np.nanmin if last == "min" or last.startswith("min_") else
                  np.nanmax if last == "max" or last.startswith("max_") else np.nanmean)
        combined[name] = float(reduce(column))
    return combined
