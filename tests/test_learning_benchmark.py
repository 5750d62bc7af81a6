"""benchmarks/learning.py on a tiny override of the quickstart: two estimators, one seed, two iterations."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
# Seconds, not hours: a small model, a 5-step warm start, 2 tasks x 4 rollouts, 4 validation tasks every iteration.
TINY = ["--config", str(QUICKSTART), "--estimators", "grpo", "hgpo_k2", "--seeds", "0", "--iterations", "2",
        "--eval_steps", "1", "--num_eval_tasks", "4", "--warmstart_steps", "5", "--warmstart_batch_size", "8",
        "--tiny_hidden_size", "32", "--tiny_num_layers", "1", "--tiny_num_heads", "2", "--tasks_per_device", "2",
        "--num_generations", "4", "--per_device_train_batch_size", "16", "--report_to", "none",
        "--disable_tqdm", "true"]


def test_learning_curves_resume_and_results_section(tmp_path, capsys):
    from benchmarks.learning import END, HEADING, START, main, update_results

    out = tmp_path / "out"
    main([*TINY, "--output_dir", str(out)])
    curves = json.loads((out / "curves.json").read_text())
    runs = curves["runs"]
    assert set(runs) == {"grpo/seed0", "hgpo_k2/seed0"}
    for run in runs.values():
        assert [t["iteration"] for t in run["train"]] == [1, 2]
        assert [e["iteration"] for e in run["eval"]] == [0, 1, 2]  # 0: the warm start, then every iteration
        assert all(0 <= point["success"] <= 1 for point in run["train"] + run["eval"])
        assert run["config"]["trainer"]["estimator"] == run["options"]["estimator"] and run["wall_seconds"] > 0
    assert runs["hgpo_k2/seed0"]["config"]["trainer"]["hierarchy_depth"] == 2
    # Both estimators started from the one warm start of seed 0: same weights, same greedy validation.
    assert {run["warmstart_sha256"] for run in runs.values()} == {curves["warmstarts"]["0"]["sha256"]}
    assert runs["grpo/seed0"]["eval"][0] == runs["hgpo_k2/seed0"]["eval"][0]
    assert "--iterations 2" in curves["command"] and curves["config"]["config_yaml"] == QUICKSTART.read_text()
    markdown = (out / "learning.md").read_text()
    assert "| grpo | 1 | " in markdown and "| hgpo_k2 | 1 | " in markdown and "not reached" in markdown
    assert (out / "learning.png").stat().st_size > 0
    assert "| estimator | seeds | final validation success |" in capsys.readouterr().out

    # --resume: only the run missing from curves.json trains, from the saved warm start (not rebuilt).
    kept = runs["grpo/seed0"]
    del runs["hgpo_k2/seed0"]
    (out / "curves.json").write_text(json.dumps(curves))
    results = tmp_path / "results.md"
    results.write_text(f"# Results\n\nabove\n\n{START}\nold table\n{END}\n\nbelow\n")
    main([*TINY, "--output_dir", str(out), "--resume", "--update-results", "--results_file", str(results)])
    printed = capsys.readouterr().out
    assert "grpo seed 0: in" in printed and "reused" in printed and "run 1/1 hgpo_k2 seed 0" in printed
    resumed = json.loads((out / "curves.json").read_text())
    assert resumed["runs"]["grpo/seed0"] == kept
    assert resumed["runs"]["hgpo_k2/seed0"]["warmstart_sha256"] == kept["warmstart_sha256"]

    # --update-results rewrote the marked section only.
    text = results.read_text()
    assert text.startswith(f"# Results\n\nabove\n\n{START}\n") and text.endswith(f"{END}\n\nbelow\n")
    assert "old table" not in text and "| hgpo_k2 | 1 | " in text and "](learning_curves.png)" in text
    # ...and put the plot beside the results file, where the committed link finds it (outputs/ is untracked).
    assert (results.parent / "learning_curves.png").read_bytes() == (out / "learning.png").read_bytes()
    # A results file without the markers gets them at its end, under the heading; the rest is untouched.
    copy = tmp_path / "results_copy.md"
    original = "# Results\n\n## Speed\n\nA table.\n"
    copy.write_text(original)
    update_results(copy, resumed, out / "learning.png", 0.9)
    assert copy.read_text().startswith(original.rstrip() + f"\n\n{HEADING}\n\n{START}\n")
    assert copy.read_text().endswith(f"{END}\n")

    # --resume refuses to mix runs made with other settings.
    with pytest.raises(SystemExit, match="another config"):
        main([*TINY, "--output_dir", str(out), "--resume", "--learning_rate", "1e-4"])


@pytest.mark.slow
def test_parallel_runs_give_the_same_curves(tmp_path):
    from benchmarks.learning import main

    def curves(jobs: int) -> dict:
        out = tmp_path / f"jobs{jobs}"
        main([*TINY, "--output_dir", str(out), "--jobs", str(jobs)])
        return json.loads((out / "curves.json").read_text())

    one, two = curves(1), curves(2)
    assert set(one["runs"]) == set(two["runs"]) == {"grpo/seed0", "hgpo_k2/seed0"}
    assert one["warmstarts"]["0"]["sha256"] == two["warmstarts"]["0"]["sha256"]
    for key, run in one["runs"].items():
        assert (run["train"], run["eval"]) == (two["runs"][key]["train"], two["runs"][key]["eval"]), key
    with pytest.raises(SystemExit):
        main([*TINY, "--output_dir", str(tmp_path / "none"), "--jobs", "0"])


@pytest.mark.slow
def test_a_run_that_stops_early_ends_its_curve_where_it_stopped(tmp_path):
    # Learning rate 0: the first evaluation during training (iteration 1) scores as the warm start did and stops
    # the run. The curve must end there, not at the iteration cap with an evaluation labelled as if the run had
    # gone on (failed on the old code: evaluations at [0, 1, 4]).
    from benchmarks.learning import main

    out = tmp_path / "out"
    # A warm start that already succeeds sometimes (as test_cli's early-stop test), so a threshold of 0.01 holds.
    main([*TINY, "--estimators", "grpo", "--iterations", "4", "--learning_rate", "0", "--early_stop_success", "0.01",
          "--early_stop_patience", "1", "--tiny_hidden_size", "64", "--tiny_num_layers", "2", "--task_kwargs",
          "{num_rooms: 3, num_colors: 3}", "--warmstart_steps", "60", "--warmstart_batch_size", "32",
          "--warmstart_learning_rate", "3e-3", "--num_eval_tasks", "11", "--invalid_action", "end_episode",
          "--admissible_only", "true", "--output_dir", str(out)])
    run = json.loads((out / "curves.json").read_text())["runs"]["grpo/seed0"]
    assert [e["iteration"] for e in run["eval"]] == [0, 1]
    assert [t["iteration"] for t in run["train"]] == [1]
    assert run["iterations"] == 1 and run["stopped_early"].startswith("stopped early")
