"""Decisions every process takes together. With several processes a process may only skip or stop what all the
others skip or stop: one waiting alone in a collective (a generate call, a forward pass under ZeRO-3, a gather)
hangs the run. Each function is one collective call, so every process must call it at the same point. And
`leave_at_exit`: how a process leaves the others when it ends."""

from __future__ import annotations

import atexit
import sys
import time
from pathlib import Path

import torch

# torch names its gloo worker threads so (15 characters: Linux cuts a thread's name there)
_GLOO_WORKER_THREAD = "pt_gloo_runloop"


def any_process(accelerator, flag: bool) -> bool:
    """Whether `flag` holds on some process."""
    return accelerator.reduce(torch.tensor(float(flag), device=accelerator.device), reduction="max").item() > 0


def process_max(accelerator, value: int) -> int:
    """The largest of every process's `value`."""
    return int(accelerator.reduce(torch.tensor(value, device=accelerator.device), reduction="max").item())


def process_sum(accelerator, value: int) -> int:
    """The sum of every process's `value`."""
    return int(accelerator.reduce(torch.tensor(value, device=accelerator.device), reduction="sum").item())


def process_values(accelerator, value: int) -> list[int]:
    """Every process's `value`, in process order."""
    return accelerator.gather(torch.tensor([value], device=accelerator.device)).tolist()


def elementwise_process_sum(accelerator, values: list[float]) -> list[float]:
    """Per position, the sum over processes of every process's `values` (in float64)."""
    return accelerator.reduce(torch.tensor(values, dtype=torch.float64, device=accelerator.device),
                              reduction="sum").tolist()


def leave_at_exit() -> None:
    """End this process's gloo process groups when it exits, before the interpreter's teardown (once per process,
    however many trainers it builds): destroy them, then let their worker threads finish. A gloo worker that has
    completed a collective still drops its own reference to it, and where that reference is the last (its caller's
    is gone) it frees the collective's tensors, whose Python objects need the GIL. A thread that asks for the GIL
    once the teardown has begun is ended by Python (pthread_exit), and the unwind meets a noexcept destructor:
    std::terminate ("terminate called without an active exception"), SIGABRT, and the launcher kills the other
    ranks: a finished run fails its launch. `destroy_process_group` does not join those workers (a DDP model keeps
    the group alive), so they get the GIL here. NCCL is left as it was (its teardown has its own rules)."""
    atexit.unregister(_leave)
    atexit.register(_leave)


def _leave() -> None:
    _destroy_gloo_groups()
    _let_gloo_workers_finish()


def _let_gloo_workers_finish(limit_s: float = 2.0, quiet_samples: int = 3) -> None:
    """Sleep (the GIL free) until none of this process's gloo worker threads has run for `quiet_samples` looks in
    a row, 10 ms apart, at most `limit_s`. A worker waiting for the GIL sleeps on a futex as an idle one does, so
    it is not seen waiting: each sleep hands it the GIL, and it is seen running until it is done. A collective
    still waiting for the other processes is not waited for. Without /proc (not Linux), one 50 ms sleep."""
    workers = _gloo_worker_threads()
    if workers is None:
        time.sleep(0.05)
        return
    deadline, quiet = time.monotonic() + limit_s, 0
    while workers and quiet < quiet_samples and time.monotonic() < deadline:
        time.sleep(0.01)
        quiet = 0 if any(_running(task) for task in workers) else quiet + 1


def _gloo_worker_threads() -> list[Path] | None:
    """This process's gloo worker threads, each as its /proc/self/task/<id> folder; None without /proc (not Linux)."""
    tasks = Path("/proc/self/task")
    return [task for task in tasks.iterdir() if _read(task / "comm") == _GLOO_WORKER_THREAD] if tasks.is_dir() else None


def _running(task: Path) -> bool:
    """Whether the thread /proc/self/task/<id> is running or runnable (its state, after its name in `stat`)."""
    return _read(task / "stat").rpartition(")")[2].split()[:1] == ["R"]


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:  # (a thread that has ended)
        return ""


def _destroy_gloo_groups() -> None:
    vllm_groups = sys.modules.get("vllm.distributed.parallel_state")
    if vllm_groups is not None and vllm_groups.model_parallel_is_initialized():
        # A colocated vLLM engine's groups are built on the default one, and its own shutdown (a finalizer that
        # runs after this) destroys them: with the default group gone first it failed ("Invalid process group
        # specified"). Its groups, then the default group, as that shutdown does.
        vllm_groups.destroy_model_parallel()
        vllm_groups.destroy_distributed_environment()
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_backend() == "gloo":
        torch.distributed.destroy_process_group()
