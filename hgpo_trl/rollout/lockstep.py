"""The lock-step multi-turn rollout: every task played G times, all live environments stepped together.

Each turn builds the memory-window prompt of every live environment, asks the policy for all of them in ONE
call, parses the actions and steps the environments. Every step becomes a `StepRecord`; the rollout knows
nothing about advantages or training. The policy is any callable from prompt texts to `Completion`s, so a
scripted policy (tests, baselines) plays exactly like a model. What an episode's step is (its prompt, its action,
its record) lives in `EpisodeStates`, which the continuous rollout (`hgpo_trl.rollout.continuous`) drives too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import numpy as np

from hgpo_trl.advantages import StepBatch
from hgpo_trl.envs.base import Info
from hgpo_trl.envs.pool import EnvBatch, StepResult
from hgpo_trl.rollout.actions import (
    ACTION_MODES,
    FORMAT_INSTRUCTIONS,
    INVALID_TAIL_CHARS,
    invalid_tail,
    match_admissible,
    parse_action,
    project_released,
)
from hgpo_trl.rollout.memory import FittedPrompt, Memory, build_prompt, fit_prompt

INVALID_ACTIONS = ("noop", "end_episode", "execute")


@dataclass
class Completion:
    """One generated answer: its text and, from a model, the token ids it came from."""

    text: str
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None  # sampling log-probabilities, when the backend gives them
    version: int | None = None  # the optimizer step of the weights the engine held when asked (async_generation)


class Policy(Protocol):
    def __call__(self, prompts: list[str]) -> list[Completion]: ...


class ScriptedPolicy(Protocol):
    """A player that reads the live environments' `info` dicts (admissible actions, an expert's next action)
    instead of the prompts: the reference rows of an evaluation (`run_rollout(..., scripted=True)`)."""

    def __call__(self, prompts: list[str], infos: list[Info]) -> list[Completion]: ...


@dataclass
class StepRecord:
    """One environment step: one training sample."""

    group: int  # task index in this rollout (the task group)
    traj: int  # trajectory index in this rollout
    step: int  # t
    observation: str  # the anchor observation the agent acted on
    prompt: str
    completion: Completion
    action: str | None  # the action sent to the environment; None: nothing was sent (an invalid output)
    reward: float
    shown_history: int  # (observation, action) pairs the prompt showed
    history_cut: bool = False  # the prompt dropped history to fit the context: HGPO caps the step's levels
    observation_cut: int = 0  # characters cut from the middle of the observation to fit the context
    over_budget: bool = False  # the prompt is over max_prompt_tokens even with nothing left to cut
    rejected: bool = False  # the environment refused the action as an invalid move (its info["invalid_move"])
    malformed: bool = False  # invalid_action="execute": the output broke the format, its action was sent anyway
    anchor: str | None = None  # what the estimators compare for the state, when not the observation (info["anchor"])
    forced: bool = False  # the environment listed one admissible action and the step took it: nothing was chosen

    @property
    def valid(self) -> bool:
        return self.action is not None and not self.rejected and not self.malformed


@dataclass
class Episode:
    group: int
    traj: int
    steps: int = 0
    total_reward: float = 0.0
    invalid: int = 0
    won: bool = False
    terminated: bool = False
    truncated: bool = False
    fault: str | None = None  # the environment failed: the episode was aborted (counted as not won)
    score: float | None = None  # the environment's own graded outcome, when it reports one (WebShop's score)


@dataclass
class RolloutSettings:
    history_length: int = 2
    max_steps: int = 50
    action_mode: str = "tags"
    require_think: bool = True
    reject_cjk: bool = True
    invalid_action: str = "noop"
    invalid_tail_chars: int = INVALID_TAIL_CHARS  # an invalid output's last characters the memory shows
    admissible_only: bool = False  # an action outside the admissible list counts as invalid
    format_instruction: str | None = None  # None: the action mode's default instruction
    max_prompt_tokens: int | None = None  # prompt budget (memory.fit_prompt); needs run_rollout's count_tokens
    # Applied to environment text and the memory before a prompt is rendered (generation.control_text_guard).
    escape_text: Callable[[str], str] | None = None

    def __post_init__(self) -> None:
        if self.action_mode not in ACTION_MODES:
            raise ValueError(f"action_mode must be one of {ACTION_MODES}, got {self.action_mode!r}")
        if self.format_instruction is None:
            self.format_instruction = FORMAT_INSTRUCTIONS[self.action_mode]
        if self.invalid_action not in INVALID_ACTIONS:
            raise ValueError(f"invalid_action must be one of {INVALID_ACTIONS}, got {self.invalid_action!r}")
        if self.invalid_action == "execute" and self.action_mode != "tags":
            raise ValueError("invalid_action 'execute' reads the output as the released projection does, from "
                             f"<action> tags: it needs action_mode 'tags', got {self.action_mode!r}")
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.history_length < 0:
            raise ValueError(f"history_length must be >= 0, got {self.history_length}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be None or >= 1, got {self.max_prompt_tokens}")


@dataclass
class Rollout:
    steps: list[StepRecord]
    episodes: list[Episode]
    generation_seconds: float
    env_seconds: float
    seconds: float
    turns: int

    def step_batch(self) -> StepBatch:
        """The steps as the advantage estimators consume them (observations as text)."""
        s = self.steps
        return StepBatch(
            group=np.array([r.group for r in s], dtype=np.int64),
            traj=np.array([r.traj for r in s], dtype=np.int64),
            step=np.array([r.step for r in s], dtype=np.int64),
            obs=[r.observation if r.anchor is None else r.anchor for r in s],
            reward=np.array([r.reward for r in s], dtype=np.float64),
            valid=np.array([r.valid for r in s], dtype=bool),
            action=[r.action for r in s],
            window=np.array([r.shown_history if r.history_cut else r.step for r in s], dtype=np.int64),
        )

    def prompt_stats(self) -> dict[str, float]:
        """Shares of the steps whose prompt was fitted to max_prompt_tokens (the trainer logs them)."""
        count = max(len(self.steps), 1)
        return {"prompt/history_cut": sum(r.history_cut for r in self.steps) / count,
                "prompt/observation_cut": sum(r.observation_cut > 0 for r in self.steps) / count,
                "prompt/over_budget": sum(r.over_budget for r in self.steps) / count}


def read_action(text: str, settings: RolloutSettings, admissible: Sequence[str]) -> tuple[str | None, bool]:
    """The action an output sends to the environment (None: nothing) and whether it is sent malformed (penalised
    but executed: `invalid_action="execute"`, the released projection). With `admissible_only`, an action the
    environment does not list is invalid: not sent, or under "execute" sent and penalised."""
    if settings.invalid_action == "execute":
        action, well_formed = project_released(text, settings.invalid_tail_chars,
                                               require_think=settings.require_think, reject_cjk=settings.reject_cjk)
        listed = match_admissible(action, admissible, settings.action_mode) if settings.admissible_only else action
        return (action, True) if listed is None else (listed, not well_formed)
    action = parse_action(text, settings.action_mode, require_think=settings.require_think,
                          reject_cjk=settings.reject_cjk)
    return (match_admissible(action, admissible, settings.action_mode) if settings.admissible_only else action), False


class EpisodeStates:
    """The episodes of one rollout as they advance, whichever loop drives them (lock-step here, continuous in
    `hgpo_trl.rollout.continuous`): each one's memory, current observation and info, and the records of its steps.
    Building the environments' resets, each next prompt and each step's record here, once, is what makes both
    loops give the same records. `env_seconds` counts the resets; the loops add their waits on steps."""

    def __init__(self, envs: EnvBatch, tasks: Sequence[Mapping[str, Any]], group_size: int,
                 settings: RolloutSettings, count_tokens: Callable[[str], int] | None = None,
                 on_episode_end: Callable[[Episode], None] | None = None):
        if settings.max_prompt_tokens is not None and count_tokens is None:
            raise ValueError("RolloutSettings.max_prompt_tokens needs count_tokens (the policy's prompt token count)")
        count = len(tasks) * group_size
        if count > len(envs):
            raise ValueError(f"need {count} environments for {len(tasks)} tasks x {group_size} rollouts, "
                             f"got {len(envs)}")
        self.envs, self.settings, self.count_tokens, self.on_episode_end = envs, settings, count_tokens, on_episode_end
        self.start = time.perf_counter()
        self.episodes = [Episode(group=i // group_size, traj=i) for i in range(count)]
        self.memories = [Memory() for _ in range(count)]
        resets = envs.reset([tasks[i // group_size] for i in range(count)])
        self.env_seconds = time.perf_counter() - self.start
        self.observations = [r.observation for r in resets]
        self.infos = [r.info for r in resets]
        self.task_texts = [info.get("task", "") for info in self.infos]
        self.done = [False] * count
        self.records: list[StepRecord] = []
        self.escape = settings.escape_text or (lambda text: text)
        for i, result in enumerate(resets):
            if result.fault is not None:
                self.episodes[i].fault = result.fault
                self._end(i)

    def live(self) -> list[int]:
        """The episodes not ended, in index order."""
        return [i for i, finished in enumerate(self.done) if not finished]

    def prompt(self, i: int) -> FittedPrompt:
        """Episode i's next prompt: its memory window and current observation, fitted to max_prompt_tokens."""
        settings, escape, info = self.settings, self.escape, self.infos[i]
        arguments = (partial(self.envs.render_prompt, i), escape(self.task_texts[i]), self.memories[i],
                     escape(self.observations[i]), [escape(a) for a in info.get("admissible_actions", [])],
                     self.episodes[i].steps, settings.history_length, settings.format_instruction)
        if settings.max_prompt_tokens is None:
            text, pairs = build_prompt(*arguments)
            return FittedPrompt(text, pairs, 0, 0, 0, False)  # no budget: nothing counted, nothing cut
        return fit_prompt(*arguments, self.count_tokens, settings.max_prompt_tokens)

    def action(self, i: int, completion: Completion) -> tuple[str | None, bool]:
        """What episode i's completion sends to its environment (`read_action`)."""
        return read_action(completion.text, self.settings, self.admissible(i))

    def admissible(self, i: int) -> list[str]:
        """Episode i's listed admissible actions as actions are compared: text actions are lower-cased as
        parse_action writes them; a tool call's arguments keep their case."""
        listed = [a.strip() for a in self.infos[i].get("admissible_actions", [])]
        return listed if self.settings.action_mode == "tool" else [a.lower() for a in listed]

    def sends(self, action: str | None) -> bool:
        """Whether a step with `action` goes to the environment (under noop an invalid output does too)."""
        return action is not None or self.settings.invalid_action == "noop"

    def record(self, i: int, fit: FittedPrompt, completion: Completion, action: str | None, malformed: bool,
               result: StepResult | None) -> None:
        """Episode i's step: its record, its memory, its totals, and its end when it ended. `result` is None when
        nothing was sent (an invalid output under end_episode: the episode ends as failed)."""
        episode, observation, info = self.episodes[i], self.observations[i], self.infos[i]
        # The game's own rules refused a well-formed action (a TextArena invalid move): an invalid step too.
        rejected = action is not None and result is not None and bool(result.info.get("invalid_move", False))
        if result is None:
            result = StepResult(observation, 0.0, True, False, info)
        record = StepRecord(group=episode.group, traj=i, step=episode.steps, observation=observation,
                            prompt=fit.text, completion=completion, action=action, reward=float(result.reward),
                            shown_history=fit.shown_history, history_cut=fit.history_dropped > 0,
                            observation_cut=fit.observation_cut, over_budget=fit.over_budget, rejected=rejected,
                            malformed=malformed, anchor=info.get("anchor"))
        # (WebShop lists one placeholder, 'search[<your query>]', and the step writes a query: not forced.)
        record.forced = record.valid and self.admissible(i) == [action]
        self.records.append(record)
        shown = action if action is not None else invalid_tail(completion.text, self.settings.invalid_tail_chars)
        self.memories[i].add(self.escape(observation), self.escape(shown))
        episode.steps += 1
        episode.total_reward += float(result.reward)
        episode.invalid += not record.valid
        episode.won = episode.won or bool(result.info.get("won", False))
        if "score" in result.info:
            episode.score = float(result.info["score"])
        self.observations[i], self.infos[i] = result.observation, result.info
        if result.fault is not None:
            episode.fault = result.fault
            self._end(i)
        elif result.terminated or result.truncated or episode.steps >= self.settings.max_steps:
            episode.terminated = bool(result.terminated)
            episode.truncated = not result.terminated
            self._end(i)

    def _end(self, i: int) -> None:
        self.done[i] = True
        if self.on_episode_end is not None:
            self.on_episode_end(self.episodes[i])

    def rollout(self, generation_seconds: float, turns: int) -> Rollout:
        """The rollout played: the steps of the episodes no fault aborted, in lock-step's order (by step index,
        then trajectory: episode i's step t is lock-step's turn t), whatever order they were played in."""
        faulted = {e.traj for e in self.episodes if e.fault is not None}
        steps = sorted((r for r in self.records if r.traj not in faulted), key=lambda r: (r.step, r.traj))
        return Rollout(steps=steps, episodes=self.episodes, generation_seconds=generation_seconds,
                       env_seconds=self.env_seconds, seconds=time.perf_counter() - self.start, turns=turns)


def run_rollout(envs: EnvBatch, tasks: Sequence[Mapping[str, Any]], group_size: int,
                policy: Policy | ScriptedPolicy, settings: RolloutSettings, *,
                keep_going: Callable[[int], bool] | None = None, on_turn: Callable[[int, int], None] | None = None,
                on_episode_end: Callable[[Episode], None] | None = None,
                count_tokens: Callable[[str], int] | None = None, scripted: bool = False) -> Rollout:
    """Play every task `group_size` times (environment g * group_size + j plays tasks[g]) until all episodes end.

    `envs` holds at least len(tasks) * group_size environments (in this process or in worker processes);
    each turn steps all live ones in one call. `keep_going(live)` decides whether another turn runs given the
    local number of live episodes; under a collective generation backend it must agree across processes (the
    trainer all-reduces it), and a turn with no local live episode still calls the policy with an empty list.
    An environment fault (an exception, a hang, a dead worker) aborts its episode: it is marked `fault` and
    its steps leave the training batch. `on_turn(turn, live)` reports progress, `on_episode_end(episode)` each
    episode as it ends. With `settings.max_prompt_tokens`, every prompt is fitted to it (`memory.fit_prompt`) as
    `count_tokens` counts. `scripted=True` calls `policy(prompts, infos)` (a `ScriptedPolicy`).
    """
    play = EpisodeStates(envs, tasks, group_size, settings, count_tokens, on_episode_end)
    keep_going = keep_going or (lambda live: live > 0)
    generation_seconds = 0.0
    turn = 0
    while keep_going(len(active := play.live())):
        if on_turn is not None:
            on_turn(turn, len(active))
        fitted = [play.prompt(i) for i in active]
        prompts = [fit.text for fit in fitted]
        tick = time.perf_counter()
        completions = policy(prompts, [play.infos[i] for i in active]) if scripted else policy(prompts)
        generation_seconds += time.perf_counter() - tick
        if len(completions) != len(prompts):
            raise RuntimeError(f"the policy returned {len(completions)} completions for {len(prompts)} prompts")
        actions = {i: play.action(i, completion) for i, completion in zip(active, completions, strict=True)}
        to_step = {i: action for i, (action, _) in actions.items() if play.sends(action)}
        tick = time.perf_counter()
        results = envs.step(to_step) if to_step else {}
        play.env_seconds += time.perf_counter() - tick
        for i, fit, completion in zip(active, fitted, completions, strict=True):
            play.record(i, fit, completion, *actions[i], results.get(i))
        turn += 1
    return play.rollout(generation_seconds, turn)
