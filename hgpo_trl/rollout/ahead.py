"""Generation beside training (`async_generation`): a thread plays the coming iterations' rollouts on a vLLM
server while the trainer trains on the last one's, each request answered by the weights the server holds when it
is sent.

The staleness bound is kept by admission: iteration k's rollout starts only once the server holds the weights of
optimizer step k - max_staleness or later. The trainer trains iteration k at optimizer step k (one optimizer step an
iteration) and pushes its weights after each, so every step of iteration k is trained at most max_staleness steps
after the weights that generated it. Nothing is dropped: a long episode holds its iteration back, and the trainer
waits for it, rather than being played again, so training does not lean toward short episodes (the bias of
dropping stale samples). An iteration's rollout plays every task's G episodes together, so a group is never split
by the cut; its episodes, and the steps of one episode, may come from different weights (each step records its
own). With max_staleness 0 iteration k is played after step k's push: the synchronous run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from hgpo_trl.rollout.lockstep import Rollout


class RolloutsStopped(Exception):
    """The rollouts ahead were stopped (the run ends): a rollout in flight is abandoned."""


class RolloutsFailed(RuntimeError):
    """The rollouts played ahead failed (the server gone, a request unanswered): the run stopped at an iteration's
    start, where a checkpoint was saved."""


class RolloutsAhead:
    """Plays iterations `first`, `first + 1`, ... `last - 1` in a thread of its own, each as soon as the bound admits
    it: `play(iteration)` returns its rollout. The trainer reports each weight push (`pushed(step)`) and takes the
    rollouts in order (`take(iteration)`, which waits for it and raises what the thread raised, or a push's failure:
    `push_failed`); `stop()` ends the thread, then calls `on_stop` (the thread's environments closed)."""

    def __init__(self, play: Callable[[int], Rollout], first: int, last: int, max_staleness: int,
                 on_stop: Callable[[], None] = lambda: None):
        self._play, self._next, self._last, self._bound, self._on_stop = play, first, last, max_staleness, on_stop
        self._version = -1  # the optimizer step of the weights the engine holds; -1 before the first push
        self._ready: dict[int, Rollout] = {}
        self._error: BaseException | None = None  # the thread's
        self._push_error: BaseException | None = None  # the trainer's push's: the engine may hold no recent weights
        self._stopping = False
        self._condition = threading.Condition()
        self.waiting_seconds = 0.0  # the trainer's, in take()
        self.admission_seconds = 0.0  # the thread's, waiting for the bound
        self._thread = threading.Thread(target=self._run, name="rollouts-ahead", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def version(self) -> int:
        """The optimizer step of the weights the engine holds now."""
        return self._version

    @property
    def stopping(self) -> bool:
        return self._stopping

    def pushed(self, step: int) -> None:
        """The engine holds the weights of optimizer step `step` from now on."""
        with self._condition:
            self._version = step
            self._condition.notify_all()

    def push_failed(self, error: BaseException) -> None:
        """The trainer's push of its weights failed: the next `take` raises it (the first one), even where that
        iteration was played already (the next push would wait on the same engine)."""
        with self._condition:
            self._push_error = self._push_error or error
            self._condition.notify_all()

    @property
    def push_failure(self) -> BaseException | None:
        return self._push_error

    def take(self, iteration: int) -> Rollout:
        """Iteration `iteration`'s rollout, once played (or the push's failure, or the thread's)."""
        tick = time.perf_counter()
        with self._condition:
            self._condition.wait_for(lambda: self._push_error is not None or iteration in self._ready
                                     or self._error is not None)
            self.waiting_seconds += time.perf_counter() - tick
            if self._push_error is not None:
                raise self._push_error
            if iteration not in self._ready:
                raise self._error
            return self._ready.pop(iteration)

    def stop(self) -> None:
        """Stop playing: the rollout in flight is abandoned (its requests dropped), the thread joined."""
        with self._condition:
            self._stopping = True
            self._condition.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        self._on_stop()

    def _run(self) -> None:
        try:
            while self._next < self._last:
                tick = time.perf_counter()
                with self._condition:
                    self._condition.wait_for(lambda: self._stopping or self._version >= self._next - self._bound)
                    self.admission_seconds += time.perf_counter() - tick
                    if self._stopping:
                        return
                rollout = self._play(self._next)
                with self._condition:
                    self._ready[self._next] = rollout
                    self._next += 1
                    self._condition.notify_all()
        except RolloutsStopped:
            return
        except BaseException as error:  # (handed to the trainer's take)
            with self._condition:
                self._error = error
                self._condition.notify_all()
