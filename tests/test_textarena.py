"""TextArena's real single-player games (textarena 0.7.4) through `make_env("textarena", game=...)`: outcomes,
the games' invalid-move rules as our invalid steps, the board as the observation, each environment's own
`random`, worker processes, nltk data checks, and a tiny-model training run through train.py."""

import json
import random
import sys
from functools import partial

import pytest

pytest.importorskip("textarena", reason="the textarena extra is not installed: pip install 'hgpo-trl[textarena]'")

from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.base import MissingExtraError
from hgpo_trl.envs.pool import InProcessEnvs, WorkerPoolEnvs
from hgpo_trl.envs.textarena_env import GAME_STARTED, NltkDataMissing
from hgpo_trl.rollout.actions import format_action
from hgpo_trl.rollout.lockstep import Completion, RolloutSettings, run_rollout

HANOI_SOLUTION = ["[a c]", "[a b]", "[c b]", "[a c]", "[b a]", "[b c]", "[a c]"]
HANOI_MOVES = ["[a b]", "[a c]", "[b a]", "[b c]", "[c a]", "[c b]"]


def play(env, task, actions):
    """The (observation, reward, terminated, truncated, info) of each action, from reset(task)."""
    first = env.reset(task)
    return first, [env.step(action) for action in actions]


def test_tower_of_hanoi_is_won_by_its_solution_and_the_reward_follows_the_score():
    env = make_env("textarena", game="TowerOfHanoi-v0")
    (observation, info), steps = play(env, {"seed": 0}, HANOI_SOLUTION)
    assert observation.startswith("Current Board:") and "A: [3, 2, 1]" in observation
    assert "Tower of Hanoi" in info["task"] and "Tower of Hanoi" not in observation  # rules: the task, not the state
    assert info["admissible_actions"] == [] and not info["won"]
    assert [s[1] for s in steps] == [0.0] * 6 + [10.0]
    *_, (last, _, terminated, truncated, end) = steps
    assert terminated and not truncated and end["won"] and end["score"] == 1.0 and not end["invalid_move"]
    assert "C: [3, 2, 1]" in last and "Game over. Congratulations" in last
    # reward="score": the game's graded outcome, here 2 disks of 3 placed when its turn limit (14) has passed.
    env = make_env("textarena", game="TowerOfHanoi-v0", reward="score", win_reward=2.0)
    _, steps = play(env, {"seed": 0}, [*HANOI_SOLUTION[:6], *["[a b]", "[b a]"] * 4, "[a b]"])
    *_, (_, reward, terminated, _, end) = steps
    assert terminated and not end["won"] and end["score"] == pytest.approx(2 / 3) and reward == 2.0 * end["score"]


def test_a_refused_move_is_an_invalid_move_and_a_second_in_a_row_ends_the_game():
    env = make_env("textarena", game="FrozenLake-v0")
    observation, info = env.reset({"seed": 0})
    assert info["admissible_actions"][:4] == ["[up]", "[down]", "[left]", "[right]"]  # from the board
    board = observation
    # Up from the top-left corner: the game's notice, the board, and the player tries again.
    refused, reward, terminated, _, info = env.step("up")
    assert info["invalid_move"] and not terminated and reward == 0.0
    assert refused.startswith("You attempted an invalid move.") and refused.endswith(board)
    assert "hit a wall" in info["invalid_reason"]
    _, _, terminated, _, info = env.step("left")
    assert terminated and info["invalid_move"] and info["invalid_reason"].startswith("Invalid Move:")
    assert not info["won"] and info["score"] < 1 and info["admissible_actions"] == []
    # A valid move in between forgives the first one: the game goes on.
    env.reset({"seed": 0})
    results = [env.step(action) for action in ["up", "right", "up"]]
    assert [r[4]["invalid_move"] for r in results] == [True, False, True] and not any(r[2] for r in results)


def test_the_observation_is_the_current_board_and_reads_the_same_on_every_path_to_it():
    env = make_env("textarena", game="FifteenPuzzle-v0")
    start, info = env.reset({"seed": 3})
    assert info["admissible_actions"] == ["[up]", "[down]", "[left]", "[right]"]
    there = env.step("up")[0]
    back, _, _, _, info = env.step("down")
    assert back == start != there and info["state_key"] == start
    assert "15-Puzzle" not in back and back.count("Current Board:") == 1  # no rules, no log of past boards
    # A board that does not list its moves: the admissible actions come from actions=, or none.
    env = make_env("textarena", game="TowerOfHanoi-v0", actions=HANOI_MOVES)
    assert env.reset({"seed": 0})[1]["admissible_actions"] == HANOI_MOVES


def test_a_game_without_a_board_shows_its_latest_message_and_keeps_it_after_an_invalid_move():
    env = make_env("textarena", game="GuessTheNumber-v0")
    observation, _ = env.reset({"seed": 7})
    assert observation == GAME_STARTED
    low, high, hints = 1, 20, []
    for _ in range(6):
        guess = (low + high) // 2
        observation, reward, terminated, _, info = env.step(f"[{guess}]")
        if terminated:
            break
        hints.append(observation)
        low, high = (guess + 1, high) if "higher" in observation else (low, guess - 1)
    assert terminated and info["won"] and reward == 10.0
    assert set(hints) <= {"The target number is higher.", "The target number is lower."}
    env.reset({"seed": 7})
    hint = env.step("[10]")[0]
    refused, _, _, _, info = env.step("ten")
    assert info["invalid_move"] and refused.startswith("You attempted an invalid move.") and refused.endswith(hint)


def trajectory(env, seed, actions):
    """The observations from reset({"seed": seed}) along `actions`, up to the end of the episode."""
    observations = [env.reset({"seed": seed})[0]]
    for action in actions:
        observation, _, terminated, truncated, _ = env.step(action)
        observations.append(observation)
        if terminated or truncated:
            break
    return observations


@pytest.mark.parametrize(("game", "actions"), [("2048-v0-ultra-easy", ["up", "left", "down", "right"] * 3),
                                               ("Minesweeper-v0-small", ["[2 2]", "[0 0]", "[4 4]", "[0 4]"])])
def test_same_seed_same_actions_same_trajectory_whatever_else_draws_from_random(game, actions):
    """2048 draws a tile after every move, Minesweeper lays its mines on the first one, both from Python's global
    `random`: each environment plays on its own state of it, and leaves the caller's as it was."""
    alone = trajectory(make_env("textarena", game=game), 5, actions)
    first, second = make_env("textarena", game=game), make_env("textarena", game=game)
    random.seed(123)
    outer = random.getstate()
    together = [[first.reset({"seed": 5})[0]], [second.reset({"seed": 5})[0]]]
    assert random.getstate() == outer
    for action in actions:  # interleaved, with the caller drawing between the calls
        together[0].append(first.step(action)[0])
        random.random()
        together[1].append(second.step(action)[0])
    assert together[0] == together[1] == alone
    assert trajectory(first, 5, actions) == alone != trajectory(second, 6, actions)


def test_several_environments_per_worker_play_alike_and_as_in_process():
    factory = partial(make_env, "textarena", game="2048-v0-ultra-easy")
    actions = ["up", "left", "down", "right", "up", "left"]
    reference = trajectory(factory(), 11, actions)
    with WorkerPoolEnvs(factory, 4, num_workers=2, reset_timeout=120, step_timeout=60) as pool:
        steps = [[r.observation for r in pool.reset([{"seed": 11}] * 4)]]
        for action in actions:
            steps.append([r.observation for r in pool.step(dict.fromkeys(range(4), action)).values()])
    assert pool.faults == 0
    assert [set(observations) for observations in steps] == [{o} for o in reference]


def test_the_rollout_counts_refused_moves_as_invalid_steps():
    script = iter(["[a c]", "[a c]", "[c a]", "[b c]"])  # the 2nd is refused (2 onto 1), the 4th too (B is empty)

    def policy(prompts):
        return [Completion(text=format_action(next(script), "plain")) for _ in prompts]

    envs = InProcessEnvs(partial(make_env, "textarena", game="TowerOfHanoi-v0", actions=HANOI_MOVES), 1)
    rollout = run_rollout(envs, [{"seed": 0}], 1, policy, RolloutSettings(action_mode="plain", max_steps=4))
    assert [r.rejected for r in rollout.steps] == [False, True, False, True]
    assert list(rollout.step_batch().valid) == [True, False, True, False] and rollout.episodes[0].invalid == 2
    assert rollout.steps[0].prompt.startswith("You are playing Tower of Hanoi")
    assert "Actions: [a b] | [a c]" in rollout.steps[0].prompt


def test_tasks_are_game_seed_rows_with_disjoint_splits():
    train = make_tasks("textarena", "train", games=["TowerOfHanoi-v0", "FrozenLake-v0"], num_tasks=2)
    assert train["task_id"] == ["TowerOfHanoi-v0/0", "TowerOfHanoi-v0/1", "FrozenLake-v0/0", "FrozenLake-v0/1"]
    assert make_tasks("textarena", "valid", game="FrozenLake-v0", num_tasks=1)["seed"] == [1_000_000]
    rows = make_tasks("textarena", "test", seeds=[4, 9])  # no game: the environment's game= plays them
    assert rows.column_names == ["task_id", "seed", "split"] and rows["seed"] == [4, 9]
    env = make_env("textarena", game="TowerOfHanoi-v0")
    assert env.reset(rows[0])[1]["game"] == "TowerOfHanoi-v0"
    assert env.reset(train[2])[1]["game"] == "FrozenLake-v0"  # a row's game wins


@pytest.mark.parametrize(("build", "message"), [
    (lambda: make_env("textarena", game="Chess-v9"), "unknown TextArena game 'Chess-v9'"),
    (lambda: make_env("textarena", game="TicTacToe-v0"), "'TicTacToe-v0' is not a single-player game"),
    (lambda: make_tasks("textarena", games=["FrozenLake-v0", "TicTacToe-v0"]), "is not a single-player game"),
    (lambda: make_env("textarena", game="TwentyQuestions-v0"), "could not be built: ValueError: OpenRouter API key"),
    (lambda: make_env("textarena", reward="points"), "reward must be one of"),
    (lambda: make_env("textarena", actions="up"), "actions must be a list of strings"),
    (lambda: make_env("textarena").reset({"seed": 0}), "TextArena task names no game"),
    (lambda: make_env("textarena", game="FrozenLake-v0").reset({"seed": -1}), "'seed' must be an integer >= 0"),
    (lambda: make_tasks("textarena", game="FrozenLake-v0", games=["FrozenLake-v0"]), "not both"),
    (lambda: make_tasks("textarena", game="FrozenLake-v0", num_tasks=0), "num_tasks must be a positive integer"),
], ids=["unknown", "two-player", "two-player-in-tasks", "needs-network", "reward", "actions", "no-game", "seed",
        "game-and-games", "num-tasks"])
def test_bad_input_is_one_error_naming_the_problem(build, message, monkeypatch):
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    with pytest.raises(ValueError, match=message):
        build()


def test_without_the_package_the_error_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)  # import textarena fails, as where it is not installed
    with pytest.raises(MissingExtraError, match=r'needs the textarena package: pip install "hgpo-trl\[textarena\]"'):
        make_env("textarena", game="FrozenLake-v0")


def test_missing_nltk_data_is_one_line_before_the_game_is_imported(tmp_path, monkeypatch):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])  # wherever the data may be, nltk looks only here now
    monkeypatch.setattr(nltk, "download", lambda *a, **k: pytest.fail("nltk.download was called"))
    with pytest.raises(NltkDataMissing, match="'Wordle-v0' needs the nltk data 'averaged_perceptron_tagger_eng "
                                              "words'.*python -m nltk.downloader") as raised:
        make_env("textarena", game="Wordle-v0")
    assert "\n" not in str(raised.value) and "textarena.envs.Wordle.env" not in sys.modules
    with pytest.raises(NltkDataMissing, match="'Hangman-v0' needs the nltk data 'words'"):
        make_tasks("textarena", game="Hangman-v0")
    # With the data folder present, the game's own nltk.download('words') answers locally (no network): what
    # fails then is reading the empty corpus, still one error naming the game.
    (tmp_path / "corpora" / "words").mkdir(parents=True)
    with pytest.raises(ValueError, match="'Hangman-v0' could not be built"):
        make_env("textarena", game="Hangman-v0")


SECRETARY_RUN = """model_name_or_path: tiny
output_dir: {out}
report_to: none
use_cpu: true
env_name: textarena
env_kwargs: {{"game": "Secretary-v0", "actions": ["[accept]", "[continue]"]}}
task_kwargs: {{"game": "Secretary-v0", "num_tasks": 2}}
env_workers: 2
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
max_completion_length: 5
max_env_steps: 5
train_iterations: 2
save_strategy: "no"
logging_steps: 1
disable_tqdm: true
plots: false
"""


@pytest.mark.slow
def test_train_py_trains_the_tiny_model_on_secretary_with_env_workers(tmp_path, capsys):
    from hgpo_trl.commands.train import main

    config = tmp_path / "secretary.yaml"
    config.write_text(SECRETARY_RUN.format(out=tmp_path / "out") + "console_metrics: true\n")  # the dicts too
    main(["--config", str(config)])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["iterations"] == summary["optimizer_steps"] == 2 and 0 <= summary["success_rate_end"] <= 1
    assert summary["config"]["trainer"]["env_name"] == "textarena" and summary["config"]["trainer"]["env_workers"] == 2
    printed = capsys.readouterr().out
    assert printed.count("[iter ") == 2 and printed.count("'env/faults': '0'") == 2  # the workers played every step
