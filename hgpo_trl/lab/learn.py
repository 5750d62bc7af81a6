"""The lab's policy-gradient loop: many seeds of a tabular softmax policy learning the corridor at once, each
iteration's advantages from the library's own estimators on one stacked `StepBatch`.

Per iteration, for every seed at once:
1. Exact values of the current policy (`corridor.exact_values`): the success probability from the entrance is the
   learning curve (no sampling noise), and Q - V the exact advantage the estimators are measured against.
2. Rollouts: `tasks` task groups of `group_size` episodes per seed, vectorised over seeds and episodes; each
   seed's random numbers depend only on (seed, iteration), so every estimator sees the same draws while it acts
   like another (common random numbers: comparisons on the same seeds are paired).
3. One `StepBatch` for all seeds, the seeds' task groups disjoint: the estimators see what the trainer
   gives them: `obs` the observation text (ProGPO pools texts that differ only in digits, as in training),
   `action` the action text, every step valid.
4. Advantages rescaled to unit standard deviation per seed: estimators differ in scale (GiGPO sums two terms,
   HGPO averages levels), so one learning rate then compares their directions, not their step sizes.
5. One policy-gradient step per seed, the mean over its steps of `A_i * grad log pi(a_i | context_i)`, with
   plain SGD on the logits: `theta[c] += lr * (1/n) sum_{i in c} A_i (onehot(a_i) - pi(. | c))`, the sum over the
   seed's rows in context c and n the seed's number of steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hgpo_trl.advantages import StepBatch, compute_advantages, estimator_options
from hgpo_trl.lab.corridor import Corridor, Values, build, exact_values, policy_probabilities


@dataclass(frozen=True)
class Setting:
    """One cell of the sweep: the share of hiding tasks (inconsistency), the group size G and the memory window H."""

    inconsistency: float = 1.0
    group_size: int = 8
    history_length: int = 2
    tasks: int = 2  # task groups per seed and iteration
    length: int = 4  # corridor sections
    iterations: int = 40
    learning_rate: float = 4.0
    gamma: float = 0.95
    norm: str = "mean_std_norm"

    def __post_init__(self):
        if not 0.0 <= self.inconsistency <= 1.0:
            raise ValueError(f"Setting.inconsistency is a share of hiding tasks, in [0, 1]; got {self.inconsistency}")

    def corridor(self) -> Corridor:
        return build(self.history_length, self.length)


# An estimator of the lab: the library's by name (through compute_advantages), or a function of the batch and the
# exact values (the references: the oracle groups and the exact advantage).
Reference = Callable[[StepBatch, "Steps", Setting, str], np.ndarray]  # (batch, steps, setting, norm)


@dataclass(frozen=True)
class Spec:
    label: str
    name: str | None = None  # a registered estimator
    options: dict[str, Any] = field(default_factory=dict)
    reference: Reference | None = None

    def advantages(self, batch: StepBatch, steps: Steps, setting: Setting, norm: str) -> np.ndarray:
        if self.reference is not None:
            return self.reference(batch, steps, setting, norm)
        accepted = estimator_options(self.name)
        shared = {key: value for key, value in (("gamma", setting.gamma), ("norm", norm)) if key in accepted}
        return compute_advantages(self.name, batch, **{**shared, **self.options})


@dataclass(frozen=True)
class Steps:
    """One iteration's steps for all seeds, in rollout order: seed, episode, t, node, action slot, and the
    exact advantage of each (under the policy that acted)."""

    seed: np.ndarray
    episode: np.ndarray  # within its seed
    t: np.ndarray
    node: np.ndarray
    action: np.ndarray
    exact: np.ndarray


def draws(seeds: Sequence[int], iteration: int, episodes: int, max_steps: int) -> np.ndarray:
    """(seeds, episodes, max_steps + 1) uniforms, seed s's from (s, iteration) alone: one per step for the action,
    the last for the task's kind (read from the task group's first episode)."""
    return np.stack([np.random.default_rng([int(s), iteration]).random((episodes, max_steps + 1)) for s in seeds])


def rollout(corridor: Corridor, probabilities: np.ndarray, values: Values, uniforms: np.ndarray,
            inconsistency: float, group_size: int) -> Steps:
    """Play every seed's episodes at once, each task group from a hiding task's entrance (node 1) with
    probability `inconsistency` and from a clear one's (node 0) otherwise."""
    seeds, episodes = uniforms.shape[:2]
    seed = np.repeat(np.arange(seeds), episodes)
    episode = np.tile(np.arange(episodes), seeds)
    first = episode - episode % group_size
    node = (uniforms[seed, first, -1] < inconsistency).astype(np.int64)
    alive = np.ones(seeds * episodes, dtype=bool)
    advantage = values.advantage()
    columns: list[tuple[np.ndarray, ...]] = []
    for t in range(corridor.max_steps):
        if not alive.any():
            break
        s, e, n = seed[alive], episode[alive], node[alive]
        action = (uniforms[s, e, t] >= probabilities[s, n, 0]).astype(np.int64)  # slot 0 with its probability
        columns.append((s, e, np.full(s.size, t), n, action, advantage[s, n, action]))
        node[alive] = corridor.child[n, action]
        alive[alive] = ~corridor.done[n, action]
    return Steps(*(np.concatenate(parts) for parts in zip(*columns, strict=True)))


def step_batch(corridor: Corridor, steps: Steps, setting: Setting) -> StepBatch:
    """The library's StepBatch of all seeds: seed s's task groups and episodes get ids of their own."""
    episodes = setting.tasks * setting.group_size
    return StepBatch(group=steps.seed * setting.tasks + steps.episode // setting.group_size,
                     traj=steps.seed * episodes + steps.episode, step=steps.t, obs=corridor.texts[steps.node],
                     reward=corridor.reward[steps.node, steps.action], valid=np.ones(steps.t.size, dtype=bool),
                     action=corridor.action_texts[steps.node, steps.action])


def unit_scale(advantages: np.ndarray, seed: np.ndarray, seeds: int) -> np.ndarray:
    """Each seed's advantages divided by their standard deviation (left alone where it is ~0)."""
    n = np.bincount(seed, minlength=seeds)
    mean = np.bincount(seed, weights=advantages, minlength=seeds) / np.maximum(n, 1)
    var = np.bincount(seed, weights=advantages ** 2, minlength=seeds) / np.maximum(n, 1) - mean ** 2
    std = np.sqrt(np.maximum(var, 0.0))
    return advantages / np.where(std > 1e-12, std, 1.0)[seed]


def policy_gradient(corridor: Corridor, probabilities: np.ndarray, steps: Steps, advantages: np.ndarray,
                    seeds: int) -> np.ndarray:
    """(seeds, contexts, 2): per seed, the mean over its steps of A_i * d log pi(a_i | c_i) / d theta."""
    pi = probabilities[steps.seed, steps.node]  # (rows, 2)
    onehot = np.eye(2)[steps.action]
    per_row = advantages[:, None] * (onehot - pi) / np.bincount(steps.seed, minlength=seeds)[steps.seed, None]
    cell = (steps.seed * corridor.num_contexts + corridor.context[steps.node]) * 2
    size = seeds * corridor.num_contexts * 2
    grad = np.bincount(cell, weights=per_row[:, 0], minlength=size) + np.bincount(cell + 1, weights=per_row[:, 1],
                                                                                  minlength=size)
    return grad.reshape(seeds, corridor.num_contexts, 2)


@dataclass(frozen=True)
class Curves:
    """Per seed and iteration (0 = before any update): exact success probability and discounted value at the
    start, over the mix of task kinds."""

    success: np.ndarray  # (seeds, iterations + 1)
    value: np.ndarray


def train(setting: Setting, spec: Spec, seeds: Sequence[int], corridor: Corridor | None = None,
          on_first_batch: Callable[[StepBatch, Steps], None] | None = None) -> Curves:
    """`setting.iterations` policy-gradient iterations of every seed in `seeds`, from the uniform policy."""
    corridor = corridor or setting.corridor()
    s = len(seeds)
    logits = np.zeros((s, corridor.num_contexts, 2))
    episodes = setting.tasks * setting.group_size
    success, value = np.zeros((s, setting.iterations + 1)), np.zeros((s, setting.iterations + 1))
    mix = np.array([1.0 - setting.inconsistency, setting.inconsistency])  # clear and hiding entrances
    for iteration in range(setting.iterations + 1):
        probabilities = policy_probabilities(corridor, logits)
        values = exact_values(corridor, probabilities, setting.gamma)
        success[:, iteration], value[:, iteration] = values.success[:, :2] @ mix, values.v[:, :2] @ mix
        if iteration == setting.iterations:
            break
        steps = rollout(corridor, probabilities, values, draws(seeds, iteration, episodes, corridor.max_steps),
                        setting.inconsistency, setting.group_size)
        batch = step_batch(corridor, steps, setting)
        if on_first_batch is not None and iteration == 0:
            on_first_batch(batch, steps)
        advantages = unit_scale(spec.advantages(batch, steps, setting, setting.norm), steps.seed, s)
        logits += setting.learning_rate * policy_gradient(corridor, probabilities, steps, advantages, s)
    return Curves(success=success, value=value)
