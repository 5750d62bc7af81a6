"""Grouped statistics and within-group normalisation: sort once so each group is a contiguous run, then reduce
with `np.bincount`. No Python loop over rows or groups."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

NORMS = ("mean_norm", "mean_std_norm")
STD_EPS = 1e-6
# ddof of mean_std_norm's std: 0 (population, this project's default) or 1 (torch.std, where the release uses it).
DDOFS = (0, 1)
_RADIX_LIMIT = 1 << 16  # numpy sorts 16-bit keys stably by radix sort: O(N), several times faster


def check_norm(norm: str) -> None:
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")


def check_ddof(std_ddof: int) -> None:
    if isinstance(std_ddof, bool) or std_ddof not in DDOFS:
        raise ValueError(f"std_ddof must be one of {DDOFS}, got {std_ddof!r}")


def narrow(codes: np.ndarray) -> np.ndarray:
    """Non-negative codes as uint16 when they fit (radix sort), int64 otherwise."""
    return codes.astype(np.uint16) if codes.size and codes.max() < _RADIX_LIMIT else codes


@dataclass(frozen=True)
class Groups:
    """A partition of some rows of an N-row batch into groups: `order` lists the member rows group by group,
    `run[j]` is the group of row `order[j]` (0..G-1, non-decreasing).

    Per-row results have length N; rows outside the partition get 0 (size 0). Sums run with `np.bincount`
    over `order`, which keeps the rows' own order within a group: float results are a deterministic function
    of the (canonically sorted) batch.
    """

    order: np.ndarray
    run: np.ndarray
    n: int

    @classmethod
    def of(cls, ids: np.ndarray, member: np.ndarray | None = None) -> Groups:
        """Group the `member` rows (default: all) by equal non-negative integer `ids`."""
        rows = np.arange(ids.size) if member is None else np.flatnonzero(member)
        order = rows[np.argsort(narrow(ids[rows]), kind="stable")]
        first = np.ones(order.size, dtype=bool)
        first[1:] = ids[order][1:] != ids[order][:-1]
        return cls(order, np.cumsum(first) - 1, ids.size)

    @classmethod
    def nested(cls, columns: list[np.ndarray], members: list[np.ndarray]) -> list[Groups]:
        """For j = 1..len(columns)-1: the `members[j-1]` rows grouped by equal columns[0..j], from one sort.

        Columns are non-negative codes. A row outside members[j-1] must hold a code in column j that no member
        holds there (e.g. 0, with members' codes shifted by one), so that it never shares a run with a member.
        """
        n = columns[0].size
        order = np.lexsort([narrow(c) for c in columns[::-1]])
        first = np.zeros(n, dtype=bool)
        first[:1] = True
        levels = []
        for j, column in enumerate(columns):
            ordered = column[order]
            first[1:] |= ordered[1:] != ordered[:-1]
            if j >= 1:
                keep = members[j - 1][order]
                levels.append(cls(order[keep], np.cumsum(first[keep]) - 1, n))
        return levels

    @classmethod
    def stack(cls, parts: list[Groups]) -> Groups:
        """Several partitions of the same N rows as one partition of len(parts) * N rows: row j * N + i is
        row i of parts[j] (for one vectorised pass over all of them; tile the values to match)."""
        n = parts[0].n
        group_offsets = np.cumsum([0] + [p.num_groups for p in parts[:-1]])
        return cls(np.concatenate([p.order + j * n for j, p in enumerate(parts)]),
                   np.concatenate([p.run + off for p, off in zip(parts, group_offsets, strict=True)]),
                   n * len(parts))

    @property
    def num_groups(self) -> int:
        return int(self.run[-1]) + 1 if self.run.size else 0

    @cached_property
    def sizes(self) -> np.ndarray:
        """Per group: its number of members."""
        return np.bincount(self.run, minlength=self.num_groups)

    def _sum(self, ordered: np.ndarray) -> np.ndarray:
        return np.bincount(self.run, weights=ordered, minlength=self.num_groups)

    def _scatter(self, ordered: np.ndarray) -> np.ndarray:
        """Values at the positions of `order` put back on their rows; 0 on rows outside the partition."""
        out = np.zeros(self.n, dtype=ordered.dtype)
        out[self.order] = ordered
        return out

    def spread(self, per_group: np.ndarray) -> np.ndarray:
        """Per-group values given to their member rows; 0 elsewhere."""
        return self._scatter(per_group[self.run])

    def size(self) -> np.ndarray:
        """Per row: the size of its group (0 outside the partition)."""
        return self.spread(self.sizes)

    def total(self, values: np.ndarray) -> np.ndarray:
        """Per row: the sum of its group's values."""
        return self.spread(self._sum(values[self.order]))

    def mean(self, values: np.ndarray) -> np.ndarray:
        """Per row: its group's mean."""
        return self.spread(self._sum(values[self.order]) / self.sizes)

    def _centred(self, ordered: np.ndarray) -> np.ndarray:
        return ordered - (self._sum(ordered) / self.sizes)[self.run]

    def variance(self, values: np.ndarray) -> np.ndarray:
        """Per row: its group's population variance (ddof = 0), two-pass for accuracy."""
        centred = self._centred(values[self.order])
        return self.spread(self._sum(centred * centred) / self.sizes)

    def normalize(self, values: np.ndarray, norm: str, ddof: int = 0) -> np.ndarray:
        """Per row: its value normalised within its group; exactly 0 for singletons, for groups whose values
        are all equal (tested exactly, not through a std that rounding leaves at ~1e-15) and for rows outside
        the partition. `ddof`: 0 (population std) or 1 (sample std, torch.std's default); a ddof-1 std of one
        value is undefined, and a singleton gets 0 under either."""
        ordered = values[self.order]
        centred = self._centred(ordered)
        if norm == "mean_std_norm":
            std = np.sqrt(self._sum(centred * centred) / np.maximum(self.sizes - ddof, 1))
            centred = centred / (std + STD_EPS)[self.run]
        representative = np.empty(self.num_groups)
        representative[self.run] = ordered  # any member's value will do
        flat = (self.sizes < 2) | (self._sum(ordered != representative[self.run]) == 0)
        return self._scatter(np.where(flat[self.run], 0.0, centred))


def group_ids(*columns: np.ndarray) -> np.ndarray:
    """Compact ids (0..G-1) of the rows' tuples of non-negative column codes: equal ids iff equal tuples."""
    everyone = [np.ones(columns[0].size, dtype=bool)] * (len(columns) - 1)
    groups = Groups.nested(list(columns), everyone)[-1]
    return groups.spread(np.arange(groups.num_groups))


def normalize_within(ids: np.ndarray, values: np.ndarray, norm: str, ddof: int = 0) -> np.ndarray:
    """`values` normalised within the groups of equal `ids` (see `Groups.normalize`)."""
    return Groups.of(ids).normalize(values, norm, ddof)
