"""Plain-Python reference estimators, written from ALGORITHMS.md with dicts and loops (no numpy), and released
functions rewritten from reading them (similarity clusters, verl's balanced partition).

They are deliberately plain — dicts of members, loops over rows, lists re-summed per row — and share no code
and no trick with `hgpo_trl.advantages`. The property tests compare the two; `benchmarks/advantages.py` times them.
A step is a dict with keys group, traj, step, obs, reward, valid, action (optional), window (optional).
"""

from __future__ import annotations

import math
import re
from difflib import SequenceMatcher


def rows_of(batch) -> list[dict]:
    n = len(batch.group)
    rows = []
    for i in range(n):
        row = {"i": i, "group": batch.group[i], "traj": batch.traj[i], "step": int(batch.step[i]),
               "obs": batch.obs[i], "reward": float(batch.reward[i]), "valid": bool(batch.valid[i])}
        row["action"] = None if batch.action is None else batch.action[i]
        row["window"] = None if batch.window is None else int(batch.window[i])
        rows.append(row)
    return rows


def trajectories(rows) -> dict:
    trajs = {}
    for row in rows:
        trajs.setdefault(row["traj"], []).append(row)
    for steps in trajs.values():
        steps.sort(key=lambda r: r["step"])
    return trajs


def returns(rows, gamma, penalty) -> dict:
    """Return-to-go per row index, by the reverse recurrence, minus the penalty at invalid steps only."""
    out = {}
    for steps in trajectories(rows).values():
        running = 0.0
        for row in reversed(steps):
            running = row["reward"] + gamma * running
            out[row["i"]] = running
        for row in steps:
            if not row["valid"]:
                out[row["i"]] -= penalty
    return out


def normalize(values: list[float], norm: str, ddof: int = 0) -> list[float]:
    """Within-group normalisation: all-equal (or singleton) groups give exactly 0; std with `ddof` (0: population)."""
    n = len(values)
    if n < 2 or max(values) == min(values):
        return [0.0] * n
    mean = sum(values) / n
    if norm == "mean_norm":
        return [v - mean for v in values]
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - ddof))
    return [(v - mean) / (std + 1e-6) for v in values]


def normalize_groups(keys: dict, values: dict, norm: str, ddof: int = 0) -> dict:
    """keys: row index -> group key (rows absent from keys take no part); returns row index -> advantage."""
    members = {}
    for i, key in keys.items():
        members.setdefault(key, []).append(i)
    out = {}
    for idx in members.values():
        for i, a in zip(idx, normalize([values[i] for i in idx], norm, ddof), strict=True):
            out[i] = a
    return out


def episode_units(batch, episode_stats, invalid_penalty):
    """The episode term's units: (unit key per row index, group key per unit, score per unit)."""
    rows = rows_of(batch)
    trajs = trajectories(rows)
    total = {t: sum(r["reward"] for r in steps) for t, steps in trajs.items()}
    if episode_stats == "trajectories":
        score = {t: total[t] - invalid_penalty * sum(not r["valid"] for r in steps) for t, steps in trajs.items()}
        return {r["i"]: r["traj"] for r in rows}, {t: steps[0]["group"] for t, steps in trajs.items()}, score
    score = {r["i"]: total[r["traj"]] - (invalid_penalty if not r["valid"] else 0.0) for r in rows}
    return {r["i"]: r["i"] for r in rows}, {r["i"]: r["group"] for r in rows}, score


def grpo(batch, norm="mean_std_norm", episode_stats="trajectories", std_ddof=0, invalid_penalty=0.1):
    unit, group, score = episode_units(batch, episode_stats, invalid_penalty)
    adv = normalize_groups(group, score, norm, std_ddof)
    return [adv[unit[i]] for i in range(len(batch.group))]


def released_similarity_groups(group, obs, threshold):
    """Released GiGPO's similarity grouping (gigpo/core_gigpo.py: build_step_group with enable_similarity, and
    are_similar), rewritten from reading it: rows in the order given; within its task group a row joins the first
    cluster whose representative (first member) has SequenceMatcher(None, obs, representative).ratio() >=
    threshold, else starts a new one. (The release also asserts 0 < threshold < 1.) One label per row:
    (group, cluster number)."""
    representatives = {}
    labels = []
    for g, text in zip(group, obs, strict=True):
        if not isinstance(text, str):
            raise ValueError("Only text-based observations are supported for similarity-based GiGPO")
        clusters = representatives.setdefault(g, [])
        for c, representative in enumerate(clusters):
            if SequenceMatcher(None, text, representative).ratio() >= threshold:
                labels.append((g, c))
                break
        else:
            clusters.append(text)
            labels.append((g, len(clusters) - 1))
    return labels


def anchor_keys(rows, similarity_threshold):
    """Row index -> anchor-group key: (group, obs), or the released similarity cluster with rows taken in
    (traj, step) order (the release's batch order when rows come in rollout order)."""
    if similarity_threshold is None:
        return {r["i"]: (r["group"], r["obs"]) for r in rows}
    ordered = sorted(rows, key=lambda r: (r["traj"], r["step"]))
    labels = released_similarity_groups([r["group"] for r in ordered], [r["obs"] for r in ordered],
                                        similarity_threshold)
    return {r["i"]: label for r, label in zip(ordered, labels, strict=True)}


def gigpo(batch, gamma=0.95, omega=1.0, norm="mean_std_norm", episode_stats="trajectories", std_ddof=0,
          invalid_penalty=0.1, similarity_threshold=None):
    rows = rows_of(batch)
    episode = grpo(batch, norm, episode_stats, std_ddof, invalid_penalty)
    ret = returns(rows, gamma, invalid_penalty)
    step = normalize_groups(anchor_keys(rows, similarity_threshold), ret, norm, std_ddof)
    return [episode[r["i"]] + omega * step[r["i"]] for r in rows]


def level_key(row, by_traj, k):
    """(group, obs_{t-k}, ..., obs_t), or None when the step has no level k."""
    t = row["step"]
    if t < k or (row["window"] is not None and row["window"] < k):
        return None
    steps = by_traj[row["traj"]]
    return (row["group"], tuple(steps[s]["obs"] for s in range(t - k, t + 1)))


def group_members(keys: dict) -> dict:
    members = {}
    for i, key in keys.items():
        members.setdefault(key, []).append(i)
    return members


def hgpo(batch, gamma=0.95, depth=2, alpha=1.0, norm="mean_std_norm", weighting="power",
         base_group=False, drop_zero_items=False, episode_stats="trajectories", std_ddof=0, invalid_penalty=0.1):
    rows = rows_of(batch)
    by_traj = trajectories(rows)
    ret = returns(rows, gamma, invalid_penalty)
    base = grpo(batch, norm, episode_stats, std_ddof, invalid_penalty)
    _, unit_group, unit_score = episode_units(batch, episode_stats, invalid_penalty)
    units_per_group = {}
    for u, g in unit_group.items():
        units_per_group.setdefault(g, []).append(u)
    task_returns = {}
    for r in rows:
        task_returns.setdefault(r["group"], []).append(ret[r["i"]])

    def pvar(values):
        m = sum(values) / len(values)
        return sum((v - m) ** 2 for v in values) / len(values)

    levels = []  # per level: (advantages, members by key, keys)
    for k in range(depth + 1):
        keys = {}
        for r in rows:
            key = level_key(r, by_traj, k)
            if key is not None:
                keys[r["i"]] = key
        levels.append((normalize_groups(keys, ret, norm), group_members(keys), keys))

    out = []
    for r in rows:
        i = r["i"]
        items = []  # (level or "base", value, mean, variance, n)
        for k, (adv, members, keys) in enumerate(levels):
            if i in keys and len(members[keys[i]]) >= 2:
                vals = [ret[j] for j in members[keys[i]]]
                items.append((k, adv[i], sum(vals) / len(vals), pvar(vals), len(vals)))
        if base_group and len(units_per_group[r["group"]]) >= 2:
            scores = [unit_score[u] for u in units_per_group[r["group"]]]
            items.append(("base", base[i], sum(scores) / len(scores), pvar(scores), len(scores)))
        if drop_zero_items:
            items = [it for it in items if abs(it[1]) > 1e-12]
        levels_on = [it for it in items if it[0] != "base"]
        if not items:
            out.append(0.0)
            continue
        if weighting == "power":
            # Released weights (k+2)^alpha, base 1; scaled by the deepest level's weight so nothing overflows.
            top = max((it[0] for it in levels_on), default=0)
            weights = [((1.0 if it[0] == "base" else it[0] + 2.0) / (top + 2.0)) ** alpha for it in items]
        else:
            deepest_mean = levels_on[-1][2] if levels_on else 0.0
            floor = max(0.25 * pvar(task_returns[r["group"]]), 1e-12)
            weights = []
            for level, _, mean, var, n in items:
                var = max(var, 1e-12) if level == "base" else max(var, floor)
                weights.append(1.0 / ((mean - deepest_mean) ** 2 + var / n))
        out.append(sum(w * it[1] for w, it in zip(weights, items, strict=True)) / sum(weights))
    return out


def semantic(obs):
    if not isinstance(obs, str):
        return obs
    return " ".join(re.sub(r"\d+", "", obs.lower()).split())


def progpo(batch, gamma=0.95, depth=2, lam=1.0, norm="mean_std_norm", invalid_penalty=0.1,
           state_key=None):
    rows = rows_of(batch)
    by_traj = trajectories(rows)
    ret = returns(rows, gamma, invalid_penalty)
    key_fn = state_key or semantic

    prefix = {}
    for r in rows:
        steps = by_traj[r["traj"]][: r["step"] + 1]
        prefix[r["i"]] = (r["group"], tuple((s["obs"], s["action"]) for s in steps[:-1]), steps[-1]["obs"])
    peer = normalize_groups(prefix, ret, norm)

    task = {}
    for r in rows:
        task.setdefault(r["group"], []).append(ret[r["i"]])

    def pvar(values):
        m = sum(values) / len(values)
        return sum((v - m) ** 2 for v in values) / len(values)

    depth_groups = []  # per depth d: row index -> pooled key, and key -> member row indices
    for d in range(depth + 1):
        keys = {}
        for r in rows:
            key = level_key(r, by_traj, d)
            if key is not None:
                keys[r["i"]] = (key[0], tuple(key_fn(o) for o in key[1]))
        depth_groups.append((keys, group_members(keys)))

    potential = {}
    for r in rows:
        num = den = 0.0
        floor = max(0.25 * pvar(task[r["group"]]), 1e-12)
        for keys, members in depth_groups:
            if r["i"] not in keys or len(members[keys[r["i"]]]) < 2:
                continue
            vals = [ret[j] for j in members[keys[r["i"]]]]
            loo = (sum(vals) - ret[r["i"]]) / (len(vals) - 1)
            weight = (len(vals) - 1) / max(pvar(vals), floor)
            num += weight * loo
            den += weight
        potential[r["i"]] = num / den if den > 0 else sum(task[r["group"]]) / len(task[r["group"]])

    out = []
    for r in rows:
        steps = by_traj[r["traj"]]
        nxt = potential[steps[r["step"] + 1]["i"]] if r["step"] + 1 < len(steps) else 0.0
        reward = r["reward"] - (invalid_penalty if not r["valid"] else 0.0)
        out.append(peer[r["i"]] + lam * (reward + gamma * nxt - potential[r["i"]]))
    return out


REFERENCES = {"grpo": grpo, "gigpo": gigpo, "hgpo": hgpo, "progpo": progpo}


def released_balanced_partitions(seqlens, k):
    """verl's `get_seqlen_balanced_partitions(seqlens, k_partitions=k, equal_size=True)` (verl/utils/
    seqlen_balancing.py, `karmarkar_karp`, which `_balance_batch` calls), rewritten from reading it: (length,
    index) pairs sorted ascending, cut into runs of k, each run a state of k one-item sets; the heap pops the state
    with the largest spread first (ties: the one whose largest set is larger) and merges the second popped into
    the first, set i taking set k-1-i, sets kept in descending order; a set orders by (sum, size, its (index,
    length) items in insertion order). The final state's sets, each sorted: rank r gets set r."""
    import heapq

    class Bin:
        def __init__(self):
            self.total, self.items = 0, []

        def put(self, index, length):
            self.items.append((index, length))
            self.total += length

        def __lt__(self, other):
            return (self.total, len(self.items), self.items) < (other.total, len(other.items), other.items)

    class Partial:
        def __init__(self, pairs):
            self.bins = []
            for index, length in pairs:
                b = Bin()
                b.put(index, length)
                self.bins.append(b)
            self.bins.sort(reverse=True)

        def spread(self):
            return self.bins[0].total - self.bins[-1].total

        def absorb(self, other):
            for i in range(k):
                for index, length in other.bins[k - 1 - i].items:
                    self.bins[i].put(index, length)
            self.bins.sort(reverse=True)

        def __lt__(self, other):
            if self.spread() != other.spread():
                return self.spread() > other.spread()
            return self.bins[0] > other.bins[0]

    assert len(seqlens) >= k and len(seqlens) % k == 0
    ordered = sorted((length, index) for index, length in enumerate(seqlens))
    heap = []
    for start in range(0, len(ordered), k):
        heapq.heappush(heap, Partial([(index, length) for length, index in ordered[start:start + k]]))
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.absorb(second)
        heapq.heappush(heap, first)
    return [sorted(index for index, _ in b.items) for b in heap[0].bins]
