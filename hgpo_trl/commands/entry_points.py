"""The console entry points (`train.py`, `evaluate.py`, `hgpo-train`, `hgpo-eval`): `--help`, and a configuration
the parser refuses (an unknown key, a value of the wrong type: `hgpo_trl.commands.quick_check`), are answered before the
training stack (torch, Transformers, TRL's trainer) is imported, in about a second instead of ten or more."""

from __future__ import annotations

import sys

from hgpo_trl.commands.arguments import EVAL_SECTIONS, TRAIN_SECTIONS
from hgpo_trl.commands.parser import ConfigError, answered_help, command_name
from hgpo_trl.commands.quick_check import refuse_early
from hgpo_trl.runtime.signals import SignalStop, interrupting


def train(argv: list[str] | None = None) -> None:
    """`hgpo_trl.commands.train.main`, after a `--help` or an early refusal."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not answered_early(argv, TRAIN_SECTIONS, "train.py"):
        try:
            with interrupting():  # (seconds of imports: a scheduler's SIGTERM here ended the run without a word)
                from hgpo_trl.commands.train import main
        except SignalStop as stop:
            print(f"{command_name('train.py')}: {stop} as it started; nothing was trained", file=sys.stderr)
            raise SystemExit(128 + stop.signal) from None
        main(argv)


def evaluate(argv: list[str] | None = None) -> None:
    """`hgpo_trl.commands.evaluate.main`, after a `--help` or an early refusal."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not answered_early(argv, EVAL_SECTIONS, "evaluate.py"):
        from hgpo_trl.commands.evaluate import main

        main(argv)


def answered_early(argv: list[str], sections: tuple[type, ...], script: str) -> bool:
    """Whether the command line was answered before the imports: its `--help` printed (True), or its configuration
    refused in one line, as the command itself would refuse it (exit 2)."""
    if answered_help(argv, sections, script):
        return True
    try:
        refuse_early(argv, sections, script)
    except ConfigError as err:
        print(f"{command_name(script)}: configuration error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return False
