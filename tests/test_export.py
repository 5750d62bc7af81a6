"""hgpo_trl.models.export: merging a LoRA adapter into a plain model folder (function, CLI, errors)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from hgpo_trl.models.export import main, merge_adapter
from hgpo_trl.models.tiny import CHAT_TEMPLATE, build_tiny_model, build_tiny_tokenizer, save_tiny

ROOT = Path(__file__).resolve().parents[1]
TEXT = "you are in the kitchen . <action> go to hall </action>"
CORPUS = ["You are in the kitchen. There is a door to the hall!", "go to hall", "take the key"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(base folder, adapter folder with a tokenizer, adapter folder without, tokenizer, adapter model)."""
    root = tmp_path_factory.mktemp("export")
    tokenizer = build_tiny_tokenizer(CORPUS)
    base = save_tiny(build_tiny_model(tokenizer), tokenizer, root / "base")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      task_type="CAUSAL_LM")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B starts at 0 (a no-op adapter): make the merge observable
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    model.eval()
    with_tokenizer, without_tokenizer = root / "adapter", root / "adapter-bare"
    model.save_pretrained(with_tokenizer)
    model.save_pretrained(without_tokenizer)
    # As TRL's trainer saves a run built in memory: the tokenizer's config has no auto_map entry.
    tokenizer.save_pretrained(with_tokenizer)
    return base, with_tokenizer, without_tokenizer, tokenizer, model


def logits(model, tokenizer, text=TEXT):
    with torch.no_grad():
        return model(**tokenizer(text, return_tensors="pt")).logits


def assert_merged(folder, run):
    base, _, _, tokenizer, adapter_model = run
    merged = AutoModelForCausalLM.from_pretrained(folder)
    loaded = AutoTokenizer.from_pretrained(folder)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert loaded.encode(TEXT) == tokenizer.encode(TEXT)
    assert loaded.decode(loaded.encode(TEXT)) == TEXT
    assert loaded.chat_template == CHAT_TEMPLATE
    chat = [{"role": "user", "content": "go to hall"}]
    assert loaded.apply_chat_template(chat, tokenize=False) == tokenizer.apply_chat_template(chat, tokenize=False)
    expected = logits(adapter_model, tokenizer)
    got = logits(merged, loaded)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    plain = logits(AutoModelForCausalLM.from_pretrained(base), tokenizer)
    assert (plain - expected).abs().max() > 1e-2  # the adapter matters, so the check above can fail


def test_merge_matches_adapter_model_and_keeps_tokenizer(tmp_path, run):
    _, adapter, _, _, _ = run
    out = merge_adapter(adapter, tmp_path / "merged")
    assert out == tmp_path / "merged"
    assert (out / "config.json").is_file() and (out / "chat_template.jinja").is_file()
    assert not (out / "adapter_config.json").exists()
    # The adapter's tokenizer had no auto_map: the merged folder gets it, or qwen2's tokenizer class would
    # rebuild a byte-level BPE from the word-level vocabulary.
    assert json.loads((out / "tokenizer_config.json").read_text())["auto_map"]
    assert_merged(out, run)


@pytest.mark.slow
def test_cli_takes_tokenizer_from_base_and_an_explicit_base_model(tmp_path, run):
    base, _, bare, _, _ = run
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "hgpo_trl.models.export", str(bare), str(tmp_path / "merged"),
                             "--base-model", str(base)], capture_output=True, text=True, env=env, cwd=ROOT,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert str(tmp_path / "merged") in result.stdout
    # Copied verbatim from the base folder, which save_tiny wrote.
    assert (tmp_path / "merged" / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    assert_merged(tmp_path / "merged", run)


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope does not exist: pass the output_dir of a LoRA run"):
        merge_adapter(tmp_path / "nope", tmp_path / "out")


def test_folder_without_adapter_config(tmp_path, run):
    base, _, _, _, _ = run
    with pytest.raises(ValueError, match=r"holds no adapter_config.json \(it holds a full model"):
        merge_adapter(base, tmp_path / "out")
    (tmp_path / "run" / "checkpoint-5").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint-5" / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds no adapter_config.json: .*adapters found in: .*checkpoint-5"):
        merge_adapter(tmp_path / "run", tmp_path / "out")


def test_base_model_not_found(tmp_path, run, capsys):
    _, adapter, _, _, _ = run
    moved = tmp_path / "adapter"
    moved.mkdir()
    config = json.loads((adapter / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "/gone/tiny"}))
    with pytest.raises(FileNotFoundError, match=r"names base model '/gone/tiny', but /gone/tiny is not a folder: "
                                                r"pass .* --base-model"):
        merge_adapter(moved, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"base model 'no-such-org/no-such-model', which cannot be "
                                                r"loaded .*--base-model"):
        merge_adapter(adapter, tmp_path / "out", base_model="no-such-org/no-such-model")
    (moved / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    assert main([str(moved), str(tmp_path / "out")]) == 2
    assert "does not name its base model" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_output_folder_must_not_be_an_input(run):
    _, adapter, _, _, _ = run
    with pytest.raises(ValueError, match=r"is the adapter folder: pick a new folder"):
        merge_adapter(adapter, adapter)
