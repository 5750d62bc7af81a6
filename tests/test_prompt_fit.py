"""Prompts over the token budget (issue 7): the oldest history goes first, then the middle of the observation;
the task, admissible actions and format instruction are never cut; every cut is counted; nothing raises."""

import re
from functools import partial

import pytest

from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.pool import InProcessEnvs
from hgpo_trl.rollout.actions import FORMAT_INSTRUCTIONS
from hgpo_trl.rollout.lockstep import Completion, RolloutSettings, run_rollout
from hgpo_trl.rollout.memory import Memory, build_prompt, cut_middle, fit_prompt

INSTRUCTION = FORMAT_INSTRUCTIONS["tags"]
ADMISSIBLE = ["go to hall", "open red door"]


def render(task, history, observation, admissible, step):
    lines = [f"Task: {task}", *(f"> {o}\n< {a}" for o, a in history), f"Now: {observation}",
             f"Actions: {' | '.join(admissible)}"]
    return "\n".join(lines)


def words(text: str) -> int:
    return len(text.split())


MEMORY = Memory([("oldest room one", "act one"), ("middle room two", "act two"), ("newest room three", "act three")])


def fit(observation="you are in the hall", budget=1000, memory=MEMORY, history_length=3):
    return fit_prompt(render, "find the gold", memory, observation, ADMISSIBLE, 3, history_length, INSTRUCTION,
                      words, budget)


def test_a_prompt_within_the_budget_is_the_full_prompt():
    full, pairs = build_prompt(render, "find the gold", MEMORY, "you are in the hall", ADMISSIBLE, 3, 3, INSTRUCTION)
    result = fit(budget=words(full))
    assert (result.text, result.shown_history, result.history_dropped, result.observation_cut) == (full, pairs, 0, 0)
    assert result.tokens == words(full) and not result.over_budget


def test_the_oldest_history_is_dropped_first():
    full = fit().text
    result = fit(budget=words(full) - 1)
    assert result.shown_history == 2 and result.history_dropped == 1 and result.observation_cut == 0
    assert "oldest" not in result.text and "middle room two" in result.text and "newest room three" in result.text
    result = fit(budget=words(full) - 8)  # each pair is 7 words: two must go, the newest stays
    assert result.shown_history == 1 and "middle" not in result.text and "newest room three" in result.text


def test_then_the_observation_is_shortened_in_the_middle_with_a_marker():
    observation = "BEGIN " + " ".join(f"w{i}" for i in range(500)) + " END"
    result = fit(observation, budget=120)
    assert result.shown_history == 0 and result.history_dropped == 3  # all history went first
    assert result.observation_cut > 0 and not result.over_budget and result.tokens <= 120
    assert "Now: BEGIN w0 w1" in result.text and "w498 w499 END\nActions:" in result.text
    assert f"[... {result.observation_cut} characters cut ...]" in result.text
    kept = len(observation) - result.observation_cut
    assert cut_middle(observation, kept) in result.text
    assert fit(observation, budget=121).observation_cut <= result.observation_cut  # the most that fits is kept


def test_the_instruction_and_admissible_actions_are_never_cut():
    protected = words(f"Task: find the gold\nNow: [... 1 characters cut ...]\nActions: {' | '.join(ADMISSIBLE)}\n"
                      f"{INSTRUCTION}")
    result = fit("x" * 10_000, budget=protected - 5)  # even with nothing else left, over the budget
    assert result.over_budget and result.tokens > protected - 5  # reported, not raised
    assert result.text.endswith(f"Actions: go to hall | open red door\n{INSTRUCTION}")
    assert result.text.startswith("Task: find the gold\n") and result.shown_history == 0


def test_an_empty_observation_and_no_history_over_the_budget_is_reported():
    result = fit("", budget=1, memory=Memory())
    assert result.over_budget and result.observation_cut == 0 and result.history_dropped == 0


def play(budget, count_tokens=len, action_mode="plain", history_length=2):
    tasks = list(make_tasks("keydoor", "train", num_tasks=1))
    row = tasks[0]
    plan = [f"take {row['gold']} key", "go to hall", "go to vault", f"open {row['gold']} door"]
    if action_mode == "tags":
        plan = [f"<think>the plan</think><action>{action}</action>" for action in plan]

    def policy(prompts):  # the expert's plan by step number: a cut prompt may no longer show the key taken
        return [Completion(text=plan[int(re.search(r"^Step (\d+)\.", p, re.MULTILINE).group(1))]) for p in prompts]

    settings = RolloutSettings(action_mode=action_mode, history_length=history_length, max_prompt_tokens=budget)
    return run_rollout(InProcessEnvs(partial(make_env, "keydoor"), 1), tasks, 1, policy, settings,
                       count_tokens=count_tokens)


def test_the_rollout_fits_every_prompt_and_counts_the_cuts():
    free = play(None, count_tokens=None)
    assert [len(s.prompt) for s in free.steps] == [187, 243, 280, 276]  # characters, history_length 2
    rollout = play(200)
    assert all(e.won for e in rollout.episodes)  # the expert still reads the shortened prompts
    assert [s.shown_history for s in rollout.steps] == [0, 0, 1, 0]
    assert [s.history_cut for s in rollout.steps] == [False, True, True, True]
    assert all(len(s.prompt) <= 200 and s.observation_cut == 0 and not s.over_budget for s in rollout.steps)
    assert rollout.prompt_stats() == {"prompt/history_cut": 0.75, "prompt/observation_cut": 0.0,
                                      "prompt/over_budget": 0.0}
    # HGPO caps a cut step's levels at the observations its prompt really showed.
    assert rollout.step_batch().window.tolist() == [0, 0, 1, 0]
    assert free.step_batch().window.tolist() == [0, 1, 2, 3]


def test_the_rollout_shortens_observations_and_reports_prompts_over_the_budget():
    rollout = play(150)
    first = rollout.steps[0]
    assert first.observation_cut > 0 and "characters cut ...]" in first.prompt and len(first.prompt) <= 150
    assert "You are in the entrance" in first.observation  # the anchor observation (HGPO's key) is whole
    rollout = play(100, action_mode="tags")  # the tags instruction alone is longer than 100 characters
    assert all(s.over_budget and s.prompt.endswith(INSTRUCTION) for s in rollout.steps)
    assert all(e.won for e in rollout.episodes)  # and the run goes on
    assert rollout.prompt_stats()["prompt/over_budget"] == 1.0


def test_a_real_tokenizer_counts_the_budget(tiny_tokenizer):
    count = lambda text: len(tiny_tokenizer(text)["input_ids"])  # noqa: E731
    rollout = play(40, count_tokens=count)
    assert all(count(s.prompt) <= 40 or s.over_budget for s in rollout.steps)
    assert any(s.history_cut for s in rollout.steps)


def test_a_budget_needs_a_token_count_and_a_positive_value(tmp_path):
    with pytest.raises(ValueError, match="max_prompt_tokens needs count_tokens"):
        play(100, count_tokens=None)
    with pytest.raises(ValueError, match="max_prompt_tokens must be None or >= 1"):
        RolloutSettings(max_prompt_tokens=0)
    args = HGPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", num_generations=2,
                      per_device_train_batch_size=2, max_prompt_tokens=512)
    assert args.rollout_settings().max_prompt_tokens == 512
    with pytest.raises(ValueError, match="HGPOConfig.max_prompt_tokens must be None or an integer >= 1"):
        HGPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_prompt_tokens=0)
