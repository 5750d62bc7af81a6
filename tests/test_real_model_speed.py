"""benchmarks/real_model_speed.py's quick mode on the tiny model: every row of its table printed, with numbers."""

import os
import re

import torch

from hgpo_trl.rollout.vllm_cpu import cpu_build


def test_the_quick_mode_prints_every_row(capsys, monkeypatch):
    for name, value in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"), ("VLLM_CPU_KVCACHE_SPACE", "1")):
        monkeypatch.setenv(name, os.environ.get(name, value))  # (the script's defaults, undone after the test)
    from benchmarks.real_model_speed import main

    threads = torch.get_num_threads()
    try:
        main(["--quick", "--model", "tiny", "--threads", "1", "--iteration", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    figures = {m.group(1).strip(): float(m.group(2)) for m in re.finditer(r"^(.{52}) +([\d.]+) \S+", out, re.M)}
    for dtype in ("float32", "bfloat16"):
        for layout in ("A@B", "A@B^T"):
            assert figures[f"matmul {dtype} 256x256 {layout}"] > 0
    assert figures["memory read (sum of 32 MiB)"] > 0
    engines = ["transformers generate"] + (["vLLM lock-step", "vLLM continuous"] if cpu_build() else [])
    for engine in engines:
        assert figures[f"{engine}: 2 x 4 new tokens"] > 0 and f"{engine}: decode" in out
        assert re.search(rf"^{engine}: prefill \(\d+ prompt tokens\) +[\d.]+ tok/s .* of the fp32 matmul peak", out,
                         re.M)
    if not cpu_build():
        assert re.search(r"^vLLM +skipped  its CPU build is not installed", out, re.M)
    assert re.search(r"^train float32 2x16 fwd\+bwd\+AdamW +[\d.]+ tok/s .* of the fp32 matmul peak", out, re.M)
    assert re.search(r"^train bf16 autocast 1x16 fwd\+bwd\+AdamW +[\d.]+ tok/s .* of the bf16 matmul peak", out, re.M)
    parts = ["generation", "environments", "rollout's own loop", "advantages", "batch (log-probs, tensors)",
             "forward + backward", "optimizer step", "the rest"]
    assert figures["iteration 1: wall"] > 0 and all(f"iteration 1: {part}" in figures for part in parts)
    assert "iteration 2" not in out
