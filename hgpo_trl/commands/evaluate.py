"""`evaluate.py` / `hgpo-eval`: success on an environment's evaluation splits over several seeds, as the HGPO
paper reports it, for a model or for reference players that need none.

    hgpo-eval --config configs/alfworld/hgpo_k4_qwen2.5-1.5b.yaml --model_name_or_path outputs/alfworld/run
    python evaluate.py --config configs/quickstart.yaml --model_name_or_path outputs/quickstart --greedy
    hgpo-eval --config configs/alfworld/hgpo_k4_qwen2.5-1.5b.yaml --policy random expert     # no model loaded

The config is a train.py YAML, so a model plays with the environment, prompts, action rules and generation
settings it was trained with. `model_name_or_path`: a run's output_dir or checkpoint-N folder, a LoRA adapter
folder (merged into its base in memory), any model folder or hub id, or `tiny` (built as train.py builds it).
Each task of each split (at most `num_eval_tasks`) is played once per seed at `eval_temperature` (`--greedy`:
0). Default splits: ALFWorld valid_seen (in-distribution) and valid_unseen (out-of-distribution), WebShop test
(the goals WebShop's baselines report on), keydoor valid, any other environment `eval_split`. Results: success,
WebShop's score, success per task type (ALFWorld's six), each per seed and as mean and std over the seeds, in
`evaluation.json` and `evaluation.md` under `eval_output_dir`.

The command line: its arguments and checks, then every player, seed and split in turn. Who plays is
`hgpo_trl.commands.players` (generation: vLLM when `use_vllm` is set and it runs here, on a GPU or as its CPU build,
else transformers' generate); how a split is played and scored, `hgpo_trl.evaluation.protocol`, the protocol the
trainer's evaluate() shares.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from trl import ModelConfig

from hgpo_trl.commands.arguments import (
    EVAL_SECTIONS,
    TINY,
    ConfigError,
    EnvArguments,
    EvalArguments,
    checked_model_path,
    did_you_mean,
    entry_point_scope,
    parse_sections,
)
from hgpo_trl.commands.parser import answered_help, command_name
from hgpo_trl.commands.players import expert_player, model_policy, random_player
from hgpo_trl.commands.train import check_environment, load_tasks
from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_env
from hgpo_trl.envs.pool import default_worker_count, make_env_batch
from hgpo_trl.envs.registry import is_fast_env
from hgpo_trl.envs.trl_env import tool_setup, within_episode_limit
from hgpo_trl.evaluation.protocol import (
    DEFAULT_SPLITS,
    percent,
    play_split,
    seed_outcome,
    seeded_env,
    summarize,
    write_report,
)
from hgpo_trl.rollout.vllm_cpu import cpu_build

POLICIES = ("model", "random", "expert")


@dataclass
class Evaluation:
    """A checked command line: everything a run needs, nothing loaded yet but the task lists."""

    eval_args: EvalArguments
    env_args: EnvArguments
    args: HGPOConfig
    model_args: ModelConfig
    tasks: dict[str, list[dict[str, Any]]]  # split -> task rows
    temperature: float
    output_dir: Path
    model: tuple[Any, Any] | None = None  # (model, tokenizer) evaluated in memory (evaluate_model), else loaded


@dataclass
class EvaluationResult:
    """What `evaluate_model` returns: the report it wrote to `output_dir` (evaluation.json and evaluation.md)."""

    report: dict[str, Any]
    output_dir: Path

    def success_rate(self, split: str | None = None, policy: str = "model") -> float:
        """The mean success over the seeds of `policy` on `split` (None: the first split evaluated)."""
        rows = [r for r in self.report["results"] if r["policy"] == policy and split in (None, r["split"])]
        if not rows:
            played = sorted({(r["policy"], r["split"]) for r in self.report["results"]})
            raise KeyError(f"no result of policy {policy!r} on split {split!r}; evaluated: {played}")
        return rows[0]["success_rate"]["mean"]


def prepare(argv: list[str] | None = None, model_in_memory: bool = False, args: HGPOConfig | None = None
            ) -> Evaluation:
    """Parse and check the command line; every problem is a ConfigError naming it, raised before any model loads.
    `args`: evaluate_model's HGPOConfig, which the command line then does not set (nor turn vLLM off in)."""
    argv = cpu_overrides(argv) if args is None else argv
    return checked(*parse_sections(argv, (EvalArguments,), "evaluate.py", args), model_in_memory)


def checked(eval_args: EvalArguments, env_args: EnvArguments, args: HGPOConfig, model_args: ModelConfig,
            model_in_memory: bool = False) -> Evaluation:
    """The sections checked (`prepare` documents how), and the task lists loaded."""
    unknown = sorted(set(eval_args.policy) - set(POLICIES))
    if unknown or not eval_args.policy:
        raise ConfigError(f"EvalArguments.policy must be one or more of {POLICIES}, got {eval_args.policy}")
    if not eval_args.seeds or len(set(eval_args.seeds)) != len(eval_args.seeds):
        raise ConfigError(f"EvalArguments.seeds must be one or more distinct integers, got {eval_args.seeds}")
    if eval_args.num_envs is not None and eval_args.num_envs < 1:
        raise ConfigError(f"EvalArguments.num_envs must be None or an integer >= 1, got {eval_args.num_envs}")
    if "model" in eval_args.policy and not model_in_memory:
        model_args.model_name_or_path = checked_model_path(model_args.model_name_or_path)
    splits = eval_args.splits or DEFAULT_SPLITS.get(args.env_name, (env_args.eval_split,))
    if None in splits:
        raise ConfigError(f"EvalArguments.splits: environment {args.env_name!r} has no default evaluation split and "
                          "eval_split is None; name the splits with --splits")
    if eval_args.episodes_per_seed is not None and eval_args.episodes_per_seed < 1:
        raise ConfigError(f"EvalArguments.episodes_per_seed must be None or an integer >= 1, got "
                          f"{eval_args.episodes_per_seed}")
    episodes = eval_args.episodes_per_seed
    tasks = {}
    for split in splits:
        try:
            rows = list(load_tasks(args, env_args, split, None if episodes else env_args.num_eval_tasks))
            tasks[split] = (rows * -(-episodes // len(rows)))[:episodes] if episodes else rows
        except ValueError as err:
            raise ConfigError(f"EvalArguments.splits: environment {args.env_name!r} has no split {split!r} "
                              f"to evaluate ({err})") from None
    check_environment(args)  # (after the tasks: a data problem is reported as one, not as this)
    if "expert" in eval_args.policy:
        try:
            make_env(args.env_name, **{**(args.env_kwargs or {}), "expert": True}).close()
        except ValueError as err:
            raise ConfigError(f"EvalArguments.policy expert: environment {args.env_name!r} has no scripted expert "
                              f"(make_env(..., expert=True) giving info['expert_action']): {err}") from None
    output_dir = result_folder(eval_args, args, model_args, model_in_memory)
    temperature = 0.0 if eval_args.greedy else args.eval_temperature
    return Evaluation(eval_args, env_args, args, model_args, tasks, temperature, output_dir)


def cpu_overrides(argv: list[str] | None) -> list[str]:
    """The command line, with `--use_vllm false --bf16 false` added (unless given) where no GPU is visible or
    only reference players play: a paper config evaluates on a CPU with transformers' generate, as documented, or
    with vLLM where its CPU build is installed (`use_vllm` is then kept)."""
    import torch

    argv = list(sys.argv[1:] if argv is None else argv)
    model_plays = "--policy" not in argv or "model" in argv[argv.index("--policy") + 1:]
    if model_plays and torch.cuda.is_available():
        return argv
    kept = ("use_vllm",) if model_plays and cpu_build() else ()
    added = [f"--{name}" for name in ("use_vllm", "bf16") if f"--{name}" not in argv and name not in kept]
    path = Path(argv[argv.index("--config") + 1]) if "--config" in argv[:-1] else None
    try:  # (a config that cannot be read is reported by the parser, next)
        config = yaml.safe_load(path.read_text()) if path is not None and path.is_file() else {}
    except yaml.YAMLError:
        config = {}
    turned_off = [name[2:] for name in added if isinstance(config, dict) and config.get(name[2:]) is True]
    engine = "vLLM's CPU build" if kept and isinstance(config, dict) and config.get("use_vllm") is True else \
        "transformers"
    if model_plays and turned_off:
        print(f"{command_name('evaluate.py')}: no GPU visible: the model generates with {engine} on the CPU "
              f"({' and '.join(turned_off)} off)")
    return [*argv, *(item for name in added for item in (name, "false"))]


def result_folder(eval_args: EvalArguments, args: HGPOConfig, model_args: ModelConfig,
                  model_in_memory: bool = False) -> Path:
    """Where the report goes: `eval_output_dir`, else `evaluation` in the evaluated model's folder, else (a hub id,
    'tiny', a model in memory, reference players) in the config's output_dir; a folder that holds a report already
    gives way to the next free `evaluation-N`."""
    model = Path(model_args.model_name_or_path or "").expanduser()
    if eval_args.eval_output_dir:
        folder = Path(eval_args.eval_output_dir)
    elif "model" in eval_args.policy and not model_in_memory and model_args.model_name_or_path != TINY and model.is_dir():
        folder = model / "evaluation"
    else:
        folder = Path(args.output_dir) / "evaluation"
    if not (folder / "evaluation.json").exists():
        return folder
    free = next(folder.with_name(f"{folder.name}-{n}") for n in itertools.count(1)
                if not (folder.with_name(f"{folder.name}-{n}") / "evaluation.json").exists())
    print(f"{command_name('evaluate.py')}: {folder} already holds an evaluation; writing this one to {free}")
    return free


def run(evaluation: Evaluation) -> dict[str, Any]:
    """Play every split with every player and seed; write evaluation.json and evaluation.md; return the result."""
    from transformers import set_seed

    start = time.time()
    eval_args, args = evaluation.eval_args, evaluation.args
    settings = args.rollout_settings()
    scripted_settings = dataclasses.replace(settings, max_prompt_tokens=None)  # their prompts are never read
    model, model_settings, backend = (
        model_policy(args, evaluation.model_args, evaluation.env_args, evaluation.temperature, settings,
                     evaluation.output_dir, evaluation.model) if "model" in eval_args.policy else (None, settings, None))
    largest = max(len(tasks) for tasks in evaluation.tasks.values())
    num_envs = min(eval_args.num_envs or args.tasks_per_device * args.num_generations, largest)
    workers = args.env_workers if args.env_workers is not None else default_worker_count(is_fast_env(args.env_name))
    options = within_episode_limit(args.env_kwargs, args.max_env_steps) if args.env_name == "trl" else args.env_kwargs
    if model is not None and args.env_name == "trl":  # a TRL class: the tool format and tools it trained with
        options, model.chat_template_kwargs = tool_setup(options, model.tokenizer, model.chat_template_kwargs)
    dumps = evaluation.output_dir / "trajectories" if args.trajectory_dump_every else None
    results = []
    for policy in eval_args.policy:
        env_kwargs = {**(options or {}), **({"expert": True} if policy == "expert" else {})}
        rows: dict[str, list[dict[str, Any]]] = {split: [] for split in evaluation.tasks}
        for seed in eval_args.seeds:
            set_seed(seed)  # Python, numpy and torch: sampling is the same for the same seed
            player = {"model": model, "random": random_player(seed, settings.action_mode),
                      "expert": expert_player(settings.action_mode)}[policy]
            # New environments per seed: an expert's tie-breaks restart from the seed.
            with make_env_batch(partial(seeded_env, seed, args.env_name, env_kwargs), num_envs, workers,
                                step_timeout=args.env_step_timeout, reset_timeout=args.env_reset_timeout) as envs:
                for split, tasks in evaluation.tasks.items():
                    episodes = play_split(envs, tasks, player, model_settings if policy == "model" else scripted_settings,
                                    scripted=policy != "model",
                                    count_tokens=model.count_tokens if policy == "model" else None,
                                    description=f"{policy} {split} seed {seed}", quiet=args.disable_tqdm,
                                    dump=dumps / f"{policy}_{split}_seed{seed}.jsonl" if dumps else None, args=args)
                    rows[split].append(seed_outcome(seed, tasks, episodes))
        results += [summarize(args.env_name, policy, split, evaluation.tasks[split], rows[split])
                    for split in evaluation.tasks]
    report = {
        "env": args.env_name,
        "model": evaluation.model_args.model_name_or_path if "model" in eval_args.policy else None,
        "backend": backend, "temperature": evaluation.temperature, "seeds": list(eval_args.seeds),
        "max_env_steps": args.max_env_steps, "num_eval_tasks": evaluation.env_args.num_eval_tasks,
        "results": results, "wall_seconds": round(time.time() - start, 1),
    }
    write_report(report, evaluation.output_dir)
    return report


def evaluate_model(model_or_path: Any = None, config: str | os.PathLike | HGPOConfig | None = None, *,
                   tokenizer: Any = None, **options: Any) -> EvaluationResult:
    """hgpo-eval from Python (a notebook): evaluate `model_or_path` with `config` and return the result, as the
    command line would play and write it.

    `model_or_path`: a model in memory (a transformers model or a PEFT model; `tokenizer` is then required), or what
    `model_name_or_path` takes (a run's folder or checkpoint, a LoRA adapter folder, a hub id, 'tiny'); None: the
    config's, or the `model_name_or_path` option's (both given: refused). `config`: a train.py YAML file, an
    `HGPOConfig` (as given to `HGPOTrainer`), or None (the defaults). `options`: any field of the command line
    (`seeds`, `splits`, `greedy`, `policy`, `num_envs`, `episodes_per_seed`, `eval_output_dir`; `task_kwargs`,
    `num_eval_tasks`, ...); with a YAML file any train.py field too, overriding it; with an `HGPOConfig`, none of
    its own fields (set them on it: given here they are refused); a None value keeps the config's. Bad input raises
    `ConfigError` (a `ValueError`) with the line the command line would print; nothing is loaded or played before
    the checks pass. The caller's state is left as it was (`callers_state_kept`): the model's tensors and training
    modes, its tokenizer, the global random generators.
    """
    in_memory = model_or_path is not None and not isinstance(model_or_path, str | os.PathLike)
    if in_memory and tokenizer is None:
        raise ConfigError("evaluate_model: a model in memory needs its tokenizer: evaluate_model(model, config, "
                          "tokenizer=...)")
    name = f"in memory ({type(model_or_path).__name__})" if in_memory else (
        None if model_or_path is None else str(model_or_path))
    options = {key: value for key, value in options.items() if value is not None}
    if name is not None and "model_name_or_path" in options:  # (each path would silently keep another one)
        raise ConfigError(f"evaluate_model: two models named: {name} and model_name_or_path="
                          f"{options['model_name_or_path']!r}; give one")
    object_config = isinstance(config, HGPOConfig)
    if object_config and (own := sorted(set(options) & field_names(HGPOConfig))):
        raise ConfigError(f"evaluate_model: {', '.join(own)}: set HGPOConfig fields on the HGPOConfig given as "
                          "config (or give a YAML file)")
    check_options(options, (EvalArguments, EnvArguments, ModelConfig, *(() if object_config else (HGPOConfig,))))
    with entry_point_scope():  # (one parse for both kinds of config: the options are checked by the same rules)
        argv = [*(["--config", str(config)] if config is not None and not object_config else []),
                *(["--model_name_or_path", name] if name is not None else []), *command_line(options)]
        evaluation = prepare(argv, in_memory, config if object_config else None)
        evaluation.model = (model_or_path, tokenizer) if in_memory else None
        with callers_state_kept(model_or_path if in_memory else None):
            report = run(evaluation)
    return EvaluationResult(report, evaluation.output_dir)


@contextmanager
def callers_state_kept(model: Any = None) -> Iterator[None]:
    """The caller's state as it was before the block: the global random generators that each evaluation seed
    resets (Python's, numpy's, torch's and CUDA's) and, for a `model` in memory, each module's training mode and
    its own tensors, put back (a CPU model played on the GPU comes back on its CPU tensors, bit for bit, with no
    copy back)."""
    import torch

    python, numpy = random.getstate(), np.random.get_state()  # noqa: NPY002 (the legacy one is what set_seed seeds)
    modes = [(m, m.training) for m in model.modules()] if model is not None else []
    held = [(slots, name, t, t.data, t.grad, None if t.grad is None else t.grad.data)
            for m, _ in modes for slots in (m._parameters, m._buffers) for name, t in slots.items() if t is not None]
    try:
        with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)  # noqa: NPY002
        for slots, name, tensor, data, grad, grad_data in held:  # (`to` may have replaced the tensor or its data)
            slots[name], tensor.data = tensor, data
            if grad is not None:
                grad.data, tensor.grad = grad_data, grad
        for module, training in modes:
            module.train(training)


def command_line(options: dict[str, Any]) -> list[str]:
    """`options` as command-line arguments: a list as its items, each written as a single value is."""
    argv = []
    for name, value in options.items():
        items = list(value) if isinstance(value, list | tuple) else [value]
        if any(item is None for item in items):  # the command line has no word for None
            raise ConfigError(f"evaluate_model: {name}: a list cannot hold None, got {value!r}")
        argv += [f"--{name}", *map(argument, items)]
    return argv


def argument(value: Any) -> str:
    """One value as the command line takes it: a mapping as JSON, a bool as true / false."""
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def field_names(section: type) -> set[str]:
    return {f.name for f in dataclasses.fields(section) if f.init}


def check_options(options: dict[str, Any], sections: tuple[type, ...]) -> None:
    """A ConfigError naming the first option that is no field of `sections`, with the closest that is."""
    known = set().union(*(field_names(s) for s in sections))
    if unknown := sorted(set(options) - known):
        raise ConfigError(f"evaluate_model: unknown option {unknown[0]!r}{did_you_mean(unknown[0], known)}; the "
                          "options are the fields that python evaluate.py --help-all lists")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if answered_help(argv, EVAL_SECTIONS, "evaluate.py"):
        return
    with entry_point_scope():
        try:
            evaluation = prepare(argv)
        except ConfigError as err:
            print(f"{command_name('evaluate.py')}: configuration error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        report = run(evaluation)
    for r in report["results"]:
        score = f", score {percent(r['score'])}" if "score" in r else ""
        print(f"{r['policy']} on {r['split']}: success {percent(r['success_rate'])}{score} % over "
              f"{len(report['seeds'])} seed{'s' * (len(report['seeds']) != 1)}")
    print(f"wrote {evaluation.output_dir / 'evaluation.json'} and evaluation.md")


if __name__ == "__main__":
    main()
