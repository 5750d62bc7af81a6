"""Ctrl-C and SIGTERM, one rule for every stage of a run: when a repeated signal is the user's second, and what
the launcher that started this process does after it passes a signal on.

A stop reaches a process more than once without anyone asking twice: a scheduler signals every process of a job
(SLURM at a preemption) and the launcher forwards its own copy to ranks that had one; accelerate's one-process
launcher answers a terminal's Ctrl-C, which reached the process already, with a SIGTERM. So a signal is the
user's second (stop at once) only when it comes REPEAT_SECONDS or more after the one that began the stop; sooner,
it is the same stop delivered again and changes nothing. A person's second Ctrl-C, after the first's line, comes
later than that.

`interrupting()` holds for a command's whole span (its start-up, its report): there SIGINT and SIGTERM raise
`SignalStop`, so the command ends in its one line (SIGTERM's default action ended it with none).
`hgpo_trl.training.interrupts` takes them over while `train()` runs, to stop at an iteration's end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_SECONDS = 3.0  # a launcher forwards in milliseconds; a scheduler's stagger between processes is under a second
_stop = SimpleNamespace(began=None)  # when this process's stop began (time.monotonic()); None: none began


class SignalStop(KeyboardInterrupt):
    """A signal stopped the run where it was (`signal`: its number, for the exit status 128 + it)."""

    def __init__(self, message: str, number: int):
        super().__init__(message)
        self.signal = number


def begin_stop(now: float | None) -> None:
    """A stop begins at `now` (None: none is under way, as a command or a `train()` starts)."""
    _stop.began = now


def repeats_the_stop(now: float) -> bool:
    """Whether a signal at `now` is the stop under way delivered again (see the module's docstring)."""
    return _stop.began is not None and now - _stop.began < REPEAT_SECONDS


@contextmanager
def interrupting() -> Iterator[None]:
    """SIGINT and SIGTERM raise `SignalStop` while the block runs (a repeat of the stop changes nothing); the
    previous handlers after. Signal handlers live in the main thread: elsewhere, none."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    begin_stop(None)  # (a command run before this one, in this process, stopped on its own)
    previous = {number: signal.signal(number, _interrupt) for number in SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _interrupt(number: int, frame) -> None:
    now = time.monotonic()
    if repeats_the_stop(now):
        return
    begin_stop(now)
    raise SignalStop(f"interrupted by {signal.Signals(number).name}", number)


def launcher_deadline() -> str:
    """What the launcher of this process does after it passes a signal on ('': no launcher): the stop's line says
    it, so a run that cannot reach its checkpoint is not a surprise."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun: accelerate launch of several processes, or of DeepSpeed
        return (f"the launcher kills the ranks {os.environ.get('TORCH_ELASTIC_SHUTDOWN_TIMEOUT', '30')} s after it "
                "forwards a signal (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)")
    if "ACCELERATE_DYNAMO_BACKEND" in os.environ:  # accelerate's one-process launcher, which sets it (torchrun aside)
        return ("accelerate launch kills this process 5 s after a Ctrl-C or SIGTERM reaches it, whatever the settings: "
                "the checkpoint is written only if the iteration ends by then (python train.py waits for it)")
    return ""


def say(line: str) -> None:
    """One line on stdout, after what was printed before it, written whole (a signal handler may interrupt a print in
    progress). Not stderr: accelerate's one-process launcher relays the process's stderr, and lost what arrived as
    it handled a Ctrl-C (1 run in 3 here); stdout it leaves alone."""
    with contextlib.suppress(RuntimeError, ValueError, OSError):  # (a print this handler interrupted cannot flush)
        sys.stdout.flush()
    rank = os.environ.get("RANK")
    os.write(1, (f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else "")
             .encode() + line.encode() + b"\n")
