"""A config's rehearsal: the fields that change so that the run fits a CPU in minutes, and nothing else.

Kept: the environment and its data, the estimator and its options, `history_length`, `num_generations`, the
prompt and action settings, `step_batching` and the shape of its batches, `beta`, LoRA, gradient checkpointing,
the accelerate file's processes, ZeRO stage and offloads, and the cadences. Replaced: the model (a tiny one of the
same architecture and embedding rows, with the real tokenizer: `launch.py` builds it), vLLM (transformers
generation), bf16 (float32) and the counts. Under `step_batching: all_steps` the micro- and mini-batches are scaled
so that an iteration still makes at least 2 optimizer steps and pads a micro-batch: an iteration collects at
most S = 1 task x num_generations x `ENV_STEPS` steps per process: `micro_batch_structure` picks the largest
micro-batch up to the config's, and the smallest accumulation (2 or more where the config accumulates), that make at least 2
optimizer steps and pad a micro-batch: a short last one (filled or padded) first, else a window's padding alone.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from hgpo_trl.config import HGPOConfig

ENV_STEPS = 3  # per episode
COMPLETION_TOKENS = 16  # a tiny random model never ends a completion: every one runs to the cap
ITERATIONS = 3  # 1-2 in the first launch (a checkpoint at 2), 3 in the second, resumed from it
FIRST_LAUNCH_ITERATIONS = 2
# What a launch should take, each process alone on a core: its start (imports, the model, DeepSpeed, its
# environments) and each rollout step (16 tokens generated and trained, the environment stepped). Measured: the
# ALFWorld 1.5B rehearsal, 2 processes on 2 cores, 24 steps a process an iteration, ran its two launches (3
# iterations) in 200 s, these expect 264 s (docs/results.md). A launch that takes HUNG times more is taken as hung.
START_SECONDS, STEP_SECONDS, HUNG = 60.0, 2.0, 5


@dataclass(frozen=True)
class Change:
    """One field the rehearsal sets, and why."""

    name: str
    before: Any
    after: Any
    why: str


def pads(max_steps: int, micro: int, accumulation: int) -> bool:
    """Whether an iteration of `max_steps` steps leaves a micro-batch short or a window with padding alone."""
    return bool(max_steps % micro or math.ceil(max_steps / micro) % accumulation)


def micro_batch_structure(max_steps: int, micro: int, accumulation: int) -> tuple[int, int]:
    """(micro-batch, accumulation) for an iteration of at most `max_steps` steps per process: at least 2
    optimizer steps; a padded micro-batch, a short one first (filled or padded), else one of padding alone;
    accumulating (2 micro-batches or more) when the config does; the largest micro-batch up to the config's and
    the smallest accumulation up to the config's that do."""
    options = [(m, a) for m in range(min(micro, max_steps), 0, -1) for a in range(1, max(accumulation, 1) + 1)
               if math.ceil(math.ceil(max_steps / m) / a) >= 2]
    return max(options, key=lambda o: (pads(max_steps, *o), max_steps % o[0] != 0, o[1] >= min(accumulation, 2),
                                       o[0], -o[1]), default=(1, 1))


def rehearsal_changes(args: HGPOConfig, processes: int, cores: int, *, num_eval_tasks: int | None = None,
                      warmstart_steps: int = 0) -> list[Change]:
    """The fields a rehearsal of `args` (meant for `processes` processes) sets on a host of `cores` CPU cores."""
    changes = [
        Change("use_vllm", args.use_vllm, False, "no vLLM on a CPU: transformers generation"),
        Change("bf16", args.bf16, False, "no bf16 matrix units on a CPU: float32"),
        Change("use_cpu", args.use_cpu, True, "train on the CPU"),
        Change("tasks_per_device", args.tasks_per_device, 1, "one task group per process"),
        Change("max_env_steps", args.max_env_steps, min(args.max_env_steps, ENV_STEPS), "short episodes"),
        Change("max_completion_length", args.max_completion_length,
               min(args.max_completion_length or COMPLETION_TOKENS, COMPLETION_TOKENS),
               "a random model runs every completion to the cap"),
        Change("train_iterations", args.train_iterations, FIRST_LAUNCH_ITERATIONS,
               f"iterations 1-{FIRST_LAUNCH_ITERATIONS}, then a resumed launch for iteration {ITERATIONS}"),
        Change("save_every_iterations", args.save_every_iterations, FIRST_LAUNCH_ITERATIONS,
               "a checkpoint at the end of the first launch, to resume from"),
        Change("trajectory_dump_every", args.trajectory_dump_every, 1, "prompt and completion lengths"),
        Change("push_to_hub", args.push_to_hub, False, "a rehearsal uploads nothing"),
        # One log per optimizer step: TRL averages a logging interval's metrics, the checks read each iteration's.
        Change("logging_steps", args.logging_steps, 1, "every iteration's counters in the log"),
        Change("logging_strategy", str(getattr(args.logging_strategy, "value", args.logging_strategy)), "steps",
               "every iteration's counters in the log"),
    ]
    strategies = {kind: str(getattr(getattr(args, f"{kind}_strategy"), "value", getattr(args, f"{kind}_strategy")))
                  for kind in ("eval", "save")}
    for kind, strategy in strategies.items():  # optimizer-step cadences become iteration ones
        if strategy != "no":
            changes.append(Change(f"{kind}_strategy", strategy, "no", f"{kind}_every_iterations instead"))
    if args.eval_every_iterations is not None or strategies["eval"] != "no":
        changes.append(Change("eval_every_iterations", args.eval_every_iterations, FIRST_LAUNCH_ITERATIONS,
                              "an evaluation at the cadence, before the checkpoint"))
    if num_eval_tasks is None or num_eval_tasks > processes:
        changes.append(Change("num_eval_tasks", num_eval_tasks, processes, "one validation task per process"))
    if warmstart_steps > 2:
        changes.append(Change("warmstart_steps", warmstart_steps, 2, "a warm start, shortened"))
    if args.env_workers:  # 0 / None: in-process, as the config says
        workers = max(1, cores // processes)
        if workers < args.env_workers:
            changes.append(Change("env_workers", args.env_workers, workers,
                                  f"{cores} cores for {processes} processes"))
    reports = args.report_to if isinstance(args.report_to, list) else [args.report_to]
    if any(r not in ("none", "tensorboard", None) for r in reports):
        changes.append(Change("report_to", args.report_to, "tensorboard", "offline: no tracking service"))
    steps = min(args.max_env_steps, ENV_STEPS) * args.num_generations
    if args.step_batching == "all_steps":
        # (args was built in one process: its accumulation is the launch's times the processes)
        configured = (args.mini_batch_size // (args.per_device_train_batch_size * processes)
                      if args.mini_batch_size else args.gradient_accumulation_steps)
        micro, accumulation = micro_batch_structure(steps, args.per_device_train_batch_size, configured)
        why = (f"<= {steps} steps per process in micro-batches of {micro}, {accumulation} per optimizer step: "
               f"{math.ceil(math.ceil(steps / micro) / accumulation)} optimizer steps"
               + (", a padded micro-batch" if pads(steps, micro, accumulation) else ""))
        changes += [Change("per_device_train_batch_size", args.per_device_train_batch_size, micro, why),
                    Change("gradient_accumulation_steps", configured, accumulation, why)]
        if args.mini_batch_size:
            changes.append(Change("mini_batch_size", args.mini_batch_size, micro * accumulation * processes, why))
        if args.fill_multiple:  # the released fill's divisor, as many micro-batches over the processes
            ratio = max(1, args.fill_multiple // (args.per_device_train_batch_size * processes))
            changes.append(Change("fill_multiple", args.fill_multiple, ratio * micro * processes,
                                  f"{ratio} micro-batch(es) of {micro} per process, as the config's"))
    else:  # fixed_budget: two optimizer steps of one micro-batch each, a budget that num_generations divides
        micro = min(args.per_device_train_batch_size, 4)
        per_generation = math.lcm(2, args.num_generations // math.gcd(micro * processes, args.num_generations))
        why = f"2 optimizer steps of {micro} samples per process"
        changes += [Change("per_device_train_batch_size", args.per_device_train_batch_size, micro, why),
                    Change("gradient_accumulation_steps", args.gradient_accumulation_steps, per_generation // 2, why),
                    Change("steps_per_generation", args.steps_per_generation, per_generation, why)]
    return [c for c in changes if c.before != c.after]


def rollout_steps(args: HGPOConfig) -> int:
    """The most rollout steps a process plays in a rehearsal iteration of `args`: its task's num_generations
    episodes of ENV_STEPS steps, in up to max_rollout_batches rollout batches under dynamic_sampling."""
    return args.num_generations * min(args.max_env_steps, ENV_STEPS) * (
        args.max_rollout_batches if args.dynamic_sampling else 1)


def launch_expected(args: HGPOConfig, processes: int, cores: int, iterations: int) -> float:
    """Seconds a launch of `iterations` rehearsal iterations of `args` should take: every process's start and its
    steps (`rollout_steps`), the processes sharing the host's `cores`."""
    return max(1.0, processes / cores) * (START_SECONDS + iterations * rollout_steps(args) * STEP_SECONDS)


def launch_bound(args: HGPOConfig, processes: int, cores: int, iterations: int,
                 timeout: float | None = None) -> tuple[float, str]:
    """(seconds, why): how long a launch of `iterations` rehearsal iterations of `args` may run before it is
    stopped as hung: `timeout` (--rehearse_timeout) when given, else HUNG times what the plan expects
    (`launch_expected`)."""
    if timeout is not None:
        return timeout, "--rehearse_timeout"
    expected = launch_expected(args, processes, cores, iterations)
    return HUNG * expected, (f"{HUNG} x the ~{expected:.0f} s the plan expects of {processes} processes on {cores} "
                             "cores; --rehearse_timeout sets another bound")


def rehearsal_config(args: HGPOConfig, processes: int = 1, cores: int = 2) -> HGPOConfig:
    """`args`' rehearsal (its HGPOConfig fields; the model, tokenizer and accelerate file are the launcher's):
    for a Python session that holds the config object."""
    changes = {c.name: c.after for c in rehearsal_changes(args, processes, cores)
               if c.name in {f.name for f in dataclasses.fields(HGPOConfig)}}
    # Derived by __post_init__ from the fields above: derived again.
    derived = {"max_steps": -1, "generation_batch_size": None, "save_strategy": "no", "eval_strategy": "no"}
    if "steps_per_generation" not in changes:
        derived["steps_per_generation"] = None
    return dataclasses.replace(args, **{**derived, **changes})


def as_options(changes: list[Change]) -> list[str]:
    """The command-line options that set `changes`."""
    options: list[str] = []
    for change in changes:
        value = change.after
        options += [f"--{change.name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return options
