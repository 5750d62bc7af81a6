"""ProGPO ("Progress- and Reliability-Oriented Group Policy Optimization"), as this project reads its abstract.

Only the abstract is public, with no code: this module implements the reading written down in
ALGORITHMS.md, not a verified reproduction. `A_t = A_peer + lam * C_t`:
- `A_peer`: exact-prefix peer comparison, the return normalised within the steps whose whole history
  (every earlier observation and action, and the current observation) is identical.
- `C_t = r'_t + gamma * V(s_{t+1}) - V(s_t)`: transition credit from rollout-based state potentials `V`,
  fused across history depths by inverse variance, with leave-one-out means, over states pooled by a cheap
  semantic key (normalised observation text).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from hgpo_trl.advantages.batch import SortedSteps, StepBatch, codes, factorize, sort_steps
from hgpo_trl.advantages.groups import Groups, group_ids, narrow
from hgpo_trl.advantages.hgpo import TINY, VARIANCE_FLOOR_SHARE, check_level_args, history_levels
from hgpo_trl.advantages.returns import sorted_returns

_DIGITS = re.compile(r"\d+")
_SPACES = re.compile(r"\s+")


def semantic_key(obs: Hashable) -> Hashable:
    """Pool observations that differ only in case, object indices or spacing ("Cabinet 2" ~ "cabinet 1")."""
    if not isinstance(obs, str):
        return obs
    return _SPACES.sub(" ", _DIGITS.sub("", obs.lower())).strip()


def prefix_keys(steps: SortedSteps, action: np.ndarray) -> np.ndarray:
    """Per sorted row: an id equal for two steps iff they share task group, step index and whole history
    (obs_0, a_0, ..., obs_{t-1}, a_{t-1}, obs_t), given `action` codes in sorted order. These are the
    *oracle groups* of the paper's analysis."""
    key = np.zeros(len(steps), dtype=np.int64)
    rows_by_step = np.argsort(narrow(steps.step), kind="stable")
    boundaries = np.searchsorted(steps.step[rows_by_step], np.arange(steps.step.max(initial=-1) + 2))
    for t in range(len(boundaries) - 1):
        rows = rows_by_step[boundaries[t]:boundaries[t + 1]]
        if t == 0:
            key[rows] = group_ids(steps.group[rows], steps.obs[rows])
        else:  # step t - 1 of the same trajectory is the previous row
            key[rows] = group_ids(key[rows - 1], action[rows - 1], steps.obs[rows])
        key[rows] += boundaries[t]  # ids of different steps never collide
    return key


def state_potentials(steps: SortedSteps, returns: np.ndarray, depth: int, obs: np.ndarray) -> np.ndarray:
    """Per sorted row: V(s_t), the leave-one-out mean return of the step's state, fused over history depths
    d = 0..depth by inverse variance (`(n_d - 1) / v_d`, the precision of a mean of n_d - 1 peers, with
    `v_d = max(s_d^2, pooled / 4)`); the task group's mean return where no depth has a peer."""
    task = Groups.of(steps.group)
    floor = np.maximum(VARIANCE_FLOOR_SHARE * task.variance(returns), TINY)
    weighted_sum = np.zeros(len(steps))
    weight_total = np.zeros(len(steps))
    for groups in history_levels(steps, obs, depth):
        size = groups.size()
        peers = size >= 2
        others = np.where(peers, size - 1, 1)
        loo_mean = (groups.total(returns) - returns) / others
        weight = np.where(peers, others / np.maximum(groups.variance(returns), floor), 0.0)
        weighted_sum += weight * np.where(peers, loo_mean, 0.0)
        weight_total += weight
    return np.where(weight_total > 0, weighted_sum / np.where(weight_total > 0, weight_total, 1.0), task.mean(returns))


def pooled_states(steps: SortedSteps, obs: Sequence[Hashable], state_key: Callable[[Hashable], Hashable]) -> np.ndarray:
    """Per sorted row: a code shared by the observations that `state_key` maps to one key. The key function
    runs once per distinct observation, not once per step."""
    ids, uniques = factorize(steps.take(obs), "obs")
    pooled, _ = factorize([state_key(value) for value in uniques], "obs")
    return pooled[ids]


def progpo_advantages(batch: StepBatch, *, gamma: float = 0.95, depth: int = 2, lam: float = 1.0,
                      norm: str = "mean_std_norm", invalid_penalty: float = 0.1,
                      state_key: Callable[[Hashable], Hashable] | None = None) -> np.ndarray:
    """ProGPO advantages `A_t = A_peer + lam * C_t` (our reading of the abstract; see the module docstring).

    Args:
        depth: the deepest history depth K at which state potentials are estimated.
        lam: weight of the transition credit C_t.
        state_key: maps an anchor observation to the key under which potentials pool states
            (default `semantic_key`: lower case, object indices removed, whitespace folded).

    `V = 0` after a trajectory's last step, whether it terminated or was truncated: the batch holds no
    observation after the last step to estimate a potential from.
    """
    check_level_args(depth, 0.0, norm, "power")
    if not np.isfinite(lam):
        raise ValueError(f"lam must be finite, got {lam}")
    if batch.action is None:
        raise ValueError("progpo needs StepBatch.action (the action text sent to the environment; None where nothing was sent)")
    steps = sort_steps(batch)
    returns = sorted_returns(steps, gamma, invalid_penalty)
    peer = Groups.of(prefix_keys(steps, codes(steps.take(batch.action), "action"))).normalize(returns, norm)
    pooled = pooled_states(steps, batch.obs, state_key or semantic_key)
    potential = state_potentials(steps, returns, depth, pooled)
    next_potential = np.where(steps.next_in_traj(), np.r_[potential[1:], 0.0], 0.0)
    reward = steps.reward - invalid_penalty * ~steps.valid
    credit = reward + gamma * next_potential - potential
    return steps.unsort(peer + lam * credit)
