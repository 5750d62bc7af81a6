"""`HGPOConfig`: TRL's `GRPOConfig` plus the environment, memory-window and step-level estimator settings."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from trl import GRPOConfig

from hgpo_trl.advantages import estimator_options
from hgpo_trl.config_checks import check_launch_precision, check_values
from hgpo_trl.envs.registry import invalid_tail_chars, prompt_has_format
from hgpo_trl.fields import ESTIMATOR_FIELDS, HGPOFields
from hgpo_trl.rollout.actions import INVALID_TAIL_CHARS
from hgpo_trl.rollout.lockstep import RolloutSettings

SHORT_COMPLETION = 16  # tokens: completions no longer than this leave a lock-step turn little to wait for


def cpu_precision_default(use_cpu: bool) -> bool | None:
    """The `bf16` default: TRL's (None, read as True) on a GPU; False on a CPU, where bf16 autocast makes a small
    model's training 1.5x slower (no bf16 matrix units) and its log-probabilities coarser."""
    return None if torch.cuda.is_available() and not use_cpu else False


def forget_deepspeed_config(config) -> None:
    """After `config` was refused: the DeepSpeed config transformers registered for it (a weak reference, taken
    before the file is read) is no longer the process's, half built or not: kept alive by the refusal's exception
    (a notebook's last error), it made every later model forward fail ("no attribute '_stage'")."""
    from transformers.integrations import deepspeed

    registered = deepspeed._hf_deepspeed_config_weak_ref() if deepspeed._hf_deepspeed_config_weak_ref else None
    if registered is not None and (not hasattr(registered, "_stage")
                                   or registered is getattr(config, "hf_deepspeed_config", None)):
        deepspeed.unset_hf_deepspeed_config()


@dataclass
class HGPOConfig(HGPOFields, GRPOConfig):
    """Configuration of `HGPOTrainer`.

    Inherited fields keep their TRL meaning, with these readings:
    - `num_generations` (G): rollouts per task; a task group is the G rollouts of one task.
    - `per_device_train_batch_size x steps_per_generation` (M): step samples per process per iteration. A rollout
      gives any number of steps: they are sub-sampled (after computing advantages on all) or padded to M.
    - `max_steps`: optimizer steps, as in TRL; or set `train_iterations` (rollouts) and it is converted.
    - `temperature`: sampling temperature of training rollouts; `eval_temperature` for evaluation.
    - `reward_weights`, `scale_rewards`, `multi_objective_aggregation`: unused (rewards come from the environment,
      advantages from `estimator`).
    """

    _VALID_DICT_FIELDS: ClassVar[list[str]] = [*GRPOConfig._VALID_DICT_FIELDS, "env_kwargs"]

    def __post_init__(self) -> None:
        try:
            self._check_and_set()
        except BaseException:
            forget_deepspeed_config(self)
            raise

    def _check_and_set(self) -> None:
        check_values(self)
        if self.bf16 is None and not self.fp16:
            self.bf16 = cpu_precision_default(self.use_cpu)
        check_launch_precision(self)
        self._set_iteration_cadence()
        processes = int(os.environ.get("WORLD_SIZE", "1"))  # the launcher's; checked against TRL's below
        if self.step_batching == "all_steps":
            self._set_all_steps_accumulation(processes)
        elif self.mini_batch_size is not None:
            raise ValueError("HGPOConfig.mini_batch_size is read only under step_batching='all_steps'")
        self._check_generation_batch(processes)
        self._check_eval_batch(processes)
        super().__post_init__()
        if (self.early_stop_success is not None and self.eval_every_iterations is None
                and str(getattr(self.eval_strategy, "value", self.eval_strategy)) == "no"):
            raise ValueError("HGPOConfig.early_stop_success stops on validation success, and this run never "
                             "evaluates during training: set eval_every_iterations (or eval_strategy: steps and "
                             "eval_steps)")
        if self.step_batching == "all_steps":
            if self.world_size != processes:
                fix = ("on a machine without a GPU set use_cpu: true (or rehearse a GPU config: --rehearse)"
                       if not torch.cuda.is_available() and not self.use_cpu else
                       "launch with accelerate launch or torchrun")
                raise ValueError(f"HGPOConfig: the launcher started {processes} processes (WORLD_SIZE) but the "
                                 f"Trainer sees {self.world_size}: {fix}")
            # An upper bound (the busiest process keeps every group it may play, each episode to max_env_steps);
            # the iterations stop the run.
            groups = self.tasks_per_device * (self.max_rollout_batches if self.dynamic_sampling else 1)
            rows = groups * self.num_generations * self.max_env_steps
            if self.balance_steps and self.fill_last_micro_batch == "duplicate":
                # Every process's rows, filled to the multiple (hgpo_trl.training.balance), shared out in equal parts.
                multiple = self.fill_multiple or self.per_device_train_batch_size * processes
                rows = math.ceil(math.ceil(rows * processes / multiple) * multiple / processes)
            micro_batches = math.ceil(rows / self.per_device_train_batch_size)
            windows = math.ceil(micro_batches / self.gradient_accumulation_steps)
            self.max_steps = self.train_iterations * self.num_iterations * windows
        elif self.train_iterations is not None:
            per_iteration = self.steps_per_generation * self.num_iterations
            if per_iteration % self.gradient_accumulation_steps:
                raise ValueError(
                    f"train_iterations needs steps_per_generation x num_iterations ({per_iteration}) to be a "
                    f"multiple of gradient_accumulation_steps ({self.gradient_accumulation_steps})")
            self.max_steps = self.train_iterations * per_iteration // self.gradient_accumulation_steps
        steps_per_iteration = self.steps_per_generation * self.num_iterations // self.gradient_accumulation_steps
        if (self.step_batching == "fixed_budget" and str(getattr(self.save_strategy, "value", self.save_strategy))
                == "steps" and self.save_steps >= 1 and steps_per_iteration > 1 and self.save_steps % steps_per_iteration):
            raise ValueError(f"HGPOConfig.save_steps ({self.save_steps}) must be a multiple of the {steps_per_iteration} "
                             "optimizer steps of an iteration: a checkpoint inside one cannot resume it (TRL's buffer "
                             "of its samples is not saved); or use save_every_iterations")
        eval_steps = self.eval_steps or 0
        if (self.step_batching == "fixed_budget" and str(getattr(self.save_strategy, "value", self.save_strategy))
                == "best" and eval_steps >= 1 and steps_per_iteration > 1 and eval_steps % steps_per_iteration):
            raise ValueError(f"HGPOConfig.eval_steps ({eval_steps}) must be a multiple of the {steps_per_iteration} "
                             "optimizer steps of an iteration under save_strategy='best', which saves after an "
                             "evaluation: a checkpoint inside an iteration cannot resume it; or use "
                             "eval_every_iterations and save_every_iterations")

    def _set_iteration_cadence(self) -> None:
        """eval_every_iterations / save_every_iterations replace the optimizer-step strategies, which cannot say
        where an all_steps iteration ends: the Trainer's own default (save every 500 steps) is switched off, and
        a strategy the user set beside them, or under all_steps, is an error naming both."""
        defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
        for kind, every in (("save", self.save_every_iterations), ("eval", self.eval_every_iterations)):
            strategy = str(getattr(getattr(self, f"{kind}_strategy"), "value", getattr(self, f"{kind}_strategy")))
            untouched = (strategy == defaults[f"{kind}_strategy"] and
                         getattr(self, f"{kind}_steps") == defaults[f"{kind}_steps"])
            if strategy == "no":
                continue
            if untouched and (every is not None or self.step_batching == "all_steps"):
                setattr(self, f"{kind}_strategy", "no")
            elif every is not None:
                raise ValueError(f"HGPOConfig: set {kind}_every_iterations or {kind}_strategy ({strategy!r}), "
                                 "not both")
            elif self.step_batching == "all_steps":
                raise ValueError(f"HGPOConfig.{kind}_strategy={strategy!r} counts optimizer steps, whose number per "
                                 f"iteration varies under step_batching='all_steps': use {kind}_every_iterations")
        save_strategy = str(getattr(self.save_strategy, "value", self.save_strategy))
        if self.load_best_model_at_end and self.save_every_iterations is None and save_strategy == "no":
            raise ValueError("HGPOConfig.load_best_model_at_end: this run saves no checkpoint, so there is no best "
                             "model to load at the end: set save_every_iterations (a multiple of "
                             "eval_every_iterations)")
        if self.load_best_model_at_end and self.save_every_iterations is not None and (
                self.eval_every_iterations is None or self.save_every_iterations % self.eval_every_iterations):
            raise ValueError("HGPOConfig.load_best_model_at_end needs save_every_iterations to be a multiple of "
                             "eval_every_iterations (a checkpoint is kept as the best when it was just evaluated)")

    def _set_all_steps_accumulation(self, processes: int) -> None:
        """all_steps: gradient_accumulation_steps = micro-batches per optimizer step and process, from the global
        mini_batch_size (before TRL and DeepSpeed read it). The rollouts are played outside TRL's generation
        buffer, whose size (steps_per_generation) TRL still checks against num_generations: it gets one that
        passes, and nothing else reads it."""
        if self.train_iterations is None:
            raise ValueError("HGPOConfig.step_batching='all_steps' needs train_iterations: the number of optimizer "
                             "steps per iteration varies, so max_steps cannot say when to stop")
        if self.mini_batch_size is not None:
            per_process, remainder = divmod(self.mini_batch_size, processes * self.per_device_train_batch_size)
            if remainder or per_process == 0:
                raise ValueError(f"HGPOConfig.mini_batch_size ({self.mini_batch_size}) must be a multiple of "
                                 f"per_device_train_batch_size ({self.per_device_train_batch_size}) x processes "
                                 f"({processes})")
            if self.gradient_accumulation_steps not in (1, per_process):
                raise ValueError(f"HGPOConfig.gradient_accumulation_steps ({self.gradient_accumulation_steps}) "
                                 f"disagrees with mini_batch_size ({self.mini_batch_size}) = per_device_train_batch_"
                                 f"size ({self.per_device_train_batch_size}) x processes ({processes}) x "
                                 f"{per_process}: set one of them")
            self.gradient_accumulation_steps = per_process
        if self.steps_per_generation is None and self.generation_batch_size is None:
            self.steps_per_generation = self.gradient_accumulation_steps * self.num_generations

    def _check_generation_batch(self, processes: int) -> None:
        """TRL's checks of its generation batch (the step samples of an iteration over all processes), made here
        first and naming the fields to change: TRL's messages name its derived generation_batch_size."""
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError("HGPOConfig: set steps_per_generation or generation_batch_size, not both (each gives "
                             "the other: generation_batch_size = per_device_train_batch_size x processes x "
                             "steps_per_generation)")
        global_batch = self.per_device_train_batch_size * processes
        if self.generation_batch_size is not None and self.generation_batch_size % global_batch:
            raise ValueError(f"HGPOConfig.generation_batch_size ({self.generation_batch_size}) must be a multiple of "
                             f"per_device_train_batch_size ({self.per_device_train_batch_size}) x processes "
                             f"({processes}) = {global_batch}; or set steps_per_generation instead")
        steps = (f"steps_per_generation ({self.steps_per_generation})" if self.steps_per_generation is not None
                 else f"steps_per_generation (unset: gradient_accumulation_steps, {self.gradient_accumulation_steps})")
        batch = self.generation_batch_size or global_batch * (self.steps_per_generation or
                                                             self.gradient_accumulation_steps)
        if batch % self.num_generations:
            raise ValueError(
                f"HGPOConfig.num_generations ({self.num_generations}) must divide the step samples of an iteration, "
                f"per_device_train_batch_size ({self.per_device_train_batch_size}) x processes ({processes}) x "
                f"{steps} = {batch} (TRL's generation batch holds whole task groups): set "
                f"per_device_train_batch_size or steps_per_generation so that it is a multiple of "
                f"{self.num_generations}")

    def _check_eval_batch(self, processes: int) -> None:
        """TRL requires, where a run evaluates on its steps, an evaluation batch over all processes that
        num_generations divides (hgpo-trl's evaluation plays each task once and never uses that batch): checked
        here, naming the fields, before TRL's message names neither."""
        strategy = str(getattr(self.eval_strategy, "value", self.eval_strategy))
        generations = self.num_generations_eval or self.num_generations
        batch = self.per_device_eval_batch_size * processes
        if strategy != "no" and generations and batch % generations:
            raise ValueError(
                f"HGPOConfig.num_generations ({generations}) must divide per_device_eval_batch_size "
                f"({self.per_device_eval_batch_size}) x processes ({processes}), TRL's evaluation batch (hgpo-trl's "
                f"evaluation plays each task once and does not use it): set per_device_eval_batch_size to a multiple "
                f"of {generations // math.gcd(generations, processes)}")

    @property
    def depth(self) -> int:
        """K, the deepest HGPO level."""
        return self.history_length if self.hierarchy_depth is None else self.hierarchy_depth

    @property
    def streams_from_vllm(self) -> bool:
        """Whether vLLM takes this process's requests one at a time: a server, or colocated with an engine of its
        own per process, woken once (not per call, as sleep mode does)."""
        return self.use_vllm and (self.vllm_mode == "server" or (
            self.vllm_tensor_parallel_size == 1 and not self.vllm_enable_sleep_mode))

    def plays_continuously(self, env_workers: int) -> bool:
        """Whether rollouts play continuously (`rollout_mode`) with `env_workers` environment worker processes (the
        trainer's, resolved). 'auto': where colocated vLLM streams and a continuous rollout has time to win back:
        environments stepping in workers (their steps hide behind generation), or completions that may run past
        SHORT_COMPLETION tokens (a lock-step turn waits for its longest). Neither (the quickstart: keydoor in process,
        6 tokens) leaves it nothing to hide and only its cost per request: lock-step (docs/results.md)."""
        if self.rollout_mode != "auto":
            return self.rollout_mode == "continuous"
        long_completions = self.max_completion_length is None or self.max_completion_length > SHORT_COMPLETION
        return self.streams_from_vllm and (env_workers > 0 or long_completions)

    def rollout_settings(self) -> RolloutSettings:
        tail_chars = invalid_tail_chars(self.env_name)  # (None: the registration left it to the rollout)
        return RolloutSettings(
            history_length=self.history_length, max_steps=self.max_env_steps, action_mode=self.action_mode,
            require_think=self.require_think, reject_cjk=self.reject_cjk, invalid_action=self.invalid_action,
            invalid_tail_chars=INVALID_TAIL_CHARS if tail_chars is None else tail_chars, admissible_only=self.admissible_only,
            max_prompt_tokens=self.max_prompt_tokens,
            format_instruction="" if self.format_instruction is None and prompt_has_format(self.env_name)
            else self.format_instruction)

    def diagnostic_estimators(self) -> dict[str, dict[str, Any]]:
        """What `diagnostics_every` compares with the oracle: GRPO, GiGPO and HGPO at this config's depth."""
        episode = {"episode_stats": self.episode_stats, "std_ddof": self.std_ddof}
        similar = {"similarity_threshold": self.similarity_threshold}
        return {"grpo": {"estimator": "grpo", **episode},
                "gigpo": {"estimator": "gigpo", "omega": self.omega, **similar, **episode},
                "hgpo": {"estimator": "hgpo", "depth": self.depth, "alpha": self.alpha,
                         "weighting": self.weighting, "base_group": self.base_group,
                         "drop_zero_items": self.drop_zero_items, **similar, **episode}}

    def estimator_options(self) -> dict[str, Any]:
        """The keyword options of `estimator`, from this config's fields."""
        candidates = {option: self.depth if name == "hierarchy_depth" else getattr(self, name)
                      for name, option in ESTIMATOR_FIELDS.items()}
        return {k: v for k, v in candidates.items() if k in estimator_options(self.estimator)}




def check_trainer_arguments(args: Any, train_dataset: Any) -> None:
    """What `HGPOTrainer` takes: an HGPOConfig and a Dataset of task rows."""
    from datasets import Dataset

    if not isinstance(args, HGPOConfig):
        raise ValueError(f"HGPOTrainer needs an HGPOConfig, got {type(args).__name__}")
    if not isinstance(train_dataset, Dataset):
        raise ValueError("train_dataset must be a datasets.Dataset with one row per task "
                         f"(e.g. hgpo_trl.envs.make_tasks(...)), got {type(train_dataset).__name__}")
