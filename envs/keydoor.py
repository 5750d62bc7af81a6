"""Keydoor: a tiny deterministic text game whose observations are aliased.

The agent takes one of two keys (each lies in a room), walks to the hall and on to the vault, and opens a
door. The hall and vault observations read the same whichever key it took, yet the right door is
the colour of the key held, which shows only in the history (the room observation two steps back). So one
observation text is worth `gold_reward` after one path and `coin_reward` after the other: the case that
HGPO's history-deep groups separate and GiGPO's same-observation groups mix.

The dynamics are the pure function `transition(task, position, key, action)`, so exact action values can be
computed by dynamic programming over `(position, key)`; `KeyDoorEnv` only keeps the state and the step count.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import TYPE_CHECKING, Any, NamedTuple

from hgpo_trl.envs.base import Info, compact_prompt

if TYPE_CHECKING:  # imported where tasks are built: environment workers never load it (4 s)
    import datasets

ROOMS = ("library", "kitchen", "cellar", "attic", "garden", "study")
COLORS = ("red", "blue", "green", "yellow", "white", "black")
ENTRANCE, HALL, VAULT, END = "entrance", "hall", "vault", "end"
NOTHING = "Nothing happens."
SPLITS = ("train", "valid", "test")
EVAL_FRACTION = 0.15
"""Share of a pool's tasks in each of the valid and test splits (at least one task each)."""
TASK_FIELDS = ("room1", "room2", "color1", "color2", "gold")


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class KeyDoorTask:
    """One task: `room1` holds the `color1` key, `room2` the `color2` key; the `gold` door hides the gold."""

    room1: str
    room2: str
    color1: str
    color2: str
    gold: str

    def __post_init__(self) -> None:
        for name, pool in zip(TASK_FIELDS[:4], (ROOMS, ROOMS, COLORS, COLORS), strict=True):
            if getattr(self, name) not in pool:
                raise ValueError(f"keydoor task field {name!r} must be one of {pool}, got {getattr(self, name)!r}")
        if self.room1 == self.room2:
            raise ValueError(f"keydoor task fields 'room1' and 'room2' must differ, both are {self.room1!r}")
        if self.color1 == self.color2:
            raise ValueError(f"keydoor task fields 'color1' and 'color2' must differ, both are {self.color1!r}")
        if self.gold not in (self.color1, self.color2):
            raise ValueError(f"keydoor task field 'gold' must be color1 or color2 "
                             f"({self.color1!r} or {self.color2!r}), got {self.gold!r}")

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> KeyDoorTask:
        """The task of a dataset row; other columns are ignored, a `task_id` column must match the fields."""
        if not isinstance(row, Mapping):
            raise ValueError(f"keydoor task must be a mapping (a dataset row), got {type(row).__name__}")
        for name in TASK_FIELDS:
            if name not in row:
                raise ValueError(f"keydoor task row lacks field {name!r}")
            if not isinstance(row[name], str):
                raise ValueError(f"keydoor task field {name!r} must be a string, got {row[name]!r}")
        task = cls(*(row[name] for name in TASK_FIELDS))
        if "task_id" in row and not (_is_int(row["task_id"]) and row["task_id"] == task.task_id):
            raise ValueError(f"keydoor task field 'task_id' is {row['task_id']!r}, "
                             f"but the other fields make task {task.task_id}")
        return task

    @property
    def task_id(self) -> int:
        """Index in the enumeration of all tasks of the full pools: the same task has the same id in any pool."""
        return _TASK_IDS[self]

    @property
    def sentence(self) -> str:
        return f"Find the gold. It is behind the {self.gold} door."


_ALL_TASKS = tuple(KeyDoorTask(r1, r2, c1, c2, gold)
                   for r1, r2 in itertools.permutations(ROOMS, 2)
                   for c1, c2 in itertools.permutations(COLORS, 2)
                   for gold in (c1, c2))
_TASK_IDS = {task: i for i, task in enumerate(_ALL_TASKS)}


class Transition(NamedTuple):
    position: str
    key: str | None
    observation: str
    reward: float
    terminated: bool
    won: bool


def initial_observation(task: KeyDoorTask) -> str:
    return (f"You are in the entrance. The {task.room1} has a {task.color1} key. "
            f"The {task.room2} has a {task.color2} key.")


def admissible_actions(task: KeyDoorTask, position: str) -> tuple[str, ...]:
    """The actions accepted at `position` (none at the end); the key held never changes them."""
    if position == ENTRANCE:
        return (f"take {task.color1} key", f"take {task.color2} key")
    if position in (task.room1, task.room2):
        return ("go to hall",)
    if position == HALL:
        return ("go to vault",)
    if position == VAULT:
        return (f"open {task.color1} door", f"open {task.color2} door")
    if position == END:
        return ()
    raise ValueError(f"unknown keydoor position {position!r}")


def transition(task: KeyDoorTask, position: str, key: str | None, action: str | None, *,
               gold_reward: float = 10.0, coin_reward: float = 3.0, key_reward: float = 0.0) -> Transition:
    """One step from `(position, key)`. An action not admissible there (compared stripped and lower-cased) or
    None leaves the state as it is with the observation "Nothing happens."; taking the key of the gold's colour
    earns `key_reward`."""
    if position == END:
        raise ValueError("the keydoor episode is over: there is no transition from the end position")
    if action is not None and not isinstance(action, str):
        raise ValueError(f"action must be a string or None, got {type(action).__name__}")
    action = action.strip().lower() if action is not None else None
    if action not in admissible_actions(task, position):
        return Transition(position, key, NOTHING, 0.0, False, False)
    if position == ENTRANCE:
        color = action.split()[1]
        room = task.room1 if color == task.color1 else task.room2
        reward = key_reward if color == task.gold else 0.0
        return Transition(room, color, f"You are in the {room}. You take the {color} key.", reward, False, False)
    if position == HALL:
        return Transition(VAULT, key, f"You are at the vault. There is a {task.color1} door "
                                      f"and a {task.color2} door.", 0.0, False, False)
    if position == VAULT:
        door = action.split()[1]
        if door != key:
            return Transition(END, key, f"The {door} door is locked.", 0.0, True, False)
        if door == task.gold:
            return Transition(END, key, f"You open the {door} door and find the gold!", gold_reward, True, True)
        return Transition(END, key, f"You open the {door} door and find a coin.", coin_reward, True, False)
    return Transition(HALL, key, "You are in the hall.", 0.0, False, False)


class KeyDoorEnv:
    """The keydoor game as a `TextEnv`. The pools of rooms and colours come with the task rows."""

    def __init__(self, max_steps: int = 8, gold_reward: float = 10.0, coin_reward: float = 3.0,
                 key_reward: float = 0.0):
        if not _is_int(max_steps) or max_steps < 1:
            raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
        for name, value in (("gold_reward", gold_reward), ("coin_reward", coin_reward), ("key_reward", key_reward)):
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        self.max_steps = int(max_steps)
        self.gold_reward = float(gold_reward)
        self.coin_reward = float(coin_reward)
        self.key_reward = float(key_reward)
        self._task: KeyDoorTask | None = None

    def reset(self, task: Mapping[str, Any]) -> tuple[str, Info]:
        self._task = KeyDoorTask.from_row(task)
        self._task_id = self._task.task_id
        self._position, self._key = ENTRANCE, None
        self._steps = 0
        self._done = self._won = False
        observation = initial_observation(self._task)
        return observation, self._info(observation)

    def step(self, action: str | None) -> tuple[str, float, bool, bool, Info]:
        if self._task is None:
            raise RuntimeError("KeyDoorEnv.step() called before reset(task)")
        if self._done:
            raise RuntimeError("KeyDoorEnv.step() called after the episode ended; call reset(task) first")
        t = transition(self._task, self._position, self._key, action,
                       gold_reward=self.gold_reward, coin_reward=self.coin_reward, key_reward=self.key_reward)
        self._position, self._key, self._won = t.position, t.key, t.won
        self._steps += 1
        truncated = not t.terminated and self._steps >= self.max_steps
        self._done = t.terminated or truncated
        return t.observation, t.reward, t.terminated, truncated, self._info(t.observation)

    @property
    def state(self) -> tuple[int, str, str | None]:
        """`(task_id, position, key held)`: with the step count, all that the future depends on."""
        if self._task is None:
            raise RuntimeError("KeyDoorEnv.state read before reset(task)")
        return self._task_id, self._position, self._key

    def _info(self, observation: str) -> Info:
        return {"admissible_actions": list(admissible_actions(self._task, self._position)),
                "state_key": observation, "won": self._won, "task": self._task.sentence, "step": self._steps}

    def render_prompt(self, task: str, history: Sequence[tuple[str, str]], observation: str,
                      admissible: Sequence[str], step: int) -> str:
        return compact_prompt(task, history, observation, admissible, step)

    def close(self) -> None:
        """Nothing to release."""


def keydoor_tasks(split: str = "train", num_tasks: int | None = None, num_rooms: int = 2, num_colors: int = 2,
                  seed: int = 0) -> datasets.Dataset:
    """The tasks of `split` over the first `num_rooms` rooms and `num_colors` colours, one row per task.

    All tasks of the pools (ordered room pair, ordered colour pair, gold colour: 8 for the default 2x2 pools)
    are shuffled with `seed`; valid and test take `EVAL_FRACTION` of them each (at least one), train the rest.
    Every pool has at least 8 tasks, so the splits are always disjoint. `num_tasks` keeps the first
    `num_tasks` rows of the split, cycling through it again when it asks for more; repeats keep their
    `task_id`, which is the task's id in the full pools.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    for name, value, pool in (("num_rooms", num_rooms, ROOMS), ("num_colors", num_colors, COLORS)):
        if not _is_int(value) or not 2 <= value <= len(pool):
            raise ValueError(f"{name} must be an integer in [2, {len(pool)}], got {value!r}")
    if num_tasks is not None and (not _is_int(num_tasks) or num_tasks < 1):
        raise ValueError(f"num_tasks must be a positive integer or None, got {num_tasks!r}")
    rooms, colors = set(ROOMS[:num_rooms]), set(COLORS[:num_colors])
    ids = [i for i, t in enumerate(_ALL_TASKS) if {t.room1, t.room2} <= rooms and {t.color1, t.color2} <= colors]
    random.Random(seed).shuffle(ids)
    n_eval = max(1, round(len(ids) * EVAL_FRACTION))
    ids = {"valid": ids[:n_eval], "test": ids[n_eval:2 * n_eval], "train": ids[2 * n_eval:]}[split]
    if num_tasks is not None:
        ids = [ids[i % len(ids)] for i in range(num_tasks)]
    tasks = [_ALL_TASKS[i] for i in ids]
    import datasets

    return datasets.Dataset.from_dict({"task_id": ids, **{name: [getattr(t, name) for t in tasks]
                                                           for name in TASK_FIELDS}})
