"""The paper's pilot analysis on any step batch: how far each estimator's advantage is from an oracle's.

Oracle steps are those whose task group holds at least one other step with the same current observation AND
the same whole history (every earlier observation of the trajectory). Within such a group every step acted in
the same context, so the normalised return within it is an advantage free of context inconsistency: the
oracle. For each estimator, `advantage_bias` reports on the oracle steps the mean (bias) and standard deviation
(spread) of `estimator advantage - oracle advantage`, and how many steps qualified.

Histories compare observations only, as HGPO's levels do (actions show in the next observation).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hgpo_trl.advantages import StepBatch, compute_advantages, estimator_options
from hgpo_trl.advantages.batch import sort_steps
from hgpo_trl.advantages.groups import Groups, check_norm, group_ids
from hgpo_trl.advantages.returns import sorted_returns


def oracle_advantages(batch: StepBatch, *, gamma: float = 0.95, norm: str = "mean_std_norm",
                      invalid_penalty: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(advantage, qualified) per input row: the return normalised within the group of steps sharing the task
    group, the step t and the whole observation history obs_0..obs_t; `qualified` marks rows whose group has
    another member (elsewhere the advantage is 0)."""
    check_norm(norm)
    steps = sort_steps(batch)
    returns = sorted_returns(steps, gamma, invalid_penalty)
    # Prefix codes: rows at step t share a code iff their task groups and observations 0..t are equal.
    prefix = np.zeros(len(steps), dtype=np.int64)
    for t in range(int(steps.step.max()) + 1 if len(steps) else 0):
        at = np.flatnonzero(steps.step == t)
        previous = prefix[at - 1] if t > 0 else np.zeros(at.size, dtype=np.int64)
        prefix[at] = group_ids(steps.group[at], previous, steps.obs[at])
    oracle = Groups.of(group_ids(steps.step, prefix))
    return steps.unsort(oracle.normalize(returns, norm)), steps.unsort(oracle.size() >= 2)


@dataclass(frozen=True)
class Bias:
    """One estimator against the oracle on the oracle steps."""

    bias: float  # mean of (estimator - oracle)
    spread: float  # standard deviation of (estimator - oracle)
    mse: float  # mean of (estimator - oracle)^2 = bias^2 + spread^2
    steps: int  # oracle steps compared


def advantage_bias(batch: StepBatch, estimators: Mapping[str, Mapping[str, Any]], *, gamma: float = 0.95,
                   norm: str = "mean_std_norm", invalid_penalty: float = 0.1) -> dict[str, Bias]:
    """Per label of `estimators` ({label: {"estimator": name, **options}}): its `Bias` against the oracle.
    Every estimator is the library's own (`compute_advantages`), with the same gamma, norm and penalty."""
    oracle, qualified = oracle_advantages(batch, gamma=gamma, norm=norm, invalid_penalty=invalid_penalty)
    report = {}
    for label, spec in estimators.items():
        options = dict(spec)
        name = options.pop("estimator")
        shared = {"gamma": gamma, "norm": norm, "invalid_penalty": invalid_penalty}
        options = {**{k: v for k, v in shared.items() if k in estimator_options(name)}, **options}
        advantages = compute_advantages(name, batch, **options)
        difference = (advantages - oracle)[qualified]
        if difference.size == 0:
            report[label] = Bias(0.0, 0.0, 0.0, 0)
            continue
        report[label] = Bias(float(difference.mean()), float(difference.std()), float(np.mean(difference ** 2)),
                             int(difference.size))
    return report
