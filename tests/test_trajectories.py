"""Trajectory dumps (issue 8): what the trainer writes, and the two readers."""

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from hgpo_trl.advantages import compute_advantages, hgpo_level_stats
from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.pool import InProcessEnvs
from hgpo_trl.evaluation.trajectories import (
    main,
    read_records,
    rollout_records,
    show_episode,
    summarize,
    write_records,
)
from hgpo_trl.rollout.lockstep import Completion, RolloutSettings, run_rollout
from tests.test_trainer import make_config, make_trainer

ROOT = Path(__file__).resolve().parents[1]


def scripted_rollout():
    """Two rollouts of one task: the first takes the gold key and wins, the second answers nonsense first."""
    task = make_tasks("keydoor", "train", num_tasks=1)[0]
    plans = {0: [f"take {task['gold']} key", "go to hall", "go to vault", f"open {task['gold']} door"],
             1: ["", f"take {task['gold']} key", "go to hall", "go to vault", f"open {task['gold']} door"]}
    turn = {0: 0, 1: 0}

    def policy(prompts):
        out = []
        for i in range(len(prompts)):
            traj = i if len(prompts) == 2 else max(turn, key=lambda k: len(plans[k]) - turn[k])
            out.append(Completion(text=plans[traj][turn[traj]]))
            turn[traj] += 1
        return out

    rollout = run_rollout(InProcessEnvs(partial(make_env, "keydoor"), 2), [task], 2, policy,
                          RolloutSettings(action_mode="plain", max_steps=8))
    return task, rollout


def record_config(**fields) -> HGPOConfig:
    """The fields rollout_records reads: the returns' gamma and penalty, HGPO's depth and options."""
    return HGPOConfig(output_dir="unused", use_cpu=True, report_to="none", history_length=2,
                      **{"gamma": 0.95, "invalid_penalty": 0.1, **fields})


def test_records_hold_every_field_of_every_step(tmp_path):
    task, rollout = scripted_rollout()
    config = record_config(gamma=1.0, advantage_norm="mean_norm", invalid_penalty=0.0)
    advantages = compute_advantages("hgpo", rollout.step_batch(), **config.estimator_options())
    records = rollout_records(rollout, [task], advantages, config)
    path = write_records(tmp_path / "d.jsonl", records)
    back = read_records(path)
    assert back == json.loads(json.dumps(records)) and len(back) == len(rollout.steps) == 9
    first = [r for r in back if r["episode"] == 0]
    assert [r["step"] for r in first] == [0, 1, 2, 3] and [r["window"] for r in first] == [0, 1, 2, 2] and first[-1]["reward"] == 10.0 and first[0]["return"] == 10.0
    assert first[0]["episode_won"] and first[0]["task"] == dict(task) and "Task:" in first[0]["prompt"]
    invalid = [r for r in back if not r["valid"]]
    assert len(invalid) == 1 and invalid[0]["action"] is None and invalid[0]["output"] == ""
    assert all(r["advantage"] == float(a) for r, a in zip(back, advantages, strict=True))
    assert [(r["prompt_tokens"], r["completion_tokens"]) for r in back] == [
        (len(s.completion.prompt_ids), len(s.completion.completion_ids)) for s in rollout.steps]
    # Both rollouts start from the same observation: a level-0 peer at t = 0.
    assert all(0 in r["peer_levels"] for r in back if r["step"] == 0)


def test_peer_levels_key_on_similarity_clusters_as_the_logged_level_stats_do():
    task, rollout = scripted_rollout()
    counts = {}
    for threshold in (None, 0.3):
        records = rollout_records(rollout, [task], None, record_config(similarity_threshold=threshold))
        counts[threshold] = [sum(k in r["peer_levels"] for r in records) for k in range(3)]
        stats = hgpo_level_stats(rollout.step_batch(), depth=2, similarity_threshold=threshold)
        assert counts[threshold] == [s.with_peers for s in stats]
    assert counts[0.3] == [8, 5, 3] and counts[None] == [8, 4, 2]  # (alike histories share clusters at 0.3)


def scripted_records() -> list[dict]:
    task, rollout = scripted_rollout()
    return rollout_records(rollout, [task], None, record_config())


def test_show_and_summary():
    records = scripted_records()
    text = show_episode(records, 1)
    assert text.startswith("episode 1 (task group 0): won") and "INVALID ('')" in text and "[step 4]" in text
    assert "Task:" not in text and "Task:" in show_episode(records, 1, prompt=True)
    summary = summarize(records)
    assert summary["episodes"] == 2 and summary["success_by_task_type"] == {"all": {"episodes": 2, "success_rate": 1.0}}
    assert summary["invalid_reasons"] == {"empty output": 1} and summary["most_common_failing_states"] == []


@pytest.mark.slow
def test_show_and_summary_on_the_command_line(tmp_path, capsys):
    records = scripted_records()
    path = write_records(tmp_path / "d.jsonl", records)
    shown = subprocess.run([sys.executable, "-m", "hgpo_trl.evaluation.trajectories", "show", str(path), "--episode", "0",
                            "--prompt"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "episode 0" in shown.stdout
    assert f"    | {records[0]['prompt'].splitlines()[0]}" in shown.stdout  # the prompt the step saw, on request
    with pytest.raises(SystemExit) as exit_info:  # (in this process: one interpreter start is enough)
        main(["summary", str(tmp_path / "none.jsonl")])
    assert exit_info.value.code == 2 and "no trajectory dump at" in capsys.readouterr().err


def test_the_trainer_dumps_iterations_and_evaluations(tmp_path, tiny_model, tiny_tokenizer):
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, trajectory_dump_every=2,
                                                                    train_iterations=3))
    trainer.train()
    trainer.evaluate()
    folder = tmp_path / "out" / "trajectories"
    assert sorted(p.name for p in folder.iterdir()) == ["eval_step_000003.jsonl", "iter_000001.jsonl",
                                                         "iter_000003.jsonl"]
    records = read_records(folder / "iter_000001.jsonl")
    assert {r["group"] for r in records} == {0, 1} and all(np.isfinite(r["advantage"]) for r in records)
    # HGPO's weights, as the trainer blended them: each step's sum to 1 where it had a peer, 0 where not.
    assert all(sum(r["level_weights"]) == pytest.approx(1.0 if r["peer_levels"] else 0.0) for r in records)
    evaluation = read_records(folder / "eval_step_000003.jsonl")
    assert len({r["episode"] for r in evaluation}) == 2 and all(r["advantage"] is None for r in evaluation)
