"""Step-level advantage estimators: pure numpy functions of a `StepBatch` (no torch, no trainer state).

    from hgpo_trl.advantages import StepBatch, compute_advantages
    adv = compute_advantages("hgpo", batch, gamma=0.95, depth=2, alpha=1.0)

Estimators by name: "grpo", "gigpo", "hgpo", "progpo", and any added with `register_estimator`.
`released_options(name)` gives the options that reproduce the released verl-agent code for grpo, gigpo and hgpo.
The specification is ALGORITHMS.md (project docs: docs/concepts.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from hgpo_trl.advantages.batch import StepBatch, observation_keys
from hgpo_trl.advantages.gigpo import gigpo_advantages
from hgpo_trl.advantages.grpo import grpo_advantages
from hgpo_trl.advantages.hgpo import LevelStats, hgpo_advantages, hgpo_level_stats
from hgpo_trl.advantages.progpo import progpo_advantages, semantic_key
from hgpo_trl.advantages.returns import discounted_returns

Estimator = Callable[..., np.ndarray]

ESTIMATORS: dict[str, Estimator] = {
    "grpo": grpo_advantages,
    "gigpo": gigpo_advantages,
    "hgpo": hgpo_advantages,
    "progpo": progpo_advantages,
}


def register_estimator(name: str, fn: Estimator, *, overwrite: bool = False) -> None:
    """Add an estimator `fn(batch: StepBatch, **options) -> np.ndarray of shape (N,)` under `name`."""
    if not callable(fn):
        raise ValueError(f"estimator {name!r} must be callable, got {type(fn).__name__}")
    if name in ESTIMATORS and not overwrite:
        raise ValueError(f"estimator {name!r} is already registered (pass overwrite=True to replace it)")
    ESTIMATORS[name] = fn


def estimator_options(name: str) -> list[str]:
    """The keyword options that estimator `name` accepts."""
    fn = _lookup(name)
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


# The options that restore the released verl-agent behaviour (recipe/hgpo, gigpo, verl's GRPO with
# compute_mean_std_cross_steps=True, its default): episode statistics over step rows (each row scored by its
# episode's reward minus the invalid penalty if that row was invalid), torch.std's ddof 1 where the release uses
# it, and HGPO's filter of items equal to 0. The norm stays the caller's (released: ALFWorld mean_std_norm, WebShop
# mean_norm); gamma 0.95 and invalid_penalty 0.1 are already the defaults. HGPOConfig's fields carry the same names,
# so `HGPOConfig(estimator=name, **released_options(name), ...)` trains with them.
RELEASED_OPTIONS: dict[str, dict[str, Any]] = {
    "grpo": {"episode_stats": "steps", "std_ddof": 1},
    "gigpo": {"episode_stats": "steps", "std_ddof": 1},
    "hgpo": {"episode_stats": "steps", "std_ddof": 1, "drop_zero_items": True},
}


def released_options(name: str) -> dict[str, Any]:
    """The keyword options of estimator `name` that reproduce the released code (a fresh dict).

    Raises ValueError for an estimator without a released counterpart, or whose signature no longer takes them."""
    if name not in RELEASED_OPTIONS:
        raise ValueError(f"estimator {name!r} has no released counterpart; released options exist for "
                         f"{sorted(RELEASED_OPTIONS)}")
    options = dict(RELEASED_OPTIONS[name])
    unknown = sorted(set(options) - set(estimator_options(name)))
    if unknown:
        raise ValueError(f"estimator {name!r} does not take released option(s) {unknown}")
    return options


def compute_advantages(name: str, batch: StepBatch, **options) -> np.ndarray:
    """One advantage per step of `batch` (float64, in the batch's row order) from estimator `name`.

    Raises ValueError for an unknown estimator, an option the estimator does not take, or a bad batch.
    """
    fn = _lookup(name)
    params = inspect.signature(fn).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        accepted = estimator_options(name)
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise ValueError(f"estimator {name!r} does not take option(s) {unknown}; it takes {accepted}")
    advantages = np.asarray(fn(batch, **options), dtype=np.float64)
    if advantages.shape != (len(batch),):
        raise ValueError(f"estimator {name!r} returned shape {advantages.shape}, expected ({len(batch)},)")
    return advantages


def _lookup(name: str) -> Estimator:
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown estimator {name!r}; known: {sorted(ESTIMATORS)}") from None


__all__ = [
    "ESTIMATORS",
    "RELEASED_OPTIONS",
    "LevelStats",
    "StepBatch",
    "compute_advantages",
    "discounted_returns",
    "estimator_options",
    "gigpo_advantages",
    "grpo_advantages",
    "hgpo_advantages",
    "hgpo_level_stats",
    "observation_keys",
    "progpo_advantages",
    "register_estimator",
    "released_options",
    "semantic_key",
]
