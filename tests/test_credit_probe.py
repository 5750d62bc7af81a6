"""benchmarks/credit_probe.py on a tiny override of the quickstart: a 5-step warm start, two updates."""

import json

import pytest

from tests.test_learning_benchmark import QUICKSTART

TINY = [
    "--config",
    str(QUICKSTART),
    "--num_eval_tasks",
    "4",
    "--warmstart_steps",
    "5",
    "--warmstart_batch_size",
    "8",
    "--tiny_hidden_size",
    "32",
    "--tiny_num_layers",
    "1",
    "--tiny_num_heads",
    "2",
    "--tasks_per_device",
    "2",
    "--num_generations",
    "4",
    "--report_to",
    "none",
    "--updates",
    "2",
    "--eval_every",
    "1",
]


def test_probe_rewards_each_prompt_of_the_winning_path(tmp_path):
    from benchmarks.credit_probe import main, winning_path

    record = main([*TINY, "--train_steps", "decisions", "--output_dir", str(tmp_path)])
    assert record == json.loads((tmp_path / "probe.json").read_text())
    assert record["trained"] == ["entrance", "vault"]
    assert [e["update"] for e in record["evals"]] == [0, 1, 2]
    for row in record["evals"]:
        assert 0 <= row["entrance_acc"] <= 1 and all(0 < row[f"p_{s}"] < 1 for s in ("room", "hall", "vault"))
        assert 0 <= row["entrance_confident"] <= 1
        assert all(0 < p < 1 for p in row["entrance_colour_choice"].values())
    assert all(0 <= u["reward"] <= 1 and u["grad_norm"] >= 0 for u in record["updates"])
    assert all(u["grad_norm"] == 0 for u in record["updates"] if u["reward"] == 0)
    assert (tmp_path / "warmstart" / "warmstart.json").is_file()  # built here, as benchmarks/learning.py does

    task = {"room1": "kitchen", "room2": "library", "color1": "red", "color2": "blue", "gold": "blue"}
    path = winning_path(task, history_length=2, format_instruction="")
    assert [(name, answer) for name, _, answer in path] == [
        ("entrance", "take blue key"),
        ("room", "go to hall"),
        ("hall", "go to vault"),
        ("vault", "open blue door"),
    ]
    assert "You take the blue key." in path[3][1]  # the vault prompt shows the key in its history


def test_colour_choice_splits_each_task_between_its_two_keys():
    from benchmarks.credit_probe import colour_choice

    tasks = [
        {"room1": "kitchen", "room2": "library", "color1": "red", "color2": "blue", "gold": "blue"},
        {"room1": "kitchen", "room2": "library", "color1": "red", "color2": "green", "gold": "red"},
    ]
    assert colour_choice(tasks, [0.9, 0.2]) == {"blue": 0.9, "green": 0.8, "red": 0.15}


@pytest.mark.slow
def test_zero_updates_only_evaluates_a_saved_model(tmp_path):
    from benchmarks.credit_probe import main

    built = main([*TINY, "--updates", "1", "--output_dir", str(tmp_path / "built")])
    record = main([*TINY, "--updates", "0", "--warmstart", str(tmp_path / "built" / "warmstart"),
                   "--output_dir", str(tmp_path / "diagnosis")])
    assert record["updates"] == [] and [e["update"] for e in record["evals"]] == [0]
    assert record["evals"][0] == built["evals"][0]  # the same warm start, evaluated without training
    assert not (tmp_path / "diagnosis" / "warmstart").exists()


def test_no_reward_kept_means_no_gradient(tmp_path):
    from benchmarks.credit_probe import main

    record = main([*TINY, "--train_steps", "entrance", "--keep_reward", "0", "--output_dir", str(tmp_path)])
    assert all(u["reward"] == 0 and u["grad_norm"] == 0 for u in record["updates"])
    metrics = [{k: v for k, v in row.items() if k not in ("update", "seconds")} for row in record["evals"]]
    assert metrics[0] == metrics[2]  # all-equal rewards: zero advantages, the weights do not move


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--keep_reward", "1.5"], "--keep_reward must be in [0, 1]"),
        (["--updates", "-1"], "--updates must be >= 0"),
        (["--warmstart", "/nonexistent"], "not a saved model folder"),
        (["--env_name", "alfworld"], "knows keydoor's winning path only"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, argv, message):
    from benchmarks.credit_probe import main

    with pytest.raises(SystemExit) as exit_info:
        main([*TINY, *argv, "--output_dir", str(tmp_path)])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
