"""GiGPO (Feng et al. 2025): episode advantage plus an anchor-state step advantage."""

from __future__ import annotations

import numpy as np

from hgpo_trl.advantages.batch import StepBatch, sort_steps
from hgpo_trl.advantages.groups import check_ddof, check_norm, group_ids, normalize_within
from hgpo_trl.advantages.grpo import episode_advantages
from hgpo_trl.advantages.returns import sorted_returns
from hgpo_trl.advantages.similarity import check_similarity_threshold, similar_observations


def gigpo_advantages(batch: StepBatch, *, gamma: float = 0.95, omega: float = 1.0, norm: str = "mean_std_norm",
                     episode_stats: str = "trajectories", std_ddof: int = 0,
                     invalid_penalty: float = 0.1, similarity_threshold: float | None = None) -> np.ndarray:
    """GiGPO: `A = A_E + omega * A_S`.

    `A_E` is the GRPO episode advantage; `A_S` normalises the discounted returns `R_t` within anchor-state
    groups (steps of one task group whose current observation is identical). One `norm` serves both terms,
    as released. `std_ddof` is the ddof of `mean_std_norm`'s std in both terms: 0 (population, this project's
    default) or 1 (released GiGPO's `torch.std`). `episode_stats="steps"` is released GiGPO's episode term.
    `similarity_threshold` (released `enable_similarity` with `similarity_thresh`; off by default, as released):
    anchor groups are clusters of similar observation text (`similarity.py`: difflib ratio >= threshold with
    the cluster's first member in (trajectory, step) order); 1.0 is exact grouping. Needs `obs` as text.
    """
    check_norm(norm)
    check_ddof(std_ddof)
    check_similarity_threshold(similarity_threshold)
    if not np.isfinite(omega):
        raise ValueError(f"omega must be finite, got {omega}")
    steps = sort_steps(batch)
    episode = episode_advantages(steps, norm, episode_stats, invalid_penalty, std_ddof)
    anchors = steps.obs if similarity_threshold is None else similar_observations(steps, batch.obs,
                                                                                  similarity_threshold)
    anchor = normalize_within(group_ids(steps.group, anchors), sorted_returns(steps, gamma, invalid_penalty), norm,
                              std_ddof)
    return steps.unsort(episode + omega * anchor)
