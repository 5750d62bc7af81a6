"""The real ALFWorld games through `make_env`: the handcoded expert wins, observations read as in the papers,
rollouts of a task start alike, state keys are deterministic, and bad data fails fast instead of hanging."""

import gzip
import json
import os
import random
import re
import shutil
import sys
from functools import partial
from importlib.util import find_spec
from pathlib import Path

import pytest

from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.alfworld import NOTHING, TASK_TYPES, _Pack, _source
from hgpo_trl.envs.pool import InProcessEnvs
from hgpo_trl.rollout.lockstep import Completion, run_rollout

DATA = Path(os.environ.get("ALFWORLD_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data" / "alfworld")
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"no ALFWorld data at {DATA} (set ALFWORLD_DATA)")
needs_alfworld = pytest.mark.skipif(find_spec("alfworld") is None,
                                    reason='needs the alfworld package: pip install "hgpo-trl[alfworld]"')
SPLIT = "valid_unseen"
# valid_unseen games that the handcoded expert wins within 50 steps (with random.seed(0)), two of each task type
# but pick_two: alfworld 0.4.2's expert watches for "put" where its own commands now say "move", so it still
# believes it holds the first object and loses 12 of the 17 pick_two games (all its losses on this split).
EXPERT_GAMES = [
    "look_at_obj_in_light-Bowl-None-DeskLamp-308/trial_T20190907_133953_562557",
    "look_at_obj_in_light-Mug-None-DeskLamp-308/trial_T20190908_201421_021646",
    "pick_and_place_simple-Mug-None-Desk-308/trial_T20190909_203041_433487",
    "pick_and_place_simple-SaltShaker-None-Cabinet-10/trial_T20190906_191445_723170",
    "pick_clean_then_place_in_recep-Pan-None-CounterTop-10/trial_T20190908_032543_712058",
    "pick_clean_then_place_in_recep-SoapBar-None-CounterTop-424/trial_T20190907_074106_050405",
    "pick_cool_then_place_in_recep-Pan-None-CounterTop-10/trial_T20190908_114622_738670",
    "pick_cool_then_place_in_recep-Potato-None-Microwave-10/trial_T20190907_033228_194678",
    "pick_heat_then_place_in_recep-Apple-None-GarbageCan-10/trial_T20190908_145143_820541",
    "pick_heat_then_place_in_recep-Tomato-None-GarbageCan-10/trial_T20190908_225046_020282",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("alfworld-cache")


@pytest.fixture(scope="module")
def expert_env(cache):
    env = make_env("alfworld", split=SPLIT, data_path=DATA, expert=True, cache_dir=cache)
    yield env
    env.close()


@pytest.fixture(scope="module")
def plays(expert_env):
    """The expert's play of each game: (goal, initial observation, reset info, [(action, step results)])."""
    tasks = make_tasks("alfworld", SPLIT, data_path=DATA)
    goals = dict(zip(tasks["game_id"], tasks["goal"], strict=True))
    result = []
    for game_id in EXPERT_GAMES:
        random.seed(0)  # the expert breaks ties with Python's global random
        observation, info = expert_env.reset({"game_id": game_id})
        steps, last = [], info
        while not steps or not (steps[-1][1][2] or steps[-1][1][3]):
            action = last["expert_action"]
            steps.append((action, expert_env.step(action)))
            last = steps[-1][1][4]
        result.append((goals[game_id], observation, info, steps))
    return result


@needs_data
def test_task_lists():
    counts = {split: len(make_tasks("alfworld", split, data_path=DATA)) for split in ("train", "valid_seen", SPLIT)}
    assert counts == {"train": 3553, "valid_seen": 140, SPLIT: 134}
    tasks = make_tasks("alfworld", SPLIT, data_path=DATA)
    assert tasks.column_names == ["game_id", "task_type", "goal", "split"] and set(tasks["split"]) == {SPLIT}
    assert tasks["game_id"] == sorted(tasks["game_id"]) and set(tasks["task_type"]) == set(TASK_TYPES)
    assert make_tasks("alfworld", SPLIT, data_path=DATA, num_tasks=5)["game_id"] == tasks["game_id"][:5]
    shuffled = make_tasks("alfworld", SPLIT, data_path=DATA, seed=1)["game_id"]
    assert shuffled != tasks["game_id"] and sorted(shuffled) == tasks["game_id"]
    assert shuffled == make_tasks("alfworld", SPLIT, data_path=DATA, seed=1)["game_id"]
    looks = make_tasks("alfworld", SPLIT, data_path=DATA, task_types=["look_at_obj_in_light"])
    assert len(looks) == 18 and set(looks["task_type"]) == {"look_at_obj_in_light"}
    with pytest.raises(ValueError, match="task_types"):
        make_tasks("alfworld", SPLIT, data_path=DATA, task_types=["pick_and_place_with_movable_recep"])


@pytest.mark.slow
@needs_alfworld
@needs_data
def test_expert_wins_through_the_wrapper(plays):
    won = [steps[-1][1][4]["won"] for *_, steps in plays]
    assert sum(won) >= 9, f"the expert won {sum(won)} of {len(won)} games"
    for *_, steps in plays:
        if steps[-1][1][4]["won"]:
            assert steps[-1][1][1:4] == (10.0, True, False) and len(steps) <= 50
            assert all(reward == 0.0 for _, (_, reward, *_) in steps[:-1])


@pytest.mark.slow
@needs_alfworld
@needs_data
def test_observations_and_actions_read_as_in_the_papers(plays):
    for goal, observation, info, steps in plays:
        assert observation.startswith("You are in the middle of a room. Looking quickly around you, you see a ")
        assert info["task"] == goal + "." and observation.endswith(f"\n\nYour task is to: {info['task']}")
        assert info["state_key"] == observation and "Welcome" not in observation
        assert {"look", "inventory"} <= set(info["admissible_actions"])
        assert all(a.startswith("go to ") for a in info["admissible_actions"] if a not in ("look", "inventory"))
        for action, (next_observation, _, _, _, next_info) in steps:
            assert "help" not in next_info["admissible_actions"] and next_info["task"] == info["task"]
            assert next_info["state_key"] == next_observation
            if action.startswith("go to "):
                assert next_observation.startswith(f"You arrive at {action.removeprefix('go to ')}.")


@pytest.mark.slow
@needs_alfworld
@needs_data
def test_rollouts_of_a_task_start_alike(expert_env, cache):
    row = next(row for row in make_tasks("alfworld", SPLIT, data_path=DATA) if row["game_id"] == EXPERT_GAMES[2])
    first = expert_env.reset(row)
    expert_env.step(first[1]["admissible_actions"][0])
    other = make_env("alfworld", data_path=DATA, cache_dir=cache)  # a train environment plays the row's split
    try:
        for observation, info in (expert_env.reset(row), other.reset(row)):
            assert observation == first[0] and info["admissible_actions"] == first[1]["admissible_actions"]
    finally:
        other.close()


@needs_alfworld
@needs_data
def test_fact_keys_are_deterministic_and_truncation(cache):
    env = make_env("alfworld", split=SPLIT, data_path=DATA, state_key="facts", max_steps=4, cache_dir=cache)
    row = {"game_id": EXPERT_GAMES[0]}
    try:
        runs = []
        for _ in range(2):
            _, info = env.reset(row)
            keys = [info["state_key"]]
            for action in (info["admissible_actions"][0], "look", None):
                observation, reward, terminated, truncated, info = env.step(action)
                keys.append(info["state_key"])
                assert (reward, terminated, truncated) == (0.0, False, False)
            runs.append(keys)
        assert runs[0] == runs[1]
        start, moved, looked, nothing = runs[0]
        assert start != moved and looked == nothing and observation == NOTHING
        assert env.step("look")[1:4] == (0.0, False, True)
        with pytest.raises(RuntimeError, match="ended"):
            env.step("look")
    finally:
        env.close()


@needs_alfworld
@needs_data
def test_none_is_a_no_op_and_other_text_goes_to_the_game(expert_env):
    _, info = expert_env.reset({"game_id": EXPERT_GAMES[0]})
    observation, reward, terminated, truncated, after = expert_env.step(None)
    assert (observation, reward, terminated, truncated) == (NOTHING, 0.0, False, False)
    assert after["admissible_actions"] == info["admissible_actions"] and after["step"] == 1
    assert after["expert_action"] == info["expert_action"]
    assert expert_env.step("dance with the desklamp")[0] == NOTHING
    # invalid_action="execute" sends whatever an output yields: the game answers, it never fails.
    for hostile in ("a" * 100_000, "\x00\ud800 go to", "{{7*7}} %s {0}", "go to desk 1\ngo to desk 2", "", "这是"):
        assert expert_env.step(hostile)[0] == NOTHING
    assert expert_env.step(info["admissible_actions"][0])[0].startswith("You arrive at ")


@needs_alfworld
@needs_data
def test_prompt_is_verl_agents(expert_env):
    first = expert_env.render_prompt("put a mug in desk.", [], "You are in a room.", ["go to desk 1", "look"], 0)
    assert first == ("\nYou are an expert agent operating in the ALFRED Embodied Environment.\n"
                     "Your current observation is: You are in a room.\n"
                     "Your admissible actions of the current situation are: ['go to desk 1'\n 'look'].\n\n"
                     "Now it's your turn to take an action.\n"
                     "You should first reason step-by-step about the current situation. This reasoning process "
                     "MUST be enclosed within <think> </think> tags. \n"
                     "Once you've finished your reasoning, you should choose an admissible action for current "
                     "step and present it within <action> </action> tags.\n")
    later = expert_env.render_prompt("put a mug in desk.", [("A.", "go to desk 1"), ("B.", "look")], "C.",
                                     ["look"], 3)
    assert later.startswith(
        "\nYou are an expert agent operating in the ALFRED Embodied Environment. Your task is to: put a mug in "
        "desk.\nPrior to this step, you have already taken 3 step(s). Below are the most recent 2 observations "
        "and the corresponding actions you took: [Observation 2: 'A.', Action 2: 'go to desk 1']\n"
        "[Observation 3: 'B.', Action 3: 'look']\nYou are now at step 4 and your current observation is: C.\n"
        "Your admissible actions of the current situation are: ['look'].\n\nNow it's your turn")


# The released prompt (agent_system/environments/prompts/alfworld.py, filled by recipe/hgpo/env_manager.py) of
# EXPERT_GAMES[2] under the release's own observations: TextWorld's text as written, banner included.
ROOM = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, you see "
        "a bed 1, a desk 2, a desk 1, a drawer 6, a drawer 5, a drawer 4, a drawer 3, a drawer 2, a drawer 1, a "
        "garbagecan 1, a laundryhamper 1, a safe 1, a shelf 6, a shelf 5, a shelf 4, a shelf 3, a shelf 2, and a "
        "shelf 1.\n\nYour task is to: put some mug on desk.")
INSTRUCTION = ("Now it's your turn to take an action.\nYou should first reason step-by-step about the current "
               "situation. This reasoning process MUST be enclosed within <think> </think> tags. \nOnce you've "
               "finished your reasoning, you should choose an admissible action for current step and present it "
               "within <action> </action> tags.\n")
RELEASED_FIRST_PROMPT = (
    "\nYou are an expert agent operating in the ALFRED Embodied Environment.\nYour current observation is: "
    + ROOM + "\nYour admissible actions of the current situation are: ['go to bed 1'\n 'go to desk 1'\n 'go to "
    "desk 2'\n 'go to drawer 1'\n 'go to drawer 2'\n 'go to drawer 3'\n 'go to drawer 4'\n 'go to drawer 5'\n "
    "'go to drawer 6'\n 'go to garbagecan 1'\n 'go to laundryhamper 1'\n 'go to safe 1'\n 'go to shelf 1'\n "
    "'go to shelf 2'\n 'go to shelf 3'\n 'go to shelf 4'\n 'go to shelf 5'\n 'go to shelf 6'\n 'inventory'\n "
    "'look'].\n\n" + INSTRUCTION)
RELEASED_THIRD_PROMPT = (
    "\nYou are an expert agent operating in the ALFRED Embodied Environment. Your task is to: put some mug on "
    "desk.\nPrior to this step, you have already taken 2 step(s). Below are the most recent 2 observations and "
    "the corresponding actions you took: [Observation 1: '" + ROOM + "', Action 1: 'go to desk 1']\n"
    "[Observation 2: 'You arrive at desk 1. On the desk 1, you see a desklamp 1, a keychain 2, and a pencil 1.', "
    "Action 2: ' go to the drawer 1, then look']\nYou are now at step 3 and your current observation is: "
    "Nothing happens.\nYour admissible actions of the current situation are: ['examine desk 1'\n 'go to bed 1'\n "
    "'go to desk 2'\n 'go to drawer 1'\n 'go to drawer 2'\n 'go to drawer 3'\n 'go to drawer 4'\n 'go to "
    "drawer 5'\n 'go to drawer 6'\n 'go to garbagecan 1'\n 'go to laundryhamper 1'\n 'go to safe 1'\n 'go to "
    "shelf 1'\n 'go to shelf 2'\n 'go to shelf 3'\n 'go to shelf 4'\n 'go to shelf 5'\n 'go to shelf 6'\n "
    "'inventory'\n 'look'\n 'take keychain 2 from desk 1'\n 'take pencil 1 from desk 1'\n 'use desklamp 1'].\n\n"
    + INSTRUCTION)


@needs_alfworld
@needs_data
def test_prompts_read_as_released_character_by_character(cache, tmp_path):
    """A paper config's rollout of a real game: raw observations, the released template, and an output with no
    action block sent to the game as its last 30 characters, lower-cased, which the history then shows."""
    args = HGPOConfig(output_dir=str(tmp_path), env_name="alfworld", history_length=2, max_env_steps=3,
                      invalid_action="execute", use_cpu=True, report_to="none")
    outputs = iter(["<think>the mug may be on a desk</think><action>go to desk 1</action>",
                    "Let me think. I Will Go To The Drawer 1, Then Look", "<think>x</think><action>look</action>"])
    envs = InProcessEnvs(partial(make_env, "alfworld", split=SPLIT, data_path=DATA, raw_observations=True,
                                 cache_dir=cache), 1)
    try:
        rollout = run_rollout(envs, [{"game_id": EXPERT_GAMES[2]}], 1,
                              lambda prompts: [Completion(next(outputs)) for _ in prompts], args.rollout_settings())
    finally:
        envs.close()
    first, second, third = rollout.steps
    assert first.prompt == RELEASED_FIRST_PROMPT
    assert (second.action, second.valid) == (" go to the drawer 1, then look", False)
    assert third.prompt == RELEASED_THIRD_PROMPT


@pytest.mark.slow
@needs_alfworld
@needs_data
def test_a_json_tree_plays_the_same_games(tmp_path, cache):
    packed = _source(DATA, SPLIT)
    tree = tmp_path / "json_2.1.1" / SPLIT
    for game_id in EXPERT_GAMES[:2]:
        shutil.copytree(packed.game_file(game_id, cache).parent, tree / game_id)
    # Skipped as by alfworld: sliced objects, and games marked unsolvable.
    shutil.copytree(tree / EXPERT_GAMES[0], tree / "pick_heat_then_place_in_recep-AppleSliced-None-Fridge-1/t1")
    unsolvable = tree / "pick_and_place_simple-Mug-None-Desk-1/t1"
    shutil.copytree(tree / EXPERT_GAMES[0], unsolvable)
    game = json.loads((unsolvable / "game.tw-pddl").read_text())
    (unsolvable / "game.tw-pddl").write_text(json.dumps({**game, "solvable": False}))

    expected = [row for row in make_tasks("alfworld", SPLIT, data_path=DATA) if row["game_id"] in EXPERT_GAMES[:2]]
    for data_path in (tmp_path, tmp_path / "json_2.1.1"):
        assert list(make_tasks("alfworld", SPLIT, data_path=data_path)) == expected
    env = make_env("alfworld", split=SPLIT, data_path=tmp_path, cache_dir=cache)
    other = make_env("alfworld", split=SPLIT, data_path=DATA, cache_dir=cache)
    try:
        assert env.reset(expected[0])[0] == other.reset(expected[0])[0]
    finally:
        env.close()
        other.close()


@needs_alfworld
@needs_data
def test_packed_games_unpack_once_into_the_cache(tmp_path):
    pack = _source(DATA, SPLIT)
    if not isinstance(pack, _Pack):
        pytest.skip("ALFWORLD_DATA holds a json tree, not packed games")
    game_file = pack.game_file(EXPERT_GAMES[0], tmp_path)
    assert game_file.parent.relative_to(tmp_path).parts[1:] == tuple(EXPERT_GAMES[0].split("/"))
    assert sorted(p.name for p in game_file.parent.iterdir()) == ["game.tw-pddl", "traj_data.json"]
    before = game_file.read_text()
    pack._unpack(EXPERT_GAMES[0], game_file.parent)  # as a process that lost the race to unpack it would
    assert game_file.read_text() == before
    assert [p.name for p in game_file.parent.parent.iterdir()] == [game_file.parent.name]
    with pytest.raises(ValueError, match="not in"):
        pack.game_file("no-such-task/trial_0", tmp_path)


@pytest.mark.timeout(30)
def test_bad_data_fails_fast(tmp_path, monkeypatch):
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    with pytest.raises(ValueError, match=r"ALFWORLD_DATA.*jsonl\.gz"):
        make_env("alfworld", split=SPLIT)
    with pytest.raises(ValueError, match=re.escape(f"split '{SPLIT}' in {tmp_path}")):
        make_env("alfworld", split=SPLIT, data_path=tmp_path)
    (tmp_path / "json_2.1.1" / SPLIT / "pick_and_place_simple-Mug-None-Desk-1" / "t1").mkdir(parents=True)
    with pytest.raises(ValueError, match=f"no playable ALFWorld games for split '{SPLIT}'"):
        make_env("alfworld", split=SPLIT, data_path=tmp_path)
    with gzip.open(tmp_path / "valid_seen.jsonl.gz", "wt"):
        pass
    with pytest.raises(ValueError, match="no playable ALFWorld games for split 'valid_seen'"):
        make_tasks("alfworld", "valid_seen", data_path=tmp_path)
    with pytest.raises(ValueError, match="split must be one of"):
        make_env("alfworld", split="test", data_path=tmp_path)
    with pytest.raises(ValueError, match="state_key"):
        make_env("alfworld", split=SPLIT, data_path=tmp_path, state_key="text")


@needs_data
def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "alfworld.agents.environment.alfred_tw_env", None)
    with pytest.raises(ImportError, match=r'pip install "hgpo-trl\[alfworld\]"'):
        make_env("alfworld", split=SPLIT, data_path=DATA)


@pytest.mark.slow
@needs_alfworld
@needs_data
def test_remembered_translations_play_exactly_as_fresh_ones(cache, monkeypatch):
    """Resets reuse fast-downward translations of the same PDDL texts: the expert's play of two games,
    reset twice each in two environments, is the same step for step as with every translation made afresh."""
    import fast_downward

    from hgpo_trl.envs.alfworld import _translated

    tasks = make_tasks("alfworld", SPLIT, data_path=DATA, num_tasks=2)

    def play() -> list:
        envs = [make_env("alfworld", split=SPLIT, data_path=DATA, expert=True, cache_dir=cache) for _ in range(2)]
        seen = []
        for task in [*tasks, *tasks]:
            for env in envs:
                observation, info = env.reset(task)
                steps = [env.step(info["expert_action"])]
                steps.append(env.step(steps[-1][-1]["expert_action"]))
                seen.append((observation, sorted(info["admissible_actions"]), [s[0] for s in steps],
                             [sorted(s[-1]["admissible_actions"]) for s in steps], info["state_key"]))
        for env in envs:
            env.close()
        return seen

    random.seed(0)
    remembered = play()
    hits = _translated.cache_info().hits
    assert hits >= 4 * 7  # 8 resets into 2 games, 4 translations each: all but the first 2 x 2 of a game reused
    monkeypatch.setattr(fast_downward, "pddl2sas", fast_downward.pddl2sas.original)
    random.seed(0)
    assert play() == remembered and _translated.cache_info().hits == hits  # (none remembered this time)
