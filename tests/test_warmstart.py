"""The warm start's own tokenization of its (prompt, action) pairs equals what TRL's SFTTrainer prepares from the
same conversational rows, for the word-level tiny tokenizer and the real Qwen tokenizers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from datasets import Dataset
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer

from hgpo_trl.envs import KeyDoorEnv, keydoor_tasks, make_env, make_tasks, register_env
from hgpo_trl.models.tiny import build_tiny_model, make_tiny
from hgpo_trl.models.warmstart import random_play, sft_dataset, warm_start
from hgpo_trl.rollout.actions import FORMAT_INSTRUCTIONS

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

    from hgpo_trl.models.warmstart import data_parallel_only

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    marker = object()
    monkeypatch.setattr(deepspeed, "_hf_deepspeed_config_weak_ref", marker)
    with data_parallel_only():
        assert os.environ["ACCELERATE_USE_FSDP"] == os.environ["ACCELERATE_USE_DEEPSPEED"] == "false"
        assert deepspeed._hf_deepspeed_config_weak_ref is None
    assert os.environ["ACCELERATE_USE_FSDP"] == "true" and "ACCELERATE_USE_DEEPSPEED" not in os.environ
    assert deepspeed._hf_deepspeed_config_weak_ref is marker and PartialState().initialized


@pytest.mark.parametrize("before", [None, True, False], ids=["not set up", "CPU", "accelerator"])
def test_the_warm_start_leaves_accelerate_s_device_as_it_found_it(before):
    """A warm start on the CPU (use_cpu=True) left accelerate's process-wide state set up for the CPU, and a trainer
    built after it with use_cpu=False inherited the CPU: a GPU notebook that copied the README trained there. On
    this machine the state object says it (its cpu flag), not a GPU."""
    from accelerate.state import AcceleratorState, PartialState

    from hgpo_trl.models.warmstart import data_parallel_only

    saved = dict(PartialState._shared_state), dict(AcceleratorState._shared_state)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        if before is not None:
            PartialState(cpu=before)
        with data_parallel_only():
            pass
        assert PartialState._shared_state.get("_cpu") is before  # None: not set up, as before
        PartialState(cpu=False)  # what the trainer after it asks for (no GPU here: the flag is the check)
        assert PartialState()._cpu is (before or False)
    finally:
        for state, kept in zip((PartialState._shared_state, AcceleratorState._shared_state), saved, strict=True):
            state.clear()
            state.update(kept)


def test_the_warm_start_follows_the_machine_as_the_trainer_does():
    """The default is TrainingArguments' (HGPOConfig's): the accelerator where one is visible, else the CPU."""
    import inspect

    from hgpo_trl.config import HGPOConfig

    default = inspect.signature(warm_start).parameters["use_cpu"].default
    assert default == HGPOConfig.__dataclass_fields__["use_cpu"].default is False


class FlakyKeyDoor(KeyDoorEnv):
    """Keydoor that raises on turn 3 of every other episode (`always`: of every episode)."""

    def __init__(self, always: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.always, self.episodes = always, 0

    def reset(self, task):
        self.episodes += 1
        self.turn = 0
        return super().reset(task)

    def step(self, action):
        self.turn += 1
        if self.turn == 3 and (self.always or self.episodes % 2 == 0):
            raise RuntimeError("injected: the game engine crashed")
        return super().step(action)


def test_a_fault_ends_a_random_episode_as_in_training_and_the_tiny_model_and_warm_start_build(monkeypatch):
    """make_tiny's tokenizer and the warm start play random episodes: an environment that raises in some episodes
    ends those (their steps dropped, as a training rollout drops a faulted episode's), it does not stop the run."""
    import hgpo_trl.envs.registry as registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register_env("flaky_keydoor", FlakyKeyDoor, keydoor_tasks, fast=True)
    tasks = list(make_tasks("keydoor", "train", num_tasks=6))
    episodes = random_play(FlakyKeyDoor(max_steps=6), tasks, 6, history_length=2, max_steps=6)
    turns = [len(e) for e in random_play(KeyDoorEnv(max_steps=6), tasks, 6, history_length=2, max_steps=6)]
    assert 0 < len(episodes) < sum(turns)  # the faulted episodes' steps are gone, the others kept
    model, tokenizer = make_tiny("flaky_keydoor", tasks, hidden_size=16, num_layers=1, num_heads=2)
    metrics = warm_start(model, tokenizer, FlakyKeyDoor, tasks, steps=1, batch_size=4, max_steps=6)
    assert metrics["warmstart_examples"] >= 4


def test_an_environment_that_always_fails_stops_train_py_in_one_line_before_training(tmp_path, monkeypatch, capsys):
    import hgpo_trl.envs.registry as registry
    from hgpo_trl.commands.train import main

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register_env("broken_keydoor", lambda **kw: FlakyKeyDoor(always=True, **kw), keydoor_tasks, fast=True)
    with pytest.raises(SystemExit) as stop:
        main(["--config", "configs/quickstart.yaml", "--env_name", "broken_keydoor", "--output_dir",
              str(tmp_path / "out"), "--warmstart_steps", "1"])
    assert stop.value.code == 1
    message = capsys.readouterr().err.strip().splitlines()
    assert len(message) == 1 and "tiny tokenizer: random episodes: the environment failed in" in message[0]
    assert "RuntimeError: injected: the game engine crashed" in message[0]


def test_the_warm_start_s_plays_draw_from_one_stream_not_seed_plus_k(monkeypatch, tiny_model, tiny_tokenizer):
    """A warm start that needs several plays drew the k-th from seed + k: seed 0's second play was seed 1's
    first. Each play now continues the first one's generator."""
    import hgpo_trl.models.warmstart as warmstart_module

    seeds = []
    play = warmstart_module.random_play

    def one_episode_a_call(env, tasks, episodes, **kwargs):
        seeds.append(kwargs["seed"])
        return play(env, tasks, 1, **kwargs)

    monkeypatch.setattr(warmstart_module, "random_play", one_episode_a_call)
    tasks = list(make_tasks("keydoor", "train", num_tasks=4))
    warm_start(tiny_model, tiny_tokenizer, KeyDoorEnv, tasks, steps=1, batch_size=24, max_steps=6)
    assert len(seeds) > 1 and all(s is seeds[0] for s in seeds)  # one generator (the first call as random(0))
