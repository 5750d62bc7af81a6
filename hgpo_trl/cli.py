"""`train.py` / `hgpo-train`: YAML + command-line configuration (TRL's `TrlParser`) into a training run.

    accelerate launch train.py --config configs/quickstart.yaml [--learning_rate 1e-3 ...]
    python train.py --help        # every field with its help text

Three sections, all top-level keys of the YAML: `EnvArguments` (below), `HGPOConfig` (the trainer) and TRL's
`ModelConfig` (model path, dtype, LoRA). `model_name_or_path: tiny` builds the offline tiny model and tokenizer.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import itertools
import json
import os
import sys
import time
import types
import typing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import yaml
from trl import ModelConfig, TrlParser, get_peft_config

from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.registry import registered_envs
from hgpo_trl.reporting import (
    EvaluationBeforeTraining,
    IterationLine,
    plot_learning,
    plot_levels,
    start_evaluation,
    write_summary,
)

TINY = "tiny"


@dataclass
class EnvArguments:
    """Tasks, the offline tiny model and the supervised warm start."""

    train_split: str = field(default="train", metadata={"help": "Task split to train on."})
    eval_split: str | None = field(default="valid", metadata={"help": "Task split to evaluate on (None: none)."})
    task_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Options of the environment's task list (hgpo_trl.envs.make_tasks), e.g. "
                                        "{num_rooms: 3} or {data_path: ...}; JSON on the command line."})
    num_train_tasks: int | None = field(default=None, metadata={"help": "Use at most this many training tasks."})
    num_eval_tasks: int | None = field(default=None, metadata={"help": "Use at most this many evaluation tasks."})
    eval_before_training: bool = field(
        default=True, metadata={"help": "Evaluate before the first iteration (the start of learning.png and "
                                        "summary.json's success_rate_start; released: trainer.val_before_train)."})
    warmstart_steps: int = field(
        default=0, metadata={"help": "Supervised warm-start steps on random admissible actions before RL (tiny "
                                     "models emit no valid action without it); 0: none."})
    warmstart_learning_rate: float = field(default=1e-3, metadata={"help": "Warm-start learning rate."})
    warmstart_batch_size: int = field(default=64, metadata={"help": "Warm-start batch size."})
    tiny_hidden_size: int = field(default=64, metadata={"help": "model_name_or_path=tiny: hidden size."})
    tiny_num_layers: int = field(default=2, metadata={"help": "model_name_or_path=tiny: layers."})
    tiny_num_heads: int = field(default=4, metadata={"help": "model_name_or_path=tiny: attention heads."})
    tiny_tokenizer: str | None = field(
        default=None, metadata={"help": "model_name_or_path=tiny: a tokenizer folder (e.g. Qwen2.5's, to see what a "
                                        "real Qwen model sees); None: a word-level tokenizer built from the "
                                        "environment's texts (hgpo_trl.tiny.make_tiny)."})
    tiny_vocab_rows: int | None = field(
        default=None, metadata={"help": "model_name_or_path=tiny: embedding rows (Qwen2.5-0.5B-3B: 151936, 7B: "
                                        "152064); None: the tokenizer's size."})
    plots: bool = field(default=True, metadata={"help": "Write PNG plots of the run to output_dir."})
    env_modules: list[str] = field(
        default_factory=list,
        metadata={"help": "Python modules imported before env_name is looked up, for environments and estimators "
                          "of your own: each calls hgpo_trl.envs.register_env / register_estimator when imported "
                          "(docs/byo_env.md). Resolved from the working directory and sys.path."})


class ConfigError(ValueError):
    """A configuration a run cannot start with; the message names the field and what was expected."""


class _Parser(TrlParser):
    def error(self, message: str):
        """argparse would print the whole usage (hundreds of fields) and exit: raise the one line instead."""
        raise ConfigError(f"{message} (python {self.prog} --help lists every field)")


def parse(argv: list[str] | None = None) -> tuple[EnvArguments, HGPOConfig, ModelConfig]:
    """Parse YAML + overrides; every problem is a ConfigError that names the field, raised before any model
    is loaded."""
    env_args, args, model_args = parse_sections(argv, (), "train.py")
    if not model_args.model_name_or_path:
        raise ConfigError("ModelConfig.model_name_or_path is required: a hub id, a local path, or 'tiny'")
    return env_args, args, model_args


def parse_sections(argv: list[str] | None, extra: tuple[type, ...], prog: str) -> tuple:
    """The `extra` dataclasses (a command's own options), then `EnvArguments`, `HGPOConfig` and `ModelConfig`,
    from a YAML config (`--config`) and command-line overrides, checked as `parse` documents."""
    argv = list(sys.argv[1:] if argv is None else argv)
    sections = (*extra, EnvArguments, HGPOConfig, ModelConfig)
    if "--config" in argv:
        if argv.index("--config") + 1 == len(argv):
            raise ConfigError("--config needs the path of a YAML file")
        check_yaml_types(argv[argv.index("--config") + 1], sections, prog)
    # Before parsing: HGPOConfig checks `estimator` against the registered estimators as it is built.
    import_env_modules(requested_env_modules(argv))
    # No abbreviations: a misspelt option fails as a misspelt YAML key does, rather than setting a neighbour.
    parser = _Parser(sections, prog=prog, allow_abbrev=False)
    options = {option for action in parser._actions for option in action.option_strings} | {"--config"}
    check_known([a.split("=")[0] for a in argv if a.startswith("--")], options, "the command line", prog)
    try:
        *parsed, env_args, args, model_args = parser.parse_args_and_config(args=argv)
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from None
    if isinstance(env_args.task_kwargs, str):
        try:
            env_args.task_kwargs = json.loads(env_args.task_kwargs)
        except json.JSONDecodeError as err:
            raise ConfigError(f"EnvArguments.task_kwargs must be a mapping (JSON on the command line): {err}") from None
    if env_args.task_kwargs is not None and not isinstance(env_args.task_kwargs, dict):
        raise ConfigError(f"EnvArguments.task_kwargs must be a mapping, got {env_args.task_kwargs!r}")
    for name in ("num_train_tasks", "num_eval_tasks", "warmstart_batch_size"):
        if (value := getattr(env_args, name)) is not None and value < 1:
            raise ConfigError(f"EnvArguments.{name} must be an integer >= 1, got {value!r}")
    # A data folder that does not exist fails here, not after the model has loaded.
    for section, kwargs in (("HGPOConfig.env_kwargs", args.env_kwargs), ("EnvArguments.task_kwargs", env_args.task_kwargs)):
        data_path = (kwargs or {}).get("data_path")
        if data_path is not None and not Path(str(data_path)).expanduser().exists():
            raise ConfigError(f"{section}.data_path: {data_path} does not exist; expected the environment's data "
                              "folder or file (docs/environments.md says what each environment reads)")
    if args.env_name not in registered_envs():
        raise ConfigError(f"HGPOConfig.env_name: unknown environment {args.env_name!r}; "
                          f"registered: {registered_envs()}")
    return *parsed, env_args, args, model_args


def requested_env_modules(argv: list[str]) -> list[str]:
    """`env_modules` from the YAML config, or from the command line, which wins (read ahead of the parser)."""
    names: Any = []
    if "--config" in argv:
        names = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text()).get("env_modules") or []
    if "--env_modules" in argv:
        names = list(itertools.takewhile(lambda a: not a.startswith("--"), argv[argv.index("--env_modules") + 1:]))
    return [names] if isinstance(names, str) else list(names)


def import_env_modules(names: list[str]) -> None:
    """Import each module of `EnvArguments.env_modules` (they register environments and estimators)."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # `python train.py` puts the script's folder first, not the working one
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:  # any failure of the user's module is reported as its own, in one line
            raise ConfigError(f"EnvArguments.env_modules: cannot import {name!r}: {type(err).__name__}: {err}") from None


def check_yaml_types(path: str, sections: tuple[type, ...], prog: str) -> None:
    """A YAML value of the wrong type (a list where a number belongs, ...) fails here with the field's name,
    not later inside a dependency. Strings are left to the parser, which converts and checks them."""
    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot read the config file {path}: {err}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"the config file {path} must hold a YAML mapping of field: value")
    if not isinstance(config.get("env", {}), dict):
        raise ConfigError(f"env in {path} must be a mapping of environment variables, got {config['env']!r}")
    known = {f.name for section in sections for f in dataclasses.fields(section)} | {"env"}  # env: variables
    check_known([str(key) for key in config], known, f"config file {path}", prog)
    for section in sections:
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            if f.name not in config or isinstance(config[f.name], str) or f.name not in hints:
                continue
            expected = _accepted(hints[f.name])
            if expected and not isinstance(config[f.name], expected):
                names = ", ".join(sorted({"None" if t is type(None) else t.__name__ for t in expected}))
                raise ConfigError(f"{section.__name__}.{f.name} must be {names}, got {config[f.name]!r} ({path})")


def check_known(names: list[str], known: set[str], where: str, prog: str) -> None:
    """A ConfigError naming every unknown key of `where`, each with the closest known one."""
    unknown = [name for name in names if name not in known]
    if unknown:
        named = [f"{name} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(name, known, 1))
                 else name for name in unknown]
        raise ConfigError(f"Unknown arguments from {where}: {', '.join(named)}; every key must be a field "
                          f"(python {prog} --help lists them)")


def _accepted(hint: Any) -> tuple[type, ...]:
    """The runtime types a simple annotation allows (empty: not checked)."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    accepted: list[type] = []
    for option in options:
        origin = typing.get_origin(option) or option
        if option is type(None):
            accepted.append(type(None))
        elif origin in (int, float, bool, str, dict, list):
            accepted.append(origin)
        else:
            return ()  # enums, literals and other types are the parser's business
    if float in accepted:
        accepted.append(int)  # 1 is a fine learning rate
    return tuple(accepted)


def load_tasks(args: HGPOConfig, env_args: EnvArguments, split: str | None, limit: int | None):
    if split is None:
        return None
    tasks = make_tasks(args.env_name, split, **(env_args.task_kwargs or {}))
    return tasks.select(range(min(limit, len(tasks)))) if limit is not None else tasks


def load_model(model_args: ModelConfig, env_args: EnvArguments, args: HGPOConfig, train_tasks):
    """(model, tokenizer): the offline tiny model built for the environment's vocabulary, or any hub id/path."""
    if model_args.model_name_or_path == TINY:
        from hgpo_trl.tiny import make_tiny

        return make_tiny(args.env_name, list(train_tasks), tokenizer=env_args.tiny_tokenizer,
                         env_kwargs=args.env_kwargs, history_length=args.history_length, max_steps=args.max_env_steps,
                         hidden_size=env_args.tiny_hidden_size, num_layers=env_args.tiny_num_layers,
                         num_heads=env_args.tiny_num_heads, vocab_rows=env_args.tiny_vocab_rows, seed=args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"revision": model_args.model_revision, "trust_remote_code": args.trust_remote_code}
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=model_args.dtype or "auto",
                                                 attn_implementation=model_args.attn_implementation, **kwargs)
    return model, tokenizer


def run_warm_start(model, tokenizer, env_args: EnvArguments, args: HGPOConfig, train_tasks, output_dir: Path
                   ) -> dict[str, float]:
    """The configured supervised warm start of `model` (in place) on random admissible actions; its metrics."""
    from hgpo_trl.warmstart import warm_start

    return warm_start(model, tokenizer, partial(make_env, args.env_name, **(args.env_kwargs or {})),
                      list(train_tasks), steps=env_args.warmstart_steps, output_dir=str(output_dir),
                      history_length=args.history_length, max_steps=args.max_env_steps,
                      action_mode=args.action_mode, format_instruction=args.format_instruction,
                      batch_size=env_args.warmstart_batch_size, learning_rate=env_args.warmstart_learning_rate,
                      seed=args.seed, use_cpu=args.use_cpu, progress=not args.disable_tqdm)


def run(env_args: EnvArguments, args: HGPOConfig, model_args: ModelConfig) -> dict[str, Any]:
    from hgpo_trl.trainer import HGPOTrainer

    start = time.time()
    train_tasks = load_tasks(args, env_args, env_args.train_split, env_args.num_train_tasks)
    eval_tasks = load_tasks(args, env_args, env_args.eval_split, env_args.num_eval_tasks)
    model, tokenizer = load_model(model_args, env_args, args, train_tasks)
    warmstart = {}
    if env_args.warmstart_steps > 0:
        if not args.resume_from_checkpoint:  # a resumed run's checkpoint holds the warm-started weights
            warmstart = run_warm_start(model, tokenizer, env_args, args, train_tasks,
                                       Path(args.output_dir) / "warmstart")
        if args.beta != 0.0 and not model_args.use_peft:
            # The run starts from weights made in memory, not the loaded path's: the trainer keeps those as the KL
            # reference (saved now, reused on a resume). With PEFT the disabled adapter is the reference.
            model.config._name_or_path = ""
    trainer = HGPOTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=train_tasks,
                          eval_dataset=eval_tasks, peft_config=get_peft_config(model_args),
                          callbacks=[IterationLine()])
    if eval_tasks is not None and env_args.eval_before_training and not args.resume_from_checkpoint:
        # (a resumed run has it in its log history)
        trainer.add_callback(EvaluationBeforeTraining(trainer.evaluate()))
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(args.output_dir)
    before = start_evaluation(trainer.state.log_history)
    # The cadence may just have evaluated these weights (eval_every_iterations evaluates after the last iteration).
    last = next((h for h in reversed(trainer.state.log_history) if "eval_success_rate" in h), {})
    fresh = last.get("step") == trainer.state.global_step and not args.load_best_model_at_end
    after = (last if fresh else trainer.evaluate()) if eval_tasks is not None else {}
    summary = {
        "success_rate_start": before.get("eval_success_rate"),
        "success_rate_end": after.get("eval_success_rate"),
        "iterations": trainer.completed_iterations,
        "optimizer_steps": trainer.state.global_step,
        "wall_seconds": round(time.time() - start, 1),
        **warmstart,
        "config": {"env": dataclasses.asdict(env_args), "trainer": args.to_dict(),
                   "model": dataclasses.asdict(model_args)},
    }
    if trainer.accelerator.is_main_process:
        write_summary(args.output_dir, summary)
        if env_args.plots:
            plot_learning(trainer.state.log_history, Path(args.output_dir) / "learning.png")
            if trainer.last_level_stats:
                plot_levels(trainer.state.log_history, [s.group_sizes.tolist() for s in trainer.last_level_stats],
                            Path(args.output_dir) / "hgpo_levels.png")
    trainer.close_environments()
    return summary


def main(argv: list[str] | None = None) -> None:
    try:
        env_args, args, model_args = parse(argv)
    except ConfigError as err:
        print(f"train.py: configuration error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    summary = run(env_args, args, model_args)
    print(f"success rate {summary['success_rate_start']} -> {summary['success_rate_end']} in "
          f"{summary['iterations']} iterations, {summary['wall_seconds']} s; see {args.output_dir}/summary.json")
