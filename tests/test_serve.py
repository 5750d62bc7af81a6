"""hgpo-serve (hgpo_trl/commands/serve.py): the command line it gives vLLM's server on a CPU and on a GPU, and its
refusals in one line. The server it starts, trained with, is tests/test_vllm_cpu.py's (it needs vLLM's CPU build)."""

import json
import sys

import pytest
from transformers import AutoConfig

from hgpo_trl.commands import serve
from hgpo_trl.rollout import vllm_cpu


def options(command: list[str]) -> dict[str, str | None]:
    """A command line's options, each with its value (None for a switch)."""
    return {arg: None if i + 1 == len(command) or command[i + 1].startswith("--") else command[i + 1]
            for i, arg in enumerate(command) if arg.startswith("--")}


def test_on_a_cpu_the_server_loads_weight_files_prefills_whole_and_runs_float32(tiny_model_path):
    command, variables = serve.serve_command(str(tiny_model_path), "127.0.0.1", 8123, None, None,
                                             ["--enforce-eager"], on_gpu=False)
    assert command[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    flags = options(command)
    assert flags["--model"] == str(tiny_model_path) and flags["--port"] == "8123" and flags["--host"] == "127.0.0.1"
    assert flags["--worker-extension-cls"] == vllm_cpu.LOADER == "hgpo_trl.rollout.vllm_cpu.WeightFileLoader"
    assert flags["--dtype"] == "float32" and flags["--logprobs-mode"] == "processed_logprobs"
    # every prompt prefilled whole: a seeded request fails a chunked prefill on a CPU (issue 56)
    context = AutoConfig.from_pretrained(tiny_model_path).max_position_embeddings
    assert "--no-enable-chunked-prefill" in flags and int(flags["--max-num-batched-tokens"]) >= context
    assert command[-1] == "--enforce-eager" and variables == {"VLLM_SERVER_DEV_MODE": "1"}


def test_on_a_gpu_the_server_has_vllms_nccl_weight_transfer(tiny_model_path):
    command, _ = serve.serve_command(str(tiny_model_path), "0.0.0.0", 8000, None, 2048, [], on_gpu=True)
    flags = options(command)
    assert json.loads(flags["--weight-transfer-config"]) == {"backend": "nccl"} and flags["--dtype"] == "auto"
    assert flags["--max-model-len"] == "2048" and "--worker-extension-cls" not in command


def test_bad_cores_and_a_missing_model_folder_are_refused_in_one_line(capsys, tmp_path, monkeypatch):
    assert serve.parse_cores("0-2,5") == {0, 1, 2, 5}
    with pytest.raises(SystemExit) as stop:
        serve.main(["--model", str(tmp_path), "--cores", "1-x"])
    assert stop.value.code == 2 and "--cores: a list of cores as taskset reads it ('1', '0-3,6'), got '1-x'" in \
        capsys.readouterr().err
    monkeypatch.setattr(vllm_cpu, "vllm_runs_here", lambda: True)
    with pytest.raises(SystemExit) as stop:
        serve.main(["--model", str(tmp_path / "absent")])
    assert stop.value.code == 2 and f"--model {tmp_path / 'absent'}: no model folder there" in capsys.readouterr().err


def test_without_vllm_it_names_the_python_that_has_it(monkeypatch):
    monkeypatch.setattr(vllm_cpu, "vllm_runs_here", lambda: False)
    with pytest.raises(SystemExit) as stop:
        serve.main(["--model", "unused"])
    assert str(stop.value).startswith(f"hgpo-serve: vLLM cannot run in this Python ({sys.executable}): ")
    assert "vllm-cpu" in str(stop.value) and "\n" not in str(stop.value)
