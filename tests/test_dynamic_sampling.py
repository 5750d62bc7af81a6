"""Dynamic sampling (released algorithm.filter_groups): task groups whose episodes all got the same reward are
dropped and more rollout batches are played until the kept groups fill the iteration, at most
max_rollout_batches, the last kept unfiltered; extra batches play fresh tasks (or replay the iteration's), and a
resumed run plays the tasks the run it continues would have."""

import itertools
import json

import pytest
from datasets import Dataset

from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_tasks
from hgpo_trl.envs.keydoor import KeyDoorEnv
from hgpo_trl.trainer import HGPOTrainer


class OneStepScores(KeyDoorEnv):
    """Keydoor whose episodes end after one step with a reward set by the task's `kind`: 'same' pays every
    episode 0 (its group is dropped), 'mixed' pays the environments alternately 0 and 1 (in-process, in the order
    they are built, so each group of an even size is kept)."""

    built = itertools.count()

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.slot = next(self.built)

    def reset(self, task):
        self.kind = task["kind"]
        return super().reset(task)

    def step(self, action):
        observation, _, _, truncated, info = super().step(action)
        return observation, float(self.kind == "mixed" and self.slot % 2), True, truncated, info


class FullLengthScores(OneStepScores):
    """Episodes run to max_env_steps (every step a no-op), each step paid as OneStepScores pays; a 'flip' task
    pays like 'same' on an environment's first reset and like 'mixed' after it."""

    resets = 0

    def reset(self, task):
        self.resets += 1
        return super().reset(task)

    def step(self, action):
        observation, _, _, truncated, info = KeyDoorEnv.step(self, None)
        mixed = self.kind == "mixed" or (self.kind == "flip" and self.resets > 1)
        return observation, float(mixed and self.slot % 2), False, truncated, info


class FirstResetsFail(OneStepScores):
    """The first 12 resets in this process fail (an outage during iteration 1 of 4 environments x 3 batches)."""

    failed = itertools.count()

    def reset(self, task):
        if next(self.failed) < 12:
            raise RuntimeError("injected: the environment is down")
        return super().reset(task)


def tasks_of(kinds):
    rows = list(make_tasks("keydoor", "train", num_tasks=len(kinds)))
    return Dataset.from_list([{**row, "kind": kind} for row, kind in zip(rows, kinds, strict=True)])


def run(tmp_path, tiny_model, tiny_tokenizer, kinds, env=OneStepScores, **overrides):
    """A run of dynamic sampling on `kinds` of tasks; (its trainer, the task ids each rollout batch played)."""
    settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2,
                    tasks_per_device=2, max_completion_length=4, max_env_steps=3, action_mode="plain",
                    learning_rate=1e-2, train_iterations=2, logging_steps=1, report_to="none", use_cpu=True,
                    save_strategy="no", seed=0, disable_tqdm=True, dynamic_sampling=True, max_rollout_batches=3,
                    env_workers=0)
    settings.update(overrides)
    trainer = HGPOTrainer(model=tiny_model, args=HGPOConfig(**settings), processing_class=tiny_tokenizer,
                          train_dataset=tasks_of(kinds), env_factory=env)
    played = []
    play = trainer._play

    def recording(tasks, *args, **kwargs):
        played.append([int(t["task_id"]) for t in tasks])
        return play(tasks, *args, **kwargs)

    trainer._play = recording
    return trainer, played


def iteration_logs(trainer):
    return [log for log in trainer.state.log_history if "dynamic/rollout_batches" in log]


@pytest.mark.parametrize(("kinds", "tasks", "expected", "batching"), [
    # every group dropped until the last batch, which is kept whole
    (["same"] * 4, "fresh", {"dynamic/rollout_batches": 3, "dynamic/groups_kept": 2, "dynamic/groups_dropped": 4,
                             "steps/collected": 4}, "fixed_budget"),
    (["same"] * 4, "fresh", {"dynamic/rollout_batches": 3, "dynamic/groups_kept": 2, "dynamic/groups_dropped": 4,
                             "steps/collected": 4, "steps/trained": 4, "steps/max_untrained": 0}, "all_steps"),
    # every group kept at once
    (["mixed"] * 4, "fresh", {"dynamic/rollout_batches": 1, "dynamic/groups_kept": 2, "dynamic/groups_dropped": 0,
                              "steps/collected": 4}, "fixed_budget"),
    # one group of two kept per batch: two batches fill the iteration's two
    (["same", "mixed"], "replay", {"dynamic/rollout_batches": 2, "dynamic/groups_kept": 2,
                                   "dynamic/groups_dropped": 2, "steps/collected": 4}, "fixed_budget"),
], ids=["all-dropped", "all-dropped-all-steps", "all-kept", "half-kept"])
def test_equal_reward_groups_are_dropped_and_batches_played_until_the_iteration_is_filled(
        tmp_path, tiny_model, tiny_tokenizer, kinds, tasks, expected, batching):
    trainer, played = run(tmp_path, tiny_model, tiny_tokenizer, kinds, dynamic_sampling_tasks=tasks,
                          step_batching=batching)
    trainer.train()
    logs = iteration_logs(trainer)
    assert len(logs) == 2
    for log in logs:
        log = {**log, **next((later for later in trainer.state.log_history  # (all_steps: the counts come after)
                              if "steps/trained" in later and later["step"] >= log["step"]), {})}
        assert {key: log[key] for key in expected} == expected
    assert len(played) == 2 * expected["dynamic/rollout_batches"]  # max_rollout_batches (3) at most
    if tasks == "replay":  # the iteration's tasks again
        assert played[0] == played[1] and played[2] == played[3]


def test_extra_batches_play_fresh_tasks_and_a_resumed_run_plays_what_the_run_it_continues_would_have(
        tmp_path, tiny_model, tiny_tokenizer):
    kinds = ["same"] * 6  # every iteration plays all 3 batches: 2 extra ones
    whole, played = run(tmp_path / "whole", tiny_model, tiny_tokenizer, kinds, train_iterations=4)
    whole.train()
    assert len(played) == 12
    iterations = [played[i:i + 3] for i in range(0, 12, 3)]
    assert all(batches[1] != batches[0] and batches[2] != batches[1] for batches in iterations)  # fresh tasks

    first, _ = run(tmp_path / "resumed", tiny_model, tiny_tokenizer, kinds, train_iterations=4,
                   save_every_iterations=2)
    first.train()
    resumed, replayed = run(tmp_path / "resumed", tiny_model, tiny_tokenizer, kinds, train_iterations=4,
                            save_every_iterations=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "out" / "checkpoint-2"))
    assert replayed == played[6:]  # iterations 3 and 4, their extra batches included


def test_all_steps_trains_every_iteration_when_a_process_keeps_more_groups_than_it_plays_at_once(
        tmp_path, tiny_model, tiny_tokenizer):
    """Batch 1 keeps the 'mixed' group, batch 2 (the same tasks again) both: 3 groups of full-length episodes on
    a process that plays 2 at once. max_steps, all_steps' bound on optimizer steps, must cover them, or the run
    stops inside iteration 2 without a word."""
    trainer, _ = run(tmp_path, tiny_model, tiny_tokenizer, ["flip", "mixed"], env=FullLengthScores,
                     dynamic_sampling_tasks="replay", step_batching="all_steps")
    trainer.train()
    assert trainer.completed_iterations == 2
    first = iteration_logs(trainer)[0]
    assert (first["dynamic/rollout_batches"], first["dynamic/groups_kept"], first["steps/collected"]) == (2, 3, 18)


def test_an_outage_inside_one_iteration_counts_once_towards_max_faulty_iterations(tmp_path, tiny_model,
                                                                                  tiny_tokenizer):
    """Iteration 1's 3 batches all fault (their groups drop, more batches follow): one faulty iteration of the 3
    in a row that stop a run, not 3."""
    trainer, played = run(tmp_path, tiny_model, tiny_tokenizer, ["mixed"] * 4, env=FirstResetsFail,
                          train_iterations=3, max_faulty_iterations=3)
    trainer.train()
    assert trainer.completed_iterations == 3 and len(played) == 3 + 1 + 1
    assert [log["env/faults"] for log in iteration_logs(trainer)] == [4, 0, 0]  # the kept last batch's 4 episodes


def test_fresh_tasks_are_not_the_iterations_order_when_the_dataset_is_not_shuffled(tmp_path, tiny_model,
                                                                                   tiny_tokenizer):
    trainer, played = run(tmp_path, tiny_model, tiny_tokenizer, ["same"] * 6, shuffle_dataset=False,
                          train_iterations=1)
    trainer.train()
    first_rows = [int(row["task_id"]) for row in tasks_of(["same"] * 6)][:2]  # (unshuffled: the dataset's order)
    assert played[0] == first_rows and played[1] != played[0] and len(played) == 3


def test_dynamic_sampling_settings_are_checked():
    with pytest.raises(ValueError, match=r"HGPOConfig\.max_rollout_batches must be an integer >= 1, got 0"):
        HGPOConfig(output_dir="unused", use_cpu=True, report_to="none", max_rollout_batches=0)
    with pytest.raises(ValueError, match=r"HGPOConfig\.dynamic_sampling_tasks must be one of \('fresh', 'replay'\)"):
        HGPOConfig(output_dir="unused", use_cpu=True, report_to="none", dynamic_sampling_tasks="new")


class AlwaysFails(OneStepScores):
    def reset(self, task):
        raise RuntimeError("injected: the environment is down")


def test_a_fault_stop_checkpoints_the_task_position_its_iteration_started_from(tmp_path, tiny_model, tiny_tokenizer):
    """Every episode faults: iteration 1 plays its 3 batches (2 extra ones from the fresh-task stream) and the run
    stops. Its checkpoint holds the stream's position before the iteration, so a resume replays the iteration
    with the tasks the stopped run played, not the next ones."""
    trainer, played = run(tmp_path, tiny_model, tiny_tokenizer, ["same"] * 6, env=AlwaysFails,
                          max_faulty_iterations=1)
    with pytest.raises(RuntimeError, match="environment faults"):
        trainer.train()
    assert len(played) == 3
    state = json.loads((tmp_path / "out" / "checkpoint-0" / "hgpo_trainer_state_0.json").read_text())
    assert (state["iterations"], state["extra_batches"]) == (0, 0)
