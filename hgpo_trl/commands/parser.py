"""The command lines' parser and their `--help`. `--help` lists our own sections (each command's options, the
environment, HGPOConfig's own fields by topic, the model) without importing torch, Transformers'
TrainingArguments or TRL's GRPOConfig, so it answers in about a second; `--help-all` adds TRL's and Transformers'
fields (the whole parser, imports included)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path

from trl import ModelConfig, TrlParser

from hgpo_trl.fields import HELP_SECTIONS, HGPOFields, help_section

HELP_ALL = "--help-all"
CONSOLE_SCRIPTS = {"train.py": "hgpo-train", "evaluate.py": "hgpo-eval"}  # (the repository's script: the command)


def command_name(script: str) -> str:
    """The command the user ran, as its messages name it: the console script (`hgpo-eval`, `hgpo-train`) when
    that started this process, else `script` (`train.py`, `evaluate.py`; also a notebook's `main()`)."""
    console = CONSOLE_SCRIPTS.get(script)
    return console if console is not None and Path(sys.argv[0]).name == console else script


def invocation(script: str) -> str:
    """How the user runs the command again: `hgpo-eval`, or `python evaluate.py`."""
    name = command_name(script)
    return name if name != script else f"python {script}"


class ConfigError(ValueError):
    """A configuration a run cannot start with; the message names the field and what was expected."""


class SectionParser(TrlParser):
    """TrlParser with `--help` in sections, ours first (each command's own options, the environment, HGPOConfig's
    own fields by topic, the model), then TRL's GRPOConfig and Transformers' TrainingArguments fields."""

    def __init__(self, sections: tuple[type, ...], prog: str):
        self._section_types = sections
        super().__init__(sections, prog=prog, allow_abbrev=False,
                         usage=f"{invocation(prog)} [--config FILE.yaml] [--FIELD VALUE ...]",
                         description="Every field below is a key of the YAML config and an option here; an option "
                                     "given here overrides the file.")
        self.add_argument(HELP_ALL, action="store_true", default=argparse.SUPPRESS,
                          help="Show every field, TRL's GRPOConfig and Transformers' TrainingArguments too, and exit.")

    def _add_dataclass_arguments(self, dtype: type) -> None:
        if not hasattr(self, "_groups"):  # built once, in the order --help lists them
            self._groups: dict[str, argparse._ArgumentGroup] = {}
            config = self.add_argument_group("config file")
            config.add_argument("--config", metavar="FILE.yaml", default=argparse.SUPPRESS,
                                help="YAML file of field: value (any field below; env: sets environment variables).")
            for title in help_groups(self._section_types):
                self._groups[title] = self.add_argument_group(title)
        hints = typing.get_type_hints(dtype)
        for f in dataclasses.fields(dtype):
            if f.init:
                f.type = hints[f.name]
                self._parse_dataclass_field(self._groups[help_group(dtype, f.name)], f)

    def error(self, message: str):
        """argparse would print the whole usage and exit: raise the one line instead."""
        raise ConfigError(f"{message} ({invocation(self.prog)} {HELP_ALL} lists every field)")


def help_group(section: type, name: str) -> str:
    """The --help group of field `name` of dataclass `section`."""
    if issubclass(section, HGPOFields):
        if name in vars(HGPOFields)["__annotations__"]:  # declared (or given our default) by HGPOConfig
            return f"HGPOConfig: {help_section(name)}"
        from transformers import TrainingArguments  # (only the full --help and parsing reach here)
        from trl import GRPOConfig

        if name in vars(GRPOConfig).get("__annotations__", {}) or name not in {
                f.name for f in dataclasses.fields(TrainingArguments)}:
            return "TRL GRPOConfig: generation, loss, vLLM"
        return "Transformers TrainingArguments: optimizer, precision, logging, saving"
    if section is ModelConfig:
        return "TRL ModelConfig: model, dtype, LoRA"
    return f"{section.__name__}: {(section.__doc__ or '').strip().splitlines()[0].rstrip('.')}"


def help_groups(sections: tuple[type, ...]) -> list[str]:
    """Every group of `sections`' fields: ours first (HGPOConfig's in its topics' order), then TRL's and
    Transformers'."""
    titles = [help_group(s, f.name) for s in sections for f in dataclasses.fields(s) if f.init]
    ours = [f"HGPOConfig: {topic}" for topic in HELP_SECTIONS.values()]
    titles = sorted(dict.fromkeys(titles), key=lambda t: (
        t.startswith("Transformers"), t.startswith("TRL GRPOConfig"),
        t.startswith("TRL ModelConfig"), ours.index(t) if t in ours else -1))
    return titles


def short_help(sections: tuple[type, ...], prog: str) -> str:
    """`--help`: `sections` (the command's own options and the environment's), HGPOConfig's own fields and the
    model's, then where the rest is."""
    text = SectionParser((*sections, HGPOFields, ModelConfig), prog).format_help()
    return (f"{text}\nTRL's GRPOConfig (generation, loss, vLLM) and Transformers' TrainingArguments (optimizer, "
            f"precision, logging, saving) fields are options too: {invocation(prog)} {HELP_ALL} lists every field.\n")


def answered_help(argv: list[str], sections: tuple[type, ...], prog: str) -> bool:
    """Print the short `--help` when the command line asks for it (and nothing else is done); whether it did."""
    if "-h" not in argv and "--help" not in argv:
        return False
    print(short_help(sections, prog), end="")
    return True


def with_full_help(argv: list[str]) -> list[str]:
    """`--help-all` read as the whole parser's `--help`."""
    return ["--help" if arg == HELP_ALL else arg for arg in argv]
