"""train.py's configuration: every shipped YAML parses, and bad input stops early with a message naming the field."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hgpo_trl.commands.train import ConfigError, main, parse

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "accelerate" not in p.parts)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_shipped_config_parses(path, tmp_path):
    # (a hub id is checked against the offline cache, which holds no Qwen here: the tiny model stands in)
    _, args, _ = parse(["--config", str(path), "--output_dir", str(tmp_path), "--bf16", "false",
                       "--use_vllm", "false", "--report_to", "none", "--model_name_or_path", "tiny"])
    assert args.env_name and args.max_steps > 0


def write(tmp_path, text, model="tiny"):
    path = tmp_path / "c.yaml"
    path.write_text(f"model_name_or_path: {model}\noutput_dir: {tmp_path}/out\nreport_to: none\nuse_cpu: true\n{text}")
    return str(path)


# A run of seconds on keydoor with the tiny model; each test adds what it checks.
TINY_RUN = """env_name: keydoor
action_mode: plain
num_eval_tasks: 2
tiny_hidden_size: 32
tiny_num_layers: 1
tiny_num_heads: 2
tasks_per_device: 2
num_generations: 4
per_device_train_batch_size: 16
max_completion_length: 4
max_env_steps: 5
logging_steps: 1
disable_tqdm: true
"""


BAD = [
    ("learning_rat: 0.1\n", r"Unknown arguments from config file.*learning_rat.*python train\.py --help-all lists them"),
    ("learning_rate: [1, 2]\n", r"learning_rate must be float, int, got \[1, 2\]"),
    ("tasks_per_device: 0\n", "HGPOConfig.tasks_per_device must be an integer >= 1"),
    ("estimator: ppo\n", "HGPOConfig.estimator must be one of"),
    ("env_name: minecraft\n", "HGPOConfig.env_name: unknown environment 'minecraft'"),
    ("history_length: -2\n", "HGPOConfig.history_length must be an integer >= 0"),
    ("task_kwargs: '{broken'\n", "EnvArguments.task_kwargs must be a mapping"),
    ("num_generations: 3\nper_device_train_batch_size: 16\n", r"HGPOConfig\.num_generations \(3\) must divide the step"),
    ("early_stop_success: 1.5\neval_every_iterations: 1\n", r"HGPOConfig.early_stop_success must be None or in \(0, 1\]"),
    ("early_stop_success: 0.9\n", "early_stop_success stops on validation success, and this run never evaluates"),
]


@pytest.mark.parametrize(("text", "message"), BAD, ids=[b[0].split(":")[0] for b in BAD])
def test_bad_configs_name_the_field(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        parse(["--config", write(tmp_path, text)])


@pytest.mark.parametrize("below", ["", "run"])
def test_an_output_dir_that_is_a_file_is_refused_before_anything_runs(tmp_path, below):
    """An output_dir that is a file (or under one) ran the whole warm start (69 s), then failed in a 22-line
    `NotADirectoryError ... afile/reference_model` traceback."""
    (tmp_path / "afile").write_text("not a folder")
    output_dir = tmp_path / "afile" / below
    with pytest.raises(ConfigError, match=rf"^HGPOConfig.output_dir must be a folder \(or a path where one can be "
                                          rf"made\), got '{output_dir}': {tmp_path / 'afile'} is a file$"):
        parse(["--config", write(tmp_path, ""), "--output_dir", str(output_dir)])


@pytest.mark.parametrize("text", ["null", "None", "none"])
def test_eval_split_null_on_the_command_line_turns_the_evaluation_off(tmp_path, text):
    """`--eval_split null` (the help says "None: none") was taken as a split named 'null' (keydoor: "split must be one
    of ..."): on the command line it is YAML's null, as `eval_split: null` in the YAML is."""
    env_args, _, _ = parse(["--config", write(tmp_path, ""), "--eval_split", text])
    assert env_args.eval_split is None
    assert parse(["--config", write(tmp_path, "eval_split: null\n")])[0].eval_split is None


def test_trl_rows_without_a_validation_split_are_not_evaluated_on_as_if_they_were_one(tmp_path, capsys):
    """TRL rows given as one list (or one data file) were the rows of every split: the run's evaluation (eval_split
    'valid' by default) silently scored the training rows. One list is the training split; another split is one
    line saying how to give one, or to turn the evaluation off."""
    from hgpo_trl.commands.train import main
    from hgpo_trl.envs import make_tasks

    rows = [{"prompt": "Reach the goal.", "goal": 2}, {"prompt": "Reach the goal.", "goal": 3}]
    assert list(make_tasks("trl", "train", rows=rows)) == rows
    with pytest.raises(ValueError, match=r"^one list of rows is the 'train' split alone"):
        make_tasks("trl", "valid", rows=rows)
    config = write(tmp_path, f"""env_name: trl
env_kwargs: {{environment_factory: "tests.test_trl_env:Corridor"}}
task_kwargs: {{rows: {json.dumps(rows)}}}
action_mode: tool
""")
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", config])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(
        "train.py: configuration error: the trl tasks of split 'valid': one list of rows is the 'train' split alone"), err
    assert "--eval_split null" in err


def test_command_line_overrides_the_yaml_and_types_are_checked(tmp_path):
    _, args, _ = parse(["--config", write(tmp_path, "learning_rate: 0.1\n"), "--learning_rate", "0.5"])
    assert args.learning_rate == 0.5
    with pytest.raises(ConfigError, match=r"--learning_rate.*: invalid float value: 'fast' \(python train\.py --help-all"):
        parse(["--config", write(tmp_path, ""), "--learning_rate", "fast"])


def test_a_model_is_required(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\n")
    with pytest.raises(ConfigError, match="model_name_or_path is required"):
        parse(["--config", str(path)])


def test_a_tiny_run_writes_summary_and_plots(tmp_path, capsys, monkeypatch):
    import json

    import hgpo_trl.commands.train
    from hgpo_trl.commands.train import main

    plotted = []
    plot = hgpo_trl.commands.train.plot_learning
    monkeypatch.setattr(hgpo_trl.commands.train, "plot_learning", lambda history, path: plotted.append(history) or plot(history, path))

    config = write(tmp_path, TINY_RUN + """invalid_action: end_episode
warmstart_steps: 3
warmstart_batch_size: 8
train_iterations: 2
save_strategy: "no"
trajectory_dump_every: 1
""")
    main(["--config", config])
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["optimizer_steps"] == 2
    # The run's dumps drawn in one page, which summary.json names: both iterations and the evaluations.
    view = Path(summary["trajectory_view"]).read_text()
    assert summary["trajectory_view"] == str(out / "trajectories.html")
    assert all(f'"name":"{name}"' in view for name in ("iter_000001", "iter_000002", "eval_step_000000"))
    assert 0 <= summary["success_rate_start"] <= 1 and 0 <= summary["success_rate_end"] <= 1
    assert summary["wall_seconds"] > 0 and summary["config"]["trainer"]["env_name"] == "keydoor"
    assert (out / "learning.png").stat().st_size > 0 and (out / "hgpo_levels.png").stat().st_size > 0
    # The curve starts at the evaluation before training (iteration 0).
    evaluations = [h for h in plotted[0] if "eval_success_rate" in h]
    assert evaluations[0]["step"] == 0 and evaluations[0]["eval_success_rate"] == summary["success_rate_start"]
    printed = capsys.readouterr().out
    assert printed.count("[iter ") == 2 and "[eval " in printed and "validation success" in printed


def test_configuration_errors_exit_with_a_message(tmp_path, capsys):
    from hgpo_trl.commands.train import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--config", write(tmp_path, "estimator: ppo\n")])
    assert exit_info.value.code == 2
    assert "configuration error: HGPOConfig.estimator must be one of" in capsys.readouterr().err
    # A task option the environment does not take: one line naming it, before any model loads.
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", write(tmp_path, TINY_RUN), "--task_kwargs", "{num_rooms:6}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(r"configuration error: the keydoor tasks of split 'train': environment "
                                         r"'keydoor' does not accept these task options \['num_rooms:6'\]", err)


def test_resume_from_checkpoint_continues_the_run(tmp_path, capfd):
    import json

    from hgpo_trl.commands.train import main

    base = TINY_RUN + """warmstart_steps: 2
warmstart_batch_size: 8
save_strategy: steps
save_steps: 1
plots: false
"""
    main(["--config", write(tmp_path, base + "train_iterations: 2\n")])
    out = tmp_path / "out"
    start = json.loads((out / "summary.json").read_text())["success_rate_start"]
    checkpoint = out / "checkpoint-2"
    assert (checkpoint / "trainer_state.json").exists() and (checkpoint / "model.safetensors").exists()
    first = json.loads((out / "summary.json").read_text())["wall_seconds"]
    capfd.readouterr()
    main(["--config", write(tmp_path, base + "train_iterations: 4\n"), "--resume_from_checkpoint", str(checkpoint)])
    # The tiny model ties its LM head to the embeddings: saved once, not "missing" when the checkpoint loads.
    assert "missing keys" not in capfd.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["optimizer_steps"] == 4 and (out / "checkpoint-4").exists()
    # The wall time of both runs: the first up to its checkpoint at iteration 2 (its end), then the resumed one.
    earlier, resumed = summary["wall_seconds_segments"]
    assert 0 < earlier <= first and resumed > 0 and summary["wall_seconds"] == pytest.approx(earlier + resumed, abs=0.1)
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    # The resumed run logged iterations 3 and 4 on top of the checkpoint's history of 1 and 2.
    assert [h["step"] for h in state["log_history"] if "env/success_rate" in h] == [1, 2, 3, 4]
    # The evaluation before training travels in the checkpoints: the resumed summary still has the start.
    assert next(h["step"] for h in state["log_history"] if "eval_success_rate" in h) == 0
    assert start is not None and summary["success_rate_start"] == start


def test_a_checkpoint_of_another_process_count_is_one_line_before_any_step(tmp_path, capsys):
    from hgpo_trl.commands.train import main

    checkpoint = tmp_path / "out" / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    for rank in (0, 1):  # the state files a 2-process run leaves in its checkpoints (a real one: test_checkpoints)
        (checkpoint / f"hgpo_trainer_state_{rank}.json").write_text('{"iterations": 3}')
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", write(tmp_path, TINY_RUN + "train_iterations: 4\nplots: false\n"),
              "--resume_from_checkpoint", str(checkpoint)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "checkpoint-3 was saved by 2 processes and this run has 1" in err, err
    assert sorted(p.name for p in checkpoint.iterdir()) == ["hgpo_trainer_state_0.json", "hgpo_trainer_state_1.json"]


def test_the_kl_reference_is_the_warm_start_and_survives_a_resume(tmp_path, tiny_model_path):
    from safetensors.torch import load_file

    from hgpo_trl.commands.train import main

    def weights(folder):
        return load_file(Path(folder) / "model.safetensors")

    base = TINY_RUN + """warmstart_steps: 2
warmstart_batch_size: 8
beta: 0.1
save_strategy: steps
save_steps: 1
plots: false
"""
    # A model from a path, warm-started in memory: the reference is the warm start, not the path's weights.
    main(["--config", write(tmp_path, base + "train_iterations: 2\n", model=tiny_model_path)])
    out = tmp_path / "out"
    reference = weights(out / "reference_model")
    loaded = weights(tiny_model_path)
    assert not all(torch.equal(reference[k], loaded[k]) for k in loaded)
    main(["--config", write(tmp_path, base + "train_iterations: 3\n", model=tiny_model_path),
          "--resume_from_checkpoint", str(out / "checkpoint-2")])
    assert json.loads((out / "summary.json").read_text())["optimizer_steps"] == 3
    after = weights(out / "reference_model")
    assert all(torch.equal(reference[k], after[k]) for k in reference)  # the resume did not replace it


def test_a_model_folder_loads_through_transformers(tmp_path, tiny_model_path):
    import json

    from hgpo_trl.commands.train import main

    config = write(tmp_path, TINY_RUN + """train_iterations: 1
save_strategy: "no"
plots: false
""", model=tiny_model_path)
    main(["--config", config])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["optimizer_steps"] == 1 and summary["config"]["model"]["model_name_or_path"] == tiny_model_path


MY_ENVS = '''
from hgpo_trl.envs import register_env
from hgpo_trl.envs.keydoor import KeyDoorEnv, keydoor_tasks
from hgpo_trl.advantages import compute_advantages, register_estimator

CALLS = []


def my_grpo(batch, **options):
    CALLS.append(len(batch.reward))
    return compute_advantages("grpo", batch)


register_env("my_keydoor", KeyDoorEnv, keydoor_tasks, fast=True)
register_estimator("my_grpo", my_grpo)
'''


@pytest.fixture
def own_registries(monkeypatch):
    """Registries restored after the test: what a user's module registers does not leak into other tests."""
    import hgpo_trl.advantages
    import hgpo_trl.envs.registry

    monkeypatch.setattr(hgpo_trl.envs.registry, "_REGISTRY", dict(hgpo_trl.envs.registry._REGISTRY))
    monkeypatch.setattr(hgpo_trl.advantages, "ESTIMATORS", dict(hgpo_trl.advantages.ESTIMATORS))
    monkeypatch.setattr("hgpo_trl.config_checks.ESTIMATORS", hgpo_trl.advantages.ESTIMATORS)
    yield
    for name in [m for m in sys.modules if m.startswith("my_envs_")]:
        del sys.modules[name]


@pytest.mark.parametrize("where", ["yaml", "command line"])
def test_env_modules_register_an_environment_and_an_estimator_before_parsing(tmp_path, monkeypatch, own_registries,
                                                                               where):
    from hgpo_trl.commands.train import main

    module = f"my_envs_{where.replace(' ', '_')}"
    (tmp_path / f"{module}.py").write_text(MY_ENVS)
    monkeypatch.chdir(tmp_path)  # a module in the working directory, as a user keeps one beside the config
    config = TINY_RUN.replace("env_name: keydoor", "env_name: my_keydoor") + (
        "estimator: my_grpo\nwarmstart_steps: 2\nwarmstart_batch_size: 8\ntrain_iterations: 1\nplots: false\n"
        'save_strategy: "no"\n')
    if where == "yaml":
        main(["--config", write(tmp_path, config + f"env_modules: [{module}]\n")])
    else:
        main(["--config", write(tmp_path, config), "--env_modules", module])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["config"]["trainer"]["env_name"] == "my_keydoor" and summary["iterations"] == 1
    assert sys.modules[module].CALLS, "the registered estimator computed the advantages"


@pytest.mark.parametrize(("source", "message"), [
    (None, r"EnvArguments.env_modules: cannot import 'my_envs_missing': ModuleNotFoundError"),
    ("raise RuntimeError('no licence key')\n",
     r"EnvArguments.env_modules: cannot import 'my_envs_missing': RuntimeError: no licence key"),
])
def test_an_env_module_that_fails_to_import_is_one_line_naming_it(tmp_path, monkeypatch, capsys, own_registries,
                                                                    source, message):
    from hgpo_trl.commands.train import main

    if source is not None:
        (tmp_path / "my_envs_missing.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", write(tmp_path, TINY_RUN), "--env_modules", "my_envs_missing"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert re.search(message, err) and "\n" not in err


def test_mappings_on_the_command_line_may_be_yaml_flow_style_as_the_help_shows(tmp_path):
    env_args, args, _ = parse(["--config", write(tmp_path, ""), "--task_kwargs", "{num_rooms: 3, num_colors: 3}",
                               "--env_kwargs", "{key_reward: 3.0}"])
    assert env_args.task_kwargs == {"num_rooms": 3, "num_colors": 3} and args.env_kwargs == {"key_reward": 3.0}


def test_an_option_the_estimator_does_not_read_warns_only_when_the_user_set_it(tmp_path):
    import warnings

    with pytest.warns(UserWarning, match=r"HGPOConfig: omega set in .*c\.yaml or on the command line, but estimator "
                                         r"'hgpo' does not read it; it reads gamma, hierarchy_depth, alpha") as caught:
        parse(["--config", write(tmp_path, "estimator: hgpo\nomega: 0.5\n")])
    assert caught[0].filename == __file__  # attributed to the caller, not to the library's internals
    with pytest.warns(UserWarning, match=r"progpo_lambda, alpha set on the command line.* 'gigpo' does not read them"):
        parse(["--estimator", "gigpo", "--model_name_or_path", "tiny", "--progpo_lambda", "2", "--alpha", "2",
               "--output_dir", str(tmp_path), "--use_cpu", "true"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults of the fields hgpo does not read never warn
        parse(["--config", write(tmp_path, "estimator: hgpo\n")])


def test_a_config_warning_names_the_users_line_not_a_generated_init(tmp_path):
    from hgpo_trl.config import HGPOConfig

    with pytest.warns(UserWarning, match=r"hierarchy_depth \(4\) > history_length \(2\)") as caught:
        HGPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", hierarchy_depth=4)
    assert caught[0].filename == __file__


OUR_SECTIONS = ["options", "config file",
                "RehearsalArguments: Rehearse this config on CPUs before renting GPUs (docs/rehearsal.md)",
                "EnvArguments: Tasks, the offline tiny model and the supervised warm start",
                "HGPOConfig: environment", "HGPOConfig: iterations, step batches, cadence",
                "HGPOConfig: prompts and actions", "HGPOConfig: advantages",
                "HGPOConfig: diagnostics and trajectory dumps", "HGPOConfig: evaluation",
                "HGPOConfig: console and reporting", "TRL ModelConfig: model, dtype, LoRA"]


def sections_of(text):
    titles = [line[:-1] for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]

    def group_of(option):
        before = text[:text.index(f"\n  {option} ") + 1]
        return next(t for t in reversed(titles) if f"\n{t}:\n" in before)
    return titles, group_of


def test_help_lists_our_sections_and_names_help_all_for_the_rest(capsys):
    from hgpo_trl.commands.train import main

    main(["--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: python train.py [--config FILE.yaml] [--FIELD VALUE ...]")
    titles, group_of = sections_of(text)
    assert titles == OUR_SECTIONS
    assert group_of("--config") == "config file"
    assert group_of("--estimator") == group_of("--omega") == "HGPOConfig: advantages"
    assert group_of("--history_length") == "HGPOConfig: prompts and actions"
    assert group_of("--report_to") == group_of("--console_metrics") == group_of("--logging_steps") == \
        "HGPOConfig: console and reporting"
    assert group_of("--model_name_or_path") == "TRL ModelConfig: model, dtype, LoRA"
    assert "--num_generations" not in text and "--seed " not in text
    assert text.rstrip().endswith("python train.py --help-all lists every field.")


def test_help_all_lists_every_field_ours_first(capsys):
    from hgpo_trl.commands.train import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help-all"])
    assert exit_info.value.code == 0
    titles, group_of = sections_of(capsys.readouterr().out)
    assert titles == [*OUR_SECTIONS, "TRL GRPOConfig: generation, loss, vLLM",
                      "Transformers TrainingArguments: optimizer, precision, logging, saving"]
    assert group_of("--num_generations") == "TRL GRPOConfig: generation, loss, vLLM"
    assert group_of("--report_to") == "HGPOConfig: console and reporting"  # our default, our section
    assert group_of("--seed") == "Transformers TrainingArguments: optimizer, precision, logging, saving"


@pytest.mark.parametrize("script", ["train.py", "evaluate.py"])
def test_the_short_help_imports_neither_torch_nor_trls_trainer(script):
    """What makes --help answer in about a second (benchmarks/help.py times it)."""
    code = (f"import runpy, sys; sys.argv = ['{script}', '--help']; runpy.run_path('{script}', run_name='__main__'); "
            "heavy = sorted(m for m in ('torch', 'transformers.training_args', 'trl.trainer.grpo_config', "
            "'hgpo_trl.config') if m in sys.modules); print('HEAVY', heavy)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("HEAVY []"), done.stdout[-300:]
    own = "EvalArguments: What to evaluate" if script == "evaluate.py" else "RehearsalArguments: Rehearse"
    assert own in done.stdout and f"python {script} --help-all lists every field." in done.stdout


@pytest.mark.slow
def test_early_stop_ends_the_run_once_validation_holds_and_says_why(tmp_path, capsys):
    config = write(tmp_path, TINY_RUN + """invalid_action: end_episode
admissible_only: true
tiny_hidden_size: 64
tiny_num_layers: 2
task_kwargs: {num_rooms: 3, num_colors: 3}
warmstart_steps: 60
warmstart_batch_size: 32
warmstart_learning_rate: 3.0e-3
num_eval_tasks: 11
eval_temperature: 0.0
learning_rate: 0.0
train_iterations: 6
eval_every_iterations: 1
early_stop_success: 0.01
early_stop_patience: 2
save_strategy: steps
save_steps: 50
""")
    main(["--config", config])
    # The weights it stopped at are checkpointed (save_steps alone would have kept none).
    assert (tmp_path / "out" / "checkpoint-2").is_dir()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    # Greedy evaluation of weights that learning_rate 0 keeps: every evaluation scores what the first did.
    assert summary["success_rate_start"] > 0.01, "the warm-started model must already succeed sometimes"
    assert summary["iterations"] == 2, "two evaluations during training at >= 0.01 stop it after iteration 2"
    assert summary["stopped_early"] == "stopped early: validation success >= 0.01 at 2 evaluations in a row"
    assert "in 2 iterations (stopped early: validation success >= 0.01" in capsys.readouterr().out


def test_a_run_that_ends_by_its_iterations_says_none(tmp_path):
    config = write(tmp_path, TINY_RUN + "warmstart_steps: 0\ntrain_iterations: 1\nsave_strategy: \"no\"\n"
                   "early_stop_success: 1.0\neval_every_iterations: 1\n")
    main(["--config", config])
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["stopped_early"] is None
