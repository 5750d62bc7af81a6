"""The checks of an `HGPOConfig`'s values, in one place: each field against what it must be, the optional packages
and the device a setting needs, the launcher's precision, and what the trainer's inputs must hold; a refusal is one
line that names the field (`HGPOConfig.<field> must be ...`)."""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from hgpo_trl.advantages import ESTIMATORS, estimator_options
from hgpo_trl.advantages.groups import DDOFS, NORMS
from hgpo_trl.advantages.grpo import EPISODE_STATS
from hgpo_trl.advantages.hgpo import WEIGHTINGS
from hgpo_trl.fields import ESTIMATOR_FIELDS
from hgpo_trl.rollout.actions import ACTION_MODES
from hgpo_trl.rollout.continuous import ROLLOUT_MODES
from hgpo_trl.rollout.lockstep import INVALID_ACTIONS
from hgpo_trl.rollout.vllm_cpu import cpu_build_command, vllm_runs_here
from hgpo_trl.training.balance import PARTITIONS
from hgpo_trl.training.dynamic_sampling import TASK_CHOICES
from hgpo_trl.training.step_batches import FILLS, STEP_BATCHINGS

if TYPE_CHECKING:
    from hgpo_trl.config import HGPOConfig


def check_values(args: HGPOConfig) -> None:
    """Each field against what it must be (one line naming the field, what it must be and what it got), the
    optional packages a setting needs, and the settings TRL would take and then fail on."""
    checks = [
        ("tasks_per_device", args.tasks_per_device >= 1, "an integer >= 1"),
        ("max_env_steps", args.max_env_steps >= 1, "an integer >= 1"),
        ("history_length", args.history_length >= 0, "an integer >= 0"),
        ("hierarchy_depth", args.hierarchy_depth is None or args.hierarchy_depth >= 0, "None or >= 0"),
        ("train_iterations", args.train_iterations is None or args.train_iterations >= 1, "None or >= 1"),
        ("action_mode", args.action_mode in ACTION_MODES, f"one of {ACTION_MODES}"),
        ("invalid_action", args.invalid_action in INVALID_ACTIONS, f"one of {INVALID_ACTIONS}"),
        ("invalid_action", args.invalid_action != "execute" or args.action_mode == "tags",
         "'noop' or 'end_episode' under action_mode 'plain' ('execute' reads <action> tags, as released)"),
        ("estimator", args.estimator in ESTIMATORS, f"one of {sorted(ESTIMATORS)}"),
        ("gamma", 0.0 <= args.gamma <= 1.0, "in [0, 1]"),
        ("alpha", args.alpha >= 0.0, ">= 0"),
        ("similarity_threshold", args.similarity_threshold is None or (
            not isinstance(args.similarity_threshold, bool) and 0.0 < args.similarity_threshold <= 1.0),
         "None or in (0, 1] (1.0: exact grouping)"),
        ("weighting", args.weighting in WEIGHTINGS, f"one of {WEIGHTINGS}"),
        ("episode_stats", args.episode_stats in EPISODE_STATS, f"one of {EPISODE_STATS}"),
        ("std_ddof", not isinstance(args.std_ddof, bool) and args.std_ddof in DDOFS, f"one of {DDOFS}"),
        ("advantage_norm", args.advantage_norm in NORMS, f"one of {NORMS}"),
        ("eval_temperature", args.eval_temperature >= 0.0, ">= 0"),
        # TRL divides the logits by it, and at 0 the G rollouts of a task would all be the same.
        ("temperature", args.temperature > 0.0, "> 0 for training rollouts (eval_temperature may be 0)"),
        ("learning_rate", args.learning_rate >= 0.0, ">= 0"),
        ("invalid_penalty", args.invalid_penalty >= 0.0, ">= 0 (a penalty, subtracted from the return)"),
        ("max_completion_length", args.max_completion_length is None or args.max_completion_length >= 1,
         "None or an integer >= 1"),
        ("env_workers", args.env_workers is None or args.env_workers >= 0, "None or an integer >= 0"),
        ("env_step_timeout", args.env_step_timeout is None or args.env_step_timeout > 0, "None or > 0 seconds"),
        ("env_reset_timeout", args.env_reset_timeout is None or args.env_reset_timeout > 0,
         "None or > 0 seconds"),
        ("eval_max_tasks", args.eval_max_tasks is None or args.eval_max_tasks >= 1, "None or an integer >= 1"),
        ("early_stop_success", args.early_stop_success is None or 0.0 < args.early_stop_success <= 1.0,
         "None or in (0, 1]"),
        ("early_stop_patience", args.early_stop_patience >= 1, "an integer >= 1"),
        ("diagnostics_every", args.diagnostics_every >= 0, "an integer >= 0 (0: never)"),
        ("trajectory_dump_every", args.trajectory_dump_every >= 0, "an integer >= 0 (0: never)"),
        ("max_faulty_iterations", args.max_faulty_iterations >= 0, "an integer >= 0 (0: never stop)"),
        ("max_prompt_tokens", args.max_prompt_tokens is None or args.max_prompt_tokens >= 1,
         "None or an integer >= 1"),
        ("num_generations", args.num_generations is not None and args.num_generations >= 2,
         "an integer >= 2 (rollouts per task)"),
        ("vllm_tensor_parallel_size", args.vllm_tensor_parallel_size >= 1 and (
            not args.use_vllm or args.vllm_mode != "colocate"
            or int(os.environ.get("WORLD_SIZE", "1")) % args.vllm_tensor_parallel_size == 0),
         f"a divisor of the processes ({os.environ.get('WORLD_SIZE', '1')}) under vllm_mode 'colocate' (each "
         "process group of that size shares one vLLM engine)"),
        ("rollout_mode", args.rollout_mode in ROLLOUT_MODES, f"one of {ROLLOUT_MODES}"),
        ("rollout_mode", args.rollout_mode != "continuous" or not args.use_vllm or args.streams_from_vllm,
         "'lockstep' or 'auto' with colocated vLLM's vllm_tensor_parallel_size > 1 or vllm_enable_sleep_mode "
         "(every process joins each generate call there; continuous needs an engine of its own, or a server)"),
        ("vllm_request_timeout", args.vllm_request_timeout > 0, "a number of seconds > 0"),
        ("max_staleness", args.max_staleness >= 0, "an integer >= 0 (0: the synchronous run)"),
        ("async_generation", not args.async_generation or (args.use_vllm and args.vllm_mode == "server"),
         "false unless use_vllm is true with vllm_mode 'server' (generation runs on the server's own resources: "
         "hgpo-serve)"),
        ("async_generation", not args.async_generation or (
            args.step_batching == "fixed_budget" and not args.dynamic_sampling and args.rollout_mode == "continuous"
            and (args.steps_per_generation or args.gradient_accumulation_steps) * args.num_iterations
            == args.gradient_accumulation_steps),
         "false unless each iteration is one optimizer step (step_batching 'fixed_budget', steps_per_generation x "
         "num_iterations = gradient_accumulation_steps), without dynamic_sampling, with rollout_mode 'continuous' "
         "(the thread plays each episode on its own, as the synchronous run it reproduces at max_staleness 0)"),
        ("step_batching", args.step_batching in STEP_BATCHINGS, f"one of {STEP_BATCHINGS}"),
        ("max_rollout_batches", args.max_rollout_batches >= 1, "an integer >= 1"),
        ("dynamic_sampling_tasks", args.dynamic_sampling_tasks in TASK_CHOICES, f"one of {TASK_CHOICES}"),
        ("fill_last_micro_batch", args.fill_last_micro_batch in FILLS, f"one of {FILLS}"),
        ("balance_steps", not args.balance_steps or args.step_batching == "all_steps",
         "false under step_batching 'fixed_budget' (it shares out the rows of all_steps)"),
        ("train_forced_steps", args.train_forced_steps or args.step_batching == "fixed_budget",
         "true under step_batching 'all_steps' (which trains every step once)"),
        ("balance_partition", args.balance_partition in PARTITIONS, f"one of {tuple(PARTITIONS)}"),
        ("fill_multiple", args.fill_multiple is None or (args.fill_multiple >= 1 and args.fill_multiple
                                                         % args.per_device_train_batch_size == 0),
         f"None or a positive multiple of per_device_train_batch_size ({args.per_device_train_batch_size})"),
        ("fill_multiple", args.fill_multiple is None or (args.balance_steps
                                                         and args.fill_last_micro_batch == "duplicate"),
         "None unless balance_steps is true and fill_last_micro_batch is 'duplicate' (it sets their fill)"),
        ("mini_batch_size", args.mini_batch_size is None or args.mini_batch_size >= 1, "None or an integer >= 1"),
        ("eval_every_iterations", args.eval_every_iterations is None or args.eval_every_iterations >= 1,
         "None or an integer >= 1"),
        ("save_every_iterations", args.save_every_iterations is None or args.save_every_iterations >= 1,
         "None or an integer >= 1"),
    ]
    for name, ok, expected in checks:
        if not ok:
            close = difflib.get_close_matches(str(getattr(args, name)), list(ESTIMATORS), 1) \
                if name == "estimator" else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"HGPOConfig.{name} must be {expected}, got {getattr(args, name)!r}{hint}")
    if isinstance(args.env_kwargs, str):  # TRL decodes only JSON strings, and names no field
        try:
            args.env_kwargs = yaml.safe_load(args.env_kwargs)
        except yaml.YAMLError as err:
            raise ValueError(f"HGPOConfig.env_kwargs must be a mapping such as '{{max_steps: 30}}' (YAML or "
                             f"JSON): cannot read {args.env_kwargs!r}: {str(err).splitlines()[0]}") from None
    if args.env_kwargs is not None and not isinstance(args.env_kwargs, dict):
        raise ValueError(f"HGPOConfig.env_kwargs must be a mapping such as '{{max_steps: 30}}', got "
                         f"{args.env_kwargs!r}")
    check_output_dir(args.output_dir)
    check_device(args)
    # Optional packages: a clear error now rather than an import failure after the model has loaded.
    extras = [("use_vllm", args.use_vllm, "vllm"), ("deepspeed", args.deepspeed, "deepspeed"),
              ("env_name", args.env_name == "alfworld", "alfworld")]
    for name, wanted, package in extras:
        if wanted and importlib.util.find_spec(package) is None:
            raise ValueError(f"HGPOConfig.{name}={getattr(args, name)!r} needs the {package} package, which is "
                             f'not installed: pip install "hgpo-trl[{package}]"')
    if args.push_to_hub and str(getattr(args.hub_strategy, "value", args.hub_strategy)) in (
            "checkpoint", "all_checkpoints"):
        raise ValueError(f"HGPOConfig.hub_strategy={args.hub_strategy!r} is not supported: checkpoints are "
                         "written in a staging folder and renamed once complete, and the Trainer would upload "
                         "the staging folder; use 'every_save' or 'end'")
    if args.load_best_model_at_end and args.metric_for_best_model is None:
        raise ValueError("HGPOConfig.load_best_model_at_end needs metric_for_best_model, e.g. 'success_rate' "
                         "(evaluate() reports eval_success_rate, eval_episode_reward, ...; there is no eval_loss)")
    if args.hierarchy_depth is not None and args.hierarchy_depth > args.history_length:
        user_warning(
            f"HGPOConfig: hierarchy_depth ({args.hierarchy_depth}) > history_length ({args.history_length}): "
            "HGPO's deepest levels key on observations that the prompts do not show")


def check_output_dir(output_dir: str | None) -> None:
    """A folder, or a path where one can be made: a file there, or above it, failed at the first write, after the
    model had loaded and warm-started (a NotADirectoryError traceback)."""
    if output_dir is None:  # (the Trainer's default)
        return
    path = Path(output_dir).expanduser().absolute()
    existing = next(folder for folder in (path, *path.parents) if folder.exists())
    if not existing.is_dir():
        raise ValueError(f"HGPOConfig.output_dir must be a folder (or a path where one can be made), got "
                         f"{output_dir!r}: {existing} is a file")


def check_launch_precision(args: HGPOConfig) -> None:
    """Under DeepSpeed the launcher's mixed precision and this config's must agree: say so in one line, not
    in transformers' "ds bf16.enabled=True vs hf bf16|bf16_full_eval=False" traceback on every rank."""
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" and launched in ("no", "bf16", "fp16") and (
            (launched == "bf16") != bool(args.bf16) or (launched == "fp16") != bool(args.fp16)):
        raise ValueError(f"HGPOConfig: the accelerate file's mixed_precision: {launched} and this config's bf16: "
                         f"{bool(args.bf16)}, fp16: {bool(args.fp16)} disagree, and DeepSpeed needs them equal: "
                         f"launch with --mixed_precision {'bf16' if args.bf16 else 'fp16' if args.fp16 else 'no'}"
                         " or set bf16 / fp16 to match (a CPU has no bf16 units: --rehearse runs a GPU config "
                         "there in float32)")


def check_device(args: HGPOConfig) -> None:
    """A GPU config on a machine without one stops here, in one line naming every field to change (rather
    than TrainingArguments' "Your setup doesn't support bf16/gpu", then vLLM's own failure)."""
    from transformers.utils import is_torch_bf16_gpu_available

    wants_gpu = [f"{name}: false" for name, wanted in (
        ("use_vllm", args.use_vllm and not vllm_runs_here()),
        ("bf16", args.bf16 is True and not args.use_cpu and not is_torch_bf16_gpu_available())) if wanted]
    if wants_gpu:
        raise ValueError(f"HGPOConfig: this config needs a GPU and no GPU is visible: rehearse it on this CPU "
                         "with --rehearse (docs/rehearsal.md: a tiny model, its processes, minutes), start "
                         f"from a CPU recipe (configs/{{alfworld,webshop}}/tiny_cpu.yaml), or set {', '.join(wants_gpu)} (e.g. "
                         f"--{' false --'.join(w.split(':')[0] for w in wants_gpu)} false) to run this one on "
                         "the CPU anyway (a paper-sized run takes days there)"
                         + (f"; {cpu_build_command()}" if "use_vllm: false" in wants_gpu else ""))


def check_trainer_inputs(args: HGPOConfig, has_eval_dataset: bool, deepspeed_config: dict[str, Any] | None, *,
                         fsdp: bool) -> None:
    """What `args` alone cannot check: the settings that need validation tasks, and the launch's DeepSpeed config
    (None without DeepSpeed) against all_steps' schedule, and the launch's DeepSpeed ZeRO-3 or FSDP (`fsdp`: the
    Trainer's is_fsdp_enabled; FSDP set in an accelerate config file leaves args.fsdp empty) against a continuous
    rollout with transformers."""
    if args.eval_every_iterations and not has_eval_dataset:
        raise ValueError("HGPOConfig.eval_every_iterations needs an eval_dataset of task rows")
    if args.early_stop_success is not None and not has_eval_dataset:
        raise ValueError("HGPOConfig.early_stop_success needs an eval_dataset of task rows (it stops on "
                         "validation success)")
    if args.rollout_mode == "continuous" and not args.use_vllm and (
            fsdp or (deepspeed_config or {}).get("zero_optimization", {}).get("stage") == 3):
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
