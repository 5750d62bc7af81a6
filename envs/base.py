"""The text-environment protocol the trainer drives, in Gymnasium's habits (`reset` / `step`, an `info` dict).

An environment plays one task at a time. `reset(task)` starts the task described by one row of the task
dataset and returns `(observation, info)`; `step(action)` returns
`(observation, reward, terminated, truncated, info)`. `action=None` means the model's output was not a valid
action: the environment must not act on it (the state stays as it is) and returns its no-op observation.

Every `info` carries:
- `admissible_actions`: list[str], the actions the environment accepts now (shown in the prompt);
- `state_key`: a hashable key of the current state (for diagnostics; the anchor observation by default);
- `won`: bool, True once the task is solved;
- `task`: the task sentence shown in every prompt (in the `reset` info at least).

The environment also owns its prompt template: `render_prompt(task, history, observation, admissible, step)`
where `history` is the memory window, a list of (observation, action) pairs chosen by the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import datasets

Info = dict[str, Any]


@runtime_checkable
class TextEnv(Protocol):
    """What the trainer needs of an environment."""

    max_steps: int

    def reset(self, task: Mapping[str, Any]) -> tuple[str, Info]: ...

    def step(self, action: str | None) -> tuple[str, float, bool, bool, Info]: ...

    def render_prompt(self, task: str, history: Sequence[tuple[str, str]], observation: str,
                      admissible: Sequence[str], step: int) -> str: ...

    def close(self) -> None: ...


EnvFactory = Callable[..., TextEnv]
TaskFactory = Callable[..., datasets.Dataset]


def compact_prompt(task: str, history: Sequence[tuple[str, str]], observation: str, admissible: Sequence[str],
                   step: int) -> str:
    """A `render_prompt` layout for small models: few, regular words; `>` marks what the game said, `<` what the
    agent did. The task comes last, next to the answer, a fixed few tokens back from where the action starts."""
    lines = [f"Step {step}."]
    if history:
        lines.append("History:")
        for past_observation, past_action in history:
            lines += [f"> {past_observation}", f"< {past_action}"]
    lines += [f"Now: {observation}", f"Actions: {' | '.join(admissible)}", f"Task: {task}", "Answer:"]
    return "\n".join(lines)
