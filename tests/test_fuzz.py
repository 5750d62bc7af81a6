"""Property tests: whatever text a model emits, the action parser and the rollout neither crash nor evaluate it.

Examples per test (hypothesis, derandomized so a run is reproducible): parser properties 300, the parser against
its former regex implementation 300, the rollout 150 (each a whole keydoor rollout: 2 tasks x 2 rollouts, up to
4 steps), fit_prompt 200. Outputs mix tag fragments (unclosed, nested, repeated, inside the reasoning, closed
then reopened), control and binary characters, lone surrogates, CJK, injection-looking text, and
100k-character fillers.
"""

import builtins
import os
import re
import subprocess
import tempfile
import time
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.pool import InProcessEnvs
from hgpo_trl.rollout.actions import (
    ACTION_MODES,
    FORMAT_INSTRUCTIONS,
    MAX_ACTION_CHARS,
    MAX_TOOL_CHARS,
    match_admissible,
    parse_action,
    project_released,
)
from hgpo_trl.rollout.lockstep import Completion, RolloutSettings, StepRecord, run_rollout
from hgpo_trl.rollout.memory import Memory, fit_prompt

SENTINEL = Path(tempfile.gettempdir()) / f"hgpo-fuzz-sentinel-{os.getpid()}"
INJECTIONS = [
    f"__import__('os').system('touch {SENTINEL}')",
    f"open('{SENTINEL}', 'w').write('x')",
    f"$(touch {SENTINEL})", f"`touch {SENTINEL}`", f"; touch {SENTINEL}",
    "{{7*7}}", "${{7*7}}", "{0}", "{x}", "%s", "%(x)s", "{0.__class__.__mro__}", "<%= 7*7 %>",
]
TAGS = ["<think>", "</think>", "<action>", "</action>", "<think></think>", "<action></action>", "<Action>", "</ACTION>",
        "<action", "</action", "< action>", "<think>x</think>", "<actio", "think>", "action>", "</"]
WORDS = ["go to hall", "go to vault", "open red door", "take red key", " ", "\n", "\t", "\r\n", "\x00", "\x1b[31m",
         "\x7f", "\ufeff", "\u200b", "\u2028", "\x85", "\xa0", "\ud800", "\udfff", "\udbff\udc00", "这是", "한국어",
         "カタカナ", "ｶﾀｶﾅ", "\u0130", "\u212a", "ß", "ﬁ", "\U0001f600", "é", "A" * 201, "  Go   To\tHall  "]
WELL_FORMED = ["<think>reasoning</think><action>go to hall</action>", "<think>x</think>\n<action> Open Red Door </action>",
               "<think>a <action>wrong</action></think><action>right</action>", "go to vault\nmore text"]
FILLERS = ["a", " ", "<action>", "<think>", "</think>", "<action>x", "<think>x</think><action>", "这", "\ud800",
           "<action>go</action>", "{{7*7}}", "\x00\x01\x02"]

_piece = st.one_of(st.sampled_from(TAGS), st.sampled_from(WORDS), st.sampled_from(INJECTIONS),
                   st.sampled_from(WELL_FORMED), st.text(st.characters(exclude_categories=()), max_size=12))
SHORT = st.lists(_piece, max_size=24).map("".join)
LONG = st.builds(lambda head, filler, tail: head + (filler * (100_000 // len(filler) + 1))[:100_000] + tail,
                 SHORT, st.sampled_from(FILLERS), SHORT)
OUTPUTS = st.one_of(SHORT, SHORT, SHORT, LONG)  # mostly short: long ones cost time, not new paths
_TAG = re.compile(r"</?(?:action|think)>")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")


def normalised(text: str) -> str:
    return " ".join(text.split()).lower()


def first_action_after_think(text: str) -> str | None:
    """The brief's reading of tags mode, with str.find: the first <action>...</action> after the first </think>."""
    answer = text[text.index("</think>") + len("</think>"):]
    start = answer.find("<action>")
    end = answer.find("</action>", start + len("<action>"))
    return None if start == -1 or end == -1 else answer[start + len("<action>"):end]


def regex_reference(text: str, require_think: bool, reject_cjk: bool) -> str | None:
    """The tags-mode parser as it was before its str.find rewrite (quadratic on long outputs: short texts only)."""
    if reject_cjk and _CJK.search(text):
        return None
    if require_think:
        start, end = text.find("<think>"), text.find("</think>")
        if start == -1 or end < start:
            return None
        answer = text[end + len("</think>"):]
    else:
        answer = re.sub(r"<think>.*?</think>", " ", text, flags=re.DOTALL)
    match = re.search(r"<action>(.*?)</action>", answer, re.DOTALL)
    if match is None:
        return None
    action = re.sub(r"\s+", " ", match.group(1)).strip().lower()
    return None if not action or len(action) > MAX_ACTION_CHARS or _TAG.search(action) else action


def released_projection(text: str, tail: int) -> tuple[str, bool]:
    """verl-agent's alfworld_projection / webshop_projection for one output, step by step as released."""
    original, lowered = text, text.lower()
    start, end = lowered.find("<action>"), lowered.find("</action>")
    if start == -1 or end == -1:
        return lowered[-tail:], False
    action = lowered[start + len("<action>"):end].strip().lower()
    valid = original.find("<think>") != -1 and original.find("</think>") != -1
    return action, valid and re.search(r"[\u4e00-\u9fff]", original) is None


def no_evaluation():
    """Fail loudly if anything evaluates, executes or shells out the text while the block runs."""
    stack = ExitStack()
    for target in ("eval", "exec", "compile"):
        stack.enter_context(mock.patch.object(builtins, target, side_effect=AssertionError(f"{target} called")))
    stack.enter_context(mock.patch.object(os, "system", side_effect=AssertionError("os.system called")))
    stack.enter_context(mock.patch.object(subprocess, "Popen", side_effect=AssertionError("Popen called")))
    return stack


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=OUTPUTS, mode=st.sampled_from(ACTION_MODES), require_think=st.booleans(), reject_cjk=st.booleans())
def test_parse_action_never_raises_and_returns_a_clean_action(text, mode, require_think, reject_cjk):
    with no_evaluation():
        action = parse_action(text, mode, require_think=require_think, reject_cjk=reject_cjk)
    assert not SENTINEL.exists()
    event(f"valid: {action is not None}, long: {len(text) >= 100_000}")
    if action is None:
        return
    assert isinstance(action, str) and action
    if mode == "tool":  # (TRL classes) the answer after the reasoning as written: a tool call keeps its case
        answer = text[text.find("</think>") + len("</think>"):] if require_think else None
        assert action == action.strip() and len(action) <= MAX_TOOL_CHARS and not _TAG.search(action)
        assert not (reject_cjk and _CJK.search(text)) and (answer is None or action == answer.strip())
        return
    assert action == action.strip() == action.lower() == " ".join(action.split())
    assert len(action) <= MAX_ACTION_CHARS and not _TAG.search(action)
    assert not (reject_cjk and _CJK.search(text))
    if mode == "plain":
        assert action == normalised(next(line for line in text.splitlines() if line.strip()))
    elif require_think:
        assert text.find("<think>") < text.find("</think>")
        assert action == normalised(first_action_after_think(text))
    else:  # the first action outside the reasoning blocks: its tags are in the text, around it
        assert "<action>" in text and "</action>" in text


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=OUTPUTS, tail=st.sampled_from([30, 20]))
def test_execute_reads_every_output_as_the_released_projection(text, tail):
    with no_evaluation():
        action, valid = project_released(text, tail)
    assert not SENTINEL.exists()
    event(f"valid: {valid}, action block: {'<action>' in text.lower() and '</action>' in text.lower()}")
    assert (action, valid) == released_projection(text, tail)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=SHORT, require_think=st.booleans(), reject_cjk=st.booleans())
def test_tags_mode_matches_the_former_regex_parser(text, require_think, reject_cjk):
    assert parse_action(text, require_think=require_think, reject_cjk=reject_cjk) == \
        regex_reference(text, require_think, reject_cjk)


def test_long_repeated_tags_parse_in_linear_time():
    # A degenerate output repeating an unclosed tag took the lazy regexes ~8 s per 100k characters.
    for text, require_think in [("<think>x</think>" + "<action>" * 12_500, True), ("<action>" * 12_500, False),
                                ("<think>" * 14_000, False), ("<think>x</think><action>" + "<action>x" * 11_000, True)]:
        start = time.perf_counter()
        assert parse_action(text, require_think=require_think) is None
        assert time.perf_counter() - start < 1.0


@pytest.mark.slow
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(outputs=st.lists(OUTPUTS, min_size=1, max_size=6), mode=st.sampled_from(ACTION_MODES),
       require_think=st.booleans(), invalid_action=st.sampled_from(["noop", "end_episode", "execute"]),
       admissible_only=st.booleans(), history_length=st.integers(0, 3))
def test_rollout_survives_any_output_and_counts_invalid_steps(outputs, mode, require_think, invalid_action,
                                                              admissible_only, history_length):
    answers = iter(range(10_000))

    def policy(prompts):
        return [Completion(text=outputs[next(answers) % len(outputs)]) for _ in prompts]

    mode = "tags" if invalid_action == "execute" else mode  # the released projection reads tags
    settings_ = RolloutSettings(action_mode=mode, require_think=require_think, invalid_action=invalid_action,
                                admissible_only=admissible_only, history_length=history_length, max_steps=4)
    tasks = list(make_tasks("keydoor", "train", num_tasks=2))
    with no_evaluation():
        rollout = run_rollout(InProcessEnvs(partial(make_env, "keydoor"), 4), tasks, 2, policy, settings_)
    assert not SENTINEL.exists()
    assert all(e.fault is None for e in rollout.episodes)
    for episode in rollout.episodes:
        records = [r for r in rollout.steps if r.traj == episode.traj]
        assert [r.step for r in records] == list(range(episode.steps)) and 1 <= episode.steps <= 4
        assert episode.invalid == sum(not r.valid for r in records)
        if invalid_action == "end_episode" and episode.invalid:
            assert not records[-1].valid and not episode.won
    for record in rollout.steps:
        assert isinstance(record, StepRecord) and isinstance(record.prompt, str) and record.prompt
        assert isinstance(record.reward, float) and record.reward in (0.0, 3.0, 10.0)
        assert 0 <= record.shown_history <= min(record.step, history_length) and not record.history_cut
        admissible = record.prompt.split("\nActions: ")[-1].split("\n")[0].split(" | ")
        if invalid_action == "execute":  # every output sends something; an unlisted action is sent and penalised
            projected, well_formed = project_released(record.completion.text, 30, require_think=require_think)
            listed = match_admissible(projected, admissible) if admissible_only else projected
            assert record.action == (projected if listed is None else listed)
            assert record.valid == (well_formed and listed is not None)
        else:
            parsed = parse_action(record.completion.text, mode, require_think=require_think)
            expected = None if admissible_only and parsed not in admissible else parsed
            assert record.action == expected and record.valid == (expected is not None)
            assert len(record.prompt) < 2_000  # memory keeps a 30-character tail of an invalid output, not all
        assert "49" not in record.prompt or any("49" in o for o in outputs)  # no template ever evaluated {{7*7}}
    batch = rollout.step_batch()
    assert batch.valid.tolist() == [r.valid for r in rollout.steps]


def render(task, history, observation, admissible, step):
    lines = [f"Task: {task}", *(f"> {o}\n< {a}" for o, a in history), f"Now: {observation}",
             f"Actions: {' | '.join(admissible)}"]
    return "\n".join(lines)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(observation=OUTPUTS, pairs=st.lists(st.tuples(SHORT, SHORT), max_size=4), history_length=st.integers(0, 4),
       budget=st.integers(1, 400), admissible=st.lists(st.sampled_from(["go to hall", "open red door"]), max_size=3))
def test_fit_prompt_never_raises_never_cuts_the_instructions(observation, pairs, history_length, budget, admissible):
    memory = Memory(list(pairs))
    words = lambda text: len(text.split())  # noqa: E731  a whitespace "tokenizer"
    fit = fit_prompt(render, "reach the vault", memory, observation, admissible, 3, history_length,
                     FORMAT_INSTRUCTIONS["tags"], words, budget)
    assert fit.tokens == words(fit.text) and (fit.tokens <= budget) != fit.over_budget
    assert fit.text.endswith(f"Actions: {' | '.join(admissible)}\n{FORMAT_INSTRUCTIONS['tags']}")
    assert fit.text.startswith("Task: reach the vault\n")
    window = memory.window(history_length)
    assert fit.shown_history + fit.history_dropped == len(window)
    assert fit.observation_cut == 0 or fit.shown_history == 0  # history goes before the observation is cut
    if fit.observation_cut:
        assert f"[... {fit.observation_cut} characters cut ...]" in fit.text
    else:
        assert f"Now: {observation}\nActions:" in fit.text
