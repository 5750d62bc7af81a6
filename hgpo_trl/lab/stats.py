"""The lab's statistics over seeds: bootstrap confidence intervals, paired differences, iterations to a target,
and the advantages' bias and variance against the exact advantage (`hgpo_trl.diagnostics.study.summarise`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hgpo_trl.diagnostics.study import summarise

RESAMPLES = 1000


def bootstrap_ci(values: np.ndarray, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the mean over seeds and its 95% percentile-bootstrap interval."""
    values = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, (resamples, values.size))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(values.mean()), float(low), float(high)


def iterations_to(success: np.ndarray, target: float) -> np.ndarray:
    """Per seed: the first iteration whose success is >= target (inf where none is)."""
    reached = success >= target
    return np.where(reached.any(axis=1), reached.argmax(axis=1).astype(np.float64), np.inf)


@dataclass
class ErrorCells:
    """Per seed and cell (node, action slot): visits, sum and sum of squares of `estimate - exact`."""

    n: np.ndarray  # (seeds, cells)
    total: np.ndarray
    squares: np.ndarray

    @classmethod
    def of(cls, seed: np.ndarray, cell: np.ndarray, error: np.ndarray, seeds: int, cells: int) -> ErrorCells:
        flat = seed * cells + cell
        def count(weights):
            return np.bincount(flat, weights=weights, minlength=seeds * cells).reshape(seeds, cells)
        return cls(count(None).astype(np.float64), count(error), count(error ** 2))

    def summary(self, mask: np.ndarray, resamples: int = 200, seed: int = 0) -> dict[str, float]:
        """bias^2, variance and mse over the cells in `mask`, pooled over seeds (every seed plays the same
        policy at iteration 0, so a cell's visits are draws of one distribution), with 95% bootstrap intervals
        over seeds for bias^2."""
        pooled = summarise(self.n.sum(0), self.total.sum(0), self.squares.sum(0), mask)
        rng = np.random.default_rng(seed)
        seeds = self.n.shape[0]
        draws = [summarise(*(a[rows].sum(0) for a in (self.n, self.total, self.squares)), mask)["bias2"]
                 for rows in rng.integers(0, seeds, (resamples, seeds))]
        low, high = np.percentile(draws, [2.5, 97.5])
        return pooled | {"bias2_low": float(low), "bias2_high": float(high)}
