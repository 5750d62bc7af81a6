"""The shapes of real models: one table of the Qwen checkpoints a run names, each row's numbers from its
config.json, and the models built from a shape with random weights.

    from hgpo_trl.rehearsal.shapes import SHAPES, build_model_folder, model_shape, tiny_twin

    shape = model_shape("Qwen/Qwen2.5-7B-Instruct")       # a folder, the local HF cache, or the table
    shape.parameters                                       # 7,615,616,512, as transformers builds it
    folder = build_model_folder(tiny_twin(shape), tokenizer, "/tmp/twin")  # same architecture, 64 wide

A tiny twin keeps what the tokenizer and the code paths see (the architecture, the embedding rows, tied or
not, grouped-query attention) and shrinks the rest, so a CPU rehearsal runs the real model's code on its real
vocabulary in seconds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache
from transformers import (
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen3Config,
)

ARCHITECTURES = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}


@dataclass(frozen=True)
class ModelShape:
    """What sizes a model: its config.json's numbers, and where they come from."""

    architecture: str  # config.json's model_type: "qwen2" or "qwen3"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int  # hidden // heads for Qwen2; config.json's head_dim for Qwen3 (128, not hidden // heads)
    intermediate: int
    vocab_rows: int  # embedding rows: config.json's vocab_size, above the tokenizer's length (padding rows)
    tied: bool  # tie_word_embeddings: lm_head shares the embedding's weights
    source: str  # where the numbers come from

    @property
    def parameters(self) -> int:
        """The exact count of the model transformers builds from this shape."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + q * self.hidden  # q, k, v and o projections
        if self.architecture == "qwen2":
            attention += q + 2 * kv  # Qwen2's q, k and v have biases (o has none)
        else:
            attention += 2 * self.head_dim  # Qwen3's have none, but an RMSNorm on q and one on k per head
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden  # MLP, two RMSNorms
        embeddings = self.vocab_rows * self.hidden * (1 if self.tied else 2)  # lm_head too unless tied
        return embeddings + self.layers * layer + self.hidden  # the final norm


LLM_PROF = "github.com/citsjtu2020/LLM-Prof sglang/Model_Config.md"  # copies of Qwen checkpoints' configs

# A base checkpoint (no "-Instruct") has its instruct row's shape; model_shape finds it there. Sources: copies
# of each checkpoint's config.json in public hub pages and repositories (a copy's _name_or_path names the
# checkpoint it copies).
SHAPES: dict[str, ModelShape] = {
    "Qwen/Qwen2.5-0.5B-Instruct": ModelShape(
        "qwen2", 24, 896, 14, 2, 64, 4864, 151936, True,
        "huggingface.co/unsloth/Qwen2.5-0.5B-Instruct config.json (_name_or_path the same)"),
    "Qwen/Qwen2.5-1.5B-Instruct": ModelShape(
        "qwen2", 28, 1536, 12, 2, 128, 8960, 151936, True,
        "huggingface.co/onnx-community/Qwen2.5-1.5B-Instruct config.json (_name_or_path the same)"),
    "Qwen/Qwen2.5-3B-Instruct": ModelShape(
        "qwen2", 36, 2048, 16, 2, 128, 11008, 151936, True,
        "huggingface.co/unsloth/Qwen2.5-3B-Instruct config.json (_name_or_path the same); "
        f"Qwen2.5-3B's in {LLM_PROF}"),
    "Qwen/Qwen2.5-7B-Instruct": ModelShape(
        "qwen2", 28, 3584, 28, 4, 128, 18944, 152064, False,
        f"Qwen2.5-7B's config.json in {LLM_PROF}; a copy of Qwen/Qwen2.5-7B-Instruct's agrees"),
    "Qwen/Qwen2.5-14B-Instruct": ModelShape(
        "qwen2", 48, 5120, 40, 8, 128, 13824, 152064, False,
        "huggingface.co/ozone-research/milo-1 config.json (_name_or_path Qwen/Qwen2.5-14B-Instruct); "
        f"Qwen2.5-14B's in {LLM_PROF}"),
    "Qwen/Qwen3-0.6B": ModelShape(
        "qwen3", 28, 1024, 16, 8, 128, 3072, 151936, True,
        "huggingface.co/TensorStack/TextEncoder Qwen-3-06B/config.json (a copy of Qwen/Qwen3-0.6B's)"),
    "Qwen/Qwen3-1.7B": ModelShape(
        "qwen3", 28, 2048, 16, 8, 128, 6144, 151936, True,
        "huggingface.co/Pathstudy/copath_router config.json (a Qwen3-1.7B fine-tune); "
        "huggingface.co/keras/qwen3_1.7b_en's README agrees"),
    "Qwen/Qwen3-4B": ModelShape(
        "qwen3", 36, 2560, 32, 8, 128, 9728, 151936, True,
        f"Qwen3-4B's config.json in {LLM_PROF}"),
    "Qwen/Qwen3-8B": ModelShape(
        "qwen3", 36, 4096, 32, 8, 128, 12288, 151936, False,
        f"Qwen3-8B's config.json in {LLM_PROF}; huggingface.co/thejaminator/qwen-hook-layer-9 copies it"),
}


def shape_from_config(config: Mapping, source: str) -> ModelShape:
    """The shape a config.json (as a mapping) describes."""
    architecture = config.get("model_type")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"{source}: model_type {architecture!r} is not supported; the supported ones: "
                         f"{', '.join(ARCHITECTURES)}")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = hidden // heads  # Qwen2's attention always splits hidden evenly across heads
    if architecture == "qwen3":
        head_dim = config.get("head_dim") or head_dim  # Qwen3's is its own (128 at every size)
    return ModelShape(
        architecture=architecture, layers=config["num_hidden_layers"], hidden=hidden, heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads, head_dim=head_dim,
        intermediate=config["intermediate_size"], vocab_rows=config["vocab_size"],
        tied=bool(config.get("tie_word_embeddings", False)),  # transformers' default for both
        source=source)


def _read(path: Path | str) -> ModelShape:
    return shape_from_config(json.loads(Path(path).read_text()), source=str(path))


def _cached_config(name: str) -> str | None:
    """The config.json of hub id `name` in the local Hugging Face cache, without asking the hub."""
    try:
        found = try_to_load_from_cache(name, "config.json")
    except ValueError:  # not a valid repo id (HFValidationError): a path, say
        return None
    return found if isinstance(found, str) else None  # None, or a marker that the hub has no such file


def model_shape(name_or_path: str) -> ModelShape:
    """The shape of a model folder (its config.json), of a hub id whose config.json is in the local Hugging
    Face cache, or of a row of the table (a base id finds its "-Instruct" row)."""
    config = Path(name_or_path).expanduser() / "config.json"
    if config.is_file():
        return _read(config)
    if cached := _cached_config(name_or_path):
        return _read(cached)
    for key in (name_or_path, f"{name_or_path}-Instruct"):
        if key in SHAPES:
            return SHAPES[key]
    raise ValueError(f"no shape for {name_or_path!r}: the known ids are {', '.join(SHAPES)}; "
                     "or give a model folder with config.json")


def model_config(shape: ModelShape, tokenizer: PreTrainedTokenizerBase, **overrides) -> PretrainedConfig:
    """A transformers config of `shape` (Qwen2Config or Qwen3Config) for `tokenizer`, in float32; `overrides`
    win."""
    fields = dict(
        vocab_size=shape.vocab_rows, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate, tie_word_embeddings=shape.tied,
        max_position_embeddings=32768, rope_theta=1e6,  # as the Qwen2.5 / Qwen3 checkpoints
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        dtype="float32")
    if shape.architecture == "qwen3":
        fields["head_dim"] = shape.head_dim
    return ARCHITECTURES[shape.architecture](**{**fields, **overrides})


def tiny_twin(shape: ModelShape, hidden: int = 64, layers: int = 2, heads: int = 4) -> ModelShape:
    """`shape` scaled down: the same architecture, embedding rows and tying, and as many query heads per
    key/value head as the real model has (capped at `heads`: then one key/value head). head_dim is
    hidden // heads, the MLP 4 x hidden wide."""
    if hidden % heads:
        raise ValueError(f"tiny_twin: hidden {hidden} is not a multiple of heads {heads}")
    group = max(1, shape.heads // shape.kv_heads)
    kv_heads = max(1, heads // group)
    while heads % kv_heads:  # attention needs whole groups
        kv_heads -= 1
    return replace(shape, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                   head_dim=hidden // heads, intermediate=4 * hidden, source=f"tiny twin of {shape.source}")


def build_model_folder(shape: ModelShape, tokenizer: PreTrainedTokenizerBase, folder: Path | str,
                       device: str = "cpu", seed: int = 0) -> Path:
    """A randomly initialised float32 model of `shape`, built on `device` (a GPU builds a large one fast) and
    saved with `tokenizer` in `folder`: vLLM, the KL reference and a launch's processes load it from there."""
    folder = Path(folder)
    config = model_config(shape, tokenizer)
    # The caller's CPU random state is left as it was; the weights depend on `seed` alone.
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config._name_or_path = str(folder)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    return folder
