"""Gymnasium environments through `make_env("gymnasium", env_id=...)`: gymnasium's own toy-text environments
(FrozenLake, Taxi, CliffWalking) with their ansi frames and named Discrete actions, Blackjack's observation named
from the toy-text table, the classic-control environments' success, an environment of `spaces.Text`, observations written from their spaces (or by an
`observation_to_text` hook), seeded task groups, worker processes, bad input, and train.py's parsing of the
environment by name."""

import json
import re
import sys
from functools import partial
from typing import ClassVar

import numpy as np
import pytest
import yaml

pytest.importorskip("gymnasium", reason="the gymnasium extra is not installed: pip install 'hgpo-trl[gymnasium]'")

import gymnasium
from gymnasium import spaces
from gymnasium.wrappers import DiscretizeAction

from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.base import MissingExtraError
from hgpo_trl.envs.gymnasium_env import clean_frame
from hgpo_trl.envs.gymnasium_spaces import space_renderer
from hgpo_trl.envs.pool import WorkerPoolEnvs

FROZEN_PATH = ["down", "down", "right", "right", "down", "right"]  # through the default 4x4 map's holes


def play(env, seed, actions):
    """(observation of reset, [step results]) along `actions`, up to the end of the episode."""
    observation, _ = env.reset({"seed": seed})
    results = []
    for action in actions:
        results.append(env.step(action))
        if results[-1][2] or results[-1][3]:
            break
    return observation, results


def test_frozen_lake_frames_name_the_agent_and_the_goal_is_a_win():
    env = make_env("gymnasium", env_id="FrozenLake-v1", make_kwargs={"is_slippery": False})
    start, results = play(env, 0, FROZEN_PATH)
    assert start == "{S:red}FFF\nFHFH\nFFFH\nHFFG"  # the agent's tile in red; no ANSI codes, no action echo
    assert [r[1] for r in results] == [0.0] * 5 + [1.0]
    _, _, terminated, truncated, info = results[-1]
    assert terminated and not truncated and info["won"] and info["score"] == 1.0
    assert results[0][0] == "SFFF\n{F:red}HFH\nFFFH\nHFFG" and "(Down)" not in results[0][0]
    _, info = env.reset({"seed": 0})
    assert info["admissible_actions"] == ["left", "down", "right", "up"] and "goal G" in info["task"]
    _, results = play(env, 0, ["right", "down"])  # into the hole at row 1: over, lost
    assert results[-1][2] and not results[-1][4]["won"] and results[-1][4]["score"] == 0.0



def test_taxi_frames_show_the_taxi_the_passenger_and_the_destination_on_every_letter():
    """Where the taxi stands on a letter Taxi nests its colours (the passenger's blue or the destination's magenta
    around the taxi's yellow, or green when carrying): each colour stays on its cell, and no two states read alike
    (HGPO and GiGPO group on the text)."""
    env = gymnasium.make("Taxi-v4", render_mode="ansi")
    env.reset(seed=0)
    taxi = env.unwrapped

    def frame(state: int) -> str:
        taxi.s = state
        return clean_frame(env.render())

    assert frame(taxi.encode(0, 0, 0, 1)).splitlines()[1] == "|{R:blue,yellow}: | : :{G:magenta}|"
    for letter, (row, col) in zip("RGYB", taxi.locs, strict=True):
        for passenger in range(5):  # 4: aboard
            for destination in range(4):
                text = frame(taxi.encode(row, col, passenger, destination))
                colours = {cell: set(names.split(",")) for cell, names in re.findall(r"\{(.):([a-z,]+)\}", text)}
                assert ("green" if passenger == 4 else "yellow") in colours[letter], text
                assert passenger == 4 or "blue" in colours["RGYB"[passenger]], text
                assert "magenta" in colours["RGYB"[destination]] and "\x1b" not in text, text
    assert len({frame(state) for state in range(taxi.observation_space.n)}) == taxi.observation_space.n
    assert clean_frame("\x1b[31mA\x1b[0m\x1b[32mB\x1b[0mC\x1b[0m") == "{A:red}{B:green}C"  # adjacent spans
    env.close()

def test_slippery_ice_is_the_same_for_the_same_seed_and_differs_between_seeds():
    env = make_env("gymnasium", env_id="FrozenLake-v1")
    moves = ["right", "down"] * 10
    runs = {seed: [r[0] for r in play(env, seed, moves)[1]] for seed in (1, 1, 2, 3)}
    again = [r[0] for r in play(make_env("gymnasium", env_id="FrozenLake-v1"), 1, moves)[1]]
    assert runs[1] == again and len({tuple(run) for run in runs.values()}) > 1


def test_taxi_lists_only_the_actions_its_mask_allows_and_an_unknown_name_is_an_invalid_move():
    env = make_env("gymnasium", env_id="Taxi-v4")
    observation, info = env.reset({"seed": 3})
    assert info["admissible_actions"] == ["south", "east"]  # Taxi's action_mask at this start
    assert "{ :yellow}" in observation and "{R:blue}" in observation and "{Y:magenta}" in observation
    again, reward, terminated, _, info = env.step("Fly ")
    assert again == observation and reward == 0.0 and not terminated
    assert info["invalid_move"] and info["invalid_reason"].startswith("unknown action 'Fly '")
    _, reward, _, _, info = env.step(" Pickup")  # names are read stripped and lower-cased; a wrong pickup costs 10
    assert reward == -10.0 and not info["invalid_move"]
    starts = {env.reset({"seed": seed})[0] for seed in range(6)}
    assert len(starts) > 1 and env.reset({"seed": 3})[0] == observation  # seeds make the task groups


def test_cliff_walking_sends_the_agent_back_and_the_goal_ends_it():
    env = make_env("gymnasium", env_id="CliffWalking-v1", reward_scale=0.01, max_steps=20)
    start, results = play(env, 0, ["right"])
    assert results[0][0] == start and results[0][1] == -1.0 and not results[0][2]  # -100 x 0.01, back at start
    _, results = play(env, 0, ["up", *["right"] * 11, "down"])
    _, _, terminated, _, info = results[-1]
    assert terminated and info["won"] and info["score"] == pytest.approx(-0.13) and len(results) == 13
    _, results = play(env, 0, ["up"] * 25)  # our own step limit
    assert len(results) == 20 and results[-1][3] and not results[-1][2] and not results[-1][4]["won"]


def test_blackjack_reads_as_named_parts_and_a_win_is_a_positive_reward():
    env = make_env("gymnasium", env_id="Blackjack-v1")
    observation, info = env.reset({"seed": 0})
    assert observation == "your sum 11, dealer shows 10, usable ace: no"  # Tuple(Discrete(32), Discrete(11), ...)
    assert info["admissible_actions"] == ["stand", "hit"] and "blackjack" in info["task"]
    assert env.step("hit")[:4] == ("your sum 12, dealer shows 10, usable ace: no", 0.0, False, False)
    assert env.reset({"seed": 5})[0] == "your sum 21, dealer shows 9, usable ace: yes"
    _, reward, terminated, _, info = env.step("stand")
    assert reward == 1.0 and terminated and info["won"] and info["score"] == 1.0
    assert env.reset({"seed": 23})[0] == "your sum 15, dealer shows an ace, usable ace: no"
    _, reward, terminated, _, info = env.step(" Stand")
    assert reward == -1.0 and terminated and not info["won"]
    env.reset({"seed": 7})
    _, reward, terminated, _, info = env.step("stand")
    assert reward == 0.0 and terminated and not info["won"]  # a draw is no win


def discretized(env_id, **make_kwargs):
    """A classic-control environment of Box actions (refused as such) as 3 pushes: -2/3, 0 and 2/3 of its range."""
    return DiscretizeAction(gymnasium.make(env_id, **make_kwargs), bins=3)


def balance(observation):  # CartPole's [x, x', angle, angle']: push right under a pole leaning or falling right
    x, speed, angle, spin = observation
    return int(10 * angle + 2 * spin + 0.1 * x + 0.5 * speed > 0)


def pump(index):  # push along the velocity at observation[index]: swings MountainCar and Acrobot up to their goal
    return lambda observation: 2 if observation[index] >= 0 else 0


PUSHES = ["push left", "no push", "push right"]


@pytest.mark.parametrize(("env_id", "names", "ends_it", "won_ended", "lasts", "won_cut"), [
    ("CartPole-v1", ["push left", "push right"], lambda _: 0, False, balance, True),  # the pole falls: lost
    ("MountainCar-v0", PUSHES, pump(1), True, lambda _: 1, False),  # the flag, at a reward of -1: won
    ("Acrobot-v1", ["torque -1", "no torque", "torque +1"], pump(5), True, lambda _: 1, False),  # swung up, reward 0
    (partial(discretized, "MountainCarContinuous-v0"), PUSHES, pump(1), True, lambda _: 1, False),
    (partial(discretized, "Pendulum-v1"), PUSHES, None, None, lambda _: 2, False),  # never ends: never won
], ids=["CartPole", "MountainCar", "Acrobot", "MountainCarContinuous", "Pendulum"])
def test_classic_control_success_follows_what_its_ending_means(env_id, names, ends_it, won_ended, lasts, won_cut):
    """success "auto", played on the observations' text: an episode the environment ends (`ends_it`) and one
    cut by its own time limit or by max_steps (`lasts`)."""

    def outcome(policy, max_steps=1000, **make_kwargs):
        env = make_env("gymnasium", env_id=env_id, action_names=names, max_steps=max_steps, make_kwargs=make_kwargs)
        observation, _ = env.reset({"seed": 0})
        for _ in range(max_steps):
            observation, _, terminated, truncated, info = env.step(names[policy(json.loads(observation))])
            if terminated or truncated:
                return terminated, info["won"]
        return None

    if ends_it is not None:
        assert outcome(ends_it) == (True, won_ended)
    assert outcome(lasts, max_episode_steps=40) == outcome(lasts, max_steps=40) == (False, won_cut)


@pytest.mark.parametrize("action", ["jump", None], ids=["unknown action", "no action"])
def test_invalid_moves_do_not_keep_cartpole_s_pole_up(action):
    """An invalid move does not step the environment but counts towards max_steps: an episode of them alone is cut
    at max_steps with the pole never moved, which 'truncated' must not call a win (a model writing nonsense
    scored 100 % on CartPole)."""
    env = make_env("gymnasium", env_id="CartPole-v1", action_names=["push left", "push right"], max_steps=5)
    env.reset({"seed": 0})
    for _ in range(5):
        _, _, terminated, truncated, info = env.step(action)
    assert truncated and not terminated and info["won"] is False


class SecretWord(gymnasium.Env):
    """A gymnasium.Env of text observations and actions: say the secret word, drawn from the seeded np_random."""

    metadata: ClassVar[dict] = {"render_modes": []}
    WORDS = ("apple", "river", "stone")

    def __init__(self):
        self.observation_space = spaces.Text(64, charset="abcdefghijklmnopqrstuvwxyz .")
        self.action_space = spaces.Text(8, charset="abcdefghijklmnopqrstuvwxyz")

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.word = self.WORDS[self.np_random.integers(len(self.WORDS))]
        return f"the secret starts with {self.word[0]}.", {}

    def step(self, action):
        won = action == self.word
        return ("yes." if won else "no."), float(won), won, False, {"is_success": won}


def test_an_env_of_text_spaces_is_played_as_written():
    env = make_env("gymnasium", env_id=SecretWord, task="Say the secret word.", action_names=list(SecretWord.WORDS))
    observation, info = env.reset({"seed": 0})
    assert observation.startswith("the secret starts with ") and info["task"] == "Say the secret word."
    assert info["admissible_actions"] == ["apple", "river", "stone"]
    word = {w[0]: w for w in SecretWord.WORDS}[observation[-2]]
    assert env.step("two words")[4]["invalid_move"]  # a space is outside the action space's charset
    assert env.step("pear")[0] == "no."  # any text of the space is sent, listed or not
    _, reward, terminated, _, info = env.step(word)
    assert terminated and info["won"] and reward == 1.0


@pytest.mark.parametrize(("space", "observation", "text"), [
    (spaces.Discrete(3, start=-1), np.int64(-1), "-1"),
    (spaces.Text(16), "door", "door"),
    (spaces.MultiDiscrete([3, 2, 4]), np.array([2, 0, 3]), "[2, 0, 3]"),
    (spaces.MultiDiscrete([[2, 2], [3, 3]]), np.array([[1, 0], [2, 1]]), "[[1, 0], [2, 1]]"),
    (spaces.MultiBinary(3), np.array([1, 0, 1], dtype=np.int8), "[1, 0, 1]"),
    (spaces.Box(-1, 1, (3,)), np.array([0.0273, -0.5, -0.00004], dtype=np.float32), "[0.027, -0.5, 0]"),
    (spaces.Box(0, 9, (2, 2), dtype=np.int64), np.array([[1, 2], [3, 4]]), "[[1, 2], [3, 4]]"),
    (spaces.Box(-np.inf, np.inf, ()), np.array(1234.5678), "1234.568"),
    (spaces.Box(0, 1, (2,), dtype=np.bool_), np.array([True, False]), "[1, 0]"),
    (spaces.Tuple((spaces.Discrete(32), spaces.Discrete(11), spaces.Discrete(2))), (14, 10, 0), "(14, 10, 0)"),
    (spaces.Dict({"position": spaces.Box(0, 4, (2,), dtype=np.int64), "has_key": spaces.Discrete(2)}),
     {"position": np.array([3, 0]), "has_key": 1}, "{has_key: 1, position: [3, 0]}"),  # the space's (sorted) keys
    (spaces.Tuple((spaces.Discrete(2), spaces.Dict({"goal": spaces.Tuple((spaces.Discrete(5), spaces.Discrete(5))),
                                                    "seen": spaces.MultiBinary(2)}))),
     (1, {"goal": (4, 2), "seen": np.array([0, 1])}), "(1, {goal: (4, 2), seen: [0, 1]})"),
], ids=["discrete", "text", "multi-discrete", "multi-discrete-2d", "multi-binary", "box-floats", "box-ints",
        "box-scalar", "box-bools", "tuple", "dict", "nested"])
def test_an_observation_is_written_from_its_space(space, observation, text):
    assert space_renderer(space)(observation) == text


def test_an_array_of_up_to_64_numbers_is_written_and_an_unknown_env_reads_that_way():
    assert space_renderer(spaces.Box(0, 1, (8, 8), dtype=np.int64))(np.eye(8, dtype=np.int64)).count("1") == 8
    with pytest.raises(ValueError, match=r"holds 65 numbers, over the 64"):
        space_renderer(spaces.Box(0, 1, (65,)))
    env = make_env("gymnasium", env_id="MountainCar-v0", action_names=["push left", "no push", "push right"])
    assert env.reset({"seed": 0})[0] == "[-0.473, 0]"  # Box(2) of floats (position, velocity), no ansi frame


class Unreadable(gymnasium.Env):
    """An environment whose observations have no default text; never reset (it is refused before)."""

    metadata: ClassVar[dict] = {"render_modes": []}

    def __init__(self, observation_space):
        self.observation_space, self.action_space = observation_space, spaces.Discrete(2)


def camera():
    return Unreadable(spaces.Box(0, 255, (8, 8, 3), np.uint8))


def road_map():
    return Unreadable(spaces.Graph(spaces.Discrete(3), None))


def hand_of_cards():
    return Unreadable(spaces.Tuple((spaces.Discrete(2), spaces.Sequence(spaces.Discrete(52)))))


@pytest.mark.parametrize(("env_id", "part"), [
    (camera, "Box(0, 255, (8, 8, 3), uint8) holds 192 numbers, over the 64 written out as text"),
    (road_map, "Graph(Discrete(3), None) has no default text"),
    (hand_of_cards, "Sequence(Discrete(52), stack=False) has no default text"),  # a part of the Tuple
], ids=["image", "graph", "nested-sequence"])
def test_observations_with_no_text_are_refused_in_one_line_that_names_the_hook(env_id, part):
    with pytest.raises(ValueError) as refused:
        make_env("gymnasium", env_id=env_id, action_names=["wait", "go"])
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"Gymnasium environment '{env_id.__name__}' has no text")
    assert part in message and "pass observation_to_text, a function observation -> str" in message
    assert "env_kwargs {observation_to_text: 'my_module:my_function'}" in message


def blackjack_in_words(observation):
    """Blackjack's observation as a user's hook writes it (read by the test below as "module:function" too)."""
    player, dealer, usable_ace = observation
    return f"I hold {player}{' with a soft ace' if usable_ace else ''}; the dealer shows {dealer}."


def test_observation_to_text_replaces_the_default_given_as_a_function_or_in_yaml():
    from_python = make_env("gymnasium", env_id="Blackjack-v1", observation_to_text=blackjack_in_words)
    options = yaml.safe_load('{env_id: Blackjack-v1, observation_to_text: "tests.test_gymnasium:blackjack_in_words"}')
    for env in (from_python, make_env("gymnasium", **options)):
        assert env.reset({"seed": 5})[0] == "I hold 21 with a soft ace; the dealer shows 9."
        assert env.step("hit")[0] == "I hold 18; the dealer shows 9."
    with pytest.raises(ValueError, match="returned a tuple, not a str"):
        make_env("gymnasium", env_id="Blackjack-v1", observation_to_text=tuple).reset({"seed": 0})


def test_several_environments_per_worker_play_alike():
    factory = partial(make_env, "gymnasium", env_id="FrozenLake-v1")  # slippery: each env draws from np_random
    moves = ["right", "down", "right", "down"]
    with WorkerPoolEnvs(factory, 4, num_workers=2, reset_timeout=120, step_timeout=60) as pool:
        frames = [{r.observation for r in pool.reset([{"seed": 5}] * 4)}]
        for move in moves:
            frames.append({r.observation for r in pool.step(dict.fromkeys(range(4), move)).values()})
    reference = make_env("gymnasium", env_id="FrozenLake-v1")
    expected = [reference.reset({"seed": 5})[0], *[reference.step(m)[0] for m in moves]]
    assert pool.faults == 0 and frames == [{frame} for frame in expected]


TINY_RUN = """model_name_or_path: tiny
output_dir: {out}
report_to: none
use_cpu: true
env_name: gymnasium
task_kwargs: {{num_tasks: 2}}
action_mode: plain
invalid_action: end_episode
num_eval_tasks: 2
tiny_hidden_size: 32
tiny_num_layers: 1
tiny_num_heads: 2
warmstart_steps: 20
warmstart_batch_size: 16
warmstart_learning_rate: 0.01
tasks_per_device: 2
num_generations: 4
per_device_train_batch_size: 16
max_completion_length: 3
max_env_steps: 6
train_iterations: 2
save_strategy: "no"
logging_steps: 1
disable_tqdm: true
plots: false
"""


@pytest.mark.slow
def test_tasks_are_seed_rows_and_train_py_trains_on_the_environment_by_name(tmp_path):
    from hgpo_trl.commands.train import main

    assert make_tasks("gymnasium", "valid", env_id="Taxi-v4", num_tasks=2)["task_id"] == ["Taxi-v4/1000000",
                                                                                         "Taxi-v4/1000001"]
    config = tmp_path / "frozen.yaml"
    config.write_text(TINY_RUN.format(out=tmp_path / "out"))
    main(["--config", str(config), "--env_kwargs", '{"env_id": "FrozenLake-v1", "max_steps": 6}'])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["iterations"] == summary["optimizer_steps"] == 2 and 0 <= summary["success_rate_end"] <= 1
    assert summary["config"]["trainer"]["env_kwargs"] == {"env_id": "FrozenLake-v1", "max_steps": 6}


@pytest.mark.slow
def test_train_py_trains_on_blackjack_by_name(tmp_path, monkeypatch):
    import hgpo_trl.commands.train

    histories = []  # the trainer's log history, as the run hands it to its summary
    start_evaluation = hgpo_trl.commands.train.start_evaluation
    monkeypatch.setattr(hgpo_trl.commands.train, "start_evaluation", lambda log: histories.append(log) or start_evaluation(log))
    config = tmp_path / "blackjack.yaml"
    config.write_text(TINY_RUN.format(out=tmp_path / "out"))
    hgpo_trl.commands.train.main(["--config", str(config), "--env_kwargs", '{"env_id": "Blackjack-v1"}'])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["iterations"] == summary["optimizer_steps"] == 2 and 0 <= summary["success_rate_end"] <= 1
    iterations = [log for log in histories[0] if "env/success_rate" in log]
    assert len(iterations) == 2 and all(log["steps/collected"] > 0 and log["env/faults"] == 0 for log in iterations)
    assert all(0 <= log["env/success_rate"] <= 1 and -1 <= log["env/episode_reward"] <= 1 for log in iterations)


def one_room(render_mode="ansi"):
    """A toy-text environment built by hand: no registered id, so no built-in action names."""
    # Imported by name: `gymnasium.envs.toy_text` is an attribute only once a test before made a toy-text id.
    from gymnasium.envs.toy_text import CliffWalkingEnv

    return CliffWalkingEnv(render_mode=render_mode)


@pytest.mark.parametrize(("options", "message"), [
    ({"env_id": one_room}, "Discrete action space .* pass action_names"),
    ({"env_id": "FrozenLake-v1", "action_names": ["left", "down", "right"]}, r"3 names for Discrete\(4\)"),
    ({"env_id": "FrozenLake-v1", "action_names": ["go", "Go ", "a", "b"]}, "must differ once stripped"),
    ({"env_id": "FrozenLake-v1", "action_names": {"left": 0, "jump": 7}}, r"\['jump'\] are not"),
    ({"env_id": "FrozenLake-v1", "action_names": "left down right up"}, "a list or a mapping"),
    ({"env_id": partial(one_room, render_mode=None), "action_names": ["u", "r", "d", "l"], "observation": "ansi"},
     "does not render as text"),
    ({"env_id": "CartPole-v1"}, "Discrete action space .* pass action_names"),
    ({"env_id": "Pendulum-v1"}, r"action space must be Text or Discrete, got Box\(-2.0, 2.0"),
    ({"env_id": "MountainCarContinuous-v0"}, r"action space must be Text or Discrete, got Box\(-1.0, 1.0"),
    ({"env_id": "Blackjack-v1", "observation_to_text": str, "observation": "text"}, "replaces observation='text'"),
    ({"env_id": "Blackjack-v1", "observation_to_text": "no_such_module:words"}, "cannot be imported: ModuleNot"),
    ({"env_id": "Blackjack-v1", "observation_to_text": "words"}, "a function or a 'module:function' string"),
    ({"env_id": "NoSuchGame-v0"}, "'NoSuchGame-v0' could not be made"),
    ({"env_id": "FrozenLake-v1", "success": "maybe"}, "success must be one of"),
    ({"env_id": 7}, "env_id must be a gymnasium id"),
], ids=["no-names", "wrong-count", "duplicates", "not-an-action", "string", "no-ansi", "cartpole", "pendulum",
        "mountain-car-continuous", "hook-and-mode", "hook-missing", "hook-no-module", "unknown", "success", "env-id"])
def test_bad_input_is_one_error_naming_the_problem(options, message):
    with pytest.raises(ValueError, match=message):
        make_env("gymnasium", **options)


def test_without_the_package_the_error_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gymnasium", None)  # import gymnasium fails, as where it is not installed
    with pytest.raises(MissingExtraError, match=r'needs the gymnasium package: pip install "hgpo-trl\[gymnasium\]"'):
        make_env("gymnasium", env_id="FrozenLake-v1")


def test_named_actions_by_mapping_and_a_row_without_an_environment():
    env = make_env("gymnasium", env_id=one_room, action_names={"north": 0, "east": 1, "south": 2, "west": 3})
    start, _ = env.reset({"seed": 0})
    assert env.step("north")[0] != start and env.step("south")[0] == start
    with pytest.raises(ValueError, match="names no environment"):
        make_env("gymnasium").reset({"seed": 0})
    assert clean_frame("\x1b[41mS\x1b[0mF\n  (Left)\n") == "{S:red}F"


@pytest.mark.parametrize("model", ["tiny", "folder"])
def test_train_py_refuses_an_environment_it_cannot_build_in_one_line(tmp_path, capsys, model, tiny_model,
                                                                     tiny_tokenizer):
    """Before any model loads (the tiny one is built from the environment's texts, a folder's is not)."""
    from hgpo_trl.commands.train import main

    config = tmp_path / "cartpole.yaml"
    config.write_text(TINY_RUN.format(out=tmp_path / "out"))
    argv = ["--config", str(config), "--env_kwargs", '{"env_id": "CartPole-v1"}']
    if model == "folder":
        tiny_model.save_pretrained(tmp_path / "model")
        tiny_tokenizer.save_pretrained(tmp_path / "model")
        argv += ["--model_name_or_path", str(tmp_path / "model"), "--warmstart_steps", "0"]
        capsys.readouterr()  # (the save's bar)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("train.py: configuration error: HGPOConfig.env_kwargs: environment 'gymnasium' cannot be "
                          "built: ") and "pass action_names" in err and len(err.splitlines()) == 1, err
