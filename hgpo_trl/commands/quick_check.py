"""A configuration refused in about a second. `train.py` and `hgpo-eval` import the training stack (torch,
Transformers' TrainingArguments, TRL's trainer: 10-15 s of CPU, minutes on a busy machine) before their full parse;
first, the parse's checks that need only the fields' names and types run here: unknown keys of the config file
and unknown options, each with the closest field, and values of the wrong type in either. TRL's GRPOConfig and
Transformers' TrainingArguments fields are read from their source files (`ast`), not imported. The checks and
their messages are the full parse's own (`hgpo_trl.commands.arguments`, the same SectionParser for the command line's
values); what needs the classes (a value out of range, a missing file) the full parse checks after the imports.
A source that cannot be read (another TRL layout) skips the check: the full parse still makes it."""

from __future__ import annotations

import ast
import importlib.util
import typing
from pathlib import Path
from typing import Any

from trl import ModelConfig

from hgpo_trl.commands.arguments import _accepted, check_known, check_yaml_types, section_fields
from hgpo_trl.commands.parser import HELP_ALL, SectionParser
from hgpo_trl.fields import HGPOFields

# HGPOConfig's bases under HGPOFields, the most basic first: (package, source file, class). tests/test_entry_points.py
# checks what they give against the imported HGPOConfig.
TRL_BASES = (("transformers", "training_args.py", "TrainingArguments"),
             ("trl", "trainer/base_config.py", "_BaseConfig"), ("trl", "trainer/grpo_config.py", "GRPOConfig"))
SIMPLE_TYPES = {t.__name__: t for t in (int, float, bool, str, dict, list)} | {"List": list, "Dict": dict}


class Other:
    """Any type but the simple ones (an enum of Transformers', a Literal): the type check skips it, as it skips
    the real one."""


def source_hint(node: ast.expr) -> Any:
    """The type hint an annotation's source reads as, for the type check (`arguments._accepted`): the simple types,
    None and their unions (X | Y, Optional, Union) as themselves, list[...] and dict[...] as list and dict, the
    rest `Other`. Built from the syntax tree, without evaluating it."""
    if isinstance(node, ast.Constant) and node.value is None:
        return type(None)
    if isinstance(node, ast.Name):
        return type(None) if node.id == "None" else SIMPLE_TYPES.get(node.id, Other)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return typing.Union[source_hint(node.left), source_hint(node.right)]  # noqa: UP007 (hints made at run time)
    if isinstance(node, ast.Subscript):
        name = ast.unparse(node.value).rsplit(".", 1)[-1]
        args = [source_hint(a) for a in (node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice])]
        if name in ("Optional", "Union"):
            members = (*args, type(None)) if name == "Optional" else tuple(args)
            return typing.Union[members]  # noqa: UP007 (hints made at run time)
        return SIMPLE_TYPES.get(name, Other)
    return Other


def source_fields(package: str, file: str, name: str) -> dict[str, tuple[Any, bool]] | None:
    """Class `name`'s own dataclass fields in `file` of installed `package`, read from its source: name -> (its
    type hint, whether its default is True); None when the source or the class is not found."""
    spec = importlib.util.find_spec(package)  # (a top-level package: found, not imported)
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        tree = ast.parse((Path(spec.submodule_search_locations[0]) / file).read_text())
    except (OSError, SyntaxError):
        return None
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if node is None:
        return None
    return {n.target.id: (source_hint(n.annotation), default_is_true(n.value)) for n in node.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            and "ClassVar" not in ast.unparse(n.annotation)}


def default_is_true(value: ast.expr | None) -> bool:
    """Whether a field's default, `= True` or `field(default=True, ...)`, is True (its `--no_` option)."""
    if isinstance(value, ast.Call):
        value = next((k.value for k in value.keywords if k.arg == "default"), None)
    return isinstance(value, ast.Constant) and value.value is True


def hgpo_config_fields() -> tuple[dict[str, tuple[str, Any]], set[str]] | None:
    """HGPOConfig's fields as `section_fields` gives them (in dataclass order, a subclass's hint winning), and the
    options the parser makes for those its HGPOFields base lacks (`--no_NAME` too for a bool that defaults to True,
    as Transformers' HfArgumentParser adds it); None when a base's source cannot be read."""
    fields: dict[str, tuple[Any, bool]] = {}
    for base in TRL_BASES:
        own = source_fields(*base)
        if own is None:
            return None
        fields.update(own)
    ours = section_fields((HGPOFields,))
    options = set()
    for name, (hint, true_default) in fields.items():
        if name not in ours:
            options |= {f"--{name}", f"--{name.replace('_', '-')}"}
            if true_default and _accepted(hint) in ((bool,), (bool, type(None))):
                options |= {f"--no_{name}", f"--no-{name.replace('_', '-')}"}
    fields.update({name: (hint, False) for name, (_, hint) in ours.items()})
    return {name: ("HGPOConfig", hint) for name, (hint, _) in fields.items()}, options


def refuse_early(argv: list[str], sections: tuple[type, ...], prog: str) -> None:
    """The ConfigError the full parse of the command's `sections` (TRAIN_SECTIONS, EVAL_SECTIONS) would raise first
    for `argv`'s config file (its keys and types) and command line (its options and their values' types), without
    importing the training stack; nothing when the first problem is one these checks do not see."""
    if HELP_ALL in argv or "--config" in argv[-1:]:  # (--help-all and a path-less --config: the full parse's)
        return
    hgpo = hgpo_config_fields()
    if hgpo is None:
        return
    fields = {**section_fields(sections), **hgpo[0], **section_fields((ModelConfig,))}
    if "--config" in argv:
        check_yaml_types(argv[argv.index("--config") + 1], fields, prog)
    parser = SectionParser((*sections, HGPOFields, ModelConfig), prog)
    options = {option for action in parser._actions for option in action.option_strings} | {"--config"}
    check_known([a.split("=")[0] for a in argv if a.startswith("--")], options | hgpo[1], "the command line", prog)
    parser.parse_known_args(argv)  # our fields' values and the model's, typed as the full parser types them
