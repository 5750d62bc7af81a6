"""Environments stepped one at a time without waiting: the continuous rollout (`hgpo_trl.rollout.continuous`) sends an
episode's action as soon as its completion is read and collects the result whenever it is there, so that worker
processes step environments while the engine generates.

`AsyncSteps(envs)` wraps the rollout's `EnvBatch` for one rollout. With a `WorkerPoolEnvs` each `submit` is one
message to the worker that owns the environment; a worker answers its messages in order, and `collect` takes the
answers that came. The pool's fault rules hold, one environment's step at a time where lock-step has a call:
- `step_timeout` bounds each step from the moment its worker starts it (its earlier messages answered), so a hang
  is caught as in lock-step, and sooner where a lock-step call holds several of the worker's environments;
- a worker that dies or misses a deadline is restarted; every episode it held that is still being played gets
  the fault ("timed out after X s", "worker died ..."), now or at its next submit, as lock-step gives every
  environment of the failed call (in lock-step every live episode steps in every call).
With `InProcessEnvs` (fast environments) `submit` steps at once: nothing overlaps, but the loop is the same.
A rollout that an exception ends (Ctrl-C) calls `abandon`: the workers with steps in flight restart before the
pool's next call, so that their answers never answer the next rollout's.
"""

from __future__ import annotations

import multiprocessing.connection
import time
from collections import deque
from dataclasses import dataclass, field

from hgpo_trl.envs.pool import EnvBatch, StepResult, WorkerPoolEnvs, fault_result


@dataclass
class _Queue:
    """One worker's messages in flight, in the order it answers them, and the deadline of the first."""

    indices: deque[int] = field(default_factory=deque)
    deadline: float | None = None


class AsyncSteps:
    """`submit(index, action)` now, `collect(wait)` the results later (see the module doc)."""

    def __init__(self, envs: EnvBatch):
        self.envs = envs
        self._results: dict[int, StepResult] = {}  # answered, not collected yet
        self._lost: dict[int, str] = {}  # environments of a failed worker, with its fault
        self._pool = envs if isinstance(envs, WorkerPoolEnvs) else None
        self._queues = [_Queue() for _ in range(self._pool.num_workers)] if self._pool is not None else []

    @property
    def pending(self) -> int:
        """Steps submitted and not collected yet."""
        return len(self._results) + sum(len(queue.indices) for queue in self._queues)

    def submit(self, index: int, action: str | None) -> None:
        if index in self._lost:
            self._results[index] = fault_result(self._lost.pop(index))
            self.envs.faults += 1
            return
        if self._pool is None:
            self._results.update(self.envs.step({index: action}))
            return
        w = self._pool._owner[index]  # (the pool's own bookkeeping: pool.py holds the protocol both share)
        queue = self._queues[w]
        queue.indices.append(index)  # (before the send: a send that an interruption cuts short is in flight too)
        try:
            self._pool._workers[w].conn.send(("step", [(index, action)]))
        except OSError:
            self._fail(w, self._pool._died(w))
            return
        if queue.deadline is None:
            queue.deadline = self._deadline()

    def collect(self, wait: bool) -> dict[int, StepResult]:
        """The results that came; with `wait`, at least one when a step is pending (or a deadline passes)."""
        while self._pool is not None and any(q.indices for q in self._queues):
            self._receive(wait and not self._results)
            if self._results or not wait:
                break
        results, self._results = self._results, {}
        return results

    def abandon(self) -> None:
        """The rollout ends here (an exception, Ctrl-C): every worker with a step in flight restarts before the pool's
        next call (the next rollout's reset), its answers unread. The object is done with."""
        busy = {w for w, queue in enumerate(self._queues) if queue.indices}
        if busy:
            self._pool._interrupted.update(busy)

    def _deadline(self) -> float | None:
        timeout = self._pool.step_timeout
        return None if timeout is None else time.monotonic() + timeout

    def _receive(self, block: bool) -> None:
        """The answers that are there, waiting for one (or the next deadline) when `block`; failed workers fail."""
        busy = [w for w, queue in enumerate(self._queues) if queue.indices]
        deadlines = [self._queues[w].deadline for w in busy if self._queues[w].deadline is not None]
        remaining = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        handles = {self._pool._workers[w].conn: w for w in busy}
        handles.update({self._pool._workers[w].process.sentinel: w for w in busy})
        ready = multiprocessing.connection.wait(list(handles), remaining if block else 0.0)
        for w in dict.fromkeys(handles[handle] for handle in ready):
            conn = self._pool._workers[w].conn
            try:
                while self._queues[w].indices and conn.poll():
                    (result,) = conn.recv()
                    self._results[self._queues[w].indices.popleft()] = result
                    self._pool._count([result])
                    self._queues[w].deadline = self._deadline() if self._queues[w].indices else None
            except (EOFError, OSError):
                self._fail(w, self._pool._died(w))
                continue
            if self._queues[w].indices and not self._pool._workers[w].process.is_alive():
                self._fail(w, self._pool._died(w))  # exited without answering
        now = time.monotonic()
        for w in busy:
            deadline = self._queues[w].deadline
            if self._queues[w].indices and deadline is not None and deadline <= now:
                self._fail(w, f"timed out after {self._pool.step_timeout} s")

    def _fail(self, w: int, fault: str) -> None:
        """Worker w failed: its steps in flight get `fault`, and so does the next submit of every other
        environment it held (restarted, it holds none); the pool's `_restart` gives it fresh ones to reset."""
        queue = self._queues[w]
        for index in queue.indices:
            self._results[index] = fault_result(fault)
        self._pool.faults += len(queue.indices)
        self._lost.update(dict.fromkeys((i for i in self._pool._workers[w].indices if i not in queue.indices), fault))
        queue.indices.clear()
        queue.deadline = None
        self._pool._restart(w)
