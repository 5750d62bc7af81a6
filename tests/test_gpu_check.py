"""benchmarks/gpu_check.py, the GPU check ready for the first GPU machine (issue 19): the parts that need no
CUDA, on a scaled-down model, and its clean skip without a GPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from hgpo_trl.rehearsal.shapes import SHAPES, build_model_folder, model_config, tiny_twin

ROOT = Path(__file__).resolve().parents[1]
QWEN25 = ROOT.parent / "shared" / "data" / "qwen2.5-tokenizer"
pytestmark = pytest.mark.skipif(not QWEN25.is_dir(), reason=f"the offline Qwen2.5 tokenizer is read from {QWEN25}")
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


def test_the_model_is_qwen25_1_5b_shaped():
    tokenizer = AutoTokenizer.from_pretrained(QWEN25)
    with torch.device("meta"):  # the shape without a 1.5B initialisation
        model = Qwen2ForCausalLM(model_config(SHAPES[gpu_check.MODEL], tokenizer))
    assert 1.50e9 < sum(p.numel() for p in model.parameters()) < 1.56e9  # Qwen2.5-1.5B: 1.54B
    assert model.config.num_key_value_heads == 2 and model.config.tie_word_embeddings


@pytest.mark.slow
def test_the_check_runs_on_a_scaled_down_model_on_the_cpu(tmp_path):
    from hgpo_trl.envs import make_tasks

    tokenizer = AutoTokenizer.from_pretrained(QWEN25)
    shape = tiny_twin(SHAPES[gpu_check.MODEL], hidden=16, layers=1, heads=2)
    folder = build_model_folder(shape, tokenizer, tmp_path / "model")
    result = gpu_check.check(folder, tokenizer, env_name="keydoor", env_kwargs=None,
                             tasks=make_tasks("keydoor", "train", num_tasks=8), iterations=2, completion_tokens=8,
                             env_steps=2, use_vllm=False, device="cpu")
    assert result["loss_finite"] and result["generation_tokens_per_s"] > 0 and result["optimizer_steps"] >= 1
    assert result["importance_ratio_mean"] is None and result["peak_gpu_gib"] is None
    assert "tok/s" in gpu_check.report(result) and "finite" in gpu_check.report(result)
    assert 0 < result["projected_gpu_gib"] < 1 and "(projected 0." in gpu_check.report(result)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check would run, not skip")
def test_without_cuda_it_says_so_and_exits_zero():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--tokenizer", str(QWEN25)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and "no CUDA GPU here: skipped" in done.stdout
