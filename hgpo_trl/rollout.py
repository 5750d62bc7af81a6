"""The lock-step multi-turn rollout: every task played G times, all live environments stepped together.

Each turn builds the memory-window prompt of every live environment, asks the policy for all of them in ONE
call, parses the actions and steps the environments. Every step becomes a `StepRecord`; the rollout knows
nothing about advantages or training. The policy is any callable from prompt texts to `Completion`s, so a
scripted policy (tests, baselines) plays exactly like a model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import numpy as np

from hgpo_trl.actions import (
    ACTION_MODES,
    FORMAT_INSTRUCTIONS,
    INVALID_TAIL_CHARS,
    invalid_tail,
    match_admissible,
    parse_action,
    project_released,
)
from hgpo_trl.advantages import StepBatch
from hgpo_trl.envs.base import Info
from hgpo_trl.envs.pool import EnvBatch, StepResult
from hgpo_trl.memory import FittedPrompt, Memory, build_prompt, fit_prompt

INVALID_ACTIONS = ("noop", "end_episode", "execute")


@dataclass
class Completion:
    """One generated answer: its text and, from a model, the token ids it came from."""

    text: str
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None  # sampling log-probabilities, when the backend gives them


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
        listed = match_admissible(action, admissible) if settings.admissible_only else action
        return (action, True) if listed is None else (listed, not well_formed)
    action = parse_action(text, settings.action_mode, require_think=settings.require_think,
                          reject_cjk=settings.reject_cjk)
    return (match_admissible(action, admissible) if settings.admissible_only else action), False


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
    if settings.max_prompt_tokens is not None and count_tokens is None:
        raise ValueError("RolloutSettings.max_prompt_tokens needs count_tokens (the policy's prompt token count)")
    count = len(tasks) * group_size
    if count > len(envs):
        raise ValueError(f"need {count} environments for {len(tasks)} tasks x {group_size} rollouts, "
                         f"got {len(envs)}")
    keep_going = keep_going or (lambda live: live > 0)
    start = time.perf_counter()
    episodes = [Episode(group=i // group_size, traj=i) for i in range(count)]
    memories = [Memory() for _ in range(count)]
    tick = time.perf_counter()
    resets = envs.reset([tasks[i // group_size] for i in range(count)])
    env_seconds = time.perf_counter() - tick
    generation_seconds = 0.0
    observations = [r.observation for r in resets]
    infos = [r.info for r in resets]
    task_texts = [info.get("task", "") for info in infos]
    done = [False] * count

    def end(i: int) -> None:
        done[i] = True
        if on_episode_end is not None:
            on_episode_end(episodes[i])

    escape = settings.escape_text or (lambda text: text)
    for i, result in enumerate(resets):
        if result.fault is not None:
            episodes[i].fault = result.fault
            end(i)
    records: list[StepRecord] = []
    turn = 0
    while keep_going(live := done.count(False)):
        if on_turn is not None:
            on_turn(turn, live)
        active = [i for i, finished in enumerate(done) if not finished]
        admissible = {i: [a.strip().lower() for a in infos[i].get("admissible_actions", [])] for i in active}
        prompts, fitted = [], []
        for i in active:
            arguments = (partial(envs.render_prompt, i), escape(task_texts[i]), memories[i], escape(observations[i]),
                         [escape(a) for a in infos[i].get("admissible_actions", [])], episodes[i].steps,
                         settings.history_length, settings.format_instruction)
            if settings.max_prompt_tokens is None:
                text, pairs = build_prompt(*arguments)
                fit = FittedPrompt(text, pairs, 0, 0, 0, False)  # no budget: nothing counted, nothing cut
            else:
                fit = fit_prompt(*arguments, count_tokens, settings.max_prompt_tokens)
            prompts.append(fit.text)
            fitted.append(fit)
        tick = time.perf_counter()
        completions = policy(prompts, [infos[i] for i in active]) if scripted else policy(prompts)
        generation_seconds += time.perf_counter() - tick
        if len(completions) != len(prompts):
            raise RuntimeError(f"the policy returned {len(completions)} completions for {len(prompts)} prompts")
        actions, malformed = {}, {}
        for i, completion in zip(active, completions, strict=True):
            actions[i], malformed[i] = read_action(completion.text, settings, admissible[i])
        to_step = {i: a for i, a in actions.items() if a is not None or settings.invalid_action == "noop"}
        tick = time.perf_counter()
        results = envs.step(to_step) if to_step else {}
        env_seconds += time.perf_counter() - tick
        for i, fit, completion in zip(active, fitted, completions, strict=True):
            episode, action = episodes[i], actions[i]
            result = results.get(i)
            # The game's own rules refused a well-formed action (a TextArena invalid move): an invalid step too.
            rejected = action is not None and result is not None and bool(result.info.get("invalid_move", False))
            if result is None:  # an invalid output under end_episode: the episode ends as failed
                result = StepResult(observations[i], 0.0, True, False, infos[i])
            records.append(StepRecord(group=episode.group, traj=i, step=episode.steps, observation=observations[i],
                                      prompt=fit.text, completion=completion, action=action,
                                      reward=float(result.reward), shown_history=fit.shown_history,
                                      history_cut=fit.history_dropped > 0, observation_cut=fit.observation_cut,
                                      over_budget=fit.over_budget, rejected=rejected, malformed=malformed[i],
                                      anchor=infos[i].get("anchor")))
            shown = action if action is not None else invalid_tail(completion.text, settings.invalid_tail_chars)
            memories[i].add(escape(observations[i]), escape(shown))
            episode.steps += 1
            episode.total_reward += float(result.reward)
            episode.invalid += not records[-1].valid
            episode.won = episode.won or bool(result.info.get("won", False))
            if "score" in result.info:
                episode.score = float(result.info["score"])
            observations[i], infos[i] = result.observation, result.info
            if result.fault is not None:
                episode.fault = result.fault
                end(i)
            elif result.terminated or result.truncated or episode.steps >= settings.max_steps:
                episode.terminated = bool(result.terminated)
                episode.truncated = not result.terminated
                end(i)
        turn += 1
    faulted = {e.traj for e in episodes if e.fault is not None}
    return Rollout(steps=[r for r in records if r.traj not in faulted], episodes=episodes,
                   generation_seconds=generation_seconds, env_seconds=env_seconds,
                   seconds=time.perf_counter() - start, turns=turn)
