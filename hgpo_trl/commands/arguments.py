"""The command line of `train.py` and `hgpo-eval`: a YAML config (`--config`) and overrides into checked
dataclasses, with `--help` grouped by section and every problem a `ConfigError` that names the field."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import itertools
import json
import os
import sys
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from trl import ModelConfig

from hgpo_trl.commands.parser import HELP_ALL, ConfigError, SectionParser, invocation, with_full_help
from hgpo_trl.envs.registry import registered_envs
from hgpo_trl.models.export import ADAPTER_CONFIG
from hgpo_trl.models.pretrained import PretrainedModelError, is_pretrained_name, pretrained_folder

if TYPE_CHECKING:
    from hgpo_trl.config import HGPOConfig

TINY = "tiny"


@dataclass
class EnvArguments:
    """Tasks, the offline tiny model and the supervised warm start."""

    train_split: str = field(default="train", metadata={"help": "Task split to train on."})
    eval_split: str | None = field(default="valid", metadata={"help": "Task split to evaluate on; null: none."})
    task_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Options of the environment's task list (hgpo_trl.envs.make_tasks), e.g. "
                                        "{num_rooms: 3} or {data_path: ...}; on the command line (YAML or JSON) "
                                        "it replaces the YAML's mapping as a whole."})
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
                                        "environment's texts (hgpo_trl.models.tiny.make_tiny)."})
    tiny_vocab_rows: int | None = field(
        default=None, metadata={"help": "model_name_or_path=tiny: embedding rows (Qwen2.5-0.5B-3B: 151936, 7B: "
                                        "152064); None: the tokenizer's size."})
    plots: bool = field(default=True, metadata={"help": "Write PNG plots of the run to output_dir."})
    env_modules: list[str] = field(
        default_factory=list,
        metadata={"help": "Python modules imported before env_name is looked up, for environments and estimators "
                          "of your own: each calls hgpo_trl.envs.register_env / register_estimator when imported "
                          "(docs/byo_env.md). Resolved from the working directory and sys.path."})


@dataclass
class RehearsalArguments:
    """Rehearse this config on CPUs before renting GPUs (docs/rehearsal.md)."""

    rehearse: bool = field(
        default=False, metadata={"help": "Rehearse this config on this machine's CPUs: its accelerate file "
                                         "(accelerate_config), processes and machines, a tiny model of the real "
                                         "one's architecture with its real tokenizer, 3 iterations with a "
                                         "checkpoint, a resume and an evaluation; prints a report and the real "
                                         "run's projected memory and time, and writes rehearsal.json into "
                                         "output_dir + '-rehearsal'. Launches its own processes: run it with "
                                         "python, not accelerate launch."})
    rehearse_tokenizer: str | None = field(
        default=None, metadata={"help": "--rehearse: the real model's tokenizer folder (default: the Hugging Face "
                                        "cache's, offline, for model_name_or_path)."})
    gpu_memory_gib: float = field(
        default=80.0, metadata={"help": "--rehearse: the memory of one GPU of the real run, in GiB."})
    host_memory_gib: float | None = field(
        default=None, metadata={"help": "--rehearse: the memory of one machine of the real run, in GiB (default: "
                                        "this machine's, when it has a GPU for each process of a machine; else "
                                        "the host memory is projected, not checked)."})
    rehearse_timeout: float | None = field(
        default=None, metadata={"help": "--rehearse: seconds a launch may run before it is stopped as hung (default: "
                                        "5 x what the plan expects of its processes on this machine's cores)."})


PAPER_SEEDS = (123, 456, 789)  # the released validation seeds


@dataclass
class EvalArguments:
    """What to evaluate and where the results go; everything else comes from the training config."""

    policy: list[str] = field(
        default_factory=lambda: ["model"],
        metadata={"help": "Players, one row each: 'model' (model_name_or_path), 'random' (uniform over the "
                          "admissible actions), 'expert' (the environment's scripted expert: ALFWorld's handcoded "
                          "one). 'random' and 'expert' load no model."})
    seeds: list[int] = field(
        default_factory=lambda: list(PAPER_SEEDS),
        metadata={"help": "Evaluation seeds (sampling, the random player, the expert's tie-breaks); mean and std "
                          "are taken over them."})
    greedy: bool = field(default=False, metadata={"help": "Greedy decoding (instead of eval_temperature)."})
    splits: list[str] | None = field(
        default=None, metadata={"help": "Task splits to evaluate (default: alfworld valid_seen valid_unseen, webshop "
                                        "test, keydoor valid, other environments eval_split)."})
    num_envs: int | None = field(
        default=None, metadata={"help": "Environments played at once (default: tasks_per_device x num_generations, "
                                        "as a training rollout)."})
    episodes_per_seed: int | None = field(
        default=None, metadata={"help": "Play this many episodes per split and seed, cycling through all of the "
                                        "split's tasks (num_eval_tasks is then not read); the released evaluation "
                                        "plays 512 (4 x 128). None: every task once."})
    eval_output_dir: str | None = field(
        default=None, metadata={"help": "Folder of evaluation.json and evaluation.md; default: 'evaluation' beside "
                                        "the evaluated model (inside its folder), or the config's "
                                        "output_dir/evaluation for a hub id, 'tiny' or reference players only. A "
                                        "folder that already holds a result is never overwritten: the next free "
                                        "evaluation-N is used, and said."})


# Each command's own sections (its options, the environment's), which its --help lists before HGPOConfig's and the
# model's: one home for the entry point's --help and the command's main.
TRAIN_SECTIONS = (RehearsalArguments, EnvArguments)
EVAL_SECTIONS = (EvalArguments, EnvArguments)


def flag_value(text: str) -> bool | None:
    """A boolean option's value as the parser reads it (yes/no, true/false, t/f, y/n, 1/0); None: not one."""
    return {"yes": True, "true": True, "t": True, "y": True, "1": True,
            "no": False, "false": False, "f": False, "n": False, "0": False}.get(text.lower())


def parse(argv: list[str] | None = None) -> tuple[EnvArguments, HGPOConfig, ModelConfig]:
    """Parse YAML + overrides; every problem is a ConfigError that names the field, raised before any model
    is loaded."""
    _, env_args, args, model_args = parse_sections(argv, (RehearsalArguments,), "train.py")
    model_args.model_name_or_path = checked_model_path(model_args.model_name_or_path)
    return env_args, args, model_args


def parse_sections(argv: list[str] | None, extra: tuple[type, ...], prog: str, args: HGPOConfig | None = None
                   ) -> tuple:
    """The `extra` dataclasses (a command's own options), then `EnvArguments`, `HGPOConfig` and `ModelConfig`,
    from a YAML config (`--config`) and command-line overrides, checked as `parse` documents. `args`: an
    HGPOConfig already built (evaluate_model's), returned as it is; the other sections are parsed and checked by
    the same rules."""
    from hgpo_trl.config import HGPOConfig

    argv = with_full_help(list(sys.argv[1:] if argv is None else argv))
    sections = (*extra, EnvArguments, *((HGPOConfig,) if args is None else ()), ModelConfig)
    config: dict[str, Any] = {}
    if "--config" in argv:
        if argv.index("--config") + 1 == len(argv):
            raise ConfigError("--config needs the path of a YAML file")
        config = check_yaml_types(argv[argv.index("--config") + 1], section_fields(sections), prog)
    # Before parsing: HGPOConfig checks `estimator` against the registered estimators as it is built.
    import_env_modules(requested_env_modules(argv, config))
    # No abbreviations: a misspelt option fails as a misspelt YAML key does, rather than setting a neighbour.
    parser = SectionParser(sections, prog)
    options = {option for action in parser._actions for option in action.option_strings} | {"--config"}
    check_known([a.split("=")[0] for a in argv if a.startswith("--")], options, "the command line", prog)
    try:
        *parsed, model_args = parser.parse_args_and_config(args=argv)
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from None
    *parsed, env_args, args = parsed if args is None else (*parsed, args)
    check_sections(env_args, args)
    warn_unread_options(args.estimator, user_keys(argv, config), argv)
    return *parsed, env_args, args, model_args


def check_sections(env_args: EnvArguments, args: HGPOConfig) -> None:
    """What parsing leaves unchecked, for a command line and for `evaluate_model`'s HGPOConfig alike: task_kwargs
    given as text read as a mapping and eval_split's null as None (in place), the counts, the data folders, and a
    registered env_name (after env_modules are imported: they register theirs)."""
    if isinstance(env_args.task_kwargs, str):
        env_args.task_kwargs = parse_mapping(env_args.task_kwargs, "EnvArguments.task_kwargs")
    if str(env_args.eval_split).lower() in ("null", "none", "~", ""):  # (the command line's text for YAML's null)
        env_args.eval_split = None
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
        raise ConfigError(f"HGPOConfig.env_name: unknown environment {args.env_name!r}{did_you_mean(args.env_name, registered_envs())}; "
                          f"registered: {registered_envs()}")


def parse_mapping(text: str, name: str) -> dict[str, Any]:
    """A mapping given as text on the command line: YAML flow style ({data_path: /x}) or JSON, which is YAML."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{name} must be a mapping such as '{{num_rooms: 3}}' (YAML or JSON): cannot read "
                          f"{text!r}: {str(err).splitlines()[0]}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a mapping such as '{{num_rooms: 3}}' (YAML or JSON), got {text!r}")
    return value


def did_you_mean(name: str, known) -> str:
    close = difflib.get_close_matches(str(name), list(known), 1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def user_keys(argv: list[str], config: dict[str, Any]) -> list[str]:
    """The fields the user set: the YAML config's keys and the command line's options (never the defaults)."""
    return [a[2:].split("=")[0] for a in argv if a.startswith("--")] + [str(k) for k in config]


def warn_unread_options(estimator: str, keys: list[str], argv: list[str]) -> None:
    """A warning for each advantage option the user set that the chosen estimator does not read (e.g. omega
    with hgpo): it would otherwise be silently ignored."""
    from hgpo_trl.config_checks import estimator_fields, unread_estimator_fields, user_warning

    unread = unread_estimator_fields(estimator, dict.fromkeys(keys))
    if unread:
        where = f"in {argv[argv.index('--config') + 1]} or on the command line" if "--config" in argv else "on the command line"
        user_warning(f"HGPOConfig: {', '.join(unread)} set {where}, but estimator {estimator!r} does not read "
                     f"{'it' if len(unread) == 1 else 'them'}; it reads {', '.join(estimator_fields(estimator))}")


def requested_env_modules(argv: list[str], config: dict[str, Any]) -> list[str]:
    """`env_modules` from the YAML config, or from the command line, which wins (read ahead of the parser)."""
    names: Any = config.get("env_modules") or []
    if "--env_modules" in argv:
        names = list(itertools.takewhile(lambda a: not a.startswith("--"), argv[argv.index("--env_modules") + 1:]))
    return [names] if isinstance(names, str) else list(names)


@contextmanager
def entry_point_scope() -> Iterator[None]:
    """What `train.py` and `hgpo-eval` change in their process for a run, put back after it: their `main` may be
    called from Python (a notebook, a test), whose process stays its own. `sys.path`: env_modules are found from
    the working directory, put first for the run (its environment workers are started with it). DeepSpeed's CPU
    accelerator is named when there is no CUDA: what DeepSpeed picks then anyway, without its "unable to detect"
    warning."""
    import torch

    path = list(sys.path)
    name_accelerator = not torch.cuda.is_available() and "DS_ACCELERATOR" not in os.environ
    if name_accelerator:
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        yield
    finally:
        sys.path[:] = path
        if name_accelerator:
            os.environ.pop("DS_ACCELERATOR", None)


def import_env_modules(names: list[str]) -> None:
    """Import each module of `EnvArguments.env_modules` (they register environments and estimators)."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # `python train.py` puts the script's folder first, not the working one
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:  # any failure of the user's module is reported as its own, in one line
            raise ConfigError(f"EnvArguments.env_modules: cannot import {name!r}: {type(err).__name__}: {err}") from None


def section_fields(sections: tuple[type, ...]) -> dict[str, tuple[str, Any]]:
    """Every field of the dataclasses `sections`, in their order: name -> (its section's name, its type hint)."""
    table: dict[str, tuple[str, Any]] = {}
    for section in sections:
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            table.setdefault(f.name, (section.__name__, hints.get(f.name)))
    return table


def check_yaml_types(path: str, fields: dict[str, tuple[str, Any]], prog: str) -> dict[str, Any]:
    """The config file's mapping, checked against `fields` (`section_fields`): an unknown key fails with the closest
    field, a YAML value of the wrong type (a list where a number belongs, ...) with the field's name, not later
    inside a dependency; a string must read as one of the field's types ("ten" is no int), as the parser will
    convert it."""
    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot read the config file {path}: {err}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"the config file {path} must hold a YAML mapping of field: value")
    if not isinstance(config.get("env", {}), dict):
        raise ConfigError(f"env in {path} must be a mapping of environment variables, got {config['env']!r}")
    check_known([str(key) for key in config], {*fields, "env"}, f"config file {path}", prog)  # env: variables
    for name, (section, hint) in fields.items():
        if name not in config or hint is None:
            continue
        expected, value = _accepted(hint), config[name]
        if expected and (not _reads_as(value, expected) if isinstance(value, str) else not isinstance(value, expected)):
            names = ", ".join(sorted({"None" if t is type(None) else t.__name__ for t in expected}))
            raise ConfigError(f"{section}.{name} must be {names}, got {value!r} ({path})")
    return config


def check_known(names: list[str], known: set[str], where: str, prog: str) -> None:
    """A ConfigError naming every unknown key of `where`, each with the closest known one."""
    unknown = [name for name in names if name not in known]
    if unknown:
        named = [f"{name} (did you mean {close[0]}?)" if (close := _closest(name, known)) else name for name in unknown]
        raise ConfigError(f"Unknown arguments from {where}: {', '.join(named)}; every key must be a field "
                          f"({invocation(prog)} {HELP_ALL} lists them)")


def _closest(name: str, known: set[str]) -> list[str]:
    """The known name closest to `name`; an estimator option's own name (`depth`, `norm`, `lam`, as
    `compute_advantages` takes them) maps to the config field that sets it (`hierarchy_depth`, ...)."""
    from hgpo_trl.fields import ESTIMATOR_FIELDS

    dashes = name[:len(name) - len(name.lstrip("-"))]
    fields = {option: field for field, option in ESTIMATOR_FIELDS.items() if option != field}
    if (field := fields.get(name.lstrip("-"))) and dashes + field in known:
        return [dashes + field]
    return difflib.get_close_matches(name, known, 1)


def _reads_as(text: str, expected: tuple[type, ...]) -> bool:
    """Whether the parser can convert the YAML string `text` to one of the `expected` types."""
    for kind in expected:
        if kind in (str, dict, list) or (kind is bool and flag_value(text) is not None):
            return True
        if kind in (int, float):
            try:
                kind(text)
                return True
            except ValueError:
                continue
    return False


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


def checked_model_path(name: str | None, what: str = "ModelConfig.model_name_or_path") -> str:
    """What to load for `name`, or a ConfigError: 'tiny'; a model or LoRA adapter folder (its base checked too); a hub
    id (offline: in the Hugging Face cache); a model known by name or a .gguf file, as its converted folder."""
    from huggingface_hub import is_offline_mode, try_to_load_from_cache

    if not name:
        raise ConfigError(f"{what} is required: a hub id, a local path (a model folder, a run's output_dir or "
                          "checkpoint, a LoRA adapter folder), or 'tiny'")
    if name == TINY:
        return name
    if is_pretrained_name(name):
        try:
            return pretrained_folder(name)
        except PretrainedModelError as err:
            raise ConfigError(f"{what}: {err}") from None
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / ADAPTER_CONFIG).is_file():
            base = json.loads((path / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
            checked_model_path(base, f"the base model named in {path / ADAPTER_CONFIG}")
        elif not (path / "config.json").is_file():
            inside = sorted(p.parent.name for p in path.glob("*/config.json"))
            hint = f"; models inside it: {', '.join(inside)}" if inside else ""
            raise ConfigError(f"{what}: {path} holds no model (config.json) and no LoRA adapter ({ADAPTER_CONFIG})"
                              f"{hint}")
        return name
    # A hub id is "name" or "org/name"; a deeper path, or one under an existing folder, was meant as a folder.
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name.split("/")[0]).is_dir():
        raise ConfigError(f"{what}: {path} does not exist; expected a checkpoint, model or LoRA adapter folder")
    if is_offline_mode() and not isinstance(try_to_load_from_cache(name, "config.json"), str):
        raise ConfigError(f"{what}: {name!r} is not a folder, and no model of that hub id is in the Hugging Face "
                          "cache (HF_HUB_OFFLINE is set)")
    return name
