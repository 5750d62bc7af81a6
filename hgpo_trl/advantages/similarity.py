"""Similarity-based anchor groups: released GiGPO's `enable_similarity` (gigpo/core_gigpo.py, `build_step_group`
and `are_similar`), the same clusters computed fast.

The released rule: within a task group, steps are taken in batch order; a step joins the first cluster whose
representative (its first member) has `difflib.SequenceMatcher(None, obs, representative).ratio() >= threshold`
(in that argument order: the ratio is not symmetric, as autojunk and the choice among equally long matching
blocks depend on it), else it starts a new cluster. The clusters are the anchor groups.

"Batch order" here is the sorted view's (trajectory, step) order: the order of the release's batch when rows
come in rollout order (its `gather_rollout_data` lists each trajectory's steps in turn) and trajectory ids count
rollouts, as the trainer's do. It makes the clusters independent of the order rows arrive in. (verl-agent's main
trainer permutes its batch, `balance_batch`, before the advantages, so there the first member of a cluster is
whichever step the length balancing puts first; the HGPO recipe computes the advantages before it balances, on
this order, but its GiGPO call leaves the similarity switch commented out.)

The same clusters, with far fewer `SequenceMatcher` calls (docs/results.md: 400x faster on an ALFWorld batch):
- a text met before in the task group joins the same cluster (the clusters it skipped then are still the first
  ones, and `ratio(x, x)` is 1.0: difflib's first block of two equal texts is the whole diagonal), so the greedy
  runs over distinct texts, not steps;
- a representative is skipped without `SequenceMatcher` when an upper bound of the ratio is already below the
  threshold: `real_quick_ratio` (lengths) and `quick_ratio` (shared characters), both vectorised over all pairs
  of a task group's texts, with the same float expression `2.0 * matches / total` as difflib;
- the ratios that remain are cached by pair of texts (across task groups, where the same texts meet again).
Threshold 1.0 (which the release refuses) is exact grouping: only equal texts have ratio 1.0.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from difflib import SequenceMatcher

import numpy as np

from hgpo_trl.advantages.batch import SortedSteps

# Pairs whose character counts are compared in one numpy call: bounds the temporaries at ~12 bytes x this x the
# alphabet's size.
PAIR_CHUNK = 1 << 16


def check_similarity_threshold(threshold: float | None) -> None:
    if threshold is None:
        return
    if isinstance(threshold, bool) or not isinstance(threshold, int | float | np.integer | np.floating) \
            or not 0.0 < threshold <= 1.0:
        raise ValueError(f"similarity_threshold must be None or in (0, 1] (1.0: exact grouping), got {threshold!r}")


def observation_texts(steps: SortedSteps, obs: Sequence[Hashable]) -> list[str]:
    """The observations in sorted order, refused in one line unless every one is text."""
    if isinstance(obs, np.ndarray) and obs.dtype.kind in "biuf":
        raise ValueError(f"similarity_threshold compares observation text, but StepBatch.obs holds {obs.dtype} "
                         "numbers (e.g. observation_keys): pass the observation strings")
    texts = list(steps.take(obs))
    if not all(issubclass(kind, str) for kind in set(map(type, texts))):
        row = next(i for i, text in enumerate(texts) if not isinstance(text, str))
        raise ValueError(f"similarity_threshold compares observation text, but StepBatch.obs row "
                         f"{int(steps.order[row])} holds {type(texts[row]).__name__} {texts[row]!r}")
    return texts


def similar_observations(steps: SortedSteps, obs: Sequence[Hashable], threshold: float) -> np.ndarray:
    """Per sorted row: a non-negative code of its observation's cluster, equal for two rows iff they are in one
    cluster of one task group (use it where `steps.obs` would be used). Raises ValueError for non-text `obs`."""
    texts = observation_texts(steps, obs)
    if threshold >= 1.0:
        return steps.obs
    # The distinct (task group, text) pairs in order of first appearance, task group by task group.
    key = steps.group * (int(steps.obs.max(initial=0)) + 1) + steps.obs
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    order = np.lexsort((first, steps.group[first]))
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    distinct = [texts[i] for i in first[order].tolist()]
    later, earlier = candidate_pairs(steps.group[first[order]], distinct, threshold)
    clusters = greedy_clusters(steps.obs[first[order]], distinct, later, earlier, threshold)
    return clusters[rank[inverse.ravel()]]


def candidate_pairs(group: np.ndarray, texts: list[str], threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """The pairs (later, earlier) of distinct texts of one task group (indices into `texts`, which lists each task
    group's texts together in order of appearance) whose ratio may reach `threshold`: real_quick_ratio and
    quick_ratio's upper bounds, vectorised. Sorted by later, then earlier."""
    n = len(texts)
    lengths = np.fromiter(map(len, texts), dtype=np.int64, count=n)
    later, earlier = within_group_pairs(group)
    keep = bound_reaches(np.minimum(lengths[later], lengths[earlier]), lengths[later] + lengths[earlier], threshold)
    later, earlier = later[keep], earlier[keep]
    if later.size == 0:
        return later, earlier
    counts = character_counts(texts, lengths)
    shared = np.concatenate([np.minimum(counts[later[s:s + PAIR_CHUNK]], counts[earlier[s:s + PAIR_CHUNK]]).sum(1)
                             for s in range(0, later.size, PAIR_CHUNK)])
    keep = bound_reaches(shared, lengths[later] + lengths[earlier], threshold)
    return later[keep], earlier[keep]


def within_group_pairs(group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All pairs (i, j), j < i, of positions in the same run of equal `group` values, sorted by i then j: quadratic
    in a task group's distinct texts, as the released comparisons are (400 steps give at most 80,000 pairs)."""
    n = group.size
    start = np.flatnonzero(np.r_[True, group[1:] != group[:-1]]) if n else np.zeros(0, dtype=np.int64)
    run_start = np.repeat(start, np.diff(np.r_[start, n]))
    before = np.arange(n) - run_start  # how many earlier positions share i's run
    later = np.repeat(np.arange(n), before)
    offset = np.arange(later.size) - np.repeat(np.cumsum(before) - before, before)
    return later, run_start[later] + offset


def bound_reaches(matches: np.ndarray, total: np.ndarray, threshold: float) -> np.ndarray:
    """Whether difflib's ratio `2.0 * matches / total` (1.0 for two empty texts) reaches `threshold`: the same
    float expression, so a bound computed from an upper bound of matches never rules out a pair that passes."""
    return np.where(total > 0, 2.0 * matches / np.maximum(total, 1), 1.0) >= threshold


def character_counts(texts: list[str], lengths: np.ndarray) -> np.ndarray:
    """(len(texts), alphabet) counts of each character in each text (the multisets quick_ratio intersects)."""
    points = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32)
    # Characters as 0..A-1 through a table over code points: O(N), where np.unique would sort every character.
    present = np.flatnonzero(np.bincount(points))
    table = np.zeros(int(present[-1]) + 1 if present.size else 1, dtype=np.int64)
    table[present] = np.arange(present.size)
    owner = np.repeat(np.arange(len(texts)), lengths)
    return np.bincount(owner * present.size + table[points], minlength=len(texts) * present.size).reshape(
        len(texts), present.size).astype(np.int32)


def greedy_clusters(text_ids: np.ndarray, texts: list[str], later: np.ndarray, earlier: np.ndarray,
                    threshold: float) -> np.ndarray:
    """The released greedy over distinct texts (`texts[i]`, whose text id is `text_ids[i]`), given the candidate
    pairs: text i joins the cluster of the first earlier text of its task group that founded a cluster and whose
    ratio with it reaches `threshold`, else founds one. Sequential by nature: a Python loop over distinct texts,
    with a difflib call only for surviving candidates."""
    bounds = np.searchsorted(later, np.arange(len(texts) + 1)).tolist()
    candidates, ids = earlier.tolist(), text_ids.tolist()
    cluster = [-1] * len(texts)
    founder = [False] * len(texts)
    ratios: dict[tuple[int, int], float] = {}
    count = 0
    for i, text in enumerate(texts):
        for j in candidates[bounds[i]:bounds[i + 1]]:
            if not founder[j]:
                continue
            pair = (ids[i], ids[j])
            ratio = ratios.get(pair)
            if ratio is None:
                ratio = ratios[pair] = SequenceMatcher(None, text, texts[j]).ratio()  # the released call
            if ratio >= threshold:
                cluster[i] = cluster[j]
                break
        else:
            cluster[i], founder[i] = count, True
            count += 1
    return np.array(cluster, dtype=np.int64)
