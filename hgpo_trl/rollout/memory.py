"""Memory-window prompting: step t's prompt = the task + the last H (observation, action) pairs + the current
observation (+ the admissible actions). The environment owns the template; this module chooses the window.

Only the parsed action enters memory, never the model's reasoning; an invalid output enters as a short tail of
its raw text, so the model sees what it did.

A prompt over a token budget (`fit_prompt`) drops its oldest pairs first, then shortens the current observation
in the middle behind a visible marker; the task, the admissible actions and the format instruction are never cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# (task, history, observation, admissible, step) -> prompt text: an environment's `render_prompt`.
Renderer = Callable[[str, Sequence[tuple[str, str]], str, Sequence[str], int], str]


@dataclass
class Memory:
    """One episode's (observation, action) pairs, oldest first."""

    pairs: list[tuple[str, str]] = field(default_factory=list)

    def add(self, observation: str, action_text: str) -> None:
        self.pairs.append((observation, action_text))

    def window(self, history_length: int) -> list[tuple[str, str]]:
        """The last `history_length` pairs (none when it is 0)."""
        return self.pairs[-history_length:] if history_length > 0 else []


def build_prompt(render: Renderer, task: str, memory: Memory, observation: str, admissible: Sequence[str],
                 step: int, history_length: int, format_instruction: str = "") -> tuple[str, int]:
    """The prompt text of one step, and how many earlier (observation, action) pairs it shows."""
    window = memory.window(history_length)
    return _render(render, task, window, observation, admissible, step, format_instruction), len(window)


def _render(render: Renderer, task: str, window: Sequence[tuple[str, str]], observation: str,
            admissible: Sequence[str], step: int, format_instruction: str) -> str:
    text = render(task, window, observation, admissible, step)
    return f"{text}\n{format_instruction}" if format_instruction else text


def cut_middle(text: str, keep: int) -> str:
    """`text` with all but `keep` characters cut from its middle, behind a marker saying how many."""
    if keep >= len(text):
        return text
    head = keep - keep // 2
    return f"{text[:head]} [... {len(text) - keep} characters cut ...] {text[len(text) - keep // 2:]}"


@dataclass(frozen=True)
class FittedPrompt:
    text: str
    shown_history: int  # (observation, action) pairs the prompt shows
    history_dropped: int  # pairs of the memory window dropped to fit the budget (the oldest)
    observation_cut: int  # characters cut from the middle of the current observation
    tokens: int  # the prompt's token count
    over_budget: bool  # even the shortest prompt is over: what may not be cut is longer than the budget


def fit_prompt(render: Renderer, task: str, memory: Memory, observation: str, admissible: Sequence[str],
               step: int, history_length: int, format_instruction: str, count_tokens: Callable[[str], int],
               max_tokens: int) -> FittedPrompt:
    """The prompt of `build_prompt`, fitted to `max_tokens` (as counted by `count_tokens`): the oldest pairs
    are dropped first, then the observation is shortened in the middle, keeping the most characters that fit.
    The task, admissible actions and format instruction are never cut: when they alone are over the budget,
    the shortest prompt comes back with `over_budget` set, for the caller to count (never an exception)."""
    window = memory.window(history_length)
    for dropped in range(len(window) + 1):
        text = _render(render, task, window[dropped:], observation, admissible, step, format_instruction)
        tokens = count_tokens(text)
        if tokens <= max_tokens:
            return FittedPrompt(text, len(window) - dropped, dropped, 0, tokens, False)
    # No history left: binary-search the observation characters kept around the marker.
    attempts = [(tokens, len(observation), text)]  # the whole observation, over the budget
    low, high = 0, len(observation) - 1
    while low <= high:
        keep = (low + high) // 2
        text = _render(render, task, [], cut_middle(observation, keep), admissible, step, format_instruction)
        tokens = count_tokens(text)
        attempts.append((tokens, keep, text))
        low, high = (keep + 1, high) if tokens <= max_tokens else (low, keep - 1)
    fitting = [a for a in attempts if a[0] <= max_tokens]
    tokens, keep, text = max(fitting, key=lambda a: a[1]) if fitting else min(attempts, key=lambda a: a[0])
    return FittedPrompt(text, 0, len(window), len(observation) - keep, tokens, not fitting)
