"""Two-iteration HGPO run on the tiny model, for multi-process tests: `accelerate launch ... train_keydoor.py OUT
[beta=0.1] [gc=1] [batching=all_steps [balance=PARTITION] [uneven=1]] [fault=envs|nan] [warmstart=STEPS [model=folder]]`.

balance=PARTITION: balance_steps (rows shared out over the processes) with that balance_partition. uneven=1: process 1's episodes end after their
first step, process 0's run to the step limit (invalid outputs are no-ops): the processes collect very different
numbers of steps.

rollout=MODE: rollout_mode (default auto: lock-step with transformers); each process writes the turns of each
rollout it played.

warmstart=STEPS: train.py's order: the config, then a supervised warm start of STEPS steps, then the trainer;
each process also writes the checksums of the model before and after the warm start. model=folder: the tiny
model saved to a folder and loaded by train.py's loader (hgpo_trl.commands.train.load_model), as a hub model is.

dynamic=1: dynamic sampling (at most 3 rollout batches); episodes end after one step (an invalid output's too: it
reaches the environment as a no-op, so no sampled output changes what a group is paid), every one paid 0 on
process 0 (each of its groups is dropped) and 0 or 1 alternately on process 1 (each of its groups is kept).

fault=envs: every environment of process 1 fails its first reset (iteration 1), process 0's are healthy.
fault=nan: process 1's advantages are NaN in iteration 1; each process writes the error it stopped with.
fault=nanloss: process 1's loss is infinite in the second optimizer step; each process writes the error and the
parameter checksums after the first step and when it stopped.
Collectives time out after 60 s (ddp_timeout), so a process left waiting fails the run instead of hanging.

Each process writes OUT/rank{i}.json: the tasks it played, its logged metrics and a parameter checksum; with
batching=all_steps also the advantages its estimator gave (each step its own value) and those its loss saw.
"""

import contextlib
import itertools
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from accelerate import PartialState
from transformers import TrainerCallback

from hgpo_trl.advantages import compute_advantages, register_estimator
from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_tasks
from hgpo_trl.envs.keydoor import KeyDoorEnv
from hgpo_trl.models.tiny import build_tiny_model, build_tiny_tokenizer
from hgpo_trl.trainer import HGPOTrainer
from tests.conftest import keydoor_corpus

ESTIMATED: list[list[float]] = []


def unique_advantages(batch):
    """Every step of every process its own advantage: a row the loss sees names its step."""
    values = 0.001 * (np.arange(len(batch)) + 1) + PartialState().process_index + 0.5 * (np.arange(len(batch)) % 2)
    ESTIMATED.append(np.float32(values).tolist())
    return values


class FirstResetFails(KeyDoorEnv):
    """Keydoor whose first reset raises on process 1: all of that process's episodes of iteration 1 fault."""

    resets = 0

    def reset(self, task):
        self.resets += 1
        if self.resets == 1 and PartialState().process_index == 1:
            raise RuntimeError("injected: the environment is down")
        return super().reset(task)


class EndsAtOnceOnRank1(KeyDoorEnv):
    """Keydoor whose episodes end after one step on process 1."""

    def step(self, action):
        observation, reward, terminated, truncated, info = super().step(action)
        return observation, reward, terminated or PartialState().process_index == 1, truncated, info


class DroppedOnRank0KeptOnRank1(KeyDoorEnv):
    """dynamic=1: one step per episode; process 0 pays every episode 0, process 1 its environments 0 and 1 in
    turn (in-process, in the order they are built): process 0's groups all equal, process 1's all mixed."""

    built = itertools.count()

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.slot = next(self.built)

    def step(self, action):
        observation, _, _, truncated, info = super().step(action)
        return observation, float(PartialState().process_index == 1 and self.slot % 2), True, truncated, info


def nan_on_rank1_first(batch, **options):
    advantages = compute_advantages("hgpo", batch, **options)
    ESTIMATED.append([])
    if len(ESTIMATED) == 1 and PartialState().process_index == 1:
        advantages[:] = np.nan
    return advantages


def checksum(trainer) -> float:
    """The sum of every parameter (gathered under ZeRO-3, which partitions them), NaN if any is NaN."""
    params = list(trainer.accelerator.unwrap_model(trainer.model).parameters())
    gathered = contextlib.nullcontext()
    if trainer.is_deepspeed_enabled:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params)
    with gathered, torch.no_grad():
        return float(sum(p.double().sum() for p in params))


class Checksum(TrainerCallback):
    """The parameter checksum after every optimizer step."""

    def __init__(self, trainer, checksums: list[float]):
        self.trainer, self.checksums = trainer, checksums

    def on_step_end(self, args, state, control, **kwargs):
        self.checksums.append(checksum(self.trainer))


def main(out: str, extra: list[str]) -> None:
    options = dict(arg.split("=", 1) for arg in extra)
    tokenizer = build_tiny_tokenizer(keydoor_corpus())
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    batching = {}
    if options.get("batching") == "all_steps":  # micro-batches of 2, mini-batches of 8 over both processes
        register_estimator("unique", unique_advantages)
        batching = dict(step_batching="all_steps", mini_batch_size=8, estimator="unique",
                        balance_steps="balance" in options, balance_partition=options.get("balance", "greedy"))
        if options.get("uneven") == "1":
            batching["invalid_action"] = "noop"
    if options.get("dynamic") == "1":  # noop: an invalid output still reaches the environment, which pays it
        batching.update(dynamic_sampling=True, max_rollout_batches=3, invalid_action="noop")
    if options.get("fault") == "nan":
        register_estimator("nan_on_rank1", nan_on_rank1_first)
        batching["estimator"] = "nan_on_rank1"
    args = HGPOConfig(output_dir=os.path.join(out, "run"),
                      per_device_train_batch_size=2 if "step_batching" in batching else 8,
                      num_generations=4, tasks_per_device=2, max_completion_length=4, max_env_steps=5,
                      action_mode="plain", learning_rate=1e-2, train_iterations=2,
                      logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", seed=0,
                      disable_tqdm=True, beta=float(options.get("beta", 0.0)),
                      gradient_checkpointing=options.get("gc") == "1", ddp_timeout=60,
                      rollout_mode=options.get("rollout", "auto"),
                      **{"invalid_action": "end_episode", **batching})
    warm = {}
    if "warmstart" in options:
        from trl import ModelConfig

        from hgpo_trl.commands.train import EnvArguments, load_model
        from hgpo_trl.envs import make_env
        from hgpo_trl.models.warmstart import warm_start

        if options.get("model") == "folder":  # loaded as train.py loads a hub model (ZeRO-3 would partition it)
            folder = os.path.join(out, "model")
            if PartialState().is_main_process:
                model.save_pretrained(folder)
                tokenizer.save_pretrained(folder)
            PartialState().wait_for_everyone()
            model, tokenizer = load_model(ModelConfig(model_name_or_path=folder, dtype="float32"),
                                          EnvArguments(warmstart_steps=int(options["warmstart"])), args, [])

        warm["before"] = float(sum(p.double().sum() for p in model.parameters()))
        warm_start(model, tokenizer, lambda: make_env("keydoor", max_steps=5),
                   list(make_tasks("keydoor", "train", num_rooms=4, num_colors=4)), steps=int(options["warmstart"]),
                   max_steps=5, batch_size=8, learning_rate=1e-2, seed=0, progress=True)
        warm["after"] = float(sum(p.double().sum() for p in model.parameters()))
    trainer = HGPOTrainer(model=model, args=args, processing_class=tokenizer,
                          train_dataset=make_tasks("keydoor", "train", num_rooms=4, num_colors=4),
                          eval_dataset=make_tasks("keydoor", "valid", num_tasks=3),
                          env_factory=FirstResetFails if options.get("fault") == "envs" else
                          EndsAtOnceOnRank1 if options.get("uneven") == "1" else
                          DroppedOnRank0KeptOnRank1 if options.get("dynamic") == "1" else None)
    played, turns = [], []
    original = trainer._play

    def recording_play(tasks, group_size, temperature, *args, **kwargs):
        played.append([int(t["task_id"]) for t in tasks])
        rollout = original(tasks, group_size, temperature, *args, **kwargs)
        turns.append(rollout.turns)
        return rollout

    trainer._play = recording_play
    seen = []
    compute = trainer._compute_loss

    def recording_loss(model, inputs):
        seen.append(inputs["advantages"][inputs["completion_mask"].sum(1) > 0].tolist())
        return compute(model, inputs)

    if options.get("fault") == "nanloss":
        def nan_loss_in_step_two(model, inputs):
            loss = compute(model, inputs)
            # +inf with finite gradients: DeepSpeed would take the step (it skips only non-finite gradients)
            return loss + float("inf") if trainer.state.global_step == 1 and PartialState().process_index == 1 else loss

        trainer._compute_loss = nan_loss_in_step_two
    else:
        trainer._compute_loss = recording_loss
    checksums = []
    trainer.add_callback(Checksum(trainer, checksums))
    rank = trainer.accelerator.process_index
    try:
        trainer.train()
    except FloatingPointError as err:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "error": str(err), "global_step": trainer.state.global_step,
                       "checksums": [*checksums, checksum(trainer)]}, f)
        finish()
        return
    metrics = trainer.evaluate()
    checksum_now = checksum(trainer)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": trainer.accelerator.num_processes, "played": played,
                   "log_history": trainer.state.log_history, "eval": metrics, "checksum": checksum_now,
                   "global_step": trainer.state.global_step, "estimated": ESTIMATED, "seen": seen,
                   "deepspeed": trainer.is_deepspeed_enabled, "warmstart": warm, "turns": turns,
                   "continuous": trainer.args.plays_continuously(trainer._env_workers)}, f)
    finish()


def finish() -> None:
    """Leave together: a process that exits while the other still talks to it aborts the launch (gloo)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
