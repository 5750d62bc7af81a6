"""Environments by name: `make_env(name, **kwargs)` builds one, `make_tasks(name, split, **kwargs)` lists its
tasks as a `datasets.Dataset` (one row per task: what `reset(task)` needs)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hgpo_trl.envs.base import EnvFactory, TaskFactory, TextEnv

if TYPE_CHECKING:  # imported where tasks are built: environment workers never load it (4 s)
    import datasets


@dataclass(frozen=True)
class EnvSpec:
    factory: EnvFactory
    tasks: TaskFactory | None = None
    fast: bool = False  # steps in microseconds: stays in the training process, no worker pool
    prompt_has_format: bool = False  # its prompts already say how to answer (<think>/<action>)
    invalid_tail_chars: int | None = None  # an output with no action block becomes its last N characters (None: the rollout's default, as released)


_REGISTRY: dict[str, EnvSpec] = {}


def register_env(name: str, factory: EnvFactory, tasks: TaskFactory | None = None, *, fast: bool = False,
                 prompt_has_format: bool = False, invalid_tail_chars: int | None = None, overwrite: bool = False) -> None:
    """Register `factory(**kwargs) -> TextEnv` (and optionally `tasks(split, **kwargs) -> Dataset`) as `name`.
    `fast=True` marks an environment cheap enough to step in the training process (no worker pool);
    `prompt_has_format=True` one whose template already tells the model how to answer (the trainer then adds
    no format instruction of its own); `invalid_tail_chars`: how many of an invalid output's last characters
    the memory shows (and, under `invalid_action="execute"`, the environment receives)."""
    if not callable(factory):
        raise ValueError(f"environment {name!r}: factory must be callable, got {type(factory).__name__}")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"environment {name!r} is already registered (pass overwrite=True to replace it)")
    if invalid_tail_chars is not None and (not isinstance(invalid_tail_chars, int) or invalid_tail_chars < 0):
        raise ValueError(f"environment {name!r}: invalid_tail_chars must be an integer >= 0 (0: show nothing), "
                         f"got {invalid_tail_chars!r}")
    _REGISTRY[name] = EnvSpec(factory, tasks, fast, prompt_has_format, invalid_tail_chars)


def registered_envs() -> list[str]:
    return sorted(_REGISTRY)


def _spec(name: str) -> EnvSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown environment {name!r}; registered: {registered_envs()}") from None


def is_fast_env(name: str) -> bool:
    return _spec(name).fast


def prompt_has_format(name: str) -> bool:
    return _REGISTRY[name].prompt_has_format if name in _REGISTRY else False


def invalid_tail_chars(name: str) -> int | None:
    return _REGISTRY[name].invalid_tail_chars if name in _REGISTRY else None


def make_env(name: str, **kwargs) -> TextEnv:
    """A new environment `name`, built with `kwargs` (its own options, e.g. `max_steps`)."""
    spec = _spec(name)
    try:
        return spec.factory(**kwargs)
    except TypeError as err:
        raise ValueError(f"environment {name!r} does not accept these options {sorted(kwargs)}: {err}") from None


def make_tasks(name: str, split: str = "train", **kwargs) -> datasets.Dataset:
    """The tasks of environment `name` for `split`, one row per task."""
    spec = _spec(name)
    if spec.tasks is None:
        raise ValueError(f"environment {name!r} has no task list; pass a datasets.Dataset of task rows instead")
    try:  # a signature that cannot be read (a builtin) is not checked: the call says what it refuses
        signature = inspect.signature(spec.tasks)
    except (TypeError, ValueError):
        return spec.tasks(split, **kwargs)
    try:  # the options checked before the call: a TypeError from inside the task list is its own
        signature.bind(split, **kwargs)
    except TypeError as err:
        # '{num_rooms:6}' in YAML is the key 'num_rooms:6' with no value: the flow style needs a space after ':'.
        hint = "".join(f"; write '{{{key.replace(':', ': ', 1)}}}'" for key in kwargs if ":" in key)
        raise ValueError(f"environment {name!r} does not accept these task options {sorted(kwargs)}: {err}{hint}") from None
    return spec.tasks(split, **kwargs)
