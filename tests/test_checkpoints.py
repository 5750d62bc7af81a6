"""Checkpoints (issue 18): the best one is tracked where it ends up, never in the staging folder it was written
to, whatever the save cadence, so rotation keeps it and load_best_model_at_end loads it."""

import json
from pathlib import Path

import pytest

from tests.test_trainer import make_config, make_trainer

BEST = dict(load_best_model_at_end=True, metric_for_best_model="success_rate", greater_is_better=True)


def checkpoints(out: Path) -> list[Path]:
    return sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))


@pytest.mark.parametrize("limit", [1, 2])
@pytest.mark.parametrize("cadence", ["steps", "iterations"])
def test_the_best_checkpoint_is_the_renamed_folder_and_survives_rotation(tmp_path, tiny_model, tiny_tokenizer,
                                                                         limit, cadence):
    every = (dict(eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1) if cadence == "steps"
             else dict(eval_every_iterations=1, save_every_iterations=1))
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, train_iterations=4, save_total_limit=limit,
                                                                   **BEST, **every))
    trainer.train()  # with the staging path recorded, save_total_limit=1 ended here in FileNotFoundError
    out = tmp_path / "out"
    best = Path(trainer.state.best_model_checkpoint)
    assert ".staging" not in best.parts and best.parent == out and best.is_dir()
    assert best in checkpoints(out)  # rotation kept it
    for folder in checkpoints(out):
        state = json.loads((folder / "trainer_state.json").read_text())
        recorded = state["best_model_checkpoint"]
        assert recorded is None or (".staging" not in recorded and Path(recorded).parent == out)
    assert not any((out / ".staging").glob("checkpoint-*"))


def test_a_resume_in_a_later_pass_plays_that_pass_order(tmp_path, tiny_model, tiny_tokenizer):
    """8 tasks, 2 per iteration: 4 iterations a pass. Resumed after iteration 5 (in the second pass), the run
    plays iteration 6's tasks of the uninterrupted run, not the first pass's order again."""
    args = make_config(tmp_path, train_iterations=6, save_every_iterations=1)

    def played(trainer):
        tasks = []
        original = trainer._play_iteration
        trainer._play_iteration = lambda rows: tasks.append([r["task_id"] for r in rows]) or original(rows)
        return tasks

    whole = make_trainer(tiny_model, tiny_tokenizer, args)
    uninterrupted = played(whole)
    whole.train()
    resumed = make_trainer(type(tiny_model)(tiny_model.config), tiny_tokenizer, args)
    continued = played(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-5"))
    assert len(uninterrupted) == 6 and continued == uninterrupted[5:]
