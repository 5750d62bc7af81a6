"""The continuous rollout: every episode advances on its own, none waits for a turn.

Lock-step (`hgpo_trl.rollout.lockstep.run_rollout`) generates every live episode's prompt in one call, waits for the
longest completion, then steps every environment while the engine idles. Here an episode's prompt goes to a
`CompletionStream` as soon as its environment has answered; each completion that comes out is read and its action
sent to the environment at once (`hgpo_trl.envs.async_steps`: in worker processes, while the engine generates);
its result makes the episode's next prompt, submitted at once. An engine with continuous batching (vLLM) keeps
its batch full across what lock-step calls turns.

The episodes' steps are the lock-step rollout's: the same `EpisodeStates` builds each prompt, reads each action
and records each step, and the rollout lists the steps in lock-step's order. With a policy that answers a prompt
the same whatever it is batched with (a scripted one; vLLM with a seed per request, as far as its batched
arithmetic allows: docs/trainer.md) the records are equal. No step waits on another process: with several
processes each plays its own episodes on its own engine, with no collective per turn.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from hgpo_trl.envs.async_steps import AsyncSteps
from hgpo_trl.envs.pool import EnvBatch
from hgpo_trl.rollout.lockstep import Completion, Episode, EpisodeStates, Policy, Rollout, RolloutSettings
from hgpo_trl.rollout.memory import FittedPrompt

ROLLOUT_MODES = ("auto", "lockstep", "continuous")


class CompletionStream(Protocol):
    """A generator that takes prompts one at a time and hands back completions as they finish."""

    def submit(self, key: int, prompt: str, step: int) -> None:
        """Ask for a completion of `prompt` for episode `key`'s step `step`."""

    def finished(self) -> list[tuple[int, Completion]]:
        """Generate for a while (one engine step) and return the completions that finished, by key."""

    def abort(self) -> None:
        """Drop every request not finished yet (the rollout ended early), so that none reaches the next rollout."""


class PolicyStream:
    """Any batch `Policy` as a `CompletionStream`: each `finished()` answers every prompt submitted since the last
    one in one call (for transformers' generate, which has no request-level API, and scripted policies)."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self._waiting: dict[int, str] = {}

    def submit(self, key: int, prompt: str, step: int) -> None:
        self._waiting[key] = prompt

    def finished(self) -> list[tuple[int, Completion]]:
        keys, prompts = list(self._waiting), list(self._waiting.values())
        self._waiting.clear()
        completions = self.policy(prompts)
        if len(completions) != len(prompts):
            raise RuntimeError(f"the policy returned {len(completions)} completions for {len(prompts)} prompts")
        return list(zip(keys, completions, strict=True))

    def abort(self) -> None:
        self._waiting.clear()


def run_continuous(envs: EnvBatch, tasks: Sequence[Mapping[str, Any]], group_size: int, stream: CompletionStream,
                   settings: RolloutSettings, *, on_turn: Callable[[int, int], None] | None = None,
                   on_episode_end: Callable[[Episode], None] | None = None,
                   count_tokens: Callable[[str], int] | None = None) -> Rollout:
    """Play every task `group_size` times as `run_rollout` does, each episode on its own (see the module doc).

    `on_turn(turn, live)` is called when the first episode starts its step `turn` (lock-step calls it as turn
    `turn` starts: as many calls, and a progress bar over max_env_steps reads the same). `generation_seconds`
    counts the time in the stream's engine steps, `env_seconds` the resets and the time spent waiting on an
    environment with nothing to generate (with worker processes, the environments' share of the wall time that
    generation did not hide)."""
    play = EpisodeStates(envs, tasks, group_size, settings, count_tokens, on_episode_end)
    steps = AsyncSteps(envs)
    asked: dict[int, FittedPrompt] = {}  # episodes waiting for a completion
    stepping: dict[int, tuple[FittedPrompt, Completion, str | None, bool]] = {}  # ... for their environment
    generation_seconds, turns = 0.0, 0

    def ask(i: int) -> None:
        nonlocal turns
        step = play.episodes[i].steps
        if step == turns:
            if on_turn is not None:
                on_turn(turns, len(play.live()))
            turns += 1
        asked[i] = play.prompt(i)
        stream.submit(i, asked[i].text, step)

    def answered(i: int, completion: Completion) -> None:
        fit = asked.pop(i)
        action, malformed = play.action(i, completion)
        if not play.sends(action):  # an invalid output under end_episode: nothing to step, the episode ends
            play.record(i, fit, completion, action, malformed, None)
            return
        stepping[i] = (fit, completion, action, malformed)
        tick = time.perf_counter()
        steps.submit(i, action)
        play.env_seconds += time.perf_counter() - tick

    try:
        for i in play.live():
            ask(i)
        while asked or stepping:
            if asked:
                tick = time.perf_counter()
                done = stream.finished()
                generation_seconds += time.perf_counter() - tick
                for i, completion in done:
                    answered(i, completion)
            tick = time.perf_counter()
            results = steps.collect(wait=not asked)  # wait only when the engine has nothing to generate
            if not asked:
                play.env_seconds += time.perf_counter() - tick
            for i, result in sorted(results.items()):
                play.record(i, *stepping.pop(i), result)
                if not play.done[i]:
                    ask(i)
    except BaseException:  # (Ctrl-C, a failed request): what is in flight must not reach the next rollout
        stream.abort()
        steps.abandon()
        raise
    return play.rollout(generation_seconds, turns)
