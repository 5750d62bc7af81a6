"""GRPO at the trajectory level: one score per episode, normalised within its task group."""

from __future__ import annotations

import numpy as np

from hgpo_trl.advantages.batch import SortedSteps, StepBatch, sort_steps
from hgpo_trl.advantages.groups import Groups, check_ddof, check_norm
from hgpo_trl.advantages.returns import check_penalty, episode_scores, trajectory_sums

EPISODE_STATS = ("trajectories", "steps")


def check_episode_stats(episode_stats: str) -> None:
    if episode_stats not in EPISODE_STATS:
        raise ValueError(f"episode_stats must be one of {EPISODE_STATS}, got {episode_stats!r}")


def episode_groups(steps: SortedSteps, episode_stats: str,
                   invalid_penalty: float) -> tuple[Groups, np.ndarray, np.ndarray]:
    """What the episode term compares: `(groups, scores, unit)`, where `scores` holds one score per compared unit,
    `groups` partitions the units by task group and `unit[i]` is the unit of sorted row i.

    "trajectories": one unit per trajectory, scored by its total env reward minus the penalty per invalid step.
    "steps" (as released in verl-agent, `compute_mean_std_cross_steps=True`): one unit per step row, scored by its
    episode's total env reward minus the penalty if that row was invalid, the score verl-agent's episode reward
    manager and `apply_invalid_action_penalty` leave on the row; longer trajectories weigh more.
    """
    check_episode_stats(episode_stats)
    if episode_stats == "trajectories":
        return Groups.of(steps.group[steps.traj_start]), episode_scores(steps, invalid_penalty), steps.traj
    check_penalty(invalid_penalty)
    row_scores = trajectory_sums(steps, steps.reward)[steps.traj] - invalid_penalty * ~steps.valid
    return Groups.of(steps.group), row_scores, np.arange(len(steps))


def episode_advantages(steps: SortedSteps, norm: str, episode_stats: str, invalid_penalty: float,
                       std_ddof: int = 0) -> np.ndarray:
    """Per sorted row: the GRPO (episode-level) advantage; GiGPO's A_E and HGPO's base item."""
    check_norm(norm)
    check_ddof(std_ddof)
    groups, scores, unit = episode_groups(steps, episode_stats, invalid_penalty)
    return groups.normalize(scores, norm, std_ddof)[unit]


def grpo_advantages(batch: StepBatch, *, norm: str = "mean_std_norm", episode_stats: str = "trajectories",
                    std_ddof: int = 0, invalid_penalty: float = 0.1) -> np.ndarray:
    """GRPO: each step gets its trajectory's advantage, the episode score normalised within the task group.

    The episode score is the total env reward minus `invalid_penalty` per invalid step.
    `episode_stats="steps"` reproduces the released per-row variant (see `episode_groups`); `std_ddof=1` the
    released `torch.std`. A group of one unit gets 0 (the release leaves it unnormalised: its raw score).
    """
    steps = sort_steps(batch)
    return steps.unsort(episode_advantages(steps, norm, episode_stats, invalid_penalty, std_ddof))
