"""HGPO (Hierarchy-of-Groups Policy Optimization, ICLR 2026): per-step advantages blended across history depths.

Level k groups the steps of one task group whose last k+1 anchor observations (obs_{t-k}, ..., obs_t) are
identical. Level 0 is GiGPO's anchor-state group; deeper levels are smaller but context-consistent. Each
level where a step has a peer contributes `a_k = norm(R_t within the level-k group)`; the contributions are
averaged with weights that favour deeper levels.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np

from hgpo_trl.advantages.batch import SortedSteps, StepBatch, sort_steps
from hgpo_trl.advantages.groups import Groups, check_ddof, check_norm
from hgpo_trl.advantages.grpo import check_episode_stats, episode_groups
from hgpo_trl.advantages.returns import sorted_returns
from hgpo_trl.advantages.similarity import check_similarity_threshold, similar_observations

WEIGHTINGS = ("power", "inverse_mse")
# inverse_mse floors each group's return variance at this share of its task group's pooled variance, so a
# small all-equal group cannot take all the weight (the same floor as ProGPO's potentials).
VARIANCE_FLOOR_SHARE = 0.25
TINY = 1e-12
# drop_zero_items drops items that are 0 up to rounding: whether a member sitting at its group's mean comes out
# as exactly 0.0 or as 1e-16 depends on the order of a float sum, and must not decide what is dropped.
ZERO_TOLERANCE = 1e-12


def history_levels(steps: SortedSteps, obs: np.ndarray, depth: int) -> list[Groups]:
    """HGPO's levels k = 0..depth: level k groups the steps of a task group whose observations obs_{t-k}..obs_t
    are identical (`obs`: non-negative codes per sorted row). A step at t < k, or whose prompt showed fewer
    than k earlier observations (`steps.window`), is not in level k. Keys use observations only (not actions),
    as released. The levels are nested, so one lexicographic sort serves them all."""
    rows = np.arange(len(steps))
    columns = [steps.group, obs + 1]
    members = [np.ones(len(steps), dtype=bool)]
    for k in range(1, depth + 1):
        member = members[-1] & (steps.step >= k)
        if steps.window is not None:
            member &= steps.window >= k
        # Step t - k of the trajectory is row i - k; 0 marks "no level k" and never matches a member's code.
        columns.append(np.where(member, obs[np.maximum(rows - k, 0)] + 1, 0))
        members.append(member)
    return Groups.nested(columns, members)


def anchor_codes(steps: SortedSteps, batch: StepBatch, similarity_threshold: float | None) -> np.ndarray:
    """What the levels compare observations by: their exact codes, or their similarity clusters."""
    if similarity_threshold is None:
        return steps.obs
    return similar_observations(steps, batch.obs, similarity_threshold)


def check_level_args(depth: int, alpha: float, norm: str, weighting: str) -> None:
    check_norm(norm)
    if isinstance(depth, bool) or not isinstance(depth, int | np.integer) or depth < 0:
        raise ValueError(f"depth must be an integer >= 0, got {depth!r}")
    if not (np.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha must be finite and >= 0, got {alpha}")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")


def hgpo_advantages(batch: StepBatch, *, gamma: float = 0.95, depth: int = 2, alpha: float = 1.0,
                    norm: str = "mean_std_norm", weighting: str = "power", base_group: bool = False,
                    drop_zero_items: bool = False, episode_stats: str = "trajectories", std_ddof: int = 0,
                    invalid_penalty: float = 0.1, similarity_threshold: float | None = None) -> np.ndarray:
    """HGPO advantages: `A = sum_k w_k a_k / sum_k w_k` over the levels k = 0..K where the step has a peer.

    Args:
        depth: K, the deepest level (defaults to the prompt's memory window H in the trainer).
        alpha: `weighting="power"` uses `w_k = (k+2)^alpha` as released (0: uniform; large: deepest level).
        weighting: "power", or "inverse_mse" (beyond the paper): `w_k ∝ 1 / (bhat_k^2 + s_k^2 / n_k)` with
            `bhat_k` the gap between the level-k mean and the deepest contributing level's mean (a bias proxy)
            and `s_k^2` the group's return variance, floored at a quarter of the task group's pooled variance.
        base_group: add the GRPO episode advantage as one more item, of weight 1 in the released `(k+2)^alpha`
            units (with inverse_mse, weighted from its own group of episode scores).
        drop_zero_items: reproduce the released filter that drops every item equal to 0 (here: |a| <= 1e-12,
            so float rounding does not decide), the base item included. By default
            this project keeps them: an all-equal context-consistent group means "no advantage", and dropping
            it would fall back on the biased shallow levels.
        episode_stats, std_ddof: how the base item is computed, as in `grpo_advantages` (released:
            "steps" and 1). The levels always use the population std (ddof 0), as released.
        similarity_threshold: (ours, not in the paper or the release) key the levels on clusters of similar
            observation text instead of exact text: GiGPO's `similarity_threshold` clusters (`similarity.py`),
            so level k groups steps whose last k+1 observations fall in the same clusters. 1.0: exact.

    A level whose group is a singleton does not contribute; a group whose returns are all equal contributes an
    exact 0; a step with no contributing item gets 0. Weights are computed relative to each step's deepest
    contributing level, so a large alpha neither overflows nor underflows.
    """
    steps, items, weights = hgpo_blend(
        batch, gamma=gamma, depth=depth, alpha=alpha, norm=norm, weighting=weighting, base_group=base_group,
        drop_zero_items=drop_zero_items, episode_stats=episode_stats, std_ddof=std_ddof,
        invalid_penalty=invalid_penalty, similarity_threshold=similarity_threshold)
    total = weights.sum(axis=0)
    advantages = np.where(total > 0, (weights * items).sum(axis=0) / np.where(total > 0, total, 1.0), 0.0)
    return steps.unsort(advantages)


def hgpo_blend(batch: StepBatch, *, gamma: float, depth: int, alpha: float, norm: str, weighting: str,
               base_group: bool, drop_zero_items: bool, episode_stats: str, std_ddof: int, invalid_penalty: float,
               similarity_threshold: float | None) -> tuple[SortedSteps, np.ndarray, np.ndarray]:
    """HGPO's items and weights in sorted order: (steps, items, weights), each (K+1 [+1 base], N), the weights 0
    where an item does not contribute. The options are `hgpo_advantages`'."""
    check_level_args(depth, alpha, norm, weighting)
    check_episode_stats(episode_stats)
    check_ddof(std_ddof)
    check_similarity_threshold(similarity_threshold)
    steps = sort_steps(batch)
    returns = sorted_returns(steps, gamma, invalid_penalty)
    levels = Groups.stack(history_levels(steps, anchor_codes(steps, batch, similarity_threshold), depth))
    per_level = (depth + 1, len(steps))
    stacked_returns = np.tile(returns, depth + 1)
    items = levels.normalize(stacked_returns, norm).reshape(per_level)
    on = (levels.size() >= 2).reshape(per_level)
    if drop_zero_items:
        on &= np.abs(items) > ZERO_TOLERANCE
    k = np.arange(depth + 1)[:, None]
    deepest = np.where(on, k, 0).max(axis=0)

    if weighting == "power":
        # Levels deeper than a step's deepest contributing one are masked out below; clip them so exp stays finite.
        weights = np.exp(alpha * np.minimum(np.log(k + 2.0) - np.log(deepest + 2.0), 0.0))
    else:
        task = Groups.of(steps.group)
        floor = np.maximum(VARIANCE_FLOOR_SHARE * task.variance(returns), TINY)
        means = levels.mean(stacked_returns).reshape(per_level)
        variances = np.maximum(levels.variance(stacked_returns).reshape(per_level), floor)
        sizes = np.maximum(levels.size().reshape(per_level), 1)
        deepest_mean = np.take_along_axis(means, deepest[None], axis=0)
        weights = 1.0 / ((means - deepest_mean) ** 2 + variances / sizes)

    if base_group:
        # The base item compares the episode scores of the task group (per trajectory, or per step row with
        # episode_stats="steps"); it contributes where that comparison has at least 2 members.
        units, scores, unit = episode_groups(steps, episode_stats, invalid_penalty)
        base_on = units.size()[unit] >= 2
        base_item = units.normalize(scores, norm, std_ddof)[unit]
        if drop_zero_items:
            base_on &= np.abs(base_item) > ZERO_TOLERANCE
        if weighting == "power":
            base_weight = np.exp(-alpha * np.log(deepest + 2.0))
        else:
            base_mean = units.mean(scores)[unit]
            base_var = np.maximum(units.variance(scores)[unit], TINY)
            base_n = np.maximum(units.size()[unit], 1)
            base_weight = 1.0 / ((base_mean - deepest_mean[0]) ** 2 + base_var / base_n)
        items = np.vstack([items, base_item])
        on = np.vstack([on, base_on])
        weights = np.vstack([weights, base_weight])

    return steps, items, np.where(on, weights, 0.0)


@dataclass(frozen=True)
class LevelStats:
    """How HGPO's level k grouped one batch.

    eligible: steps that have level k (t >= k, within their prompt's window).
    with_peers: steps whose level-k group holds at least one other step (the level contributes for them).
    group_sizes: histogram of the level's groups by size: `group_sizes[s]` groups have s members.
    """

    level: int
    eligible: int
    with_peers: int
    group_sizes: np.ndarray


def hgpo_level_stats(batch: StepBatch, depth: int = 2, similarity_threshold: float | None = None) -> list[LevelStats]:
    """Per level k = 0..K: how many steps had peers and the group-size histogram (for logging)."""
    check_level_args(depth, 0.0, "mean_norm", "power")
    check_similarity_threshold(similarity_threshold)
    steps = sort_steps(batch)
    return [LevelStats(level=k, eligible=int(level.order.size), with_peers=int((level.size() >= 2).sum()),
                       group_sizes=np.bincount(level.sizes, minlength=2))
            for k, level in enumerate(history_levels(steps, anchor_codes(steps, batch, similarity_threshold), depth))]


def hgpo_peer_levels(batch: StepBatch, depth: int = 2, similarity_threshold: float | None = None) -> np.ndarray:
    """(N, K+1) booleans in the batch's row order: whether the step's level-k group holds another step, i.e. the
    levels that contribute to its HGPO advantage (trajectory dumps); `similarity_threshold` as for the levels."""
    check_level_args(depth, 0.0, "mean_norm", "power")
    check_similarity_threshold(similarity_threshold)
    steps = sort_steps(batch)
    levels = history_levels(steps, anchor_codes(steps, batch, similarity_threshold), depth)
    return steps.unsort(np.stack([level.size() >= 2 for level in levels], axis=1))


def hgpo_level_weights(batch: StepBatch, **options) -> np.ndarray:
    """(N, K+1 [+1 base]) in the batch's row order: the share of each level's item (then the base item's, with
    `base_group`) in the step's HGPO advantage, summing to 1 (all 0 for a step with no contributing item); the
    options are `hgpo_advantages`' (trajectory dumps show them)."""
    defaults = {p.name: p.default for p in inspect.signature(hgpo_advantages).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    steps, _, weights = hgpo_blend(batch, **{**defaults, **options})
    total = weights.sum(axis=0)
    return steps.unsort((weights / np.where(total > 0, total, 1.0)).T)


def hgpo_level_groups(batch: StepBatch, depth: int = 2, similarity_threshold: float | None = None) -> np.ndarray:
    """(N, K+1) int64 in the batch's row order: the id of the step's level-k group (equal ids: the same group; ids
    of one level distinct across task groups), -1 where the step has no level k; `similarity_threshold` as for
    the levels. The steps that share an id are the peers HGPO normalised the step's return among."""
    check_level_args(depth, 0.0, "mean_norm", "power")
    check_similarity_threshold(similarity_threshold)
    steps = sort_steps(batch)
    ids = np.full((depth + 1, len(steps)), -1, dtype=np.int64)
    for k, level in enumerate(history_levels(steps, anchor_codes(steps, batch, similarity_threshold), depth)):
        ids[k, level.order] = level.run
    return steps.unsort(ids.T)
