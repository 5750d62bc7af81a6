"""hgpo_trl/rehearsal/shapes.py: each row of the table counts the parameters transformers builds (on the meta
device: a 14B model allocates nothing), the published totals agree, model_shape finds a shape where a run
names it, and a tiny twin saved to a folder loads offline with the real embedding rows."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hgpo_trl.rehearsal.shapes import SHAPES, build_model_folder, model_config, model_shape, tiny_twin

QWEN25 = Path(__file__).resolve().parents[2] / "shared" / "data" / "qwen2.5-tokenizer"
needs_tokenizer = pytest.mark.skipif(not QWEN25.is_dir(),
                                     reason=f"the offline Qwen2.5 tokenizer is read from {QWEN25}")
# "Number of Parameters" on the model cards (truncated, not rounded: 7.616B reads 7.61B).
PUBLISHED = {"Qwen/Qwen2.5-0.5B-Instruct": 0.49e9, "Qwen/Qwen2.5-1.5B-Instruct": 1.54e9,
             "Qwen/Qwen2.5-3B-Instruct": 3.09e9, "Qwen/Qwen2.5-7B-Instruct": 7.61e9,
             "Qwen/Qwen2.5-14B-Instruct": 14.7e9, "Qwen/Qwen3-8B": 8.2e9}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(QWEN25)


@needs_tokenizer
@pytest.mark.parametrize("name", SHAPES)
def test_the_count_is_the_one_transformers_builds(name, tokenizer):
    shape = SHAPES[name]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(shape, tokenizer))
    assert type(model).__name__ == f"{shape.architecture.capitalize()}ForCausalLM"
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert model.get_input_embeddings().weight.shape == (shape.vocab_rows, shape.hidden)
    assert model.config.tie_word_embeddings == shape.tied and shape.source


@pytest.mark.parametrize("name", PUBLISHED)
def test_the_published_totals(name):
    assert SHAPES[name].parameters == pytest.approx(PUBLISHED[name], rel=0.01)


def test_a_folder_with_a_config_json(tmp_path):
    config = {"model_type": "qwen3", "num_hidden_layers": 3, "hidden_size": 48, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96, "vocab_size": 1000,
              "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = model_shape(str(tmp_path))
    assert (shape.architecture, shape.layers, shape.hidden) == ("qwen3", 3, 48)
    assert (shape.heads, shape.kv_heads) == (4, 2)
    assert (shape.head_dim, shape.intermediate, shape.vocab_rows, shape.tied) == (32, 96, 1000, True)
    assert shape.source == str(tmp_path / "config.json")


def test_the_table_with_and_without_instruct():
    assert model_shape("Qwen/Qwen2.5-1.5B-Instruct") is SHAPES["Qwen/Qwen2.5-1.5B-Instruct"]
    assert model_shape("Qwen/Qwen2.5-1.5B") is SHAPES["Qwen/Qwen2.5-1.5B-Instruct"]
    assert model_shape("Qwen/Qwen3-4B") is SHAPES["Qwen/Qwen3-4B"]


def test_an_unknown_id_names_the_known_ones():
    with pytest.raises(ValueError, match="Qwen/Qwen2.5-7B-Instruct.*model folder with config.json"):
        model_shape("nobody/no-such-model")


def test_an_unsupported_model_type_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match="'llama'.*qwen2, qwen3"):
        model_shape(str(tmp_path))


def test_a_tiny_twin_keeps_what_the_code_paths_see():
    for shape in SHAPES.values():
        twin = tiny_twin(shape)
        assert twin.architecture == shape.architecture
        assert (twin.vocab_rows, twin.tied) == (shape.vocab_rows, shape.tied)
        assert (twin.hidden, twin.layers, twin.heads, twin.head_dim, twin.intermediate) == (64, 2, 4, 16, 256)
        assert twin.heads % twin.kv_heads == 0 and twin.source == f"tiny twin of {shape.source}"
    assert tiny_twin(SHAPES["Qwen/Qwen3-0.6B"]).kv_heads == 2  # 2 query heads per key/value head, as real
    assert tiny_twin(SHAPES["Qwen/Qwen2.5-7B-Instruct"]).kv_heads == 1  # 7 per group: one group of 4
    assert tiny_twin(replace(SHAPES["Qwen/Qwen3-8B"], kv_heads=32), heads=4).kv_heads == 4  # no grouping
    with pytest.raises(ValueError, match="multiple of heads"):
        tiny_twin(SHAPES["Qwen/Qwen3-8B"], hidden=30)


@needs_tokenizer
def test_the_saved_model_loads_offline_with_the_real_rows(tmp_path, tokenizer):
    twin = tiny_twin(SHAPES["Qwen/Qwen2.5-0.5B-Instruct"], hidden=32)
    folder = build_model_folder(twin, tokenizer, tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    assert model.get_input_embeddings().weight.shape == (151936, 32) and model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == twin.parameters
    assert (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()
    again = build_model_folder(twin, tokenizer, tmp_path / "again")  # the seed alone decides the weights
    weights = AutoModelForCausalLM.from_pretrained(again, local_files_only=True).get_input_embeddings().weight
    assert torch.equal(weights, model.get_input_embeddings().weight)
