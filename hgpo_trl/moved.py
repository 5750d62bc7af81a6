"""The module paths of release 0.1, before the stages had folders (issue 54): they keep working until 0.2, each
with a DeprecationWarning naming where it went.

`import hgpo_trl.tiny` (and `python -m hgpo_trl.trajectories ...`) find the module at its new path through a finder
on `sys.meta_path`: the old name is the very module object of the new one, so a patch through either reaches the
same code. Two old modules became packages, `hgpo_trl.rollout` and `hgpo_trl.evaluation`: their old names
(`from hgpo_trl.rollout import run_rollout`) are answered by the package's `__getattr__` (`old_name`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

# old module -> where it lives now (both under hgpo_trl)
MOVED = {
    "collective": "runtime.collective", "progress": "runtime.progress", "seeds": "runtime.seeds",
    "continuous": "rollout.continuous", "generation": "rollout.generation", "vllm_stream": "rollout.vllm_stream",
    "vllm_cpu": "rollout.vllm_cpu", "memory": "rollout.memory", "actions": "rollout.actions",
    "sampler": "rollout.sampler", "outcomes": "rollout.outcomes",
    "step_batches": "training.step_batches", "loss_inputs": "training.loss_inputs", "balance": "training.balance",
    "dynamic_sampling": "training.dynamic_sampling", "iterations": "training.iterations",
    "interrupts": "training.interrupts", "checkpoints": "training.checkpoints", "metrics": "training.metrics",
    "reporting": "training.reporting",
    "trajectories": "evaluation.trajectories", "viewer": "evaluation.viewer",
    "tiny": "models.tiny", "warmstart": "models.warmstart", "export": "models.export",
    "model_card": "models.model_card",
    "cli": "commands.train", "evaluate": "commands.evaluate", "arguments": "commands.arguments",
    "parser": "commands.parser", "quick_check": "commands.quick_check", "entry_points": "commands.entry_points",
    "players": "commands.players",
}
# the old modules that are packages now -> the module that holds their old names
BECAME_PACKAGES = {"rollout": "rollout.lockstep", "evaluation": "evaluation.protocol"}


def _warn(old: str, new: str, stacklevel: int = 3) -> None:
    """The warning, pointed at the line that used the old path (importlib's own frames are skipped)."""
    warnings.warn(f"hgpo_trl.{old} moved to hgpo_trl.{new}; the old path goes in 0.2", DeprecationWarning,
                  stacklevel=stacklevel)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `hgpo_trl.<old>` and hands out `hgpo_trl.<new>` itself (and its code, for `python -m`)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        package, _, old = fullname.partition(".")
        if package != "hgpo_trl" or old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        old = spec.name.partition(".")[2]
        _warn(old, MOVED[old])
        return importlib.import_module(f"hgpo_trl.{MOVED[old]}")

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module was imported at its new path."""

    def get_code(self, fullname: str):
        old = fullname.partition(".")[2]
        _warn(old, MOVED[old])
        new = importlib.util.find_spec(f"hgpo_trl.{MOVED[old]}")
        return new.loader.get_code(new.name)


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())


def old_name(package: str, name: str) -> Any:
    """A name of the old module `hgpo_trl.<package>` (now `BECAME_PACKAGES[package]`), for the package's
    `__getattr__`; AttributeError for any other name, as a module answers."""
    module = importlib.import_module(f"hgpo_trl.{BECAME_PACKAGES[package]}")
    if name.startswith("__") or not hasattr(module, name):
        raise AttributeError(f"module 'hgpo_trl.{package}' has no attribute {name!r}")
    _warn(f"{package}.{name}", f"{BECAME_PACKAGES[package]}.{name}", stacklevel=4)
    return getattr(module, name)
