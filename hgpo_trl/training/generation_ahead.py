"""The trainer's side of generation beside training (`async_generation`; the thread and its bound:
`hgpo_trl.rollout.ahead`). The thread plays each iteration's tasks (the ones the dataloader serves that iteration)
on the vLLM server in environments of its own (evaluation plays in the trainer's), with a tokenizer of its own and
each request's seed from the iteration, as a synchronous run draws them; the trainer pushes its weights after every
optimizer step (`PushWeights`), takes each iteration's rollout when it trains it, and logs how stale its steps were.
The thread makes no collective call: the weight push, the only one, is the trainer's."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import closing, contextmanager

import numpy as np
from transformers import TrainerCallback

from hgpo_trl.envs.pool import make_env_batch
from hgpo_trl.rollout.ahead import RolloutsAhead, RolloutsFailed
from hgpo_trl.rollout.continuous import run_continuous
from hgpo_trl.rollout.generation import ModelPolicy, push_weights, request_client, training_rollout_seed
from hgpo_trl.rollout.lockstep import Rollout, StepRecord
from hgpo_trl.rollout.vllm_stream import ServerStream
from hgpo_trl.runtime.collective import any_process


def start_rollouts_ahead(trainer) -> RolloutsAhead:
    """Push the trainer's weights and start playing from the trainer's next iteration to the run's last."""
    args, accelerator = trainer.args, trainer.accelerator
    rank, processes = accelerator.process_index, accelerator.num_processes
    backend = trainer.vllm_generation
    episodes = args.tasks_per_device * trainer.num_generations
    client = request_client(trainer, 2 * episodes)  # (the thread's requests and an evaluation's, at once)
    envs = make_env_batch(trainer.env_factory, episodes, trainer._env_workers,
                          step_timeout=args.env_step_timeout, reset_timeout=args.env_reset_timeout)
    policy = ModelPolicy(copy.deepcopy(trainer._tokenizer), None, trainer.chat_template_kwargs)
    decode = policy.tokenizer.decode

    def play(iteration: int) -> Rollout:
        tasks = [trainer.train_dataset[i] for i in trainer._task_sampler.iteration_tasks(iteration, rank, processes)]
        stream = ServerStream(client, backend, trainer.temperature, lambda text: policy.prompt_ids([text])[0],
                              lambda ids: decode(ids, skip_special_tokens=True), len(tasks) * trainer.num_generations,
                              rollout_seed=training_rollout_seed(args.seed, rank, iteration),
                              version=ahead.version, stopped=lambda: ahead.stopping)
        with closing(stream):
            return run_continuous(envs, tasks, trainer.num_generations, stream, trainer.rollout_settings,
                                  count_tokens=policy.count_tokens)

    ahead = RolloutsAhead(play, first=trainer._iteration, last=trainer.state.max_steps,
                          max_staleness=args.max_staleness, on_stop=envs.close)
    trainer._ahead = ahead
    trainer.add_callback(PushWeights(trainer))
    push_weights(trainer)
    ahead.start()
    return ahead


def take_rollout(trainer) -> Rollout:
    """The rollout of the trainer's current iteration, played ahead (the thread started at the first), with the
    seconds the trainer waited for it (`time/rollout_wait`) and how stale its steps are, relative to the optimizer
    step that trains them (`async/staleness/*`), logged."""
    ahead = trainer._ahead or start_rollouts_ahead(trainer)
    waited = ahead.waiting_seconds
    try:
        rollout, failure = ahead.take(trainer._iteration), None
    except Exception as err:  # (the thread's, or a failed weight push: a server gone or hung, a broken environment)
        rollout, failure = None, err
    if any_process(trainer.accelerator, failure is not None):  # (every process stops here, or none)
        stop_at_failed_rollout(trainer, failure)
    trainer._log_gathered("train", {"time/rollout_wait": ahead.waiting_seconds - waited,
                                    **staleness_metrics(rollout.steps, trainer.state.global_step)})
    return rollout


def stop_at_failed_rollout(trainer, failure: Exception | None) -> None:
    """Save a checkpoint (every process: it is collective) that resumes the iteration whose rollout failed, then
    raise `RolloutsFailed` naming the failure (or "on another process")."""
    saved = trainer.state.global_step > 0  # (before the first optimizer step there is nothing to keep)
    if saved:
        trainer._save_checkpoint(trainer.model, trial=None)
    raise RolloutsFailed(failure_line(trainer, failure, saved)) from failure


def failure_line(trainer, failure: Exception | None, saved: bool) -> str:
    where = f"a checkpoint was saved in {trainer.args.output_dir}; " if saved else ""
    return (f"generation beside training stopped before iteration {trainer.completed_iterations + 1}: "
            f"{failure if failure is not None else 'it failed on another process'}; {where}resume with "
            "--resume_from_checkpoint once the server answers")


@contextmanager
def rollouts_ahead_stopped(trainer) -> Iterator[None]:
    """Around a run: at its end (its last iteration, a stop, an error) the thread is stopped and what it played ahead
    dropped; a run that a failed weight push stopped (`PushWeights`: the trainer saved its checkpoint) raises
    `RolloutsFailed` then."""
    ahead = None
    try:
        yield
    finally:
        if trainer._ahead is not None:
            trainer._ahead, ahead = None, trainer._ahead
            trainer.remove_callback(PushWeights)
            ahead.stop()
    if ahead is not None and ahead.push_failure is not None:
        raise RolloutsFailed(failure_line(trainer, ahead.push_failure, saved=True)) from ahead.push_failure


class PushWeights(TrainerCallback):
    """After each optimizer step, the trainer's weights to the server (every process: the gathers are collective),
    while rollouts are played ahead. Where the push failed (on every process alike: `sync_weights`), the run saves
    a checkpoint there and stops, without the evaluation (it would play on that server)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        push_weights(self.trainer)
        if self.trainer._ahead is not None and self.trainer._ahead.push_failure is not None:
            control.should_evaluate = False
            control.should_save = control.should_training_stop = True


def staleness_metrics(steps: list[StepRecord], step: int) -> dict[str, float]:
    """How many optimizer steps older than the update at optimizer step `step` the weights that generated `steps`
    were (a step's version: its request's), their mean and the largest."""
    lags = np.array([step - s.completion.version for s in steps if s.completion.version is not None], dtype=float)
    return {"async/staleness/mean": float(lags.mean()) if lags.size else float("nan"),
            "async/staleness/max": float(lags.max()) if lags.size else float("nan")}
