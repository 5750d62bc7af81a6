"""The keydoor environment: dynamics, aliasing, task splits, prompt, registry."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hgpo_trl.envs import TextEnv, make_env, make_tasks, registered_envs
from hgpo_trl.envs.keydoor import (
    NOTHING,
    KeyDoorEnv,
    KeyDoorTask,
    admissible_actions,
    initial_observation,
    keydoor_tasks,
    transition,
)

TASK = {"room1": "library", "room2": "kitchen", "color1": "red", "color2": "blue", "gold": "red"}
GOLD_PATH = ["take red key", "go to hall", "go to vault", "open red door"]
COIN_PATH = ["take blue key", "go to hall", "go to vault", "open blue door"]


def play(env, task, actions):
    """Reset on `task`, take `actions`; the list of step results."""
    env.reset(task)
    return [env.step(action) for action in actions]


def optimal_actions(row):
    return [f"take {row['gold']} key", "go to hall", "go to vault", f"open {row['gold']} door"]


@pytest.mark.parametrize("pools", [(2, 2), (4, 4)])
@pytest.mark.parametrize("split", ["train", "valid", "test"])
def test_optimal_policy_wins_every_task(split, pools):
    env = KeyDoorEnv()
    rows = keydoor_tasks(split, num_rooms=pools[0], num_colors=pools[1])
    assert len(rows) > 0
    for row in rows:
        results = play(env, row, optimal_actions(row))
        assert [r[1] for r in results] == [0.0, 0.0, 0.0, 10.0]
        assert [(r[2], r[3]) for r in results] == [(False, False)] * 3 + [(True, False)]
        assert results[-1][4]["won"] and results[-1][4]["step"] == 4
        assert results[-1][0] == f"You open the {row['gold']} door and find the gold!"


def test_gold_path_observations_and_info():
    env = KeyDoorEnv()
    obs, info = env.reset(TASK)
    assert obs == "You are in the entrance. The library has a red key. The kitchen has a blue key."
    assert info == {"admissible_actions": ["take red key", "take blue key"], "state_key": obs, "won": False,
                    "task": "Find the gold. It is behind the red door.", "step": 0}
    assert env.state == (KeyDoorTask.from_row(TASK).task_id, "entrance", None)
    expected = [
        ("You are in the library. You take the red key.", ["go to hall"], ("library", "red")),
        ("You are in the hall.", ["go to vault"], ("hall", "red")),
        ("You are at the vault. There is a red door and a blue door.", ["open red door", "open blue door"],
         ("vault", "red")),
        ("You open the red door and find the gold!", [], ("end", "red")),
    ]
    for step, (action, (text, admissible, state)) in enumerate(zip(GOLD_PATH, expected, strict=True), 1):
        obs, _, _, _, info = env.step(action)
        assert (obs, info["admissible_actions"], env.state[1:]) == (text, admissible, state)
        assert info["state_key"] == obs and info["step"] == step


def test_coin_path_and_custom_rewards():
    env = KeyDoorEnv(gold_reward=5.0, coin_reward=2.0)
    obs, reward, terminated, truncated, info = play(env, TASK, COIN_PATH)[-1]
    assert obs == "You open the blue door and find a coin."
    assert (reward, terminated, truncated, info["won"]) == (2.0, True, False, False)
    assert play(env, TASK, GOLD_PATH)[-1][1] == 5.0


def test_key_reward_pays_the_gold_key_only():
    env = KeyDoorEnv(key_reward=2.5)
    gold, coin = play(env, TASK, GOLD_PATH), play(env, TASK, COIN_PATH)
    assert [step[1] for step in gold] == [2.5, 0.0, 0.0, 10.0]
    assert [step[1] for step in coin] == [0.0, 0.0, 0.0, 3.0]
    assert [step[1] for step in play(KeyDoorEnv(), TASK, GOLD_PATH)] == [0.0, 0.0, 0.0, 10.0]  # off by default


def test_locked_door_ends_the_episode_without_reward():
    env = KeyDoorEnv()
    obs, reward, terminated, truncated, info = play(env, TASK, [*COIN_PATH[:3], "open red door"])[-1]
    assert obs == "The red door is locked."
    assert (reward, terminated, truncated, info["won"]) == (0.0, True, False, False)


@pytest.mark.parametrize("bad", [None, "", "go to attic", "take green key", "go to library", "open green door",
                                 "go to hall please", "look"])
@pytest.mark.parametrize("prefix", range(4))
def test_invalid_action_changes_nothing(bad, prefix):
    env = KeyDoorEnv()
    info = env.reset(TASK)[1]
    for action in GOLD_PATH[:prefix]:
        info = env.step(action)[4]
    state = env.state
    obs, reward, terminated, truncated, info_after = env.step(bad)
    assert (obs, reward, terminated, truncated) == (NOTHING, 0.0, False, False)
    assert env.state == state and info_after["admissible_actions"] == info["admissible_actions"]
    assert info_after["state_key"] == NOTHING and info_after["step"] == prefix + 1
    # The game goes on from where it was.
    assert [env.step(a)[1] for a in GOLD_PATH[prefix:]][-1] == 10.0


def test_admissible_action_at_the_wrong_time_changes_nothing():
    env = KeyDoorEnv()
    env.reset(TASK)
    assert env.step("open red door")[0] == NOTHING and env.state[1:] == ("entrance", None)


def test_actions_compare_stripped_and_lower_cased():
    env = KeyDoorEnv()
    results = play(env, TASK, ["  Take RED Key ", "GO TO HALL", "go to vault\n", " Open Red Door"])
    assert results[-1][1] == 10.0 and results[-1][4]["won"]


def test_truncation_at_max_steps():
    env = KeyDoorEnv(max_steps=3)
    results = play(env, TASK, ["take red key", None, "go to hall"])
    assert [r[3] for r in results] == [False, False, True]
    assert not results[-1][2] and results[-1][4]["step"] == 3
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("go to vault")
    # Termination on the last allowed step is not truncation.
    env = KeyDoorEnv(max_steps=4)
    assert play(env, TASK, GOLD_PATH)[-1][2:4] == (True, False)


def test_step_before_reset_and_after_done_raise():
    env = KeyDoorEnv()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("take red key")
    with pytest.raises(RuntimeError, match="before reset"):
        _ = env.state
    play(env, TASK, GOLD_PATH)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("open red door")
    assert env.reset(TASK)[1]["step"] == 0  # reset starts over


@pytest.mark.parametrize(("row", "match"), [
    ({k: v for k, v in TASK.items() if k != "gold"}, "lacks field 'gold'"),
    ({**TASK, "room2": 3}, "field 'room2' must be a string"),
    ({**TASK, "room1": "Library"}, "field 'room1' must be one of"),
    ({**TASK, "color2": "purple"}, "field 'color2' must be one of"),
    ({**TASK, "room2": "library"}, "'room1' and 'room2' must differ"),
    ({**TASK, "color2": "red"}, "'color1' and 'color2' must differ"),
    ({**TASK, "gold": "green"}, "field 'gold' must be color1 or color2"),
    ({**TASK, "task_id": 12345}, "field 'task_id' is 12345"),
    ({**TASK, "task_id": "0"}, "field 'task_id' is '0'"),
    (["library", "kitchen"], "must be a mapping"),
])
def test_malformed_task_rows(row, match):
    with pytest.raises(ValueError, match=match):
        KeyDoorEnv().reset(row)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_steps": 0}, "max_steps"), ({"max_steps": 2.5}, "max_steps"), ({"max_steps": True}, "max_steps"),
    ({"gold_reward": float("nan")}, "gold_reward"), ({"coin_reward": "3"}, "coin_reward"),
    ({"key_reward": float("inf")}, "key_reward"),
])
def test_bad_constructor_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KeyDoorEnv(**kwargs)


def test_hall_and_vault_are_aliased_across_the_two_paths():
    env = KeyDoorEnv()
    gold = [r[0] for r in play(env, TASK, GOLD_PATH[:3])]
    coin = [r[0] for r in play(env, TASK, COIN_PATH[:3])]
    assert gold[0] != coin[0]  # the room observations tell the paths apart ...
    assert gold[1:] == coin[1:]  # ... the hall and the vault do not
    # The right vault action differs: the gold path wins with the red door, the other path's best is the
    # blue door (coin) while the red door is locked.
    vault = {path: [] for path in ("gold", "coin")}
    for path, prefix in (("gold", GOLD_PATH[:3]), ("coin", COIN_PATH[:3])):
        for door in ("red", "blue"):
            vault[path].append(play(env, TASK, [*prefix, f"open {door} door"])[-1][1])
    assert vault == {"gold": [10.0, 0.0], "coin": [0.0, 3.0]}


def test_transition_is_pure_and_matches_the_env():
    task = KeyDoorTask.from_row(TASK)
    assert initial_observation(task) == KeyDoorEnv().reset(TASK)[0]
    assert admissible_actions(task, "vault") == ("open red door", "open blue door")
    assert transition(task, "vault", "blue", "open blue door") == ("end", "blue",
                                                                   "You open the blue door and find a coin.",
                                                                   3.0, True, False)
    assert transition(task, "hall", "red", "go to vault") == transition(task, "hall", "red", "go to vault")
    with pytest.raises(ValueError, match="episode is over"):
        transition(task, "end", "red", "open red door")
    with pytest.raises(ValueError, match="unknown keydoor position"):
        transition(task, "roof", None, "go to hall")
    with pytest.raises(ValueError, match="action must be a string or None"):
        transition(task, "entrance", None, 3)


ROWS_4X4 = keydoor_tasks("train", num_rooms=4, num_colors=4).to_list()
ACTIONS_4X4 = sorted({f"go to {r}" for r in ("library", "kitchen", "cellar", "attic", "hall", "vault")}
                     | {f"{verb} {c} {thing}" for c in ("red", "blue", "green", "yellow")
                        for verb, thing in (("take", "key"), ("open", "door"))})


@settings(max_examples=200, deadline=None)
@given(row=st.sampled_from(ROWS_4X4), actions=st.lists(st.sampled_from([*ACTIONS_4X4, None]), max_size=10))
def test_env_follows_transition(row, actions):
    """Replaying `transition` from the env's own state gives exactly what the env returns, for any actions."""
    task = KeyDoorTask.from_row(row)
    env = KeyDoorEnv(max_steps=6)
    env.reset(row)
    for step, action in enumerate(actions, 1):
        _, position, key = env.state
        expected = transition(task, position, key, action)
        obs, reward, terminated, truncated, info = env.step(action)
        assert (obs, reward, terminated, info["won"]) == (expected.observation, expected.reward,
                                                          expected.terminated, expected.won)
        assert env.state[1:] == (expected.position, expected.key)
        assert truncated == (not terminated and step == 6)
        if terminated or truncated:
            break


def test_task_splits_are_deterministic_disjoint_and_cover_the_pool():
    for pools, sizes in (((2, 2), (6, 1, 1)), ((4, 4), (202, 43, 43))):
        kwargs = {"num_rooms": pools[0], "num_colors": pools[1]}
        splits = {s: keydoor_tasks(s, **kwargs) for s in ("train", "valid", "test")}
        assert tuple(len(d) for d in splits.values()) == sizes
        ids = {s: set(d["task_id"]) for s, d in splits.items()}
        assert sum(len(i) for i in ids.values()) == sum(sizes)  # disjoint, no repeats
        assert keydoor_tasks("train", **kwargs).to_list() == splits["train"].to_list()
        for d in splits.values():
            for row in d:
                assert row["task_id"] == KeyDoorTask.from_row(row).task_id
    assert list(keydoor_tasks("train", seed=1)["task_id"]) != list(keydoor_tasks("train", seed=0)["task_id"])


def test_pools_restrict_rooms_and_colours():
    rows = keydoor_tasks("train", num_rooms=3, num_colors=2)
    assert {r for row in rows for r in (row["room1"], row["room2"])} <= {"library", "kitchen", "cellar"}
    assert {c for row in rows for c in (row["color1"], row["color2"])} == {"red", "blue"}
    assert set(keydoor_tasks("train")["room1"]) <= {"library", "kitchen"}


def test_num_tasks_caps_and_cycles():
    def ids(split, **kwargs):
        return list(keydoor_tasks(split, **kwargs)["task_id"])

    train = ids("train")
    assert ids("train", num_tasks=4) == train[:4]
    assert ids("train", num_tasks=64) == (train * 11)[:64]
    assert ids("valid", num_tasks=3) == ids("valid") * 3
    assert keydoor_tasks("train", num_tasks=64)[63] == keydoor_tasks("train")[63 % len(train)]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"split": "dev"}, "split must be one of"), ({"num_rooms": 1}, "num_rooms"), ({"num_colors": 7}, "num_colors"),
    ({"num_tasks": 0}, "num_tasks"), ({"num_tasks": 2.0}, "num_tasks"),
])
def test_bad_task_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        keydoor_tasks(**kwargs)


def test_render_prompt_with_two_step_history():
    env = KeyDoorEnv()
    history = [("You are in the library. You take the red key.", "go to hall"),
               ("You are in the hall.", "go to vault")]
    prompt = env.render_prompt("Find the gold. It is behind the red door.", history,
                               "You are at the vault. There is a red door and a blue door.",
                               ["open red door", "open blue door"], 3)
    assert prompt == ("Step 3.\nHistory:\n"
                      "> You are in the library. You take the red key.\n< go to hall\n"
                      "> You are in the hall.\n< go to vault\n"
                      "Now: You are at the vault. There is a red door and a blue door.\n"
                      "Actions: open red door | open blue door\n"
                      "Task: Find the gold. It is behind the red door.\nAnswer:")
    assert env.render_prompt("T.", [], "O.", ["a", "b"], 0) == "Step 0.\nNow: O.\nActions: a | b\nTask: T.\nAnswer:"


def test_registry():
    assert "keydoor" in registered_envs()
    env = make_env("keydoor", max_steps=8)
    assert isinstance(env, TextEnv) and env.max_steps == 8
    assert make_tasks("keydoor", "train").to_list() == keydoor_tasks("train").to_list()
    assert len(make_tasks("keydoor", "test", num_rooms=4, num_colors=4)) == 43
    with pytest.raises(ValueError, match=r"unknown environment 'nope'; registered: \[.*'keydoor'"):
        make_env("nope")
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        make_tasks("nope")
    with pytest.raises(ValueError, match="does not accept these options"):
        make_env("keydoor", colours=3)
    with pytest.raises(ValueError, match=r"environment 'keydoor' does not accept these task options \['colours'\]"):
        make_tasks("keydoor", "train", colours=3)
    # YAML's flow mapping needs a space after each colon: '{num_rooms:6}' is the key 'num_rooms:6' with no value.
    with pytest.raises(ValueError, match=r"\['num_rooms:6'\].*write '\{num_rooms: 6\}'"):
        make_tasks("keydoor", "train", **{"num_rooms:6": None})
