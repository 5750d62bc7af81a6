"""A TRL class's episodes as the rollout plays them (envs/trl_env.py): the final reward wherever the episode ends,
the classes refused up front, the row's whole prompt, and calls compared as parsed calls, not as text."""

import re
from functools import partial
from typing import Literal

import pytest

from hgpo_trl.envs import TRLEnv, make_env
from hgpo_trl.envs.pool import make_env_batch
from hgpo_trl.envs.trl_calls import written_call
from hgpo_trl.envs.trl_env import within_episode_limit
from hgpo_trl.evaluation.trajectories import rollout_records, summarize
from hgpo_trl.rollout.lockstep import Completion, RolloutSettings, run_rollout
from tests.test_trajectories import record_config
from tests.test_trl_env import ROWS, Corridor

REWARDS: list[float] = []  # every get_reward() result, in call order


class Presses:
    """Press buttons (no reward of its own)."""

    def reset(self, **row) -> str:
        self.presses = 0
        return "Two buttons."

    def press(self, button: str) -> str:
        """Press a button.

        Args:
            button: which one.
        """
        self.presses += 1
        return f"{button} pressed."


class Buttons(Presses):
    """get_reward() counts the presses."""

    def get_reward(self) -> float:
        REWARDS.append(float(self.presses))
        return float(self.presses)


def step(prompt: str) -> int:
    """The rollout's step number, as the prompt shows it."""
    return int(re.search(r"^Step (\d+)\.$", prompt, re.M).group(1))


def test_get_reward_is_scored_when_the_rollout_truncates_after_an_unreadable_output():
    """max_env_steps 3 under noop: one output that does not parse, then two calls. The episode's third step is its
    last; get_reward() (2 presses) is added there, once per episode."""
    outputs = ["no reasoning, no call", "<think> </think>press(button='up')", "<think> </think>press(button='up')"]
    REWARDS.clear()
    with make_env_batch(lambda: TRLEnv(Buttons, max_steps=3), 2, 0) as envs:
        rollout = run_rollout(envs, ROWS[:1], 2, lambda prompts: [Completion(outputs[step(p)]) for p in prompts],
                              RolloutSettings(action_mode="tool", max_steps=3, invalid_action="noop"))
    assert [(e.steps, e.truncated, e.total_reward) for e in rollout.episodes] == [(3, True, 2.0)] * 2
    assert REWARDS == [2.0, 2.0]


def test_the_class_never_plays_past_max_env_steps(tmp_path, tiny_model, tiny_tokenizer):
    """The rollout ends an episode at max_env_steps: a larger max_steps in env_kwargs would let the rollout cut
    the episode before the class's own end, and its get_reward() would never be scored."""
    from tests.test_trainer import make_config, make_trainer

    args = make_config(tmp_path, action_mode="tool", max_env_steps=3, env_kwargs={"max_steps": 10})
    trainer = make_trainer(tiny_model, tiny_tokenizer, args, environment_factory=Buttons)
    assert trainer.env_factory().max_steps == 3
    assert within_episode_limit({"max_steps": 2}, 3) == {"max_steps": 2} and within_episode_limit(None, 3) == {
        "max_steps": 3}  # (a smaller limit is the class's own)


class Unrewarded(Presses):
    """A TRL class whose reward TRL would take from reward_funcs(environments=...): none of its own."""


class StepRewarded(Presses):
    def __init__(self):
        self.step_reward = 1.0  # an attribute: a reward source


class Quiz(Buttons):
    """`done` is a tool with an argument here (TRL would offer it), not the adapter's end-of-episode member."""

    def done(self, answer: str) -> str:
        """Give the final answer.

        Args:
            answer: the answer.
        """
        return "noted"


@pytest.mark.parametrize(("factory", "message"), [
    (Unrewarded, r"^environment_factory Unrewarded: no reward source: give the class a get_reward\(\) method or "
                 r"a step_reward member .*not reward_funcs"),
    ({"keyed": Corridor, "bare": Unrewarded}, r"^environment_factory Unrewarded \(environment 'bare'\): no reward"),
    (Quiz, r"^environment_factory Quiz: done\(answer\) takes arguments, but the episode's end is read by calling "
           r"it with none .*env_kwargs done: null"),
])
def test_a_class_without_a_reward_or_with_a_done_tool_is_refused_in_one_line(factory, message):
    with pytest.raises(ValueError, match=message) as error:
        make_env("trl", environment_factory=factory)
    assert "\n" not in str(error.value)


def test_a_step_reward_alone_is_a_reward_source_and_done_null_offers_done_as_a_tool():
    env = make_env("trl", environment_factory=StepRewarded)
    env.reset(ROWS[0])
    assert env.step("press(button='up')")[1] == 1.0
    env = make_env("trl", environment_factory=Quiz, done=None)
    env.reset(ROWS[0])
    assert set(env._tools_now) == {"press", "done"}
    assert env.step("done(answer='4')")[:4] == ("noted", 0.0, False, False)


def test_every_message_of_a_rows_conversation_is_in_the_prompt():
    """TRL renders the row's whole conversation: the system message's rules too, not only the last user message."""
    conversation = [{"role": "system", "content": "The rules: press up to win."},
                    {"role": "user", "content": [{"type": "text", "text": "Open the door."}]},
                    {"role": "assistant", "content": "press(button='down')"}, {"role": "user", "content": "Again."}]
    env = make_env("trl", environment_factory=Buttons)
    task = env.reset({"prompt": conversation})[1]["task"]
    assert task.startswith("The rules: press up to win.\nOpen the door.\nassistant: press(button='down')\nAgain.\n"
                           "Tools:\n- press(button: string)")
    assert env.reset({"prompt": conversation[-1:]})[1]["task"].startswith("Again.\nTools:")


class Lift(Buttons):
    def press(self, button: Literal["Up", "Down"]) -> str:
        """Press a button.

        Args:
            button: which one.
        """
        return super().press(button)


@pytest.mark.parametrize(("tool_format", "answer"), [
    ("call", "press ( button = ' Up ' )"),  # as the tiny word-level tokenizer decodes press(button='Up')
    ("json", '<tool_call>{"name":"press","arguments":{"button":"Up"}}</tool_call>'),
])
def test_under_admissible_only_a_call_is_matched_parsed_not_as_text(tool_format, answer):
    """The call is the admissible one whatever its spacing, and is sent as the class lists it, its case kept."""
    with make_env_batch(partial(TRLEnv, Lift, tool_format=tool_format, max_steps=1), 1, 0) as envs:
        rollout = run_rollout(envs, ROWS[:1], 1, lambda prompts: [Completion(f"<think> </think>{answer}")],
                              RolloutSettings(action_mode="tool", max_steps=1, admissible_only=True))
    [played] = rollout.steps
    assert played.valid and played.action == written_call("press", {"button": "Up"}, tool_format)
    assert rollout.episodes[0].won  # (get_reward() counted the press)


def test_one_call_written_two_ways_reaches_one_state():
    """The default anchor digests the calls parsed (name and arguments), so spacing does not split HGPO's groups."""
    env = TRLEnv(Buttons)
    anchors = []
    for call in ["press(button='up')", 'press ( button = " up " )', "press(button='down')"]:
        env.reset(ROWS[0])
        anchors.append(env.step(call)[4]["anchor"])
    assert anchors[0] == anchors[1] != anchors[2]


def test_the_summary_says_why_a_tool_mode_output_was_invalid():
    outputs = ["move(direction='right')", "<think> </think>move(direction='left')", "<think> </think>",
               "<think> </think>move(direction='up')"]
    with make_env_batch(partial(TRLEnv, Corridor, max_steps=4), 1, 0) as envs:
        rollout = run_rollout(envs, ROWS[:1], 1, lambda prompts: [Completion(outputs[step(p)]) for p in prompts],
                              RolloutSettings(action_mode="tool", max_steps=4, admissible_only=True))
    records = rollout_records(rollout, ROWS[:1], None, record_config(action_mode="tool"))
    assert summarize(records)["invalid_reasons"] == {
        "no </think> before the answer": 1, "the call failed (an error answered it)": 1,
        "no answer after </think>": 1, "not an admissible call": 1}
