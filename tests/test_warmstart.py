"""The warm start's own tokenization of its (prompt, action) pairs equals what TRL's SFTTrainer prepares from the
same conversational rows, for the word-level tiny tokenizer and the real Qwen tokenizers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from datasets import Dataset
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer

from hgpo_trl.actions import FORMAT_INSTRUCTIONS
from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.tiny import build_tiny_model
from hgpo_trl.warmstart import random_play, sft_dataset

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def keydoor_pairs() -> list[tuple[str, str]]:
    env = make_env("keydoor")
    episodes = random_play(env, list(make_tasks("keydoor", "train")), 3, history_length=2, max_steps=8,
                           format_instruction=FORMAT_INSTRUCTIONS["tags"])
    return [(prompt, action) for prompt, admissible, _ in episodes for action in admissible]


def trl_prepared(tokenizer, pairs, answer, tmp_path) -> Dataset:
    rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p, _ in pairs],
                              "completion": [[{"role": "assistant", "content": answer(a)}] for _, a in pairs]})
    config = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_length=None)
    model = build_tiny_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2)
    return SFTTrainer(model=model, args=config, train_dataset=rows, processing_class=tokenizer).train_dataset


@pytest.mark.parametrize("tokenizer_name",
                         ["tiny", "qwen2.5-tokenizer", pytest.param("qwen3-tokenizer", marks=pytest.mark.slow)])
@pytest.mark.parametrize("action_mode", ["plain", "tags"])
def test_sft_dataset_matches_trl(tokenizer_name, action_mode, tiny_tokenizer, tmp_path):
    if tokenizer_name == "tiny":
        tokenizer = tiny_tokenizer
    elif (SHARED / tokenizer_name).is_dir():
        tokenizer = AutoTokenizer.from_pretrained(SHARED / tokenizer_name)
    else:
        pytest.skip(f"the offline Qwen tokenizers are read from {SHARED} (../shared), absent here")
    answer = (lambda a: a) if action_mode == "plain" else (lambda a: f"<think> </think><action>{a}</action>")
    pairs = keydoor_pairs()
    ours, theirs = sft_dataset(tokenizer, pairs, answer), trl_prepared(tokenizer, pairs, answer, tmp_path)
    assert len(ours) == len(theirs) == len(pairs) > 10
    assert ours["input_ids"] == theirs["input_ids"]
    assert ours["labels"] == theirs["labels"]
    # The loss covers the answer (and the template's end of turn), never the prompt.
    completion = [t for t in ours["labels"][0] if t != -100]
    assert pairs[0][1].replace(" ", "") in tokenizer.decode(completion).replace(" ", "")  # (word-level spaces)
    assert all(t == -100 for t in ours["labels"][0][:len(ours["labels"][0]) - len(completion)])


def test_the_warm_start_runs_outside_the_launch_s_deepspeed_and_fsdp_and_restores_them(monkeypatch):
    """Inside: accelerate and transformers see no DeepSpeed (a second DeepSpeed Accelerator is refused) and no
    FSDP; after: the launch's settings, and accelerate set up afresh for the RL trainer."""
    from accelerate import PartialState
    from transformers.integrations import deepspeed

    from hgpo_trl.warmstart import data_parallel_only

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    marker = object()
    monkeypatch.setattr(deepspeed, "_hf_deepspeed_config_weak_ref", marker)
    with data_parallel_only(cpu=True):
        assert os.environ["ACCELERATE_USE_FSDP"] == os.environ["ACCELERATE_USE_DEEPSPEED"] == "false"
        assert deepspeed._hf_deepspeed_config_weak_ref is None
    assert os.environ["ACCELERATE_USE_FSDP"] == "true" and "ACCELERATE_USE_DEEPSPEED" not in os.environ
    assert deepspeed._hf_deepspeed_config_weak_ref is marker and PartialState().initialized
