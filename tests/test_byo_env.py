"""examples/byo_textworld.py, the bring-your-own-environment tutorial, run as a user runs it; what it builds is
real: TextWorld games, an environment that agrees with TextWorld step by step, a custom estimator fed the
rollout's StepBatch, a training run that logs its success, and an evaluation of the registered environment."""

import ast
import json
import random
import runpy
from pathlib import Path

import pytest
import textworld

from hgpo_trl.advantages import ESTIMATORS, StepBatch, compute_advantages
from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.registry import _REGISTRY

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS = 8


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory):
    """The example's namespace after it ran, top to bottom, writing under a temporary folder."""
    output = tmp_path_factory.mktemp("byo")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BYO_OUTPUT", str(output))
        patch.setenv("HOME", str(output))  # Inform 7, which compiles the games, writes ~/Inform
        namespace = runpy.run_path(str(ROOT / "examples" / "byo_textworld.py"), run_name="__main__")
    yield namespace, output
    _REGISTRY.pop("textworld", None)  # leave the registries as the other tests expect them
    ESTIMATORS.pop("turn_baseline", None)


def tutorial_definitions() -> dict:
    """The tutorial's imports, constants, functions and classes, without its cells' work (games for every split,
    registrations, training): its environment, tried in seconds."""
    path = ROOT / "examples" / "byo_textworld.py"
    def is_definition(node: ast.stmt) -> bool:
        constant = isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets)
        return constant or isinstance(node, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.ClassDef)

    definitions = [node for node in ast.parse(path.read_text()).body if is_definition(node)]
    namespace = {"__name__": "byo_textworld"}
    exec(compile(ast.Module(definitions, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def test_the_tutorials_environment_wins_a_generated_game_by_its_walkthrough(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # Inform 7, which compiles the game, writes ~/Inform
    tutorial = tutorial_definitions()
    [game_file] = tutorial["generate_games"](tmp_path, {"train": [1]})
    [task] = tutorial["textworld_tasks"]("train", games_dir=tmp_path)
    env = tutorial["TextWorldEnv"](max_steps=MAX_STEPS)
    walkthrough = textworld.Game.load(str(game_file.with_suffix(".json"))).metadata["walkthrough"]
    commands, results = play(env, task, lambda t, _: walkthrough[t])
    assert commands == walkthrough and results[-1][4]["won"] and results[-1][1:3] == (10.0, True)
    env.close()


@pytest.mark.slow
def test_games_are_generated_by_textworld(tutorial):
    _, output = tutorial
    games = sorted(p.name for p in (output / "games").glob("*.z8"))
    assert games == ["train_1.z8", "train_2.z8", "train_3.z8", "valid_4.z8"]
    for name in games:
        game = textworld.Game.load(str(output / "games" / name.replace(".z8", ".json")))
        assert len(game.quests) == 1 and game.metadata["walkthrough"]
    assert make_tasks("textworld", "train", games_dir=output / "games")["game_id"] == ["train_1", "train_2", "train_3"]
    with pytest.raises(ValueError, match="no TextWorld games for split 'test'"):
        make_tasks("textworld", "test", games_dir=output / "games")


def replay(game_file: str, commands: list[str]) -> list:
    """TextWorld's own states along `commands`, from a fresh engine of its own."""
    engine = textworld.start(game_file, textworld.EnvInfos(admissible_commands=True, won=True, lost=True))
    states = [engine.reset()]
    states += [engine.step(command)[0] for command in commands]
    engine.close()
    return states


def play(env, task, choose) -> tuple[list[str], list[tuple]]:
    """(commands, step results) of one episode of `env`; `choose(t, info)` gives the command of step t."""
    _, info = env.reset(task)
    commands, results = [], []
    while not results or not (results[-1][2] or results[-1][3]):
        commands.append(choose(len(commands), info))
        results.append(env.step(commands[-1]))
        info = results[-1][4]
    return commands, results


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_episodes_end_won_or_lost_as_textworld_says(tutorial, seed):
    """Random admissible play, then each game's walkthrough, step by step against an independent TextWorld engine."""
    _, output = tutorial
    env = make_env("textworld", max_steps=MAX_STEPS)
    rng = random.Random(seed)
    for task in make_tasks("textworld", "train", games_dir=output / "games"):
        walkthrough = textworld.Game.load(task["game_file"].replace(".z8", ".json")).metadata["walkthrough"]
        for choose in (lambda t, info: rng.choice(info["admissible_actions"]), lambda t, _, plan=walkthrough: plan[t]):
            commands, results = play(env, task, choose)
            for state, (_, reward, terminated, _, info) in zip(replay(task["game_file"], commands)[1:], results,
                                                               strict=True):
                assert (info["won"], info["lost"]) == (state["won"], state["lost"])
                assert info["admissible_actions"] == sorted(state["admissible_commands"])
                assert terminated == (state["won"] or state["lost"]) and reward == (10.0 if state["won"] else 0.0)
            _, _, terminated, truncated, _ = results[-1]
            assert truncated == (not terminated and len(results) == MAX_STEPS)
        assert results[-1][4]["won"] and len(results) == len(walkthrough)  # the walkthrough wins


@pytest.mark.slow
def test_custom_estimator_received_the_rollouts_step_batches(tutorial):
    namespace, _ = tutorial
    calls = namespace["estimator_calls"]
    logged = [e for e in namespace["trainer"].state.log_history if "steps/collected" in e]
    # One call per training iteration, and one more by the tutorial's last cell, on the last batch.
    assert len(logged) == 5 and len(calls) == 6 and calls[5] is calls[4]
    for batch, entry in zip(calls[:5], logged, strict=True):
        assert isinstance(batch, StepBatch) and len(batch) == entry["steps/collected"]
        assert set(batch.group) <= {0, 1, 2} and len(set(batch.traj)) == 12  # 3 games x 4 rollouts
        compute_advantages("hgpo", batch, depth=2)  # the batch the built-in estimators take
    advantages = compute_advantages("turn_baseline", calls[-1])
    first = [i for i, (g, t) in enumerate(zip(calls[-1].group, calls[-1].step, strict=True)) if g == 0 and t == 0]
    assert abs(sum(advantages[first])) < 1e-9  # the turn baseline centres each (task, t) cell


@pytest.mark.slow
def test_training_logged_success_and_the_warm_start_taught_the_format(tutorial):
    namespace, _ = tutorial
    iterations = [e for e in namespace["trainer"].state.log_history if "env/success_rate" in e]
    assert len(iterations) == 5 and all(0 <= e["env/success_rate"] <= 1 for e in iterations)
    assert iterations[0]["env/invalid_rate"] < 0.8  # without the warm start nearly every output is invalid


@pytest.mark.slow
def test_the_registered_environment_is_evaluated_like_the_built_ins(tutorial):
    _, output = tutorial
    report = json.loads((output / "evaluation" / "evaluation.json").read_text())
    assert report["env"] == "textworld" and report["seeds"] == [123, 456, 789]
    assert [(r["policy"], r["split"], r["tasks"]) for r in report["results"]] == [("model", "valid", 1),
                                                                                  ("random", "valid", 1)]
    assert "| random | valid | mean ± std | 1 |" in (output / "evaluation" / "evaluation.md").read_text()
