"""hgpo-trl: Hierarchy-of-Groups Policy Optimization and step-level RL estimators for LLM agents on TRL.

The public API is here, imported when first used (so that `train.py --help` and a refused config stay fast):

    from hgpo_trl import HGPOConfig, HGPOTrainer, make_env, make_tasks, make_tiny, warm_start, evaluate_model

The stages have folders of their own (docs/architecture.md): `rollout/`, `training/`, `evaluation/`, `models/`,
`commands/`, beside `trainer.py` (TRL glue), `config.py`, `advantages/` and `envs/`.
"""

import importlib
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from hgpo_trl import moved

__version__ = "0.1.0"

# name -> the module that defines it
_PUBLIC = {
    "HGPOConfig": "hgpo_trl.config", "HGPOTrainer": "hgpo_trl.trainer",
    "make_env": "hgpo_trl.envs", "make_tasks": "hgpo_trl.envs", "register_env": "hgpo_trl.envs",
    "TextEnv": "hgpo_trl.envs",
    "StepBatch": "hgpo_trl.advantages", "compute_advantages": "hgpo_trl.advantages",
    "register_estimator": "hgpo_trl.advantages",
    "make_tiny": "hgpo_trl.models.tiny", "warm_start": "hgpo_trl.models.warmstart",
    "merge_adapter": "hgpo_trl.models.export", "pretrained_folder": "hgpo_trl.models.pretrained",
    "evaluate_model": "hgpo_trl.commands.evaluate",
    "plot_learning": "hgpo_trl.training.reporting",
}
__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'hgpo_trl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # (once)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


def _find_the_venvs_deepspeed_op() -> None:
    """DeepSpeed's CPU collective op, which its CPU runs (a rehearsal's, the tests') compile on first use: set-up
    (make) builds it once into the venv, and every command run with the venv's Python (python train.py, accelerate
    launch's ranks, a notebook's kernel) loads it from there, with the ninja set-up built it with, the venv's
    (DeepSpeed installs it): torch rebuilds an extension whenever another ninja is first on PATH (a system ninja
    1.11 and the venv's 1.13 each read the other's log as a changed command), 1.5-4 minutes each time."""
    if not (Path(sys.prefix) / "torch_extensions").is_dir():  # (no set-up of ours: torch's defaults)
        return
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    venv_bin = Path(sys.executable).parent
    if (venv_bin / "ninja").is_file() and shutil.which("ninja") != str(venv_bin / "ninja"):
        os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"


_find_the_venvs_deepspeed_op()
moved.install()
