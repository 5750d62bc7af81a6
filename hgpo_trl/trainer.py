"""`HGPOTrainer`: TRL's `GRPOTrainer` trained on per-step samples of multi-turn environment rollouts.

One iteration: each process plays its `tasks_per_device` tasks `num_generations` times (`hgpo_trl.rollout.lockstep`),
every step becomes one (prompt, completion) sample with its own advantage (`hgpo_trl.advantages`), and the
parent's machinery (clipped loss, KL, optimizer, logging) trains on them, in one of two ways
(`HGPOConfig.step_batching`, `hgpo_trl.training.step_batches`): a fixed budget of samples through TRL's own buffer, or
every step once in as many optimizer steps as the steps fill (as released). Only what per-step samples require
is overridden: the task dataloader, the batch (`_generate_and_score_completions`, `_prepare_inputs`), the
schedule, checkpoints and `evaluate`; each override's needs live in modules named for them (docs/architecture.md).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from datasets import Dataset
from trl import GRPOTrainer

from hgpo_trl.advantages import StepBatch, compute_advantages, hgpo_level_stats
from hgpo_trl.config import HGPOConfig, check_trainer_arguments
from hgpo_trl.config_checks import check_trainer_inputs
from hgpo_trl.envs import TextEnv, is_fast_env, trainer_environment
from hgpo_trl.envs.pool import EnvBatch, default_worker_count, make_env_batch
from hgpo_trl.evaluation.protocol import play_shared, validation_metrics
from hgpo_trl.evaluation.trajectories import dump_path, rollout_records, write_records
from hgpo_trl.models.model_card import write_model_card
from hgpo_trl.models.pretrained import pretrained_or_same
from hgpo_trl.rollout.generation import generation_settings, trainer_rollout
from hgpo_trl.rollout.lockstep import Completion, Rollout
from hgpo_trl.rollout.sampler import TaskSampler
from hgpo_trl.rollout.vllm_cpu import vllm_starting
from hgpo_trl.runtime.collective import any_process, leave_at_exit, process_max, process_sum
from hgpo_trl.runtime.progress import transformers_bars_as_ours, transformers_bars_off
from hgpo_trl.runtime.seeds import seed_process
from hgpo_trl.training import checkpoints, loss_inputs
from hgpo_trl.training.dynamic_sampling import play_training_batches
from hgpo_trl.training.generation_ahead import rollouts_ahead_stopped
from hgpo_trl.training.interrupts import StopOnSignal
from hgpo_trl.training.iterations import (
    EarlyStop,
    FaultStreak,
    IterationCadence,
    IterationCount,
    iteration_schedule,
)
from hgpo_trl.training.metrics import (
    SampleCounts,
    TrainedSteps,
    gathered_metrics,
    iteration_metrics,
    log_completions,
)
from hgpo_trl.training.reporting import set_up_reporting
from hgpo_trl.training.step_batches import plan_micro_batches, sample_tensors, windows_for


def env_reward(completions: list, **kwargs: Any) -> list[float]:
    """Placeholder reward function: GRPOTrainer requires one, but rewards come from the environment."""
    raise RuntimeError("env_reward is a placeholder: HGPOTrainer takes rewards from the environment")


class HGPOTrainer(GRPOTrainer):
    """Train an LLM agent on a text environment with step-level advantages (HGPO, GiGPO, GRPO, ProGPO).

    Args:
        model: a model id, a path, or a `PreTrainedModel` (saved to a folder first when `beta > 0`: TRL rebuilds
            the reference model from `model.config._name_or_path`).
        args: an `HGPOConfig`.
        train_dataset: one row per task (what the environment's `reset(task)` takes, e.g. `hgpo_trl.envs.make_tasks`).
        eval_dataset: the fixed validation tasks of `evaluate()` (one rollout per task).
        env_factory: builds one environment; default `hgpo_trl.envs.make_env(args.env_name, **args.env_kwargs)`.
        environment_factory: a TRL environment class or a dict of them, as TRL's, a tool call a step (envs/trl_env.py).
    """

    _tag_names: ClassVar[list[str]] = ["trl", "hgpo"]
    _name = "HGPO"

    def __init__(self, model, args: HGPOConfig, train_dataset: Dataset, eval_dataset: Dataset | None = None,
                 processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None,
                 env_factory: Callable[[], TextEnv] | None = None, environment_factory=None):
        check_trainer_arguments(args, train_dataset)
        model = pretrained_or_same(model)  # a model the project knows by name, or a .gguf file: its folder
        # Where training started, for the model card (before the reference renames it; a warm start's caller sets it).
        self.base_model = model if isinstance(model, str) else str(getattr(model.config, "_name_or_path", "") or "")
        with transformers_bars_as_ours(args.disable_tqdm), vllm_starting(args.use_vllm, args.bf16):  # (the reference, vLLM)
            self._saved_start = (args.beta != 0.0 or peft_config is not None) and checkpoints.save_in_memory_weights(
                model, processing_class, args, peft=peft_config is not None)
            super().__init__(model=model, reward_funcs=[env_reward], args=args, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                             optimizers=optimizers, peft_config=peft_config)
        leave_at_exit()  # (its gloo process group, ended cleanly at exit: hgpo_trl.runtime.collective)
        self.env_factory, self.chat_template_kwargs = trainer_environment(self, env_factory, environment_factory)
        self.rollout_settings = generation_settings(args.rollout_settings(), self._tokenizer, self.model.config,
                                                    args.vllm_max_model_length if args.use_vllm else None,
                                                    args.max_completion_length)
        self._env_workers = args.env_workers if args.env_workers is not None else default_worker_count(
            env_factory is not None or is_fast_env(args.env_name), self.accelerator.state.num_processes)
        self._envs: EnvBatch | None = None
        self.last_level_stats: list = []  # HGPO's level statistics of the last rollout (plots)
        self._sample_rng = seed_process(args.seed, self.accelerator.process_index)  # (TRL's seed + rank replaced)
        self._training_seconds = self._batch_seconds = 0.0
        # Rollouts started (the 1-based number of the current iteration), in a mutable object: the Trainer builds a
        # DeepSpeed-config scheduler on a shallow copy of itself, and the iteration schedule must see the count.
        self._iterations = IterationCount()
        self._faults = FaultStreak(args.max_faulty_iterations)
        self._micro_batches: deque[dict[str, Any]] = deque()  # all_steps: the current iteration's, in order
        self._trained = TrainedSteps()  # all_steps: the steps/trained counters
        self.clock = checkpoints.RunClock()  # the wall time, over the runs this one resumes
        self._task_sampler = self._get_train_sampler()  # all_steps: an iteration's tasks from its number
        check_trainer_inputs(args, eval_dataset is not None, self.accelerator.state.deepspeed_plugin.deepspeed_config
                             if self.is_deepspeed_enabled else None, fsdp=self.is_fsdp_enabled)
        self.early_stop, self.signal_stop = EarlyStop(self), StopOnSignal(self)
        self._ahead = None  # async_generation: the rollouts played beside training (RolloutsAhead)
        self._ratio_inputs = None  # a loss's inputs awaiting vLLM's correction from its forward (compute_loss)
        for callback in (IterationCadence(self), self.early_stop, self.signal_stop):  # (a signal's stop comes last:
            self.add_callback(callback)                                              # it skips the evaluation)
        set_up_reporting(self)

    # ------------------------------------------------------------------ tasks and rollouts
    def get_train_dataloader(self):
        if self.args.step_batching == "all_steps":
            # The batches come from the rollouts (_prepare_inputs): the dataloader only counts the micro-steps,
            # max_steps windows of gradient_accumulation_steps on every process.
            ticks = Dataset.from_dict({"tick": list(range(self.args.max_steps * self.args.gradient_accumulation_steps
                                                         * self.accelerator.num_processes))})
            return self._get_dataloader(dataset=ticks, description="Training", batch_size=1,
                                        sampler_fn=torch.utils.data.SequentialSampler, is_training=True)
        return self._get_dataloader(dataset=self.train_dataset, description="Training",
                                    batch_size=self.args.tasks_per_device, sampler_fn=self._get_train_sampler,
                                    is_training=True)

    def _get_train_sampler(self, dataset=None) -> TaskSampler:
        return TaskSampler(dataset if dataset is not None else self.train_dataset,
                           tasks_per_iteration=self.args.tasks_per_device * self.accelerator.num_processes,
                           repeat=self.args.steps_per_generation * self.num_iterations,
                           shuffle=self.shuffle_dataset, seed=self.args.seed)

    def _environments(self) -> EnvBatch:
        """The process's environments, built once (worker processes start in seconds): one per rollout of an
        iteration; evaluation plays its tasks in chunks of that size."""
        if self._envs is None:
            self._envs = make_env_batch(self.env_factory, self.args.tasks_per_device * self.num_generations,
                                        self._env_workers, step_timeout=self.args.env_step_timeout,
                                        reset_timeout=self.args.env_reset_timeout)
        return self._envs

    def close_environments(self) -> None:
        """Shut the environment workers down (they also stop when the process exits)."""
        if self._envs is not None:
            self._envs.close()
            self._envs = None

    def _play(self, tasks: list[Mapping[str, Any]], group_size: int, temperature: float,
              description: str = "rollout", rollout_seed: int | None = None) -> Rollout:
        """One rollout of `tasks`, each `group_size` times, in the process's environments."""
        return trainer_rollout(self, self._environments(), tasks, group_size, temperature, description, rollout_seed)

    # ------------------------------------------------------------------ iterations
    @property
    def _iteration(self) -> int:
        return self._iterations.started

    @_iteration.setter
    def _iteration(self, value: int) -> None:
        self._iterations.started = value

    @property
    def at_iteration_boundary(self) -> bool:
        """Whether the last optimizer step ended an iteration (checkpoints and evaluations go there only)."""
        if self.args.step_batching == "all_steps":
            return not self._micro_batches
        return self._step % (self.args.steps_per_generation * self.num_iterations) == 0

    @property
    def completed_iterations(self) -> int:
        return self._iteration - (0 if self.at_iteration_boundary else 1)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """Under all_steps the schedule runs over `train_iterations` and is read at the completed iterations:
        max_steps is only a bound, and the optimizer steps of one iteration share its learning rate."""
        if self.args.step_batching != "all_steps" or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        schedule = super().create_scheduler(self.args.train_iterations, optimizer)
        self.lr_scheduler = iteration_schedule(schedule, lambda: self.completed_iterations)
        return self.lr_scheduler

    def _play_iteration(self, tasks: list[Mapping[str, Any]]) -> tuple[Rollout, StepBatch, np.ndarray, float]:
        """One training rollout of `tasks` and its advantages (on all steps): (rollout, batch, advantages,
        seconds spent on the advantages). Stops every process when the environments keep failing or an
        advantage is not finite."""
        rollout, tasks = play_training_batches(self, tasks)  # more than one batch under dynamic_sampling
        batch = rollout.step_batch()
        tick = time.perf_counter()
        advantages = compute_advantages(self.args.estimator, batch, **self.args.estimator_options())
        advantage_seconds = time.perf_counter() - tick
        if any_process(self.accelerator, not np.all(np.isfinite(advantages))):  # no process raises alone
            raise FloatingPointError(f"non-finite advantages at iteration {self._iteration + 1} (estimator "
                                     f"{self.args.estimator!r}); the parameters were not updated")
        every = self.args.trajectory_dump_every
        if every and self._iteration % every == 0:
            self._dump(f"iter_{self._iteration + 1:06d}", rollout_records(rollout, tasks, advantages, self.args))
        return rollout, batch, advantages, advantage_seconds

    # ------------------------------------------------------------------ fixed_budget: through TRL's buffer
    def training_step(self, model, inputs, num_items_in_batch):
        tick = time.perf_counter()
        self._batch_seconds = 0.0
        if self.args.step_batching == "all_steps" and not self._micro_batches:
            self._micro_batches.extend(self._all_steps_iteration())
            self._batch_seconds = time.perf_counter() - tick
            if not self._micro_batches:
                # The last iterations collected no step on any process: no backward, so the gradients stay None
                # and the optimizer step the Trainer still takes moves nothing; IterationCadence stops the run.
                return torch.zeros((), device=self.accelerator.device)
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not self._micro_batches and (trained := self._trained.finish(self.accelerator)) is not None:  # the iteration's last
            self._log_gathered("train", trained)
        # The parent builds the batch (rollout and all) inside training_step: that time is not training.
        self._training_seconds += time.perf_counter() - tick - self._batch_seconds
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss, checked before its backward: under DeepSpeed the optimizer steps inside the backward of a
        window's last micro-batch, so a check after it would come too late. Every process takes the same
        decision, so none is left waiting in a collective."""
        with loss_inputs.ratio_from_loss_forward(self, inputs):  # (vLLM's correction, where no old forward gave it)
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.model.training and "step_rows" in inputs:
            self._trained.count(inputs["step_rows"])
        if self.model.training and any_process(self.accelerator, not torch.isfinite(loss).all()):
            raise FloatingPointError(
                f"non-finite loss at iteration {self._iteration} (1-based; optimizer step {self.state.global_step + 1}): the "
                f"parameters were not updated and the last checkpoint in {self.args.output_dir} is intact; check "
                "the advantages (adv/*) and lower learning_rate, then resume with --resume_from_checkpoint")
        return loss

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor | Any]:
        start = time.perf_counter()
        mode = "train" if self.model.training else "eval"
        rollout, batch, advantages, advantage_seconds = self._play_iteration(list(inputs))
        output, selected, samples = loss_inputs.budget_inputs(self, rollout, advantages)
        self._log_iteration(mode, rollout, batch, advantages, samples, advantage_seconds)
        log_completions(self, [rollout.steps[i] for i in selected], advantages[selected])
        self._iteration += 1
        self._batch_seconds = time.perf_counter() - start
        return output

    # ------------------------------------------------------------------ all_steps: every step, as released
    def _prepare_inputs(self, inputs):
        """all_steps: the next micro-batch of the current iteration; training_step plays the next iteration when
        they are used up (the parent's buffer would regenerate every steps_per_generation x num_iterations
        micro-steps)."""
        if self.args.step_batching != "all_steps" or not self.model.training:
            return super()._prepare_inputs(inputs)
        return self._micro_batches.popleft()

    def _all_steps_iteration(self) -> list[dict[str, Any]]:
        """The micro-batches of the next iteration that collects a step on some process: every step once (its
        own, or with `balance_steps` an equal share of all), the last micro-batch short or filled with copies
        (`fill_last_micro_batch`), then micro-batches of padding alone so that every process runs the busiest
        one's count of windows, repeated `num_iterations` times. Log-probabilities are taken here, before the
        first update. Empty when the remaining iterations collect no step at all."""
        rank, processes = self.accelerator.process_index, self.accelerator.num_processes
        windows = 0
        while not windows:  # no optimizer step on nothing: an iteration whose episodes all failed trains none
            if self._iteration >= self.args.train_iterations:
                return []
            tasks = [self.train_dataset[i] for i in self._task_sampler.iteration_tasks(self._iteration, rank, processes)]
            rollout, batch, advantages, advantage_seconds = self._play_iteration(tasks)
            rows = loss_inputs.training_rows(self, rollout, advantages)
            plan = plan_micro_batches(len(rows.completions), self.args.per_device_train_batch_size,
                                      "pad" if rows.balanced else self.args.fill_last_micro_batch,
                                      self.args.shuffle_steps, self._sample_rng)
            windows = windows_for(process_max(self.accelerator, len(plan)), self.args.gradient_accumulation_steps)
            samples = loss_inputs.all_steps_counts(len(rollout.steps), rows, plan, windows, self.args, self.num_iterations)
            self._trained.start(rows.num_ids, shared=rows.balanced)
            self._log_iteration("train", rollout, batch, advantages, samples, advantage_seconds)
            self._iteration += 1
        log_completions(self, rollout.steps, advantages)
        return loss_inputs.all_steps_inputs(self, rows, plan, windows)

    # ------------------------------------------------------------------ samples
    def _samples(self, completions: list[Completion], advantages: np.ndarray, padding: int) -> dict[str, torch.Tensor]:
        return sample_tensors(completions, advantages, padding, self._tokenizer.pad_token_id, self.eos_token_ids[0],
                              self.accelerator.device, self.mask_truncated_completions, self.eos_token_ids)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        with loss_inputs.completion_positions_only():
            return loss_inputs.with_loss_ratio(self, super()._get_per_token_logps_and_entropies(*args, **kwargs))

    def _dump(self, name: str, records: list[dict]) -> None:  # (read by hgpo_trl.evaluation.trajectories)
        write_records(dump_path(self.args.output_dir, name, self.accelerator), records)

    # ------------------------------------------------------------------ checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The parent's, without transformers' "Writing model shards" bar (one per save, between our lines); a
        user's save (not a checkpoint's) also refreshes the model card with the evaluations so far."""
        with transformers_bars_off():
            super().save_model(output_dir, _internal_call)
        if not _internal_call and (output_dir is None or Path(output_dir) == Path(self.args.output_dir)):
            self.create_model_card()

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None) -> None:
        """Our own README.md (TRL's describes GRPO and a base model of "None" for one built in memory)."""
        if self.is_world_process_zero():
            write_model_card(self.args, model_name=model_name, base_model=self.base_model,
                             log_history=self.state.log_history, completed_iterations=self.completed_iterations)

    def _save_checkpoint(self, model, trial) -> None:
        """The parent's checkpoint plus our run state, staged, then renamed into place (`hgpo_trl.training.checkpoints`)."""
        checkpoints.save_checkpoint(self, trial, partial(super()._save_checkpoint, model, trial))

    def _determine_best_metric(self, metrics, trial) -> bool:
        """The best step, marked under save_every_iterations too (load_best_model_at_end and rotation read it)."""
        is_new_best = super()._determine_best_metric(metrics, trial)
        if is_new_best and self.args.save_every_iterations:
            self.state.best_global_step = self.state.global_step
        return is_new_best

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """The parent's, from the checkpoint `checkpoints.check_resume` accepts (another process count, damage, shape: refused)."""
        checkpoint = checkpoints.check_resume(resume_from_checkpoint, self.args, self.accelerator.num_processes,
                                              self._saved_start, self.model.config)
        with self.signal_stop.installed(), rollouts_ahead_stopped(self):  # (Ctrl-C / SIGTERM; async_generation)
            return super().train(checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def _issue_warnings_after_load(self, load_result) -> None:
        super()._issue_warnings_after_load(checkpoints.without_tied_keys(self.model, load_result))

    def _load_optimizer_and_scheduler(self, checkpoint):
        with checkpoints.cpu_map_location(self.args.device):
            super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            checkpoints.load_run_state(self, checkpoint)

    # ------------------------------------------------------------------ logging
    def _log_iteration(self, mode: str, rollout: Rollout, batch: StepBatch, advantages: np.ndarray,
                       samples: SampleCounts, advantage_seconds: float) -> None:
        every = self.args.diagnostics_every
        levels = hgpo_level_stats(batch, depth=self.args.depth, similarity_threshold=self.args.similarity_threshold) \
            if self.args.estimator == "hgpo" else None
        if levels is not None and rollout.steps:
            self.last_level_stats = levels
        local = iteration_metrics(rollout, batch, advantages, samples, self.args, levels, eos_token_ids=self.eos_token_ids,
                                  diagnostics=bool(every) and mode == "train" and self._iteration % every == 0,
                                  advantage_seconds=advantage_seconds, training_seconds=self._training_seconds)
        self._training_seconds = 0.0
        self._log_gathered(mode, local)
        # TRL's num_tokens: the prompt and completion tokens of every step played so far, over all processes.
        tokens = sum(len(s.completion.prompt_ids) + len(s.completion.completion_ids) for s in rollout.steps)
        self.state.num_input_tokens_seen += process_sum(self.accelerator, tokens)
        self._metrics[mode]["num_tokens"] = [self.state.num_input_tokens_seen]

    def _log_gathered(self, mode: str, local: dict[str, float]) -> None:
        """Gather every process's `local` metrics (the same keys everywhere) and log them combined."""
        for name, value in gathered_metrics(self.accelerator, local).items():
            self._metrics[mode][name].append(value)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and "loss" in logs:  # training logs say which iteration they end in
            logs = {**logs, "iteration": self._iteration}
        elif "eval_success_rate" in logs:  # an evaluation, after the iterations completed
            logs = {**logs, "iteration": self.completed_iterations}
        super().log(logs, start_time)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Play every validation task once at `eval_temperature` (`hgpo_trl.evaluation.protocol`'s protocol, as hgpo-eval
        plays it) and log the success rate (the parent's evaluation would play G x G rollouts per task)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset of task rows")
        dump = bool(self.args.trajectory_dump_every)
        was_training = self.model.training
        self.model.eval()
        try:
            totals, records = play_shared(
                list(dataset)[: self.args.eval_max_tasks], len(self._environments()),
                lambda tasks, c, chunks: self._play(tasks, 1, self.args.eval_temperature, f"evaluation {c + 1}/{chunks}"),
                self.accelerator, record_args=self.args if dump else None)
            if dump:
                self._dump(f"eval_step_{self.state.global_step:06d}", records)
            metrics = validation_metrics(totals, metric_key_prefix)
            self.log(metrics)  # in eval mode: training metrics stay for the next training log
        finally:
            self.model.train(was_training)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

