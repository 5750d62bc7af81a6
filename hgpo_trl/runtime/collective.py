"""Decisions every process takes together. With several processes a process may only skip or stop what all the
others skip or stop: one waiting alone in a collective (a generate call, a forward pass under ZeRO-3, a gather)
hangs the run. Each function is one collective call, so every process must call it at the same point."""

from __future__ import annotations

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
