"""The console entry points (`train.py`, `evaluate.py`, `hgpo-train`, `hgpo-eval`): `--help` is answered before
the training stack (torch, Transformers, TRL's trainer) is imported, in about a second instead of ten."""

from __future__ import annotations

import sys

from hgpo_trl.arguments import EVAL_SECTIONS, TRAIN_SECTIONS
from hgpo_trl.parser import answered_help


def train(argv: list[str] | None = None) -> None:
    """`hgpo_trl.cli.main`, after a `--help`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not answered_help(argv, TRAIN_SECTIONS, "train.py"):
        from hgpo_trl.cli import main

        main(argv)


def evaluate(argv: list[str] | None = None) -> None:
    """`hgpo_trl.evaluate.main`, after a `--help`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not answered_help(argv, EVAL_SECTIONS, "evaluate.py"):
        from hgpo_trl.evaluate import main

        main(argv)
