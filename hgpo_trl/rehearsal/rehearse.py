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
from pathlib import Path
from typing import Any

import yaml

from hgpo_trl.arguments import TINY, ConfigError, RehearsalArguments, parse_sections
from hgpo_trl.rehearsal.launch import (
    build_model,
    cpu_launch_file,
    free_port,
    launch,
    prepare_folder,
    read_launch_file,
)
from hgpo_trl.rehearsal.plan import FIRST_LAUNCH_ITERATIONS, ITERATIONS, as_options, rehearsal_changes
from hgpo_trl.rehearsal.projection import (
    IterationLoad,
    Placement,
    Workload,
    gpu_seconds_bound,
    lora_parameters,
    project_memory,
    verdict,
)
from hgpo_trl.rehearsal.report import (
    files_saved,
    iteration_counters,
    projected_prompt_tokens,
    read_state,
    rounded,
    table,
    token_lengths,
    trained_once,
)

CPU_OPTIONS = ["--use_vllm", "false", "--bf16", "false", "--use_cpu", "true"]
OWN_OPTIONS = {"--rehearse": 0, "--rehearse_tokenizer": 1, "--gpu_memory_gib": 1}


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
                if name == "--rehearse" and i + 1 < len(argv) and argv[i + 1].lower() in ("true", "false", "1", "0"):
                    skip = 1
            continue
        kept.append(arg)
    return kept


def user_value(argv: list[str], name: str, default: Any) -> Any:
    """A field as the user set it (the command line over the YAML), read before the CPU options replace it."""
    for i, arg in enumerate(argv):
        if arg == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
        else:
            continue
        return yaml.safe_load(value)
    if "--config" in argv:
        config = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text()) or {}
        return config.get(name, default)
    return default


def find_tokenizer(name: str, folder: str | None):
    """The real model's tokenizer, offline: `folder` (--rehearse_tokenizer), the model folder's own, or the
    Hugging Face cache's for hub id `name`; else one line saying which to give."""
    from transformers import AutoTokenizer

    from hgpo_trl.tiny import load_tokenizer_folder

    if folder is not None:
        try:
            return load_tokenizer_folder(folder)
        except ValueError as err:
            raise ConfigError(f"RehearsalArguments.rehearse_tokenizer: {str(err).split(': ', 1)[1]}") from None
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        raise ConfigError(f"--rehearse needs {name}'s tokenizer, offline, and the Hugging Face cache has none: give "
                          "its folder with --rehearse_tokenizer FOLDER (e.g. ../shared/data/qwen2.5-tokenizer for "
                          "Qwen2.5, ../shared/data/qwen3-tokenizer for Qwen3)") from None


def rehearse(argv: list[str]) -> dict[str, Any]:
    """Rehearse the run `argv` describes (train.py's command line, with or without --rehearse); the report,
    also written to its folder's rehearsal.json."""
    from hgpo_trl.rehearsal.shapes import model_shape

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("--rehearse launches its own processes: run it with python train.py, not under "
                          "accelerate launch or torchrun")
    argv = list(argv)
    options, env_args, args, model_args = parse_sections([*argv, *CPU_OPTIONS], (RehearsalArguments,), "train.py")
    config_file = argv[argv.index("--config") + 1] if "--config" in argv else None
    launch_file = read_launch_file(args.accelerate_config, config_file)
    processes, machines = launch_file.processes, launch_file.machines
    if processes % machines:
        raise ConfigError(f"HGPOConfig.accelerate_config: {launch_file.path} has num_processes {processes} over "
                          f"num_machines {machines}: accelerate counts num_processes over all machines")
    changes = rehearsal_changes(args, processes, os.cpu_count() or 1,
                                num_eval_tasks=env_args.num_eval_tasks if env_args.eval_split else processes,
                                warmstart_steps=env_args.warmstart_steps)
    out = Path(f"{args.output_dir.rstrip('/')}-rehearsal")
    name = model_args.model_name_or_path
    shape, tokenizer = None, None
    model_options: list[str] = []
    if name != TINY:
        try:
            shape = model_shape(name)
        except ValueError as err:
            raise ConfigError(f"ModelConfig.model_name_or_path: {err}") from None
        tokenizer = find_tokenizer(name, options.rehearse_tokenizer)
    prepare_folder(out)
    if shape is not None:
        model_options = ["--model_name_or_path", str(build_model(shape, tokenizer, out / "model")),
                         "--dtype", "float32"]
    port = free_port()
    (out / "accelerate.yaml").write_text(yaml.safe_dump(cpu_launch_file(launch_file, port), sort_keys=False))
    run_dir = out / "run"
    base = [*without_own_options(argv), *CPU_OPTIONS, *as_options(changes), *model_options, "--output_dir", str(run_dir),
            "--disable_tqdm", "true"]
    print(f"rehearsal: {processes} processes ({machines} machine(s)) under {out / 'accelerate.yaml'}; logs in {out}",
          flush=True)
    launches = [{"name": f"1 (iterations 1-{FIRST_LAUNCH_ITERATIONS})",
                 "wall_s": launch(out / "accelerate.yaml", machines, base, out / "launch1.log")}]
    from transformers.trainer_utils import get_last_checkpoint

    checkpoint = get_last_checkpoint(str(run_dir))
    if checkpoint is None:
        raise ConfigError(f"the rehearsal's first launch saved no checkpoint in {run_dir} (see {out}/launch1.log)")
    print(f"rehearsal: iterations 1-{FIRST_LAUNCH_ITERATIONS} in {launches[0]['wall_s']:.0f} s; resuming from "
          f"{Path(checkpoint).name}", flush=True)
    resumed = [*base, "--train_iterations", str(ITERATIONS), "--resume_from_checkpoint", checkpoint]
    launches.append({"name": f"2 (iteration {ITERATIONS}, resumed from {Path(checkpoint).name})",
                     "wall_s": launch(out / "accelerate.yaml", machines, resumed, out / "launch2.log")})
    report = build_report(argv, config_file, launch_file, args, model_args, changes, shape, run_dir, launches,
                          Path(checkpoint).name, options.gpu_memory_gib)
    (out / "rehearsal.json").write_text(json.dumps(rounded(report), indent=2))
    print(table(report), flush=True)
    print(f"rehearsal: {'passed' if all(report['checks'].values()) else 'FAILED'}; {out / 'rehearsal.json'}",
          flush=True)
    return report


def build_report(argv, config_file, launch_file, args, model_args, changes, shape, run_dir: Path, launches,
                 checkpoint: str, gpu_gib: float) -> dict[str, Any]:
    state = read_state(run_dir)
    history = state.get("log_history", [])
    rows = iteration_counters(history, launch_file.processes)
    evaluations = [{"iteration": h.get("iteration"), "success_rate": h["eval_success_rate"]}
                   for h in history if "eval_success_rate" in h]
    files = files_saved(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text()) if files["summary"] else {}
    checks = {
        "every collected step trained once": trained_once(rows, args.num_iterations),
        "two optimizer steps or more an iteration": bool(rows) and all(r.get("optimizer_steps", 0) >= 2 for r in rows),
        "a padded micro-batch": any(r.get("padded_fraction", 0) > 0 or r.get("duplicated", 0) > 0 for r in rows),
        "resumed to iteration 3": [r["iteration"] for r in rows] == list(range(1, ITERATIONS + 1))
        and summary.get("iterations") == ITERATIONS,
        "evaluated": bool(evaluations),
        "saved model, card, checkpoints": files["model"] and files["model_card"] and bool(files["checkpoints"]),
    }
    real_bf16 = user_value(argv, "bf16", None) is not False
    report: dict[str, Any] = {
        "run": {"config": config_file, "accelerate_config": launch_file.path, "processes": launch_file.processes,
                "machines": launch_file.machines,
                "distribution": (f"DeepSpeed ZeRO-{launch_file.zero_stage}"
                                 + (", optimizer offload" if launch_file.offloads("optimizer") else "")
                                 + (", parameter offload" if launch_file.offloads("param") else ""))
                if launch_file.deepspeed else launch_file.settings.get("distributed_type", "NO"),
                "model": model_args.model_name_or_path,
                "twin": "tiny" if shape is None else "2 layers, hidden 64, the real embedding rows",
                "estimator": args.estimator, "step_batching": args.step_batching,
                "lora": bool(model_args.use_peft), "beta": args.beta,
                "gradient_checkpointing": args.gradient_checkpointing},
        "replaced": [{"field": c.name, "config": c.before, "rehearsal": c.after, "why": c.why} for c in changes],
        "launches": launches, "resumed_from": checkpoint, "iterations": rows, "evaluations": evaluations,
        "files": files, "checks": checks, "tokens": token_lengths(run_dir),
        "sizes": {"max_prompt_tokens": args.max_prompt_tokens, "history_length": args.history_length,
                  "max_completion_length": args.max_completion_length},
    }
    if shape is not None and report["tokens"]:
        report["sizes"]["projected_prompt_tokens"] = projected_prompt_tokens(report["tokens"], args.history_length,
                                                                              args.max_prompt_tokens)
        report["projection"] = projection(argv, args, model_args, shape, launch_file, report, real_bf16, gpu_gib)
    return report


def projection(argv, args, model_args, shape, launch_file, report, bf16: bool, gpu_gib: float) -> dict[str, Any]:
    """The real run's memory per device and per machine, its iteration at full scale and a GPU-time bound."""
    micro = args.per_device_train_batch_size
    completion = report["sizes"]["max_completion_length"] or 256
    prompt = report["sizes"]["projected_prompt_tokens"]
    # (args holds the user's values but for CPU_OPTIONS' use_vllm, bf16 and use_cpu)
    colocated = bool(user_value(argv, "use_vllm", False)) and args.vllm_mode == "colocate"
    sleeps = args.vllm_enable_sleep_mode
    place = Placement(processes=launch_file.processes, zero_stage=launch_file.zero_stage,
                      offload_optimizer=launch_file.offloads("optimizer"), offload_param=launch_file.offloads("param"),
                      bf16=bf16, processes_per_machine=launch_file.processes // launch_file.machines)
    trainable = lora_parameters(shape, model_args.lora_r, model_args.lora_target_modules) if model_args.use_peft \
        else None
    work = Workload(micro_batch=micro, prompt_tokens=prompt, completion_tokens=completion,
                    gradient_checkpointing=args.gradient_checkpointing,
                    reference=args.beta != 0.0 and not model_args.use_peft, trainable=trainable,
                    weight_bytes=2 if model_args.dtype in ("bfloat16", "float16") else 4,
                    vllm_share=args.vllm_gpu_memory_utilization if colocated and not sleeps else 0.0)
    memory = project_memory(shape, place, work, gpu_gib)
    steps = args.tasks_per_device * launch_file.processes * args.num_generations * args.max_env_steps  # the bound
    per_process = steps / launch_file.processes
    accumulation = (args.mini_batch_size // (micro * launch_file.processes) if args.mini_batch_size
                    else args.gradient_accumulation_steps)
    windows = math.ceil(math.ceil(per_process / micro) / max(accumulation, 1))
    prompt_mean = report["tokens"]["prompt"]["mean"]
    trained = steps * (prompt_mean + completion) * args.num_iterations
    passes = (windows * args.num_iterations > 1) + work.reference  # old and reference log-probabilities
    load = IterationLoad(step_samples=steps, optimizer_steps=windows * args.num_iterations,
                         generated_tokens=steps * completion, prompt_tokens=steps * prompt_mean,
                         scored_tokens=passes * steps * (prompt_mean + completion), trained_tokens=trained)
    return {"gpu": memory.gpu, "gpu_total": memory.gpu_total, "gpu_gib": gpu_gib,
            "verdict": verdict(memory, shape, place, work), "host": memory.host, "assumptions": memory.assumptions,
            "iteration": load.__dict__, "iterations": args.train_iterations or 1,
            "gpu_seconds_bound": gpu_seconds_bound(shape, load, launch_file.processes,
                                                   gradient_checkpointing=args.gradient_checkpointing)}
