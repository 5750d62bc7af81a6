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
Optionally:
- `score`: the environment's own graded outcome of the episode (WebShop's purchase score, a TextArena game's
  reward), in the info of the last step;
- `anchor`: what the advantage estimators compare for the state the agent acts in, when the observation shown
  does not name it (a TRL tool's result, `envs/trl_env.py`); default the observation;
- `invalid_move`: True when the environment itself rejected the action as breaking the game's rules (a
  TextArena invalid move): the rollout counts the step as invalid, as an output that did not parse (the
  estimators' `invalid_penalty`, `env/invalid_rate`), while the environment applies its own rules to it.

The environment also owns its prompt template: `render_prompt(task, history, observation, admissible, step)`
where `history` is the memory window, a list of (observation, action) pairs chosen by the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from numbers import Integral
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # imported where tasks are built: environment workers never load it (4 s)
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
TaskFactory = Callable[..., "datasets.Dataset"]

SEED_SPLITS = {"train": 0, "valid": 1_000_000, "test": 2_000_000}
"""First seed of each split of the seeded environments (TextArena, Gymnasium): disjoint ranges of a million."""


class MissingExtraError(ImportError, ValueError):
    """An optional package is not installed; the message names the extra that installs it."""


class EnvironmentFaults(RuntimeError):
    """The environment kept failing (more than half the episodes of a rollout, for as long as the fault limit
    allows): the run stops, and the message says where it stopped and what to change."""


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def split_seeds(split: str, num_tasks: int = 16, seeds: Sequence[int] | None = None) -> list[int]:
    """The reset seeds of `split`: `seeds` as given, else `num_tasks` consecutive seeds from `SEED_SPLITS[split]`
    (train 0, 1, ...; valid 1,000,000, ...; test 2,000,000, ...), so the splits never share a start."""
    if split not in SEED_SPLITS:
        raise ValueError(f"split must be one of {tuple(SEED_SPLITS)}, got {split!r}")
    if seeds is not None:
        if isinstance(seeds, str) or not all(_is_int(s) and s >= 0 for s in seeds) or not seeds:
            raise ValueError(f"seeds must be a non-empty list of integers >= 0, got {seeds!r}")
        return [int(s) for s in seeds]
    if not _is_int(num_tasks) or num_tasks < 1:
        raise ValueError(f"num_tasks must be a positive integer, got {num_tasks!r}")
    if num_tasks > 1_000_000:
        raise ValueError(f"num_tasks must be at most 1,000,000 (the size of a split's seed range), got {num_tasks}")
    return list(range(SEED_SPLITS[split], SEED_SPLITS[split] + num_tasks))


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


def rules_prompt(rules: str, history: Sequence[tuple[str, str]], observation: str, admissible: Sequence[str],
                 step: int, answer_format: str = "Answer with one move, in the format the rules give.") -> str:
    """A `render_prompt` layout for games that explain themselves (TextArena, Gymnasium adapters): the game's
    rules first, then the history in `compact_prompt`'s marks (`>` what the game said, `<` what the agent did),
    the current observation, and the admissible actions, or `answer_format` when the game lists none."""
    lines = [rules.strip(), "", f"Step {step}."]
    if history:
        lines.append("History:")
        for past_observation, past_action in history:
            lines += [f"> {past_observation}", f"< {past_action}"]
    lines += ["Now:", observation]
    lines.append(f"Actions: {' | '.join(admissible)}" if admissible else answer_format)
    lines.append("Answer:")
    return "\n".join(lines)
