"""Dynamic sampling (DAPO's filter, verl-agent's `algorithm.filter_groups`): a task group whose G episodes all got
the same episode reward has an episode term of zero, so it is dropped, and more rollout batches are played until
the kept groups fill an iteration's tasks (over all processes) or `max_rollout_batches` batches are spent. The
last batch is kept unfiltered, and the kept total may overshoot the target, as released.

The release replays its batch of prompts each try (ALFWorld's and WebShop's environments draw new games at every
reset there). Ours plays fresh tasks by default (`dynamic_sampling_tasks`): a stream of its own, seeded apart from
the iterations' and counted in the checkpoint, so a resumed run plays what the run it continues would have;
'replay' plays the iteration's tasks again. Every process plays the same number of batches: whether to go on is
decided from counts summed over the processes, so none waits in a collective the others skip."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hgpo_trl.rollout.generation import training_rollout_seed
from hgpo_trl.rollout.lockstep import Rollout
from hgpo_trl.runtime.collective import elementwise_process_sum
from hgpo_trl.training.generation_ahead import take_rollout

TASK_CHOICES = ("fresh", "replay")


def equal_reward_groups(rollout: Rollout) -> set[int]:
    """The groups whose episodes all got the same total environment reward (before the invalid-action penalty)."""
    rewards: dict[int, set[float]] = {}
    for episode in rollout.episodes:
        rewards.setdefault(episode.group, set()).add(episode.total_reward)
    return {group for group, values in rewards.items() if len(values) == 1}


def without_groups(rollout: Rollout, dropped: set[int]) -> Rollout:
    """`rollout` without the steps and episodes of the `dropped` groups."""
    return dataclasses.replace(rollout, steps=[s for s in rollout.steps if s.group not in dropped],
                               episodes=[e for e in rollout.episodes if e.group not in dropped])


def merged(rollouts: Sequence[Rollout], tasks: Sequence[Sequence[Mapping[str, Any]]]) -> tuple[Rollout, list]:
    """One rollout of several batches' (kept) groups, renumbered so that group g plays the g-th of the merged task
    list (groups and trajectories stay distinct: a task replayed is a new group, as released), with the batches'
    times and turns summed."""
    steps, episodes, rows = [], [], []
    for rollout, batch_tasks in zip(rollouts, tasks, strict=True):
        groups = sorted({e.group for e in rollout.episodes})
        new_group = {g: len(rows) + i for i, g in enumerate(groups)}
        trajs = sorted({e.traj for e in rollout.episodes})
        new_traj = {t: len(episodes) + i for i, t in enumerate(trajs)}
        steps += [dataclasses.replace(s, group=new_group[s.group], traj=new_traj[s.traj]) for s in rollout.steps]
        episodes += sorted((dataclasses.replace(e, group=new_group[e.group], traj=new_traj[e.traj])
                            for e in rollout.episodes), key=lambda e: e.traj)
        rows += [batch_tasks[g] for g in groups]
    total = Rollout(steps, episodes, generation_seconds=sum(r.generation_seconds for r in rollouts),
                    env_seconds=sum(r.env_seconds for r in rollouts), seconds=sum(r.seconds for r in rollouts),
                    turns=sum(r.turns for r in rollouts))
    return total, rows


def play_filtered(play: Callable[[list], Rollout], first_tasks: list, extra_tasks: Callable[[], list],
                  target_groups: int, max_batches: int, accelerator) -> tuple[Rollout, list, list, dict[str, float]]:
    """Play `first_tasks`, then batches of `extra_tasks()` while the kept groups of every process together are
    fewer than `target_groups`, at most `max_batches` batches, dropping the equal-reward groups of every batch but
    the last; (the kept groups as one rollout, their tasks in group order, every episode played, the dynamic/*
    metrics)."""
    kept: list[Rollout] = []
    kept_tasks: list[list] = []
    played: list[Rollout] = []
    kept_total = dropped_total = 0.0
    for batch in range(max_batches):
        tasks = first_tasks if batch == 0 else extra_tasks()
        rollout = play(tasks)
        played.append(rollout)
        dropped = set() if batch == max_batches - 1 else equal_reward_groups(rollout)
        kept.append(without_groups(rollout, dropped))
        kept_tasks.append(tasks)
        kept_here, dropped_here = elementwise_process_sum(accelerator, [len(tasks) - len(dropped), len(dropped)])
        kept_total, dropped_total = kept_total + kept_here, dropped_total + dropped_here
        if kept_total >= target_groups:
            break
    rollout, tasks = merged(kept, kept_tasks)
    episodes = [e for r in played for e in r.episodes]
    won, count = elementwise_process_sum(accelerator, [sum(e.won for e in episodes), len(episodes)])
    return rollout, tasks, episodes, {"dynamic/rollout_batches": float(len(played)), "dynamic/groups_kept": kept_total,
                            "dynamic/groups_dropped": dropped_total, "dynamic/played_success_rate": won / max(count, 1),
                            "time/extra_rollouts": sum(r.seconds for r in played[1:])}


def play_training_batches(trainer, tasks: list) -> tuple[Rollout, list]:
    """An iteration's training rollout of `tasks`: one batch, or under `dynamic_sampling` the kept groups of as
    many as `play_filtered` plays (their metrics logged), with the kept groups' tasks in group order. A broken
    environment stops the run: the fault streak counts iterations, over every episode the iteration played."""
    args, accelerator = trainer.args, trainer.accelerator
    batches = itertools.count()

    def play(batch_tasks: list) -> Rollout:  # (its bar, or its lines, named for the iteration it plays)
        if args.async_generation:  # (played ahead, in a thread)
            return take_rollout(trainer)
        return trainer._play(batch_tasks, trainer.num_generations, trainer.temperature,
                             f"iteration {trainer._iteration + 1} rollout", rollout_seed=training_rollout_seed(
                                 args.seed, accelerator.process_index, trainer._iteration, next(batches)))

    if not args.dynamic_sampling:
        rollout = play(tasks)
        trainer._faults.stop_if_broken(trainer, rollout)
        return rollout, tasks

    def extra_tasks() -> list:
        batch = trainer._iterations.extra_batches
        trainer._iterations.extra_batches += 1
        if args.dynamic_sampling_tasks == "replay":
            return tasks
        indices = trainer._task_sampler.extra_tasks(batch, accelerator.process_index, accelerator.num_processes)
        return [trainer.train_dataset[i] for i in indices]

    start = trainer._iterations.extra_batches
    rollout, kept_tasks, episodes, metrics = play_filtered(
        play, tasks, extra_tasks, args.tasks_per_device * accelerator.num_processes, args.max_rollout_batches,
        accelerator)
    trainer._faults.stop_if_broken(trainer, dataclasses.replace(rollout, episodes=episodes), extra_batches=start)
    trainer._log_gathered("train", metrics)
    return rollout, kept_tasks
