"""Decisions every process takes together. With several processes a process may only skip or stop what all the
others skip or stop: one waiting alone in a collective (a generate call, a forward pass under ZeRO-3, a gather)
hangs the run. Each function is one collective call, so every process must call it at the same point. And
`leave_at_exit`: how a process leaves the others when it ends."""

from __future__ import annotations

import atexit
import sys

import torch


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
    """Destroy this process's gloo process groups when it exits, before the interpreter's teardown (once per
    process, however many trainers it builds). Left to the teardown, a gloo worker thread that still held a
    collective's tensors freed them there, reached for the GIL and was ended by Python mid-unwind: std::terminate,
    "terminate called without an active exception", SIGABRT, and the launcher then killed the other ranks (a ZeRO-2
    run stopped by a signal failed its launch). `destroy_process_group` waits for that work first. NCCL is left
    as it was (its teardown has its own rules, and is not seen here)."""
    atexit.unregister(_destroy_gloo_groups)
    atexit.register(_destroy_gloo_groups)


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
