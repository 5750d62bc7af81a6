"""vLLM generation (colocate and server mode) on a GPU: two HGPO iterations with a small model each.

Skips without CUDA or without the `vllm` extra. Run on a GPU machine with:
    pip install -e ".[dev,vllm]" && pytest -q tests/gpu
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("vLLM tests need a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

from hgpo_trl.config import HGPOConfig  # noqa: E402
from hgpo_trl.envs import make_tasks  # noqa: E402
from hgpo_trl.models.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny  # noqa: E402
from hgpo_trl.trainer import HGPOTrainer  # noqa: E402
from tests.conftest import keydoor_corpus  # noqa: E402


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    tokenizer = build_tiny_tokenizer(keydoor_corpus())
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=4, seed=0)
    return str(save_tiny(model, tokenizer, tmp_path_factory.mktemp("tiny")))


def config(tmp_path, **overrides):
    return HGPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=16, num_generations=4,
                      tasks_per_device=2, max_completion_length=4, max_env_steps=5, action_mode="plain",
                      invalid_action="end_episode", learning_rate=1e-3, train_iterations=2, logging_steps=1,
                      report_to="none", save_strategy="no", use_vllm=True, bf16=False, **overrides)


def train(path, args):
    trainer = HGPOTrainer(model=path, args=args, train_dataset=make_tasks("keydoor", "train", num_tasks=8),
                          eval_dataset=make_tasks("keydoor", "valid", num_tasks=2))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "env/success_rate" in h]
    assert len(logs) == args.train_iterations and all(h["steps/collected"] > 0 for h in logs)
    assert trainer.evaluate()["eval_tasks"] == 2.0
    return trainer


def test_colocate(tmp_path, model_path):
    train(model_path, config(tmp_path, vllm_mode="colocate", vllm_gpu_memory_utilization=0.2,
                             vllm_max_model_length=512))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server(tmp_path, model_path):
    port, group_port = _free_port(), _free_port()
    serve = Path(sys.executable).with_name("trl")
    server = subprocess.Popen([str(serve), "vllm-serve", "--model", model_path, "--port", str(port),
                               "--gpu_memory_utilization", "0.2", "--max_model_len", "512"],
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(2)
        else:
            pytest.fail("the vLLM server did not start within 300 s")
        train(model_path, config(tmp_path, vllm_mode="server", vllm_server_port=port, vllm_group_port=group_port))
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_hgpo_eval_generates_with_vllm_and_a_seed_repeats(tmp_path, model_path):
    """hgpo-eval with use_vllm on a GPU: vLLM generates, and the same seed gives the same results."""
    import json

    from hgpo_trl.commands import evaluate

    config = tmp_path / "eval.yaml"
    config.write_text(f"model_name_or_path: {model_path}\noutput_dir: {tmp_path}/run\nreport_to: none\n"
                      "env_name: keydoor\naction_mode: plain\nmax_env_steps: 5\nmax_completion_length: 4\n"
                      "num_eval_tasks: 4\nuse_vllm: true\nbf16: false\nvllm_gpu_memory_utilization: 0.2\n"
                      "vllm_max_model_length: 512\neval_temperature: 1.0\n")
    reports = []
    for name in ("first", "again"):
        evaluate.main(["--config", str(config), "--seeds", "7", "--eval_output_dir", str(tmp_path / name)])
        reports.append(json.loads((tmp_path / name / "evaluation.json").read_text()))
    assert reports[0]["backend"] == "vllm" and reports[0]["results"][0]["tasks"] == 4
    assert reports[0]["results"] == reports[1]["results"]


def test_generation_beside_training_with_hgpo_serve_and_trls_nccl_push(tmp_path, model_path):
    """async_generation on a GPU (issue 57): hgpo-serve (vLLM's server with its NCCL weight transfer) plays the
    coming iterations while the trainer trains, TRL's NCCL push after each optimizer step; no step trained more
    than max_staleness steps after the weights that generated it, each push timed, the evaluation after."""
    port, group_port = _free_port(), _free_port()
    server = subprocess.Popen([sys.executable, "-m", "hgpo_trl.commands.serve", "--model", model_path, "--port",
                               str(port), "--max_model_len", "512", "--gpu-memory-utilization", "0.2"],
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"}, start_new_session=True)
    try:
        args = config(tmp_path, vllm_mode="server", vllm_server_base_url=f"http://127.0.0.1:{port}",
                      vllm_group_port=group_port, vllm_server_timeout=300, rollout_mode="continuous",
                      async_generation=True, max_staleness=1, train_iterations=4)
        trainer = train(model_path, args)
        logs = [h for h in trainer.state.log_history if "env/success_rate" in h]
        assert all(h["async/staleness/max"] <= 1 for h in logs)  # (unbound, iteration 3 could play on step 0's weights)
        assert all(h["time/weight_push"] > 0 for h in logs)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
