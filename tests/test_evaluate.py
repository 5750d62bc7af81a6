"""hgpo-eval / evaluate.py: results per split, seed and task type; reference players; model paths; errors."""

import copy
import json
import os
import re
import subprocess
import sys
from importlib.machinery import ModuleSpec
from importlib.util import find_spec
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from hgpo_trl.commands import entry_points, evaluate, players
from hgpo_trl.envs import KeyDoorEnv, keydoor_tasks, make_tasks, register_env
from hgpo_trl.envs.alfworld import TASK_TYPES
from hgpo_trl.models.tiny import build_tiny_model, save_tiny
from tests.test_cli import sections_of

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("ALFWORLD_DATA") or ROOT.parent / "shared" / "data" / "alfworld")
needs_alfworld = pytest.mark.skipif(not DATA.is_dir() or find_spec("alfworld") is None,
                                    reason=f"needs the alfworld package and ALFWorld data at {DATA}")

# The tiny model on a few keydoor tasks: each evaluation takes a second or two.
KEYDOOR = """env_name: keydoor
task_kwargs: {"num_rooms": 3, "num_colors": 3}
action_mode: plain
max_env_steps: 4
max_completion_length: 4
num_eval_tasks: 3
tiny_hidden_size: 32
tiny_num_layers: 1
tiny_num_heads: 2
"""


def config(tmp_path, text, model="tiny"):
    path = tmp_path / "eval.yaml"
    path.write_text(f"model_name_or_path: {model}\noutput_dir: {tmp_path}/run\nreport_to: none\nuse_cpu: true\n"
                    f"disable_tqdm: true\n{text}")
    return str(path)


def evaluation(tmp_path, *argv, text=KEYDOOR, model="tiny", out="eval"):
    """Run hgpo-eval in this process; (report, Markdown table) from its output folder."""
    evaluate.main(["--config", config(tmp_path, text, model), "--eval_output_dir", str(tmp_path / out), *argv])
    return (json.loads((tmp_path / out / "evaluation.json").read_text()),
            (tmp_path / out / "evaluation.md").read_text())


def test_tiny_model_on_keydoor_writes_json_and_markdown_per_seed(tmp_path, capsys):
    report, table = evaluation(tmp_path, "--seeds", "1", "2")
    assert {k: report[k] for k in ("env", "model", "backend", "temperature", "seeds", "max_env_steps")} == {
        "env": "keydoor", "model": "tiny", "backend": "transformers", "temperature": 0.4, "seeds": [1, 2],
        "max_env_steps": 4}
    [result] = report["results"]
    assert {k: result[k] for k in ("policy", "split", "label", "tasks")} == {
        "policy": "model", "split": "valid", "label": None, "tasks": 3}
    rates = [row["success_rate"] for row in result["seeds"]]
    assert [row["seed"] for row in result["seeds"]] == [1, 2]
    assert result["success_rate"] == pytest.approx({"mean": sum(rates) / 2, "std": abs(rates[0] - rates[1]) / 2})
    for row in result["seeds"]:
        assert set(row) == {"seed", "success_rate", "episode_length", "invalid_rate", "faulted"}
        assert 1 <= row["episode_length"] <= 4 and 0 <= row["invalid_rate"] <= 1 and row["faulted"] == 0
    assert "task_types" not in result and "score" not in result  # keydoor tasks have no type, no score
    lines = table.splitlines()
    assert "| policy | split | seed | tasks | success |" in lines
    assert [line.split(" | ")[2] for line in lines if line.startswith("| model")] == ["1", "2", "mean ± std"]
    assert "model on valid: success" in capsys.readouterr().out


def test_a_seed_gives_the_same_games_and_another_seed_others(tmp_path):
    """The same seed twice: the same model outputs and random moves; another seed: other outputs."""
    sampled = KEYDOOR + "eval_temperature: 1.0\ntrajectory_dump_every: 1\n"
    runs = {name: evaluation(tmp_path, "--policy", "model", "random", "--seeds", seed, text=sampled, out=name)[0]
            for name, seed in (("first", "5"), ("again", "5"), ("other", "6"))}
    dumps = {name: {policy: (tmp_path / name / "trajectories" / f"{policy}_valid_seed{seed}.jsonl").read_text()
                    for policy in ("model", "random")}
             for name, seed in (("first", 5), ("again", 5), ("other", 6))}
    assert dumps["first"] == dumps["again"] and runs["first"]["results"] == runs["again"]["results"]
    assert dumps["first"]["model"] != dumps["other"]["model"]


def test_random_player_on_keydoor_plays_only_admissible_actions(tmp_path):
    report, table = evaluation(tmp_path, "--policy", "random", "--seeds", "1", "2", "--num_eval_tasks", "20")
    assert report["model"] is None and report["backend"] is None  # no model was loaded
    [result] = report["results"]
    assert result["policy"] == "random" and result["tasks"] == 11  # every validation task of the 3x3 pools
    # Every keydoor episode of admissible actions ends at the door on step 4; a random door is right 1 time in 4.
    assert all(row["invalid_rate"] == 0 and row["episode_length"] == 4 for row in result["seeds"])
    assert 0 < result["success_rate"]["mean"] < 0.6
    assert "| random | valid | mean ± std | 11 |" in table


def test_episodes_per_seed_cycles_through_every_task_of_the_split(tmp_path):
    """As the released evaluation plays 4 x 128 episodes per seed: every task of the split (num_eval_tasks is not
    read), cycled to the count."""
    report, _ = evaluation(tmp_path, "--policy", "random", "--seeds", "1", "--episodes_per_seed", "25")
    [result] = report["results"]
    assert result["tasks"] == 25  # the 11 validation tasks of the 3x3 pools, 2 full passes and 3 more
    with pytest.raises(SystemExit):
        evaluation(tmp_path, "--policy", "random", "--episodes_per_seed", "0", out="bad")


@pytest.mark.slow
@needs_alfworld
def test_random_player_on_real_alfworld_games_per_task_type(tmp_path):
    text = f"""env_name: alfworld
env_kwargs: {{"data_path": "{DATA}", "cache_dir": "{tmp_path / 'cache'}"}}
task_kwargs: {{"data_path": "{DATA}", "seed": 0}}
env_workers: 0
num_eval_tasks: 2
max_env_steps: 3
"""
    report, table = evaluation(tmp_path, "--policy", "random", "--seeds", "1", text=text)
    results = {r["split"]: r for r in report["results"]}
    assert list(results) == ["valid_seen", "valid_unseen"]  # the paper's two ALFWorld evaluations
    assert results["valid_seen"]["label"] == "in-distribution"
    assert results["valid_unseen"]["label"] == "out-of-distribution"
    for split, result in results.items():
        types = make_tasks("alfworld", split, data_path=DATA, seed=0, num_tasks=2)["task_type"]
        assert set(result["task_types"]) == set(types) and set(types) <= set(TASK_TYPES)
        assert sum(t["tasks"] for t in result["task_types"].values()) == 2
        assert set(result["seeds"][0]["task_types"]) == set(types)
        [row] = result["seeds"]
        assert row["episode_length"] == 3 and row["invalid_rate"] == 0 and row["faulted"] == 0
    header = next(line for line in table.splitlines() if line.startswith("| policy"))
    assert all(t in header for r in results.values() for t in r["task_types"])
    assert "valid_unseen (out-of-distribution)" in table


@pytest.mark.slow
@needs_alfworld
def test_expert_player_wins_real_alfworld_games(tmp_path):
    """ALFWorld's handcoded expert, through the rollout: it wins the first two valid_unseen games
    (look_at_obj_in_light), in 12 steps each."""
    text = f"""env_name: alfworld
env_kwargs: {{"data_path": "{DATA}", "cache_dir": "{tmp_path / 'cache'}"}}
task_kwargs: {{"data_path": "{DATA}"}}
env_workers: 0
num_eval_tasks: 2
max_env_steps: 50
"""
    report, _ = evaluation(tmp_path, "--policy", "expert", "--seeds", "123", "--splits", "valid_unseen", text=text)
    [result] = report["results"]
    assert result["success_rate"] == {"mean": 1.0, "std": 0.0}
    assert result["task_types"] == {"look_at_obj_in_light": {"tasks": 2, "mean": 1.0, "std": 0.0}}
    assert result["seeds"][0]["episode_length"] < 20 and result["seeds"][0]["invalid_rate"] == 0


def test_lora_adapter_folder_is_merged_and_evaluated(tmp_path, tiny_tokenizer):
    base = save_tiny(build_tiny_model(tiny_tokenizer, hidden_size=32, num_layers=1, num_heads=2), tiny_tokenizer,
                     tmp_path / "base")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora)
    with torch.no_grad():  # B starts at 0 (a no-op adapter): make it matter
        for name, param in adapter.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    adapter.save_pretrained(tmp_path / "adapter")
    tiny_tokenizer.save_pretrained(tmp_path / "adapter")  # as TRL saves a LoRA run
    report, _ = evaluation(tmp_path, "--seeds", "1", model=tmp_path / "adapter")
    assert report["model"] == str(tmp_path / "adapter") and report["results"][0]["tasks"] == 3

    args = evaluate.prepare(["--config", config(tmp_path, KEYDOOR, tmp_path / "adapter")])
    model, tokenizer = players.load_model(args.model_args, args.env_args, args.args)
    ids = torch.tensor([tiny_tokenizer.encode("you are in the hall . go to vault")])
    assert tokenizer.encode("go to vault") == tiny_tokenizer.encode("go to vault")
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)


def test_a_checkpoint_saved_by_a_run_keeps_its_word_level_tokenizer(tmp_path, tiny_tokenizer):
    """A run saves the tiny tokenizer without save_tiny's auto_map: AutoTokenizer would read it as Qwen2's BPE."""
    folder = tmp_path / "checkpoint-2"
    build_tiny_model(tiny_tokenizer, hidden_size=32, num_layers=1, num_heads=2).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    text = "You are in the hall. go to vault"
    assert players.load_tokenizer(str(folder)).encode(text) == tiny_tokenizer.encode(text)


ERRORS = [
    pytest.param(["--model_name_or_path", "{tmp}/run/checkpoint-5"], "model_name_or_path: .*checkpoint-5 does not exist",
                 id="missing-checkpoint"),
    pytest.param(["--model_name_or_path", "{tmp}"], r"holds no model \(config.json\) and no LoRA adapter",
                 id="folder-without-model"),
    pytest.param(["--env_name", "minecraft"], "unknown environment 'minecraft'", id="unknown-env"),
    pytest.param(["--splits", "valid_seen"], "environment 'keydoor' has no split 'valid_seen'", id="missing-split"),
    pytest.param(["--policy", "expert"], "environment 'keydoor' has no scripted expert", id="no-expert"),
    pytest.param(["--policy", "smart"], "policy must be one or more of", id="unknown-policy"),
    pytest.param(["--seeds", "1", "1"], "seeds must be one or more distinct integers", id="repeated-seed"),
]


@pytest.mark.parametrize(("argv", "message"), ERRORS)
def test_bad_input_is_one_line_and_exit_code_2_before_any_model_loads(tmp_path, capsys, monkeypatch, argv, message):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(evaluate, "model_policy", no_model)
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(["--config", config(tmp_path, KEYDOOR), *[a.format(tmp=tmp_path) for a in argv]])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("evaluate.py: configuration error: ")
    assert re.search(message, err), err


@pytest.mark.slow
def test_evaluate_py_at_the_repository_root(tmp_path):
    """The command a user types: the random player needs no model, and bad input exits with code 2."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(ROOT / "evaluate.py"), "--config", config(tmp_path, KEYDOOR), "--policy", "random",
               "--eval_output_dir", str(tmp_path / "eval")]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "random on valid: success" in result.stdout and (tmp_path / "eval" / "evaluation.md").is_file()
    bad = subprocess.run([*command, "--splits", "train", "nope"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "has no split 'nope'" in bad.stderr


def test_use_vllm_on_a_gpu_generates_through_vllm(tmp_path, tiny_model_path, monkeypatch):
    """No GPU here: a stand-in for vLLM records what the evaluation asks of it (the real one runs on GPU machines)."""
    calls = {"prompts": [], "params": []}

    class LLM:
        def __init__(self, **options):
            calls["options"] = options

        def generate(self, prompts, params, use_tqdm):
            calls["prompts"] += prompts
            calls["params"] += params
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[3, 2])]) for _ in prompts]  # <unk>, <|im_end|>

    vllm = ModuleType("vllm")
    vllm.__spec__ = ModuleSpec("vllm", None)  # what HGPOConfig's check of the extra finds
    vllm.LLM, vllm.SamplingParams = LLM, dict
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    report, _ = evaluation(tmp_path, "--seeds", "1", "--use_vllm", "true", model=tiny_model_path)
    assert report["backend"] == "vllm"
    assert calls["options"]["model"] == tiny_model_path and calls["options"]["skip_tokenizer_init"]
    assert all(set(prompt) == {"prompt_token_ids"} for prompt in calls["prompts"])
    assert {(p["temperature"], p["max_tokens"], tuple(p["stop_token_ids"])) for p in calls["params"]} == {(0.4, 4, (2,))}
    assert len({p["seed"] for p in calls["params"]}) == len(calls["params"])  # each request its own seed


def test_random_player_on_the_generated_webshop_reports_score_and_success(tmp_path):
    shop = "env_name: webshop\naction_mode: plain\nmax_env_steps: 6\nnum_eval_tasks: 4\n"
    report, table = evaluation(tmp_path, "--policy", "random", "--seeds", "1", "2", text=shop)
    [result] = report["results"]
    assert result["split"] == "test" and result["tasks"] == 4  # the goals WebShop's baselines report on
    for row in result["seeds"]:
        assert 0 <= row["success_rate"] <= row["score"] <= 1  # a success is a purchase scored 1
    assert set(result["score"]) == {"mean", "std"} and "| random | test |" in table


def test_hgpo_eval_plays_the_same_games_as_the_trainers_evaluation(tmp_path, tiny_model_path, tiny_tokenizer):
    """Greedy, same model and tasks: hgpo-eval's prompts and raw outputs are the trainer's, step for step."""
    from transformers import AutoModelForCausalLM

    from hgpo_trl.config import HGPOConfig
    from hgpo_trl.evaluation.trajectories import read_records
    from hgpo_trl.trainer import HGPOTrainer

    # Outputs stay invalid but episodes go on ("noop"): every step of the 4 compares a free-text output.
    settings = {"action_mode": "plain", "max_env_steps": 4, "max_completion_length": 4, "invalid_action": "noop",
                "admissible_only": False, "trajectory_dump_every": 1}
    text = KEYDOOR + "".join(f"{k}: {str(v).lower()}\n" for k, v in settings.items())
    evaluation(tmp_path, "--greedy", "--seeds", "1", model=tiny_model_path, text=text)
    ours = read_records(tmp_path / "eval" / "trajectories" / "model_valid_seed1.jsonl")

    tasks = make_tasks("keydoor", "valid", num_rooms=3, num_colors=3).select(range(3))
    args = HGPOConfig(output_dir=str(tmp_path / "trainer"), report_to="none", use_cpu=True, disable_tqdm=True,
                      eval_temperature=0.0, per_device_train_batch_size=8, num_generations=2, **settings)
    trainer = HGPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_path), args=args,
                          processing_class=tiny_tokenizer, train_dataset=tasks, eval_dataset=tasks)
    metrics = trainer.evaluate()
    [dump] = (tmp_path / "trainer" / "trajectories").glob("eval_*.jsonl")
    theirs = read_records(dump)
    key = lambda r: (json.dumps(r["task"], sort_keys=True), r["step"])  # noqa: E731
    assert len(ours) == len(theirs) == 3 * 4
    assert [(r["prompt"], r["output"]) for r in sorted(ours, key=key)] == \
           [(r["prompt"], r["output"]) for r in sorted(theirs, key=key)]
    assert metrics["eval_success_rate"] == 0.0 == json.loads(
        (tmp_path / "eval" / "evaluation.json").read_text())["results"][0]["success_rate"]["mean"]


class GradedFlakyKeyDoor(KeyDoorEnv):
    """Keydoor that grades every step 0.5 and fails on the first step of every odd-numbered task: those episodes
    are faulted and unscored."""

    def step(self, action):
        if self._task_id % 2:
            raise RuntimeError("injected: the game engine crashed")
        observation, reward, terminated, truncated, info = super().step(action)
        return observation, reward, terminated, truncated, {**info, "score": 0.5}


def test_the_same_games_give_the_same_success_score_and_faults_in_every_report(tmp_path, tiny_model_path,
                                                                                tiny_tokenizer, monkeypatch):
    """One definition (hgpo_trl.rollout.outcomes): success = won / played, score = the mean over every episode with a
    faulted (unscored) one counted 0, the faulted counted apart. The trainer's evaluate(), hgpo-eval,
    evaluate_model and both dumps' summaries agree on games where one episode of three faults; a training
    iteration's env/ metrics and its dump's summary agree too."""
    import hgpo_trl.envs.registry as registry
    from hgpo_trl.commands.evaluate import evaluate_model
    from hgpo_trl.config import HGPOConfig
    from hgpo_trl.evaluation.trajectories import read_records, show_episode, summarize
    from hgpo_trl.trainer import HGPOTrainer

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register_env("graded_flaky_keydoor", GradedFlakyKeyDoor, keydoor_tasks, fast=True)
    settings = {"env_name": "graded_flaky_keydoor", "action_mode": "plain", "max_env_steps": 4,
                "max_completion_length": 4, "trajectory_dump_every": 1}
    text = KEYDOOR.replace("env_name: keydoor\n", "") + "".join(f"{k}: {v}\n" for k, v in settings.items())
    report, _ = evaluation(tmp_path, "--greedy", "--seeds", "1", model=tiny_model_path, text=text)
    in_memory = evaluate_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), config(tmp_path, text),
                               tokenizer=tiny_tokenizer, greedy=True, seeds=[1], eval_output_dir=str(tmp_path / "m"))

    tasks = make_tasks("graded_flaky_keydoor", "valid", num_rooms=3, num_colors=3).select(range(3))
    args = HGPOConfig(output_dir=str(tmp_path / "trainer"), report_to="none", use_cpu=True, disable_tqdm=True,
                      eval_temperature=0.0, per_device_train_batch_size=8, num_generations=2, train_iterations=1,
                      save_strategy="no", **settings)
    [faulty] = [i for i, task_id in enumerate(tasks["task_id"]) if task_id % 2]  # one task of the three
    steady = next(i for i in range(3) if i != faulty)  # an iteration plays 2 tasks twice: 2 episodes of 4 fault
    trainer = HGPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_path), args=args,
                          processing_class=tiny_tokenizer, train_dataset=tasks.select([steady, faulty]),
                          eval_dataset=tasks)
    metrics = trainer.evaluate()  # (before training: the model hgpo-eval played)
    [dump] = (tmp_path / "trainer" / "trajectories").glob("eval_*.jsonl")
    trainer.train()
    [log] = [h for h in trainer.state.log_history if "env/score" in h]
    [iteration_dump] = (tmp_path / "trainer" / "trajectories").glob("iter_*.jsonl")

    def numbers(source, prefix=""):
        return {k: source[prefix + k] for k in ("success_rate", "score", "faulted")}

    [row] = report["results"][0]["seeds"]
    assert numbers(row)["score"] == pytest.approx(0.5 * 2 / 3) and row["faulted"] == 1
    assert numbers(row) == numbers(in_memory.report["results"][0]["seeds"][0]) == numbers(metrics, "eval_") == \
        numbers(summarize(read_records(dump))) == \
        numbers(summarize(read_records(tmp_path / "eval" / "trajectories" / "model_valid_seed1.jsonl")))
    records = read_records(dump)
    [outcome] = [r for r in records if r["episode_fault"]]  # the faulted episode: its outcome, no step
    assert outcome["step"] is None and "injected" in show_episode(records, outcome["episode"]).splitlines()[0]
    played = summarize(read_records(iteration_dump))
    assert log["env/faults"] == played["faulted"] > 0 and log["env/success_rate"] == played["success_rate"]
    assert log["env/score"] == pytest.approx(played["score"]) == pytest.approx(0.5 * 2 / 4)  # 2 of 4 episodes faulted


def test_results_go_beside_the_evaluated_model_and_never_over_an_earlier_one(tmp_path, tiny_model_path, capsys):
    import shutil

    model = tmp_path / "run" / "checkpoint-7"
    shutil.copytree(tiny_model_path, model)
    command = ["--config", config(tmp_path, KEYDOOR, str(model)), "--seeds", "1"]
    evaluate.main(command)
    first = json.loads((model / "evaluation" / "evaluation.json").read_text())
    evaluate.main([*command, "--greedy"])
    assert f"{model / 'evaluation'} already holds an evaluation; writing this one to {model / 'evaluation-1'}" in \
        capsys.readouterr().out
    assert json.loads((model / "evaluation" / "evaluation.json").read_text()) == first  # untouched
    assert json.loads((model / "evaluation-1" / "evaluation.json").read_text())["temperature"] == 0.0
    # Reference players alone go to the config's output_dir; a model is not needed.
    evaluate.main(["--config", config(tmp_path, KEYDOOR), "--seeds", "1", "--policy", "random"])
    assert (tmp_path / "run" / "evaluation" / "evaluation.json").is_file()


def test_evaluate_model_takes_a_folder_or_the_same_model_in_memory_and_returns_the_result(tmp_path, tiny_tokenizer):
    """From Python: a folder, the same weights in memory (a PEFT model too), with a YAML file or an HGPOConfig,
    play the same games for the same seed, and the result is what evaluation.json holds."""
    from hgpo_trl.commands.evaluate import EvaluationResult, evaluate_model
    from hgpo_trl.config import HGPOConfig

    model = build_tiny_model(tiny_tokenizer, hidden_size=32, num_layers=1, num_heads=2)
    folder = save_tiny(model, tiny_tokenizer, tmp_path / "model")
    yaml_file = config(tmp_path, KEYDOOR)
    from_folder = evaluate_model(str(folder), yaml_file, seeds=[3], eval_output_dir=str(tmp_path / "folder"))
    assert isinstance(from_folder, EvaluationResult) and from_folder.output_dir == tmp_path / "folder"
    assert from_folder.report == json.loads((tmp_path / "folder" / "evaluation.json").read_text())
    assert from_folder.report["model"] == str(folder)
    assert from_folder.success_rate() == from_folder.success_rate("valid") == \
        from_folder.report["results"][0]["success_rate"]["mean"]
    with pytest.raises(KeyError, match=r"no result of policy 'random'"):
        from_folder.success_rate(policy="random")

    model.train()
    in_memory = evaluate_model(model, yaml_file, tokenizer=tiny_tokenizer, seeds=[3])
    assert model.training  # evaluated in eval mode, handed back as it came
    assert in_memory.report["results"] == from_folder.report["results"]
    assert in_memory.report["model"] == "in memory (Qwen2ForCausalLM)"
    assert in_memory.output_dir == tmp_path / "run" / "evaluation"  # the config's output_dir, not a model folder

    args = HGPOConfig(output_dir=str(tmp_path / "run"), env_name="keydoor", action_mode="plain", max_env_steps=4,
                      max_completion_length=4, use_cpu=True, report_to="none", disable_tqdm=True)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    with_config = evaluate_model(lora, args, tokenizer=tiny_tokenizer, seeds=[3], num_eval_tasks=3,
                                 task_kwargs={"num_rooms": 3, "num_colors": 3})
    assert with_config.output_dir == tmp_path / "run" / "evaluation-1"  # the one before is kept
    assert with_config.report["results"] == from_folder.report["results"]  # a new adapter (B = 0) is the base


def test_evaluate_model_leaves_the_callers_model_tokenizer_and_random_generators_as_they_were(tmp_path,
                                                                                              tiny_tokenizer):
    """A notebook's objects after evaluate_model(model, ...): the model's dtype, values, generation config and
    training mode (each module's), the tokenizer's pad token and padding side, and the global random generators
    (Python's, numpy's, torch's) that each evaluation seed resets. (Its device: the next test.)"""
    import random

    import numpy as np
    from transformers import set_seed

    from hgpo_trl.commands.evaluate import evaluate_model

    def next_draws():  # (numpy's legacy global generator: the one set_seed seeds)
        return random.random(), float(np.random.random()), torch.rand(1).item()  # noqa: NPY002

    model = build_tiny_model(tiny_tokenizer, hidden_size=32, num_layers=1, num_heads=2).to(torch.float64).train()
    model.model.embed_tokens.eval()  # a module the caller froze stays in eval mode
    tokenizer = copy.deepcopy(tiny_tokenizer)  # (the fixture is the session's)
    tokenizer.pad_token, tokenizer.padding_side = None, "right"  # the evaluation pads on the left, with eos
    values, generation = {k: v.clone() for k, v in model.state_dict().items()}, model.generation_config.to_dict()
    set_seed(11)
    expected = next_draws()
    set_seed(11)
    evaluate_model(model, config(tmp_path, KEYDOOR), tokenizer=tokenizer, seeds=[3])
    assert next_draws() == expected
    assert (tokenizer.pad_token, tokenizer.padding_side) == (None, "right")
    assert model.training and not model.model.embed_tokens.training
    assert all(m.training for m in model.modules() if m is not model.model.embed_tokens)
    assert {(t.device.type, t.dtype) for t in model.parameters()} == {("cpu", torch.float64)}
    assert model.generation_config.to_dict() == generation
    for key, value in model.state_dict().items():
        assert torch.equal(value, values[key]), key


def test_the_model_is_handed_back_on_its_own_tensors_wherever_the_evaluation_moved_it(tmp_path, tiny_tokenizer):
    """On a GPU machine the evaluation plays a CPU model on the GPU (`hf_generator`'s device); here it moves it to
    the meta device, which holds no values: the model comes back on the CPU with every value."""
    from hgpo_trl.config import HGPOConfig

    model = build_tiny_model(tiny_tokenizer, hidden_size=32, num_layers=1, num_heads=2)
    values = {k: v.clone() for k, v in model.state_dict().items()}
    args = HGPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with evaluate.callers_state_kept(model):
        players.hf_generator(model, tiny_tokenizer, args, 0.0, device="meta")
        assert {t.device.type for t in model.state_dict().values()} == {"meta"}
    assert {t.device.type for t in model.state_dict().values()} == {"cpu"}
    for key, value in model.state_dict().items():
        assert torch.equal(value, values[key]), key


def test_evaluate_model_raises_a_value_error_with_the_one_line_before_any_model_plays(tmp_path, tiny_tokenizer,
                                                                                        monkeypatch):
    from hgpo_trl.commands.evaluate import evaluate_model
    from hgpo_trl.config import HGPOConfig

    monkeypatch.setattr(evaluate, "run", lambda *args: pytest.fail("a model played despite the bad input"))
    yaml_file = config(tmp_path, KEYDOOR)
    model = build_tiny_model(tiny_tokenizer, hidden_size=32, num_layers=1, num_heads=2)
    args = HGPOConfig(output_dir=str(tmp_path / "run"), use_cpu=True, report_to="none")
    misspelt = HGPOConfig(output_dir=str(tmp_path / "run"), use_cpu=True, report_to="none", env_name="keydor")
    twice = r"^evaluate_model: two models named: .* and model_name_or_path=.*; give one$"
    for call, message in [
        (lambda: evaluate_model(model, yaml_file), r"^evaluate_model: a model in memory needs its tokenizer"),
        (lambda: evaluate_model("tiny", yaml_file, greedyy=True), r"unknown option 'greedyy' \(did you mean 'greedy'\?\)"),
        (lambda: evaluate_model("tiny", yaml_file, seeds=[1, 1]), r"seeds must be one or more distinct integers"),
        (lambda: evaluate_model("tiny", yaml_file, splits=["valid_seen"]), r"has no split 'valid_seen'"),
        (lambda: evaluate_model(str(tmp_path), yaml_file), r"holds no model \(config\.json\)"),
        (lambda: evaluate_model(model, args, tokenizer=tiny_tokenizer, max_env_steps=3),
         r"max_env_steps: set HGPOConfig fields on the HGPOConfig given as config"),
        (lambda: evaluate_model("tiny", yaml_file, splits=["valid", None]), r"^evaluate_model: splits: .*None"),
        # With an HGPOConfig, the options get the checks the command line's get, in the same words.
        (lambda: evaluate_model(model, args, tokenizer=tiny_tokenizer, num_eval_tasks=0),
         r"^EnvArguments.num_eval_tasks must be an integer >= 1, got 0$"),
        (lambda: evaluate_model(model, args, tokenizer=tiny_tokenizer, task_kwargs="{num_rooms: 3"),
         r"^EnvArguments.task_kwargs must be a mapping such as"),
        (lambda: evaluate_model(model, args, tokenizer=tiny_tokenizer, task_kwargs="{data_path: /nope}"),
         r"^EnvArguments.task_kwargs.data_path: /nope does not exist"),  # the text is read as a mapping
        (lambda: evaluate_model(model, args, tokenizer=tiny_tokenizer, task_kwargs={"data_path": "/nope"}),
         r"^EnvArguments.task_kwargs.data_path: /nope does not exist"),
        (lambda: evaluate_model(model, misspelt, tokenizer=tiny_tokenizer),
         r"^HGPOConfig.env_name: unknown environment 'keydor' \(did you mean 'keydoor'\?\)"),
        (lambda: evaluate_model(model, args, tokenizer=tiny_tokenizer, env_modules=["no_such_env_module"]),
         r"^EnvArguments.env_modules: cannot import 'no_such_env_module'"),
        # Two models named: refused on both config paths, never one of them played silently.
        (lambda: evaluate_model(str(tmp_path), yaml_file, model_name_or_path="tiny"), twice),
        (lambda: evaluate_model(model, yaml_file, tokenizer=tiny_tokenizer, model_name_or_path="tiny"), twice),
        (lambda: evaluate_model("tiny", args, model_name_or_path=str(tmp_path)), twice),
    ]:
        with pytest.raises(ValueError, match=message) as error:
            call()
        assert "\n" not in str(error.value)


# evaluate_model's options that its YAML path refuses, each in one line (a pattern of the line).
BAD_OPTIONS = [
    ({"seeds": ["one"]}, r"argument --seeds: invalid int value: 'one'"),
    ({"seeds": [1.5]}, r"argument --seeds: invalid int value: '1.5'"),
    ({"seeds": []}, r"argument --seeds: expected at least one argument"),
    ({"seeds": [1, 1]}, r"seeds must be one or more distinct integers"),
    ({"greedy": "maybe"}, r"argument --greedy: Truthy value expected: got maybe"),
    ({"num_envs": 2.5}, r"argument --num_envs.*: invalid int value: '2.5'"),
    ({"num_envs": 0}, r"num_envs must be None or an integer >= 1, got 0"),
    ({"episodes_per_seed": "many"}, r"argument --episodes_per_seed.*: invalid int value: 'many'"),
    ({"policy": ["smart"]}, r"policy must be one or more of"),
    ({"splits": ["valid_seen"]}, r"has no split 'valid_seen'"),
    ({"splits": ["valid", None]}, r"^evaluate_model: splits: a list cannot hold None"),
    ({"num_eval_tasks": 0}, r"^EnvArguments.num_eval_tasks must be an integer >= 1, got 0$"),
    ({"task_kwargs": "{num_rooms: 3"}, r"^EnvArguments.task_kwargs must be a mapping such as"),
]
# Options given as the command line writes them: read as it reads them.
TEXT_OPTIONS = {"seeds": "1", "num_envs": "2", "policy": "random", "splits": "valid", "num_eval_tasks": "2",
                "greedy": "yes", "episodes_per_seed": "4"}


def test_evaluate_model_checks_options_by_one_rule_with_a_yaml_file_or_an_hgpo_config(tmp_path, monkeypatch):
    """The same options, the same errors (or the same reading) whichever config holds the training settings."""
    from hgpo_trl.commands.evaluate import evaluate_model
    from hgpo_trl.config import HGPOConfig

    played = []
    monkeypatch.setattr(evaluate, "run", lambda evaluation: played.append(evaluation) or {})
    yaml_file = config(tmp_path, KEYDOOR)
    args = HGPOConfig(output_dir=str(tmp_path / "run"), env_name="keydoor", action_mode="plain", max_env_steps=4,
                      max_completion_length=4, use_cpu=True, report_to="none", disable_tqdm=True)
    keydoor = {"num_eval_tasks": 3, "task_kwargs": {"num_rooms": 3, "num_colors": 3}}  # (the YAML file's)
    for options, message in BAD_OPTIONS:
        errors = []
        for config_given, given in ((yaml_file, options), (args, {**keydoor, **options})):
            with pytest.raises(ValueError) as error:
                evaluate_model("tiny", config_given, **given)
            errors.append(str(error.value))
        assert errors[0] == errors[1] and re.search(message, errors[0]) and "\n" not in errors[0], (options, errors)
    assert not played
    evaluate_model("tiny", yaml_file, **TEXT_OPTIONS)
    evaluate_model("tiny", args, **{**keydoor, **TEXT_OPTIONS})
    [ours, theirs] = [(e.eval_args, e.env_args.num_eval_tasks, e.tasks) for e in played]
    assert ours == theirs and ours[0].seeds == [1] and ours[0].policy == ["random"] and ours[0].greedy is True


def test_command_line_writes_a_list_item_as_a_single_value():
    assert evaluate.command_line({"task_kwargs": {"a": 1}, "greedy": True, "items": [{"a": 1}, False, 2]}) == [
        "--task_kwargs", '{"a": 1}', "--greedy", "true", "--items", '{"a": 1}', "false", "2"]


def test_help_all_lists_trls_and_transformers_sections_after_ours(capsys):
    with pytest.raises(SystemExit) as exit_info:
        entry_points.evaluate(["--help-all"])
    assert exit_info.value.code == 0
    titles, group_of = sections_of(capsys.readouterr().out)
    assert titles[2].startswith("EvalArguments: What to evaluate") and titles[3].startswith("EnvArguments: ")
    assert titles[-2:] == ["TRL GRPOConfig: generation, loss, vLLM",
                           "Transformers TrainingArguments: optimizer, precision, logging, saving"]
    assert group_of("--policy") == titles[2] and group_of("--num_generations") == titles[-2]
    assert group_of("--seed") == titles[-1]
