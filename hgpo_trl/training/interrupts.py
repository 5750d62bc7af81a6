"""Ctrl-C and SIGTERM during training: the first asks the run to stop where a checkpoint can resume it.

A scheduler's SIGTERM before a preemption, or a Ctrl-C in a terminal or a notebook, would otherwise end the run
wherever it is, losing every iteration since the last checkpoint. While `HGPOTrainer.train` runs, the first
SIGINT or SIGTERM only sets a flag (and prints one line); at the end of the iteration being played every process
asks whether any process saw one (one collective decision: a signal that reached a single rank stops them all
at the same boundary), and if so the run skips that boundary's evaluation, saves a checkpoint and stops. One that
came while the run started (its checkpoint loading, DeepSpeed starting) stops it before its first iteration: there
is nothing new to save. A second signal stops at once (`SignalStop`, a `KeyboardInterrupt`, nothing saved), but
only one that comes `REPEAT_SECONDS` after the first: sooner, it is the same stop delivered again (a launcher's
forward of a scheduler's SIGTERM, accelerate's SIGTERM after a Ctrl-C; `hgpo_trl.runtime.signals`).

The launcher kills the process some time after it passes a signal on, and the line says when
(`launcher_deadline`): torchrun (`accelerate launch` of several processes) `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` seconds
later (30 by default: set it above an iteration's time at the launch), accelerate's one-process launcher 5 s later.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from transformers import TrainerCallback

from hgpo_trl.runtime.collective import any_process
from hgpo_trl.runtime.signals import (
    REPEAT_SECONDS,
    SIGNALS,
    SignalStop,
    begin_stop,
    launcher_deadline,
    repeats_the_stop,
    say,
)
from hgpo_trl.training.iterations import IterationTrainer


class StopOnSignal(TrainerCallback):
    """The stop on a signal, as a callback: handlers installed for the span of `train()` (`installed`), the decision
    at every iteration boundary. `signal_name` is the signal that stopped the run (None: none did); `announce`:
    print where the checkpoint is at the end (train.py prints its own line, with the command that resumes it)."""

    def __init__(self, trainer: IterationTrainer):
        self.trainer = trainer
        self.requested: str | None = None  # the first signal seen on this process
        self.signal_name: str | None = None  # the signal that stopped the run (on every process)
        self.announce = True
        self.boundary = self.iteration_seconds = 0.0
        self.completed: int | None = None  # the iterations completed at the last boundary (None: training not begun)

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The handlers while the block runs, the previous ones put back however it ends (the Trainer calls no
        on_train_end when training raises). Installed before the checkpoint loads: a signal then is kept for
        on_train_begin. Signal handlers live in the main thread: elsewhere, none."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self.requested = self.signal_name = self.completed = None
        self.boundary = time.monotonic()
        begin_stop(None)
        previous = {number: signal.signal(number, self._handle) for number in SIGNALS}
        try:
            yield
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    def on_train_begin(self, args, state, control, **kwargs):
        self.boundary, self.completed = time.monotonic(), self.trainer.completed_iterations
        if any_process(self.trainer.accelerator, self.requested is not None):  # it came as the run started
            name = self.requested or "a signal on another process"
            raise SignalStop(f"stopped by {name} before iteration {self.completed + 1} began (it came as the run "
                             f"started)", getattr(signal, name, signal.SIGTERM))

    def on_train_end(self, args, state, control, **kwargs):
        if self.signal_name and self.announce and state.is_world_process_zero:
            print(f"[stop] stopped by {self.signal_name} after iteration {self.trainer.completed_iterations}: "
                  f"{self.checkpoint} holds it (resume_from_checkpoint)", flush=True)

    @property
    def checkpoint(self) -> str:
        """The checkpoint the stop saved (the last optimizer step's)."""
        return os.path.join(self.trainer.args.output_dir, f"checkpoint-{self.trainer.state.global_step}")

    def on_step_end(self, args, state, control, **kwargs):
        if not self.trainer.at_iteration_boundary:
            return
        now = time.monotonic()
        self.iteration_seconds, self.boundary = now - self.boundary, now
        self.completed = self.trainer.completed_iterations
        if any_process(self.trainer.accelerator, self.requested is not None):
            self.signal_name = self.requested or "a signal on another process"
            control.should_evaluate = False  # the user wants the run to end: the checkpoint, then out
            control.should_save = control.should_training_stop = True

    def _handle(self, number: int, frame) -> None:
        now, name = time.monotonic(), signal.Signals(number).name
        if self.requested is not None:
            if repeats_the_stop(now):
                return
            raise SignalStop(f"{name} again: stopped at once", number)
        self.requested = name
        begin_stop(now)
        if self.completed is None:
            where = "the run stops before its first iteration (it is starting)"
        else:
            took = f"iterations take ~{seconds(self.iteration_seconds)}, " if self.iteration_seconds else ""
            where = (f"the run stops when iteration {self.completed + 1} ends ({took}this one has run "
                     f"{seconds(now - self.boundary)}) and saves a checkpoint there")
        deadline = launcher_deadline()
        say(f"[stop] {name}: {where}; a second Ctrl-C or SIGTERM, {REPEAT_SECONDS:.0f} s or more after this one, "
            f"stops at once, saving nothing{'; ' + deadline if deadline else ''}")


def seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"
