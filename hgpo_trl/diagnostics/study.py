"""An exact bias/variance study of the advantage estimators on the built-in aliased environment (issue 6, part 2).

    python -m hgpo_trl.diagnostics.study [--batches 1000] [--tasks 8] [--group-size 8] [--json]

1. A fixed stochastic policy plays keydoor: at the entrance it takes the gold key with probability `p_key`, at
   the vault it opens the door of the key it holds with probability `p_door` (the other door otherwise); every
   other position has one admissible action. It only ever picks admissible actions, so no step is invalid and
   the invalid penalty plays no part. (The policy "knows" its key: the room observation is in its history.)
2. Exact advantages by dynamic programming over histories (the tree has 4 leaves per task):
   `V(h) = sum_a pi(a|h) (r(h, a) + gamma V(h a o))`, `A(h_t, a_t) = Q(h_t, a_t) - V(h_t)`, h_t the full history.
   Dynamics are deterministic, so a history is its task and its action sequence.
3. Many rollout batches, as in training: `tasks` task groups of `group_size` rollouts, one `StepBatch` built
   the way `Rollout.step_batch` builds it (obs = the observation text the step acted on). Every estimator is
   the library's own, called through `compute_advantages`, with `norm="mean_norm"`: in that mode an estimator
   is a centred return in reward units, comparable with `Q - V`; `mean_std_norm` rescales by a group's spread
   and is not. GiGPO's `A_E + A_S` and ProGPO's `A_peer + C_t` are sums of two advantage estimates as the
   library defines them; they are run as defined, and their scale shows in their bias.
4. Per cell (task, history, action): the error `estimate - exact` over all the cell's visits. bias^2 is the
   visit-weighted mean of the squared cell-mean error, variance the visit-weighted mean within-cell variance,
   mse the mean squared error, so mse = bias^2 + variance. Reported overall and at the aliased states: the
   observations a task reaches by more than one history (the hall and the vault, t = 2 and 3), where
   same-observation groups mix the two key contexts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hgpo_trl.advantages import StepBatch, compute_advantages

# The estimators of the study: label -> (registered name, options). gamma and norm are added to all but grpo,
# which scores whole episodes (undiscounted) and takes no gamma.
ESTIMATOR_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "grpo": ("grpo", {}),
    "gigpo (A_E + A_S)": ("gigpo", {}),
    "hgpo K=0 (= GiGPO A_S)": ("hgpo", {"depth": 0}),
    **{f"hgpo K={k} alpha={a}": ("hgpo", {"depth": k, "alpha": float(a)})
       for k in (1, 2, 4) for a in (0, 1, 2)},
    "hgpo K=2 inverse_mse": ("hgpo", {"depth": 2, "weighting": "inverse_mse"}),
    "progpo K=2": ("progpo", {"depth": 2}),
    # lam = 0 leaves ProGPO's exact-prefix peer term alone: the paper's oracle groups, as a reference row.
    "progpo K=2 lam=0 (oracle groups)": ("progpo", {"depth": 2, "lam": 0.0}),
}


@dataclass(frozen=True)
class Settings:
    batches: int = 1000  # ~10 s on one core; the bias^2 ordering is stable from ~200
    tasks: int = 8
    group_size: int = 8
    p_key: float = 0.5
    p_door: float = 0.7
    gamma: float = 0.95
    seed: int = 0
    num_rooms: int = 4
    num_colors: int = 4


# ----------------------------------------------------------------------------------------------------------
# Exact values by dynamic programming over histories.

Policy = Callable[[Any, str, str | None, Sequence[str]], np.ndarray]


def keydoor_policy(p_key: float, p_door: float) -> Policy:
    """pi(action | history) over the admissible actions, given the task, the position and the key held."""
    from hgpo_trl.envs.keydoor import ENTRANCE, VAULT

    def policy(task, position: str, key: str | None, actions: Sequence[str]) -> np.ndarray:
        if position == ENTRANCE:
            return np.array([p_key if a == f"take {task.gold} key" else 1.0 - p_key for a in actions])
        if position == VAULT:
            return np.array([p_door if a == f"open {key} door" else 1.0 - p_door for a in actions])
        return np.full(len(actions), 1.0 / len(actions))

    return policy


@dataclass(frozen=True)
class Leaf:
    """One complete history and the exact quantities of each of its steps."""

    probability: float
    obs: tuple[str, ...]  # the observation step t acted on
    actions: tuple[str, ...]
    rewards: tuple[float, ...]
    advantages: tuple[float, ...]  # exact Q(h_t, a_t) - V(h_t)
    values: tuple[float, ...]  # exact V(h_t)


def exact_leaves(task, policy: Policy, gamma: float, *, gold_reward: float = 10.0, coin_reward: float = 3.0,
                 max_steps: int = 8) -> list[Leaf]:
    """Every complete history of `task` under `policy`, with its probability and exact per-step advantages.

    V is 0 after the last step, whether the episode terminated or was cut at `max_steps` (as the estimators
    assume: the batch holds nothing after a trajectory's last step)."""
    from hgpo_trl.envs.keydoor import ENTRANCE, admissible_actions, initial_observation, transition

    def expand(position: str, key: str | None, obs: str, t: int) -> tuple[float, list[Leaf]]:
        # Returns V(h) and the leaves below h, each holding the steps from h onwards.
        actions = admissible_actions(task, position)
        probs = policy(task, position, key, actions)
        q_values, below = [], []
        for action in actions:
            step = transition(task, position, key, action, gold_reward=gold_reward, coin_reward=coin_reward)
            if step.terminated or t + 1 >= max_steps:
                next_value, subtree = 0.0, [Leaf(1.0, (), (), (), (), ())]
            else:
                next_value, subtree = expand(step.position, step.key, step.observation, t + 1)
            q_values.append(step.reward + gamma * next_value)
            below.append((step.reward, subtree))
        value = float(np.dot(probs, q_values))
        leaves = [Leaf(p * leaf.probability, (obs, *leaf.obs), (a, *leaf.actions), (r, *leaf.rewards),
                       (q - value, *leaf.advantages), (value, *leaf.values))
                  for a, p, q, (r, subtree) in zip(actions, probs, q_values, below, strict=True) if p > 0
                  for leaf in subtree]
        return value, leaves

    return expand(ENTRANCE, None, initial_observation(task), 0)[1]


# ----------------------------------------------------------------------------------------------------------
# The step table: every step of every leaf of every task, so that a batch is a gather of rows.

@dataclass(frozen=True)
class StepTable:
    obs: np.ndarray  # object array of observation texts
    action: np.ndarray  # object array of action texts
    step: np.ndarray
    reward: np.ndarray
    exact: np.ndarray  # exact advantage
    cell: np.ndarray  # id of (task, history, action): equal iff the task and actions a_0..a_t are equal
    aliased: np.ndarray  # the observation is reached by more than one history in its task
    leaf_start: list[np.ndarray]  # per task: the first row of each leaf
    leaf_length: list[np.ndarray]
    leaf_probability: list[np.ndarray]
    cells: int


def step_table(tasks: Sequence[Any], policy: Policy, gamma: float) -> StepTable:
    columns: dict[str, list] = {name: [] for name in ("obs", "action", "step", "reward", "exact", "cell")}
    cell_ids: dict[tuple, int] = {}
    starts, lengths, probabilities, histories_of_obs = [], [], [], []
    for g, task in enumerate(tasks):
        leaves = exact_leaves(task, policy, gamma)
        length = np.array([len(leaf.obs) for leaf in leaves])
        starts.append(len(columns["obs"]) + np.cumsum(length) - length)
        lengths.append(length)
        probabilities.append(np.array([leaf.probability for leaf in leaves]))
        seen: dict[str, set] = {}
        for leaf in leaves:
            for t in range(len(leaf.obs)):
                seen.setdefault(leaf.obs[t], set()).add(leaf.actions[:t])
                columns["obs"].append(leaf.obs[t])
                columns["action"].append(leaf.actions[t])
                columns["step"].append(t)
                columns["reward"].append(leaf.rewards[t])
                columns["exact"].append(leaf.advantages[t])
                columns["cell"].append(cell_ids.setdefault((g, leaf.actions[:t + 1]), len(cell_ids)))
        histories_of_obs.append(seen)
    task_of_row = np.repeat(np.arange(len(tasks)), [int(length.sum()) for length in lengths])
    aliased = np.array([len(histories_of_obs[g][o]) > 1 for g, o in zip(task_of_row, columns["obs"], strict=True)])
    return StepTable(obs=np.array(columns["obs"], dtype=object), action=np.array(columns["action"], dtype=object),
                     step=np.array(columns["step"], dtype=np.int64), reward=np.array(columns["reward"]),
                     exact=np.array(columns["exact"]), cell=np.array(columns["cell"], dtype=np.int64),
                     aliased=aliased, leaf_start=starts, leaf_length=lengths, leaf_probability=probabilities,
                     cells=len(cell_ids))


def sample_batch(table: StepTable, group_size: int, rng: np.random.Generator) -> tuple[StepBatch, np.ndarray]:
    """One rollout batch: `group_size` rollouts of every task, drawn from the policy (a complete history is drawn
    with its probability, the same law as drawing action by action). Returns the batch and its rows of `table`."""
    starts, lengths = [], []
    for start, length, probability in zip(table.leaf_start, table.leaf_length, table.leaf_probability, strict=True):
        drawn = rng.choice(len(probability), size=group_size, p=probability)
        starts.append(start[drawn])
        lengths.append(length[drawn])
    start, length = np.concatenate(starts), np.concatenate(lengths)
    traj = np.repeat(np.arange(start.size), length)
    offset = np.arange(traj.size) - np.repeat(np.cumsum(length) - length, length)
    rows = start[traj] + offset
    group = traj // group_size
    # As Rollout.step_batch: group = task index, traj, step t, the observation text acted on, reward, valid.
    batch = StepBatch(group=group, traj=traj, step=table.step[rows], obs=table.obs[rows].tolist(),
                      reward=table.reward[rows], valid=np.ones(rows.size, dtype=bool),
                      action=table.action[rows].tolist())
    return batch, rows


def estimate(batch: StepBatch, label: str, gamma: float) -> np.ndarray:
    """The study's estimator `label` on `batch`: the library's own function, through `compute_advantages`."""
    name, options = ESTIMATOR_SPECS[label]
    shared = {"norm": "mean_norm"} if name == "grpo" else {"norm": "mean_norm", "gamma": gamma}
    return compute_advantages(name, batch, **shared, **options)


# ----------------------------------------------------------------------------------------------------------
# The study.

def summarise(n: np.ndarray, total: np.ndarray, squares: np.ndarray, cells: np.ndarray) -> dict[str, float]:
    """bias^2, variance and mse over the cells selected by boolean mask `cells` (weighted by visits)."""
    n, total, squares = n[cells], total[cells], squares[cells]
    seen = n > 0
    n, total, squares = n[seen], total[seen], squares[seen]
    visits = n.sum()
    if visits == 0:
        return {"bias2": 0.0, "variance": 0.0, "mse": 0.0, "steps": 0}
    mean = total / n
    within = np.maximum(squares / n - mean ** 2, 0.0)  # clip a -1e-16 rounding residue
    return {"bias2": float(np.dot(n, mean ** 2) / visits), "variance": float(np.dot(n, within) / visits),
            "mse": float(squares.sum() / visits), "steps": int(visits)}


def run_study(settings: Settings, labels: Sequence[str] | None = None, tasks: Sequence[Any] | None = None) -> dict:
    """Sample `settings.batches` batches, run every estimator on each, and report its errors against exact A."""
    from hgpo_trl.envs.keydoor import KeyDoorTask, keydoor_tasks

    began = time.perf_counter()
    labels = list(ESTIMATOR_SPECS) if labels is None else list(labels)
    if tasks is None:
        rows = keydoor_tasks("train", num_tasks=settings.tasks, num_rooms=settings.num_rooms,
                             num_colors=settings.num_colors)
        tasks = [KeyDoorTask.from_row(row) for row in rows]
    table = step_table(tasks, keydoor_policy(settings.p_key, settings.p_door), settings.gamma)
    rng = np.random.default_rng(settings.seed)
    visits = np.zeros(table.cells)
    total = {label: np.zeros(table.cells) for label in labels}
    squares = {label: np.zeros(table.cells) for label in labels}
    exact_squares = np.zeros(table.cells)
    for _ in range(settings.batches):
        batch, rows = sample_batch(table, settings.group_size, rng)
        cell = table.cell[rows]
        visits += np.bincount(cell, minlength=table.cells)
        exact_squares += np.bincount(cell, weights=table.exact[rows] ** 2, minlength=table.cells)
        for label in labels:
            error = estimate(batch, label, settings.gamma) - table.exact[rows]
            total[label] += np.bincount(cell, weights=error, minlength=table.cells)
            squares[label] += np.bincount(cell, weights=error ** 2, minlength=table.cells)

    # Each cell is at one step t and one observation, so step and aliasing are per-cell masks.
    cell_step = np.zeros(table.cells, dtype=np.int64)
    cell_step[table.cell] = table.step
    cell_aliased = np.zeros(table.cells, dtype=bool)
    cell_aliased[table.cell] = table.aliased
    everywhere = np.ones(table.cells, dtype=bool)
    steps = sorted(set(cell_step.tolist()))
    results = []
    for label in labels:
        name, options = ESTIMATOR_SPECS[label]
        args = (visits, total[label], squares[label])
        results.append({"label": label, "estimator": name, "options": options,
                        "overall": summarise(*args, everywhere), "aliased": summarise(*args, cell_aliased),
                        "by_step": {str(t): summarise(*args, cell_step == t) for t in steps}})
    results.sort(key=lambda r: r["overall"]["mse"])
    zero = np.zeros(table.cells)
    return {"settings": vars(settings) | {"norm": "mean_norm"},
            "aliased_steps": sorted(set(cell_step[cell_aliased].tolist())),
            # The mse of always answering 0 (E[A^2]): the scale an estimator has to beat.
            "zero_estimator": {"overall": summarise(visits, zero, exact_squares, everywhere),
                               "aliased": summarise(visits, zero, exact_squares, cell_aliased)},
            "results": results, "wall_s": time.perf_counter() - began}


def format_table(report: dict) -> str:
    s = report["settings"]
    lines = [f"Exact bias/variance study on keydoor: {s['batches']} batches x {s['tasks']} tasks x "
             f"{s['group_size']} rollouts, p_key={s['p_key']}, p_door={s['p_door']}, gamma={s['gamma']}, "
             f"norm=mean_norm, seed={s['seed']}; aliased states: t in {report['aliased_steps']}",
             f"{'estimator':<34}{'bias^2':>9}{'variance':>10}{'mse':>9}  |{'bias^2@al':>10}{'var@al':>9}"
             f"{'mse@al':>9}{'bias^2@vault':>13}{'var@vault':>10}"]
    vault = str(max(report["aliased_steps"])) if report["aliased_steps"] else None
    for r in report["results"]:
        o, a = r["overall"], r["aliased"]
        v = r["by_step"][vault] if vault else {"bias2": float("nan"), "variance": float("nan")}
        lines.append(f"{r['label']:<34}{o['bias2']:>9.3f}{o['variance']:>10.3f}{o['mse']:>9.3f}  |"
                     f"{a['bias2']:>10.3f}{a['variance']:>9.3f}{a['mse']:>9.3f}{v['bias2']:>13.3f}{v['variance']:>10.3f}")
    zero = report["zero_estimator"]
    lines.append(f"{'(zero: always 0, mse = E[A^2])':<34}{'':>9}{'':>10}{zero['overall']['mse']:>9.3f}  |"
                 f"{'':>10}{'':>9}{zero['aliased']['mse']:>9.3f}")
    best, worst = report["results"][0], report["results"][-1]
    by_alias = min(report["results"], key=lambda r: r["aliased"]["bias2"])
    lines.append(f"Lowest mse: {best['label']} ({best['overall']['mse']:.3f}); highest: {worst['label']} "
                 f"({worst['overall']['mse']:.3f}); least biased at aliased states: {by_alias['label']} "
                 f"(bias^2 {by_alias['aliased']['bias2']:.3f}).")
    lines.append(f"Wall time: {report['wall_s']:.1f} s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hgpo_trl.diagnostics.study", description=__doc__.split("\n")[0])
    defaults = Settings()
    parser.add_argument("--batches", type=int, default=defaults.batches)
    parser.add_argument("--tasks", type=int, default=defaults.tasks)
    parser.add_argument("--group-size", type=int, default=defaults.group_size)
    parser.add_argument("--p-key", type=float, default=defaults.p_key, help="P(take the gold key)")
    parser.add_argument("--p-door", type=float, default=defaults.p_door, help="P(open the held key's door)")
    parser.add_argument("--gamma", type=float, default=defaults.gamma)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    for name in ("batches", "tasks", "group_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("p_key", "p_door", "gamma"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    report = run_study(Settings(batches=args.batches, tasks=args.tasks, group_size=args.group_size,
                                p_key=args.p_key, p_door=args.p_door, gamma=args.gamma, seed=args.seed))
    print(json.dumps(report, indent=1) if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
