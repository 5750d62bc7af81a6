"""Task sampling: one dataset row per task, distinct tasks per process, each iteration's batch re-served for
every buffered micro-step (TRL's generation buffer consumes one dataloader batch per micro-step but only
the first of each iteration starts a rollout)."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler

from hgpo_trl.runtime.seeds import integer_seed


class TaskSampler(Sampler[int]):
    """Yields task indices for `tasks_per_iteration` tasks (all processes together) per iteration, the
    iteration's list repeated `repeat` times. Accelerate hands the processes consecutive slices of
    `tasks_per_iteration / num_processes` rows in turn, so each process always gets its own distinct tasks.

    One pass covers every task once (a fresh permutation each pass when `shuffle`); when the dataset holds
    fewer tasks than one iteration needs, tasks repeat.
    """

    def __init__(self, data_source: Sized, tasks_per_iteration: int, repeat: int, shuffle: bool = True,
                 seed: int = 0):
        if len(data_source) == 0:
            raise ValueError("the task dataset is empty: it needs at least one row (one task)")
        if len(data_source) < tasks_per_iteration:
            warnings.warn(f"the task dataset has {len(data_source)} tasks but one iteration plays "
                          f"{tasks_per_iteration}: tasks repeat within an iteration", stacklevel=2)
        self.num_tasks = len(data_source)
        self.tasks_per_iteration = tasks_per_iteration
        self.repeat = repeat
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    @property
    def iterations_per_pass(self) -> int:
        return math.ceil(self.num_tasks / self.tasks_per_iteration)

    def set_epoch(self, epoch: int) -> None:
        """The Trainer names the pass (epoch) it starts: a resumed run then plays that pass's order, not the
        first pass's again."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        order = self.pass_order(self.epoch)
        self.epoch += 1
        for start in range(0, len(order), self.tasks_per_iteration):
            chunk = order[start:start + self.tasks_per_iteration]
            for _ in range(self.repeat):
                yield from chunk

    def pass_order(self, passes: int) -> list[int]:
        """The tasks of pass `passes` (0-based) in order, one iteration's after another: the pass-th permutation
        drawn from the seeded generator (every pass a fresh one when `shuffle`), a function of the pass alone."""
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(passes + 1):
            permutation = (torch.randperm(self.num_tasks, generator=generator) if self.shuffle
                           else torch.arange(self.num_tasks))
        needed = self.iterations_per_pass * self.tasks_per_iteration
        return (permutation.tolist() * math.ceil(needed / self.num_tasks))[:needed]

    def iteration_tasks(self, iteration: int, rank: int, num_processes: int) -> list[int]:
        """The task indices process `rank` plays in (0-based) `iteration`: what the dataloader serves it, as a
        function of the iteration alone (step_batching='all_steps', where the dataloader only counts
        micro-steps)."""
        passes, chunk = divmod(iteration, self.iterations_per_pass)
        per_process = self.tasks_per_iteration // num_processes
        start = chunk * self.tasks_per_iteration + rank * per_process
        return self.pass_order(passes)[start:start + per_process]

    def extra_tasks(self, batch: int, rank: int, num_processes: int) -> list[int]:
        """The task indices process `rank` plays in the run's (0-based) `batch`-th extra rollout batch of dynamic
        sampling: the iterations' sequence drawn from a stream of its own (`hgpo_trl.runtime.seeds`) and always shuffled (an unshuffled stream would
        replay the iterations' order: extra batch b, iteration b's tasks)."""
        extra = copy.copy(self)
        extra.seed, extra.shuffle = integer_seed(self.seed, "extra_tasks"), True
        return extra.iteration_tasks(batch, rank, num_processes)

    def __len__(self) -> int:
        return self.iterations_per_pass * self.tasks_per_iteration * self.repeat
