"""`python train.py --config C --rehearse`: the config's run rehearsed on this machine's CPUs, from its command
line to its report (docs/rehearsal.md).

    from hgpo_trl.rehearsal import rehearse
    report = rehearse(["--config", "configs/alfworld/hgpo_k4_qwen2.5-1.5b.yaml",
                       "--rehearse_tokenizer", "../shared/data/qwen2.5-tokenizer"])
"""

from __future__ import annotations

import json
import math
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hgpo_trl.commands.arguments import TINY, ConfigError, RehearsalArguments, flag_value, parse_sections
from hgpo_trl.config import HGPOConfig
from hgpo_trl.rehearsal.launch import (
    LaunchFile,
    RehearsalError,
    RehearsalInterrupted,
    Stopped,
    build_deepspeed_op,
    build_model,
    cpu_launch_file,
    free_port,
    launch,
    prepare_folder,
    read_launch_file,
    stopping,
)
from hgpo_trl.rehearsal.plan import (
    FIRST_LAUNCH_ITERATIONS,
    ITERATIONS,
    as_options,
    launch_bound,
    launch_expected,
    rehearsal_changes,
)
from hgpo_trl.rehearsal.projection import (
    IterationLoad,
    Placement,
    Workload,
    gpu_seconds_bound,
    host_verdict,
    lora_parameters,
    project_memory,
    verdict,
)
from hgpo_trl.rehearsal.report import (
    files_saved,
    iteration_counters,
    json_ready,
    projected_prompt_tokens,
    read_state,
    table,
    token_lengths,
    trained_once,
)
from hgpo_trl.rehearsal.shapes import ModelShape
from hgpo_trl.rehearsal.watch import LaunchWatch, plan_line

CPU_OPTIONS = ["--use_vllm", "false", "--bf16", "false", "--use_cpu", "true"]
OWN_OPTIONS = {"--rehearse": 0, "--rehearse_tokenizer": 1, "--gpu_memory_gib": 1, "--host_memory_gib": 1,
               "--rehearse_timeout": 1}


def without_own_options(argv: list[str]) -> list[str]:
    """`argv` without the rehearsal's own options (the launched runs must not rehearse again)."""
    kept, skip = [], 0
    for i, arg in enumerate(argv):
        if skip:
            skip -= 1
            continue
        name = arg.split("=")[0]
        if name in OWN_OPTIONS:
            if "=" not in arg:
                skip = OWN_OPTIONS[name]
                if name == "--rehearse" and i + 1 < len(argv) and flag_value(argv[i + 1]) is not None:
                    skip = 1
            continue
        kept.append(arg)
    return kept


def user_value(argv: list[str], name: str, default: Any) -> Any:
    """A field as the user set it: the command line's last value (as the parser reads it), else the YAML's; read
    before the CPU options replace it."""
    values = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == f"--{name}"]
    values += [arg.split("=", 1)[1] for arg in argv if arg.startswith(f"--{name}=")]
    if values:
        text = values[-1]
        return flag if (flag := flag_value(text)) is not None else yaml.safe_load(text)
    if "--config" in argv:
        config = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text()) or {}
        return config.get(name, default)
    return default


def find_tokenizer(name: str, folder: str | None):
    """The real model's tokenizer, offline: `folder` (--rehearse_tokenizer) when given, else the Hugging Face
    cache's for `name` (or the model folder's own); else one line saying which to give."""
    from transformers import AutoTokenizer

    from hgpo_trl.models.tiny import load_tokenizer_folder

    if folder is not None:
        try:
            return load_tokenizer_folder(folder)
        except ValueError as err:
            raise ConfigError(f"RehearsalArguments.rehearse_tokenizer: {folder} is not a tokenizer folder ({err})") \
                from None
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        raise ConfigError(f"--rehearse needs {name}'s tokenizer, offline, and the Hugging Face cache has none: give "
                          "its folder with --rehearse_tokenizer FOLDER (e.g. ../shared/data/qwen2.5-tokenizer for "
                          "Qwen2.5, ../shared/data/qwen3-tokenizer for Qwen3)") from None


@dataclass
class Rehearsal:
    """What a rehearsal was asked and set up: the user's command line and config, the launch, the changes."""

    argv: list[str]
    config_file: str | None
    launch_file: LaunchFile
    args: HGPOConfig  # the user's fields, but for CPU_OPTIONS'
    model_args: Any
    evaluates: bool
    changes: list
    shape: ModelShape | None  # None: a tiny model config (nothing to project)
    folder: Path
    gpu_gib: float
    host_gib: float | None  # None: not checked
    timeout: float | None  # a launch's, in seconds (None: from the plan)

    @property
    def run_dir(self) -> Path:
        return self.folder / "run"


def rehearse(argv: list[str]) -> dict[str, Any]:
    """Rehearse the run `argv` describes (train.py's command line, with or without --rehearse); the report,
    also written to its folder's rehearsal.json. A Ctrl-C, SIGTERM or SIGHUP is one RehearsalError line (a launch
    stops every process it started first, the op build its compilers)."""
    try:
        with stopping():  # (outside the launches, SIGTERM and SIGHUP took their default action: no line)
            return rehearsal_report(argv)
    except Stopped as stop:  # outside the launches, which say it themselves
        raise RehearsalInterrupted(f"interrupted by {stop}, with no launch running", getattr(signal, str(stop))) from None


def rehearsal_report(argv: list[str]) -> dict[str, Any]:
    """`rehearse` but for its Ctrl-C line."""
    from transformers.trainer_utils import get_last_checkpoint

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("--rehearse launches its own processes: run it with python train.py, not under "
                          "accelerate launch or torchrun")
    plan, tokenizer = prepare(list(argv))
    base = [*without_own_options(plan.argv), *CPU_OPTIONS, *as_options(plan.changes), "--output_dir",
            str(plan.run_dir), "--disable_tqdm", "true"]
    if plan.shape is not None:
        base += ["--model_name_or_path", str(build_model(plan.shape, tokenizer, plan.folder / "model")),
                 "--dtype", "float32"]
    launch_file, machines = plan.folder / "accelerate.yaml", plan.launch_file.machines
    launch_file.write_text(yaml.safe_dump(cpu_launch_file(plan.launch_file, free_port()), sort_keys=False))
    processes, cores = plan.launch_file.processes, os.cpu_count() or 1
    print(f"rehearsal: {processes} processes ({machines} machine(s)) under {launch_file}; logs in {plan.folder}",
          flush=True)
    names = [(f"launch 1 (iterations 1-{FIRST_LAUNCH_ITERATIONS})", FIRST_LAUNCH_ITERATIONS),
             (f"launch 2 (iteration {ITERATIONS}, resumed)", ITERATIONS - FIRST_LAUNCH_ITERATIONS)]
    print(plan_line(plan.args, processes, cores, names, plan.timeout), flush=True)
    if plan.launch_file.uses_deepspeed:
        print(f"rehearsal: DeepSpeed's CPU op ready in {build_deepspeed_op():.0f} s, before any rank starts", flush=True)
    watches = [LaunchWatch(name, iterations, launch_expected(plan.args, processes, cores, iterations), processes)
               for name, iterations in names]
    watches[0].then = f"{names[1][0]}, ~{watches[1].expected:,.0f} s"
    first = launch(launch_file, machines, base, plan.folder / "launch1.log",
                   *launch_bound(plan.args, processes, cores, FIRST_LAUNCH_ITERATIONS, plan.timeout), watches[0])
    checkpoint = get_last_checkpoint(str(plan.run_dir))
    if checkpoint is None:
        raise RehearsalError(f"the rehearsal's first launch ended without a checkpoint in {plan.run_dir} (its logs: "
                             f"{plan.folder}/launch1*.log)")
    print(f"rehearsal: iterations 1-{FIRST_LAUNCH_ITERATIONS} in {first:.0f} s; resuming from "
          f"{Path(checkpoint).name}", flush=True)
    second = launch(launch_file, machines, [*base, "--train_iterations", str(ITERATIONS), "--resume_from_checkpoint",
                                            checkpoint], plan.folder / "launch2.log",
                    *launch_bound(plan.args, processes, cores, ITERATIONS - FIRST_LAUNCH_ITERATIONS, plan.timeout),
                    watches[1])
    launches = [{"name": f"1 (iterations 1-{FIRST_LAUNCH_ITERATIONS})", "wall_s": first},
                {"name": f"2 (iteration {ITERATIONS}, resumed from {Path(checkpoint).name})", "wall_s": second}]
    report = build_report(plan, launches, Path(checkpoint).name)
    (plan.folder / "rehearsal.json").write_text(json.dumps(json_ready(report), indent=2))
    print(table(report), flush=True)
    print(f"rehearsal: {'passed' if passed(report) else 'FAILED'}; {plan.folder / 'rehearsal.json'}", flush=True)
    return report


def prepare(argv: list[str]) -> tuple[Rehearsal, Any]:
    """The rehearsal of `argv`, checked before anything is written (the config, its launch file, the model's
    shape and tokenizer), with its folder made ready; and the real tokenizer."""
    from hgpo_trl.rehearsal.shapes import model_shape

    options, env_args, args, model_args = parse_sections([*argv, *CPU_OPTIONS], (RehearsalArguments,), "train.py")
    for name in ("host_memory_gib", "rehearse_timeout"):
        if (value := getattr(options, name)) is not None and not value > 0:
            raise ConfigError(f"RehearsalArguments.{name} must be > 0, got {value}")
    config_file = argv[argv.index("--config") + 1] if "--config" in argv else None
    launch_file = read_launch_file(args.accelerate_config, config_file)
    processes, machines = launch_file.processes, launch_file.machines
    if processes % machines:
        raise ConfigError(f"HGPOConfig.accelerate_config: {launch_file.path} has num_processes {processes} over "
                          f"num_machines {machines}: accelerate counts num_processes over all machines")
    changes = rehearsal_changes(args, processes, os.cpu_count() or 1,
                                num_eval_tasks=env_args.num_eval_tasks if env_args.eval_split else processes,
                                warmstart_steps=env_args.warmstart_steps)
    shape, tokenizer = None, None
    if model_args.model_name_or_path != TINY:
        try:
            shape = model_shape(model_args.model_name_or_path)
        except ValueError as err:
            raise ConfigError(f"ModelConfig.model_name_or_path: {err}") from None
        tokenizer = find_tokenizer(model_args.model_name_or_path, options.rehearse_tokenizer)
    evaluates = env_args.eval_split is not None and any(c.name == "eval_every_iterations" for c in changes)
    folder = Path(f"{args.output_dir.rstrip('/')}-rehearsal")
    prepare_folder(folder)
    host_gib = options.host_memory_gib if options.host_memory_gib is not None else this_host_gib(processes // machines)
    return Rehearsal(argv, config_file, launch_file, args, model_args, evaluates, changes, shape, folder,
                     options.gpu_memory_gib, host_gib, options.rehearse_timeout), tokenizer


def this_host_gib(processes_per_machine: int) -> float | None:
    """This machine's memory in GiB (its cgroup's limit where lower) when it is one of the real run's kind, with a
    CUDA GPU for each process of a machine; None on any other (a CPU host says nothing of the target's)."""
    import torch

    if torch.cuda.device_count() < processes_per_machine:
        return None
    sizes = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            sizes.append(int(Path(limit).read_text()))
        except (OSError, ValueError):  # none, or "max"
            pass
    return min(sizes) / 2**30


def passed(report: dict[str, Any]) -> bool:
    """Every check that applies holds (None: does not apply to this config)."""
    return all(ok is not False for ok in report["checks"].values())


def build_report(plan: Rehearsal, launches: list[dict[str, Any]], checkpoint: str) -> dict[str, Any]:
    args, launch_file = plan.args, plan.launch_file
    history = read_state(plan.run_dir).get("log_history", [])
    rows = iteration_counters(history, launch_file.processes)
    evaluations = [{"iteration": h.get("iteration"), "success_rate": h["eval_success_rate"]}
                   for h in history if "eval_success_rate" in h]
    files = files_saved(plan.run_dir)
    # The resumed launch played iteration 3 alone (a run started over would have logged iteration 1 again).
    resumed_logs = "".join(p.read_text(errors="replace") for p in plan.folder.glob("launch2*.log"))
    all_steps = args.step_batching == "all_steps"
    checks = {
        "every collected step trained once": trained_once(rows, args.num_iterations) if all_steps else None,
        "two optimizer steps or more an iteration": bool(rows) and all(r.get("optimizer_steps", 0) >= 2 for r in rows),
        "a padded micro-batch": any(r.get("padded_fraction", 0) > 0 or r.get("duplicated", 0) > 0 for r in rows)
        if all_steps else None,
        "resumed for iteration 3": [r["iteration"] for r in rows] == list(range(1, ITERATIONS + 1))
        and f"[iter {ITERATIONS:>4}]" in resumed_logs and "[iter    1]" not in resumed_logs,
        "evaluated at the cadence": any(e["iteration"] == FIRST_LAUNCH_ITERATIONS for e in evaluations)
        if plan.evaluates else None,
        "saved model, card, checkpoints": files["model"] and files["model_card"] and bool(files["checkpoints"]),
    }
    report: dict[str, Any] = {
        "run": {"config": plan.config_file, "accelerate_config": launch_file.path,
                "processes": launch_file.processes, "machines": launch_file.machines,
                "distribution": (f"DeepSpeed ZeRO-{launch_file.zero_stage}"
                                 + (", optimizer offload" if launch_file.offloads("optimizer") else "")
                                 + (", parameter offload" if launch_file.offloads("param") else ""))
                if launch_file.uses_deepspeed else launch_file.settings.get("distributed_type", "NO"),
                "model": plan.model_args.model_name_or_path,
                "twin": "tiny" if plan.shape is None else "2 layers, hidden 64, the real embedding rows",
                "estimator": args.estimator, "step_batching": args.step_batching,
                "lora": bool(plan.model_args.use_peft), "beta": args.beta,
                "gradient_checkpointing": args.gradient_checkpointing},
        "replaced": [{"field": c.name, "config": c.before, "rehearsal": c.after, "why": c.why} for c in plan.changes],
        "launches": launches, "resumed_from": checkpoint, "iterations": rows, "evaluations": evaluations,
        "files": files, "checks": checks, "tokens": token_lengths(plan.run_dir),
        "sizes": {"max_prompt_tokens": args.max_prompt_tokens, "history_length": args.history_length,
                  "max_completion_length": args.max_completion_length},
    }
    if plan.shape is not None and report["tokens"]:
        report["sizes"]["projected_prompt_tokens"] = projected_prompt_tokens(report["tokens"], args.history_length,
                                                                              args.max_prompt_tokens)
        report["projection"] = projection(plan, report)
    return report


def projection(plan: Rehearsal, report: dict[str, Any]) -> dict[str, Any]:
    """The real run's memory per device and per machine, its largest iteration and a GPU-time bound for it."""
    args, model_args, shape, launch_file = plan.args, plan.model_args, plan.shape, plan.launch_file
    micro, processes = args.per_device_train_batch_size, launch_file.processes
    completion = args.max_completion_length or 256
    colocated = bool(user_value(plan.argv, "use_vllm", False)) and args.vllm_mode == "colocate"
    place = Placement(processes=processes, zero_stage=launch_file.zero_stage,
                      offload_optimizer=launch_file.offloads("optimizer"), offload_param=launch_file.offloads("param"),
                      bf16=user_value(plan.argv, "bf16", None) is not False,
                      processes_per_machine=processes // launch_file.machines, deepspeed=launch_file.uses_deepspeed,
                      zero3_init=launch_file.zero3_init)
    trainable = lora_parameters(shape, model_args.lora_r, model_args.lora_target_modules) if model_args.use_peft \
        else None
    work = Workload(micro_batch=micro, prompt_tokens=report["sizes"]["projected_prompt_tokens"],
                    completion_tokens=completion, gradient_checkpointing=args.gradient_checkpointing,
                    reference=args.beta != 0.0 and not model_args.use_peft, trainable=trainable,
                    weight_bytes=2 if model_args.dtype in ("bfloat16", "float16") else 4,
                    vllm_share=args.vllm_gpu_memory_utilization if colocated and not args.vllm_enable_sleep_mode
                    else 0.0, warm_start=(user_value(plan.argv, "warmstart_steps", 0) or 0) > 0)
    memory = project_memory(shape, place, work, plan.gpu_gib, plan.host_gib)
    # The largest iteration: every episode to its step limit, every completion to its cap.
    steps = args.tasks_per_device * processes * args.num_generations * args.max_env_steps
    accumulation = (args.mini_batch_size // (micro * processes) if args.mini_batch_size
                    else args.gradient_accumulation_steps)
    windows = math.ceil(math.ceil(steps / processes / micro) / max(accumulation, 1))
    prompt_mean = report["tokens"]["prompt"]["mean"]
    passes = (windows * args.num_iterations > 1) + work.reference  # old and reference log-probabilities
    load = IterationLoad(step_samples=steps, optimizer_steps=windows * args.num_iterations,
                         generated_tokens=steps * completion, prompt_tokens=steps * prompt_mean,
                         scored_tokens=passes * steps * (prompt_mean + completion),
                         trained_tokens=steps * (prompt_mean + completion) * args.num_iterations)
    return {"gpu": memory.gpu, "gpu_total": memory.gpu_total, "gpu_gib": plan.gpu_gib,
            "verdict": verdict(memory, shape, place, work), "host": memory.host, "host_load": memory.load,
            "host_gib": plan.host_gib, "host_verdict": host_verdict(memory, shape, place, work),
            "assumptions": memory.assumptions,
            "iteration": load.__dict__, "iterations": args.train_iterations or 1,
            "gpu_seconds_bound": gpu_seconds_bound(shape, load, processes,
                                                   gradient_checkpointing=args.gradient_checkpointing)}
