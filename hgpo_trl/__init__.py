"""hgpo-trl: Hierarchy-of-Groups Policy Optimization and step-level RL estimators for LLM agents on TRL."""

import os
import shutil
import sys
from pathlib import Path

__version__ = "0.1.0"


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
