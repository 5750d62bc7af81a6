"""The rows each process trains in an `all_steps` iteration (`TrainingRows`): its own steps, or, with
`balance_steps` (as released), an equal share of every process's steps with balanced token counts.

Advantages are computed where the groups were played. Then, balanced, the iteration's rows are taken in the
released batch's order (process by process, each trajectory's steps in turn: `gather_rollout_data`), filled to a
multiple of `fill_multiple` with copies of random rows (the released `adjust_batch(mode="copy")`, before the
split) and split into one set per process, sizes within one row of each other, token counts balanced (verl's
`_balance_batch`; `balance_partition` picks ours or its Karmarkar-Karp), each set in that order: every optimizer
step then trains exactly `mini_batch_size` rows over all processes (the last aside); filled
(`fill_last_micro_batch: duplicate`) to a multiple of the micro-batch x processes, no process runs a micro-batch
of padding alone while another trains. The plan is a pure function of the rows' token counts and a seed every
process shares, so each process computes the same plan; the rows travel in one all-gather of token ids, sampling
log-probabilities and advantages (`benchmarks/balance.py` measures it).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hgpo_trl.rollout.lockstep import Completion, StepRecord


@dataclass(frozen=True)
class TrainingRows:
    """The rows a process trains in one iteration, before they are cut into micro-batches."""

    completions: list[Completion]  # token ids (and sampling log-probabilities) of each row
    advantages: np.ndarray
    ids: np.ndarray  # each row's step: its index in the process's rollout, or, balanced, over all processes
    num_ids: int  # how many steps the ids count (the size of the steps/trained counter)
    copies: int = 0  # rows here that copy another row (the global fill)
    balanced: bool = False  # ids count every process's steps: the counter is summed over processes
    token_spread: dict[str, float] = field(default_factory=dict)  # balanced: global_seqlen/* (`token_spread`)


def own_rows(steps: Sequence[StepRecord], advantages: np.ndarray) -> TrainingRows:
    """Unbalanced: a process trains the steps it played."""
    return TrainingRows([s.completion for s in steps], np.asarray(advantages, dtype=np.float64),
                        np.arange(len(steps)), len(steps))


def fill_rows(num_rows: int, multiple: int, fill: str, rng: np.random.Generator) -> np.ndarray:
    """The iteration's rows as indices, every row once, then (`fill="duplicate"`) copies of rows drawn at random
    without replacement up to a multiple of `multiple` rows, appended, as released."""
    short = -num_rows % multiple
    if fill != "duplicate" or not num_rows or not short:
        return np.arange(num_rows)
    return np.concatenate([np.arange(num_rows), rng.choice(num_rows, size=short, replace=short > num_rows)])


def greedy_partition(lengths: Sequence[int], parts: int) -> list[np.ndarray]:
    """Positions 0..len(lengths)-1 split into `parts` sets whose sizes differ by at most one, with balanced sums
    of `lengths`: longest first, each to the set with the smallest sum that still has room (ties: the lower set).
    Each set in ascending order. A row moves the largest gap by at most its own length."""
    lengths = np.asarray(lengths, dtype=np.int64)
    capacity = [len(lengths) // parts + (part < len(lengths) % parts) for part in range(parts)]
    members: list[list[int]] = [[] for _ in range(parts)]
    sums = [0] * parts
    for position in np.argsort(-lengths, kind="stable"):
        part = min((p for p in range(parts) if len(members[p]) < capacity[p]), key=lambda p: (sums[p], p))
        members[part].append(int(position))
        sums[part] += int(lengths[position])
    return [np.sort(np.array(m, dtype=np.int64)) for m in members]


class _Split:
    """A partial split of the largest differencing method: `parts` sets, largest first. A set is [token sum,
    size, its (position, length) members in the order they joined] and compares as that list, as verl's does."""

    def __init__(self, positions: np.ndarray, lengths: np.ndarray):
        self.sets = sorted(([int(lengths[p]), 1, [(int(p), int(lengths[p]))]] for p in positions), reverse=True)

    def spread(self) -> int:
        return self.sets[0][0] - self.sets[-1][0]

    def __lt__(self, other: _Split) -> bool:  # the heap's first: the largest spread, then the larger largest set
        return (self.spread(), self.sets[0]) > (other.spread(), other.sets[0])

    def join(self, other: _Split) -> _Split:
        """Each set takes the other's set of the opposite rank: the largest gets the smallest."""
        for mine, theirs in zip(self.sets, reversed(other.sets), strict=True):
            mine[0], mine[1] = mine[0] + theirs[0], mine[1] + theirs[1]
            mine[2].extend(theirs[2])
        self.sets.sort(reverse=True)
        return self


def karmarkar_karp_partition(lengths: Sequence[int], parts: int) -> list[np.ndarray]:
    """Positions split as verl's `get_seqlen_balanced_partitions(lengths, parts, equal_size=True)` splits them
    (`_balance_batch`, as released), set r to process r, each in ascending order: rows sorted by (length,
    position) are cut into runs of `parts`, one row per set; the two partial splits with the largest spread are
    joined until one is left. Rows that are not a multiple of `parts` (verl refuses them) get zero-length
    placeholders, sorted first and dropped after: sizes then differ by one at most."""
    lengths = np.asarray(lengths, dtype=np.int64)
    count, short = len(lengths), -len(lengths) % parts
    if not count:
        return [np.zeros(0, dtype=np.int64) for _ in range(parts)]
    order = np.r_[np.arange(count, count + short), np.lexsort((np.arange(count), lengths))]
    lengths = np.r_[lengths, np.zeros(short, dtype=np.int64)]
    heap = [_Split(order[start:start + parts], lengths) for start in range(0, len(order), parts)]
    heapq.heapify(heap)  # `_Split`s are totally ordered (no two share a position): the pops do not depend on it
    while len(heap) > 1:
        heapq.heappush(heap, heapq.heappop(heap).join(heapq.heappop(heap)))
    return [np.sort(np.array([p for p, _ in members if p < count], dtype=np.int64)) for *_, members in heap[0].sets]


PARTITIONS = {"greedy": greedy_partition, "karmarkar_karp": karmarkar_karp_partition}


def token_spread(lengths: Sequence[int], sets: Sequence[np.ndarray]) -> dict[str, float]:
    """`global_seqlen/*` as released (verl's `log_seqlen_unbalance`): the processes' token sums had the rows been
    split in order into equal parts (min, max, minmax_diff), as balanced (balanced_min, balanced_max), and their
    mean."""
    lengths = np.asarray(lengths, dtype=np.int64)
    in_order = [int(part.sum()) for part in np.array_split(lengths, len(sets))]
    balanced = [int(lengths[s].sum()) for s in sets]
    return {"global_seqlen/min": min(in_order), "global_seqlen/max": max(in_order),
            "global_seqlen/minmax_diff": max(in_order) - min(in_order),
            "global_seqlen/balanced_min": min(balanced), "global_seqlen/balanced_max": max(balanced),
            "global_seqlen/mean": int(lengths.sum()) / len(sets)}


def _packed(steps: Sequence[StepRecord], advantages: np.ndarray) -> dict[str, np.ndarray]:
    """One process's rows as flat arrays: what the all-gather carries (4 bytes a token, 8 a log-probability)."""
    flat = lambda lists, dtype: np.fromiter((x for xs in lists for x in xs), dtype=dtype)  # noqa: E731
    completions = [s.completion for s in steps]
    for c in completions:
        if c.logprobs is not None and len(c.logprobs) != len(c.completion_ids):
            raise ValueError(f"a completion has {len(c.logprobs)} sampling log-probabilities for "
                             f"{len(c.completion_ids)} tokens")
    return {"prompt_lengths": np.array([len(c.prompt_ids) for c in completions], dtype=np.int64),
            "prompts": flat((c.prompt_ids for c in completions), np.int32),
            "completion_lengths": np.array([len(c.completion_ids) for c in completions], dtype=np.int64),
            "completions": flat((c.completion_ids for c in completions), np.int32),
            "advantages": np.asarray(advantages, dtype=np.float64),
            "has_logprobs": np.array([c.logprobs is not None for c in completions], dtype=bool),
            "logprobs": flat(([np.nan if x is None else x for x in c.logprobs] for c in completions
                              if c.logprobs is not None), np.float64)}


class _Rows:
    """Row `i` of one process's packed arrays, as a Completion."""

    def __init__(self, packed: dict[str, np.ndarray]):
        self.packed = packed
        self.prompt_starts = np.r_[0, np.cumsum(packed["prompt_lengths"])]
        self.completion_starts = np.r_[0, np.cumsum(packed["completion_lengths"])]
        self.logprob_starts = np.r_[0, np.cumsum(packed["completion_lengths"] * packed["has_logprobs"])]

    def __getitem__(self, i: int) -> Completion:
        p, (a, b), (c, d) = self.packed, self.prompt_starts[i:i + 2], self.completion_starts[i:i + 2]
        e, f = self.logprob_starts[i:i + 2]
        logprobs = p["logprobs"][e:f].tolist() if p["has_logprobs"][i] else None
        return Completion("", p["prompts"][a:b].tolist(), p["completions"][c:d].tolist(), logprobs)


def balanced_rows(accelerator, steps: Sequence[StepRecord], advantages: np.ndarray, *, fill_multiple: int,
                  fill: str, seed: Sequence[int], partition: str = "greedy") -> TrainingRows:
    """This process's share of every process's rows (`balance_steps`), split by `PARTITIONS[partition]`; ids
    number the rows over all processes in the released batch order. Every process must call it; `seed` must be
    the same on all of them (it draws the fill's copies)."""
    from accelerate.utils import gather_object

    batch_order = sorted(range(len(steps)), key=lambda i: (steps[i].traj, steps[i].step))
    packed = _packed([steps[i] for i in batch_order], np.asarray(advantages)[batch_order])
    everyone = gather_object([packed]) if accelerator.num_processes > 1 else [packed]
    lengths = np.concatenate([p["prompt_lengths"] + p["completion_lengths"] for p in everyone])
    rows = fill_rows(len(lengths), fill_multiple, fill, np.random.default_rng(list(seed)))
    sets = PARTITIONS[partition](lengths[rows], accelerator.num_processes)
    positions = sets[accelerator.process_index]
    mine = rows[positions]
    starts = np.cumsum([0] + [len(p["advantages"]) for p in everyone])
    owners = np.searchsorted(starts, mine, side="right") - 1
    tables = [_Rows(p) for p in everyone]
    return TrainingRows([tables[o][i - starts[o]] for i, o in zip(mine, owners, strict=True)],
                        np.concatenate([p["advantages"] for p in everyone])[mine], mine, len(lengths),
                        copies=int(np.sum(positions >= len(lengths))), balanced=True,
                        token_spread=token_spread(lengths[rows], sets))
