"""Batches of environments for the rollout: stepped in this process, or in a pool of worker processes.

Real environments are slow (ALFWorld: reset 2-2.6 s, step ~90 ms), so `WorkerPoolEnvs` spreads a batch over
worker processes, each owning a contiguous share of the environments, in the manner of Gymnasium's
`AsyncVectorEnv`. One call sends each worker all of its commands in one message and gets all of its results
back in one message. `InProcessEnvs` steps a fast environment (keydoor) here, behind the same interface.

Faults are results, not exceptions, so one broken environment never stops training:
- an environment whose `reset`/`step` raises gets a `StepResult` with `fault="<ExceptionType>: message"`,
  `terminated=True`, reward 0; it is dropped and rebuilt from the factory on its next reset;
- a worker that dies, or does not answer within `step_timeout`/`reset_timeout`, is killed and restarted with
  fresh environments; every environment of that worker in the call gets a fault result ("worker died ...",
  "timed out after X s"), and the others it held are lost too (a step before their next reset is a fault).
`faults` counts the fault results since the batch was built (for the `env/faults` metric). The workers of a call
an exception ends (Ctrl-C) restart before their next call (not at once: a run that stops waits for no new worker).

`render_prompt` needs no round trip: it calls the template of one environment built here and never reset, so
the environment's `render_prompt` must not depend on its state (true of keydoor; require it of new envs).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from hgpo_trl.envs.base import TextEnv

# What the main process sends a worker it stops (a timeout, close): not SIGTERM, which a scheduler sends every
# process of a job while the main process finishes its iteration.
STOP_SIGNAL = signal.SIGUSR1


@dataclass
class StepResult:
    """One environment's answer to `reset` (reward 0, not done) or `step`; `fault` says why it failed."""

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)
    fault: str | None = None


def fault_result(fault: str) -> StepResult:
    return StepResult("", 0.0, True, False, {}, fault)


class EnvBatch(Protocol):
    """What the rollout drives: `num_envs` environments addressed by index."""

    faults: int

    def __len__(self) -> int: ...

    def reset(self, tasks: Sequence[Mapping[str, Any]]) -> list[StepResult]:
        """Reset every environment, environment i on `tasks[i]`."""

    def step(self, actions: Mapping[int, str | None]) -> dict[int, StepResult]:
        """Step the environments given, by index; the results come in increasing index order."""

    def render_prompt(self, index: int, task: str, history: Sequence[tuple[str, str]], observation: str,
                      admissible: Sequence[str], step: int) -> str: ...

    def close(self) -> None: ...


class _Envs:
    """Environments by index, built from the factory on reset; an exception becomes a fault result."""

    def __init__(self, factory: Callable[[], TextEnv], indices: Sequence[int]):
        self.factory = factory
        self.envs: dict[int, TextEnv | None] = dict.fromkeys(indices)

    def run(self, command: str, items: Sequence[tuple[int, Any]]) -> list[StepResult]:
        return [self._run_one(command, index, argument) for index, argument in items]

    def _run_one(self, command: str, index: int, argument: Any) -> StepResult:
        try:
            if command == "reset":
                if self.envs[index] is None:
                    self.envs[index] = self.factory()
                observation, info = self.envs[index].reset(argument)
                return StepResult(observation, 0.0, False, False, info)
            if self.envs[index] is None:
                raise RuntimeError("the environment was lost to a fault; reset it first")
            observation, reward, terminated, truncated, info = self.envs[index].step(argument)
            return StepResult(observation, float(reward), bool(terminated), bool(truncated), info)
        except Exception as err:
            self._discard(index)
            return fault_result(f"{type(err).__name__}: {err}")

    def _discard(self, index: int) -> None:
        env, self.envs[index] = self.envs[index], None
        if env is not None:
            try:
                env.close()
            except Exception:
                pass  # the environment is already broken; its fault has been reported

    def close(self) -> None:
        for index in self.envs:
            self._discard(index)


class _Batch:
    """What both implementations share: the size, the fault count and the prompt template."""

    def __init__(self, factory: Callable[[], TextEnv], num_envs: int):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.factory = factory
        self.num_envs = num_envs
        self.faults = 0
        self._template: TextEnv | None = None

    def __len__(self) -> int:
        return self.num_envs

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def render_prompt(self, index: int, task: str, history: Sequence[tuple[str, str]], observation: str,
                      admissible: Sequence[str], step: int) -> str:
        if not 0 <= index < self.num_envs:
            raise IndexError(f"environment index {index} out of range [0, {self.num_envs})")
        if self._template is None:
            self._template = self.factory()
        return self._template.render_prompt(task, history, observation, admissible, step)

    def _check(self, tasks: Sequence[Mapping[str, Any]] | None = None,
               actions: Mapping[int, str | None] | None = None) -> None:
        if tasks is not None and len(tasks) > self.num_envs:
            raise ValueError(f"at most one task per environment ({self.num_envs}), got {len(tasks)}")
        bad = [i for i in actions or () if not 0 <= i < self.num_envs]
        if bad:
            raise IndexError(f"environment indices {bad} out of range [0, {self.num_envs})")

    def _count(self, results: Sequence[StepResult]) -> None:
        self.faults += sum(result.fault is not None for result in results)

    def close(self) -> None:
        template, self._template = self._template, None
        if template is not None:
            template.close()


class InProcessEnvs(_Batch):
    """`num_envs` environments stepped one after another in this process (for fast environments)."""

    def __init__(self, factory: Callable[[], TextEnv], num_envs: int):
        super().__init__(factory, num_envs)
        self._envs = _Envs(factory, range(num_envs))

    def reset(self, tasks: Sequence[Mapping[str, Any]]) -> list[StepResult]:
        self._check(tasks=tasks)
        results = self._envs.run("reset", list(enumerate(tasks)))
        self._count(results)
        return results

    def step(self, actions: Mapping[int, str | None]) -> dict[int, StepResult]:
        self._check(actions=actions)
        indices = sorted(actions)
        results = self._envs.run("step", [(i, actions[i]) for i in indices])
        self._count(results)
        return dict(zip(indices, results, strict=True))

    def close(self) -> None:
        self._envs.close()
        super().close()


def _serve(conn: multiprocessing.connection.Connection, factory: Callable[[], TextEnv],
           indices: Sequence[int]) -> None:
    """A worker's loop: (command, [(index, argument)]) in, [StepResult] out; None or a closed pipe ends it."""
    # Ctrl-C reaches the whole process group, a scheduler's SIGTERM every process of the job: the main process
    # decides when the workers stop (it finishes its iteration first: hgpo_trl.training.interrupts).
    # A handler that does nothing, not SIG_IGN: the processes an environment starts would inherit SIG_IGN (and
    # then never stop on their own terminate()); a handler resets to the default in them.
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda *_: None)
    # The main process's own stop after a timeout (_stop): still close the environments (and their processes).
    signal.signal(STOP_SIGNAL, lambda *_: sys.exit(1))
    envs = _Envs(factory, indices)
    try:
        while (message := conn.recv()) is not None:
            conn.send(envs.run(*message))
    except EOFError:
        pass  # the main process is gone
    finally:
        envs.close()


@dataclass
class _Worker:
    indices: range
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection


def _start(context, factory: Callable[[], TextEnv], indices: range) -> _Worker:
    conn, child_conn = context.Pipe()
    # Not a daemon: daemonic processes may not start processes, and an environment may need to.
    process = context.Process(target=_serve, args=(child_conn, factory, indices), daemon=False,
                              name=f"env-worker-{indices.start}-{indices.stop - 1}")
    process.start()
    child_conn.close()  # the worker holds the only other end, so its death reads as EOF here
    return _Worker(indices, process, conn)


def _stop(workers: list[_Worker], grace: float) -> None:
    """Ask the workers to finish within `grace` seconds (0: do not ask), terminate or kill those that do not,
    reap them all, and empty the list."""
    for worker in workers if grace > 0 else ():
        with suppress(OSError):  # (it is gone already)
            worker.conn.send(None)
    deadline = time.monotonic() + grace
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))
        for end in (partial(_ask_to_stop, worker.process), worker.process.kill):
            if worker.process.is_alive():
                end()
                worker.process.join(1.0)
        worker.conn.close()
    workers.clear()


def _ask_to_stop(process: multiprocessing.process.BaseProcess) -> None:
    with suppress(ProcessLookupError):  # (it ended meanwhile)
        os.kill(process.pid, STOP_SIGNAL)


def default_num_workers(local_processes: int = 1) -> int:
    """The cores this process may use, shared among the `local_processes` training processes of the node."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, local_processes))


LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def local_process_count(num_processes: int) -> int:
    """The training processes on this node, of the run's `num_processes`, as the launcher says it: torchrun and
    accelerate launch (LOCAL_WORLD_SIZE), DeepSpeed's launcher (LOCAL_SIZE), Open MPI, Slurm; else all of them
    (the fewest workers)."""
    value = next((os.environ[name] for name in LOCAL_SIZE_VARIABLES if os.environ.get(name, "").isdigit()), None)
    return int(value) if value is not None else num_processes


def default_worker_count(fast: bool, num_processes: int = 1) -> int:
    """`env_workers` when it is None: 0 (in process) for a fast environment, else one worker per core of this
    process's share of its node (`default_num_workers`; `num_processes`: the run's)."""
    return 0 if fast else default_num_workers(local_process_count(num_processes))


class WorkerPoolEnvs(_Batch):
    """`num_envs` environments stepped in parallel by `num_workers` worker processes (see the module doc).

    `factory` is a picklable zero-argument callable (e.g. `functools.partial(hgpo_trl.envs.make_env, "alfworld")`).
    `step_timeout`/`reset_timeout` (seconds, None: no limit) bound one call to a worker, i.e. all of its
    environments in turn; `reset_timeout` also covers a fresh worker's start-up and the building of its
    environments, which happen on its first reset. Workers start with `start_method` ("spawn": forking after
    CUDA is initialised breaks the child).
    """

    def __init__(self, factory: Callable[[], TextEnv], num_envs: int, num_workers: int | None = None,
                 step_timeout: float | None = None, reset_timeout: float | None = None,
                 start_method: str = "spawn"):
        super().__init__(factory, num_envs)
        num_workers = default_num_workers() if num_workers is None else num_workers
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        num_workers = min(num_envs, num_workers)
        self.step_timeout, self.reset_timeout = step_timeout, reset_timeout
        self._context = multiprocessing.get_context(start_method)
        shares = [range(w * num_envs // num_workers, (w + 1) * num_envs // num_workers)
                  for w in range(num_workers)]
        self._owner = [w for w, share in enumerate(shares) for _ in share]
        self._workers: list[_Worker] = []
        self._interrupted: set[int] = set()  # workers whose answers to an interrupted call may still come
        # Runs on close(), on garbage collection, and at exit before multiprocessing joins its children
        # (which would wait forever on workers still serving).
        self._finalizer = multiprocessing.util.Finalize(self, _stop, args=(self._workers, 5.0), exitpriority=10)
        try:
            for share in shares:
                self._workers.append(_start(self._context, factory, share))
        except BaseException:
            self.close()
            raise

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def reset(self, tasks: Sequence[Mapping[str, Any]]) -> list[StepResult]:
        self._check(tasks=tasks)
        return list(self._call("reset", dict(enumerate(tasks)), self.reset_timeout).values())

    def step(self, actions: Mapping[int, str | None]) -> dict[int, StepResult]:
        self._check(actions=actions)
        return self._call("step", actions, self.step_timeout)

    def close(self) -> None:
        self._finalizer()  # idempotent: a Finalize runs its callback once
        super().close()

    def _call(self, command: str, arguments: Mapping[int, Any], timeout: float | None) -> dict[int, StepResult]:
        if not self._workers:
            raise RuntimeError("the environment pool is closed")
        for w in sorted(self._interrupted):  # (their answers to an interrupted call may still come)
            self._restart(w)
        self._interrupted.clear()
        jobs: dict[int, list[tuple[int, Any]]] = {}
        for index in sorted(arguments):
            jobs.setdefault(self._owner[index], []).append((index, arguments[index]))
        failed: dict[int, str] = {}
        try:
            for w, items in jobs.items():
                try:
                    self._workers[w].conn.send((command, items))
                except OSError:
                    failed[w] = self._died(w)
            replies = self._collect([w for w in jobs if w not in failed], timeout, failed)
        except BaseException:
            self._interrupted.update(jobs)  # (Ctrl-C): replies still in flight would answer the next call
            raise
        results: dict[int, StepResult] = {}  # in index order: the workers' shares are contiguous, in order
        for w, items in jobs.items():
            if w in failed:
                self._restart(w)
                replies[w] = [fault_result(failed[w]) for _ in items]
            results.update(zip([index for index, _ in items], replies[w], strict=True))
        self._count(list(results.values()))
        return results

    def _collect(self, waiting: list[int], timeout: float | None, failed: dict[int, str]) -> dict[int, list]:
        """The replies of the `waiting` workers; those that die or miss the deadline go to `failed`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: dict[int, list] = {}
        waiting = set(waiting)
        while waiting:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                failed.update((w, f"timed out after {timeout} s") for w in waiting)
                break
            # Waiting on the process sentinels too: a dead worker is noticed even with no deadline.
            handles = {self._workers[w].conn: w for w in waiting}
            handles.update({self._workers[w].process.sentinel: w for w in waiting})
            for ready in multiprocessing.connection.wait(list(handles), remaining):
                w = handles[ready]
                if w not in waiting:
                    continue  # both its pipe and its sentinel were ready
                waiting.discard(w)
                try:
                    if not self._workers[w].conn.poll():
                        raise EOFError  # exited without answering
                    replies[w] = self._workers[w].conn.recv()
                except (EOFError, OSError):
                    failed[w] = self._died(w)
        return replies

    def _died(self, w: int) -> str:
        process = self._workers[w].process
        process.join(1.0)  # let the exit code settle
        return f"worker died (exit code {process.exitcode})"

    def _restart(self, w: int) -> None:
        indices = self._workers[w].indices
        _stop([self._workers[w]], grace=0.0)  # a worker that failed a call cannot be trusted to finish cleanly
        self._workers[w] = _start(self._context, self.factory, indices)


def make_env_batch(factory: Callable[[], TextEnv], num_envs: int, num_workers: int | None = None,
                   **pool_options: Any) -> InProcessEnvs | WorkerPoolEnvs:
    """`InProcessEnvs` for 0 workers (fast environments), else a `WorkerPoolEnvs` of `num_workers` processes
    (None: `default_num_workers()`); `pool_options` go to `WorkerPoolEnvs`. In process, a step or reset cannot be
    interrupted: timeouts asked for get a warning that they cannot hold."""
    num_workers = default_num_workers() if num_workers is None else num_workers
    if num_workers == 0:
        if any(pool_options.get(name) is not None for name in ("step_timeout", "reset_timeout")):
            warnings.warn("env_workers=0 steps the environments in the training process, where env_step_timeout "
                          "and env_reset_timeout cannot be enforced: set env_workers >= 1 for them to hold",
                          UserWarning, stacklevel=2)
        return InProcessEnvs(factory, num_envs)
    return WorkerPoolEnvs(factory, num_envs, num_workers, **pool_options)
