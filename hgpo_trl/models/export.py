"""Merge a LoRA run into a plain model folder that any `transformers` loader reads as-is.

    hgpo-merge outputs/run outputs/run-merged [--base-model Qwen/Qwen2.5-1.5B-Instruct]
    python -m hgpo_trl.models.export outputs/run outputs/run-merged

    from hgpo_trl.models.export import merge_adapter
    merge_adapter("outputs/run", "outputs/run-merged")

The output folder holds the merged weights (`merge_and_unload`), the config, the generation config, the
tokenizer and its chat template, so `AutoModelForCausalLM.from_pretrained(folder)` and
`AutoTokenizer.from_pretrained(folder)` load it with `trust_remote_code` off, and so do vLLM and TRL.

The base model is the adapter's `base_model_name_or_path` (in `adapter_config.json`) unless `base_model` is
given. The tokenizer comes from the adapter folder when it holds one (TRL saves it there), else from the base.
A local tokenizer is copied file by file rather than re-saved, then reloaded from the output folder and
checked against the source: the tiny word-level tokenizer (`hgpo_trl.models.tiny`) needs an `auto_map` entry in
`tokenizer_config.json` to load next to a "qwen2" config.json, and that entry is added when it is missing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
# Tokenizer files as transformers and sentencepiece write them; copied verbatim when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
TOKENIZER_DIRS = ("additional_chat_templates",)
# Tokenizer classes that only wrap tokenizer.json: next to a config.json of a model type with its own tokenizer
# class (e.g. qwen2), AutoTokenizer would rebuild that class from the vocabulary unless auto_map points back here.
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
TOKENIZER_AUTO_MAP = {"AutoTokenizer": [None, "TokenizersBackend"]}
PROBE_TEXT = "You are in the middle of a room. Your task is to: put a clean mug in the coffeemachine 1!"


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json",
                                                        "tokenizer.model", "vocab.json", "vocab.txt"))


def _read_adapter_config(adapter_path: Path) -> dict:
    if not adapter_path.exists():
        raise FileNotFoundError(f"adapter folder {adapter_path} does not exist: pass the output_dir of a LoRA run "
                                f"(or one of its checkpoint-* folders)")
    if not adapter_path.is_dir():
        raise ValueError(f"adapter path {adapter_path} is not a folder: pass the folder that holds "
                         f"{ADAPTER_CONFIG} and adapter_model.safetensors")
    config_file = adapter_path / ADAPTER_CONFIG
    if not config_file.is_file():
        nested = sorted(str(p.parent) for p in adapter_path.glob(f"*/{ADAPTER_CONFIG}"))
        hint = f"; adapters found in: {', '.join(nested)}" if nested else ""
        full = " (it holds a full model: load it directly, there is nothing to merge)" \
            if (adapter_path / "config.json").is_file() else ""
        raise ValueError(f"{adapter_path} holds no {ADAPTER_CONFIG}{full}: pass a folder saved from a PEFT "
                         f"(LoRA) model, e.g. the output_dir of a run with use_peft{hint}")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON ({err}): re-save the adapter") from err


def _base_model_name(adapter_config: dict, adapter_path: Path, base_model: str | None) -> str:
    if base_model:
        return str(base_model)
    name = adapter_config.get("base_model_name_or_path")
    if not name:
        raise ValueError(f"{adapter_path / ADAPTER_CONFIG} does not name its base model "
                         f"(base_model_name_or_path is empty): pass base_model= / --base-model")
    return str(name)


def _load_base(base: str, adapter_path: Path, from_config: bool):
    from transformers import AutoModelForCausalLM

    where = f"{adapter_path / ADAPTER_CONFIG} names base model {base!r}" if from_config else \
        f"base model {base!r}"
    path = Path(base).expanduser()
    # A hub id is "name" or "org/name"; anything else is meant as a folder.
    looks_local = base.startswith((".", "/", "~")) or path.exists() or base.count("/") > 1
    if looks_local and not path.is_dir():
        raise FileNotFoundError(f"{where}, but {path} is not a folder: pass the base model's folder or hub id "
                                f"with base_model= / --base-model")
    try:
        return AutoModelForCausalLM.from_pretrained(str(path) if looks_local else base, dtype="auto")
    except (OSError, ValueError) as err:  # not found, not reachable offline, or not a model
        reason = " ".join(str(err).split())  # one line
        raise FileNotFoundError(f"{where}, which cannot be loaded ({reason}). Pass the base model's folder or hub "
                                f"id with base_model= / --base-model; a hub id needs network access or a "
                                f"copy in the Hugging Face cache (HF_HUB_OFFLINE=1 uses the cache only)") from err


def _same_tokenizer(expected, folder: Path) -> str | None:
    """None if AutoTokenizer loads `folder` into a tokenizer that behaves as `expected`, else what differs."""
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(folder)
    except Exception as err:  # any failure to load is a difference, reported to the caller
        return f"it does not load ({type(err).__name__}: {err})"
    if loaded.get_vocab() != expected.get_vocab():
        return "the vocabulary differs"
    vocab_sample = " ".join(token for token, _ in sorted(expected.get_vocab().items(), key=lambda kv: kv[1])[:64])
    for text in (PROBE_TEXT, vocab_sample):
        if loaded.encode(text) != expected.encode(text):
            return f"it encodes {text[:40]!r}... differently ({type(loaded).__name__} vs {type(expected).__name__})"
    if loaded.chat_template != expected.chat_template:
        return "the chat template differs"
    return None


def _save_tokenizer(source: str, output_dir: Path) -> None:
    """Copy (local folder) or save (hub id) the tokenizer of `source` into `output_dir`, and check it reloads."""
    from transformers import AutoTokenizer

    source_path = Path(source).expanduser()
    expected = AutoTokenizer.from_pretrained(source_path if source_path.is_dir() else source)
    if source_path.is_dir():
        for name in TOKENIZER_FILES:
            if (source_path / name).is_file():
                shutil.copy2(source_path / name, output_dir / name)
        for name in TOKENIZER_DIRS:
            if (source_path / name).is_dir():
                shutil.copytree(source_path / name, output_dir / name, dirs_exist_ok=True)
    else:
        expected.save_pretrained(output_dir)
    problem = _same_tokenizer(expected, output_dir)
    config_file = output_dir / "tokenizer_config.json"
    if problem and config_file.is_file():
        tokenizer_config = json.loads(config_file.read_text())
        if tokenizer_config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES and "auto_map" not in tokenizer_config:
            # As hgpo_trl.models.tiny.save_tiny: keep AutoTokenizer on the generic backend, which reads tokenizer.json.
            tokenizer_config["auto_map"] = TOKENIZER_AUTO_MAP
            config_file.write_text(json.dumps(tokenizer_config, indent=2))
            problem = _same_tokenizer(expected, output_dir)
    if problem:
        raise RuntimeError(f"the tokenizer from {source} does not round-trip through {output_dir}: {problem}")


def merge_adapter(adapter_path: str | Path, output_dir: str | Path, base_model: str | None = None) -> Path:
    """Merge the PEFT adapter in `adapter_path` into its base model and save a plain model folder.

    `base_model` (a folder or hub id) overrides the adapter's `base_model_name_or_path`. Returns the output
    folder. Raises FileNotFoundError for a missing adapter folder or a base model that cannot be found, and
    ValueError for a folder without adapter_config.json, an adapter that does not fit the base, or an output
    folder that is an input folder; RuntimeError if the saved tokenizer does not reload as the source's.
    """
    from peft import PeftModel

    adapter_path = Path(adapter_path).expanduser()
    output_dir = Path(output_dir).expanduser()
    adapter_config = _read_adapter_config(adapter_path)
    base = _base_model_name(adapter_config, adapter_path, base_model)
    for name, folder in (("adapter", adapter_path), ("base model", Path(base).expanduser())):
        if folder.is_dir() and output_dir.resolve() == folder.resolve():
            raise ValueError(f"output_dir {output_dir} is the {name} folder: pick a new folder, the merged model "
                             f"would overwrite or mix with its files")
    model = _load_base(base, adapter_path, from_config=not base_model)
    try:
        merged = PeftModel.from_pretrained(model, adapter_path).merge_and_unload()
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"the adapter in {adapter_path} does not fit base model {base!r} ({err}): pass the base "
                         f"it was trained on with base_model= / --base-model") from err
    output_dir.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(output_dir)
    _save_tokenizer(str(adapter_path) if _has_tokenizer(adapter_path) else base, output_dir)
    return output_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hgpo-merge",
        description="Merge a LoRA adapter (the output_dir of a run with use_peft) into its base model and save "
                    "a plain model folder (weights, config, tokenizer, chat template) that "
                    "AutoModelForCausalLM / AutoTokenizer / vLLM load as-is.")
    parser.add_argument("adapter_path", help="folder holding adapter_config.json and the adapter weights")
    parser.add_argument("output_dir", help="folder to write the merged model to (created if missing)")
    parser.add_argument("--base-model", default=None,
                        help="base model folder or hub id (default: the adapter's base_model_name_or_path)")
    args = parser.parse_args(argv)
    try:
        out = merge_adapter(args.adapter_path, args.output_dir, base_model=args.base_model)
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"hgpo-merge: error: {err}", file=sys.stderr)
        return 2
    print(f"merged {args.adapter_path} into its base model: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
