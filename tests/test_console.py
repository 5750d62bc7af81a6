"""What a run shows and leaves: one [iter] line per iteration and one [eval] line per evaluation, no metrics
dicts or shard bars unless asked, no progress bars where the console is no terminal (a log file, CI: as here,
where capfd captures it), a labelled warm start, a warning when most outputs are invalid, and an output folder
without empty leftovers and with our own model card."""

import json
from pathlib import Path

import pytest

from hgpo_trl.commands.train import main
from tests.test_alfworld import needs_alfworld
from tests.test_cli import TINY_RUN, write


def run(tmp_path, capfd, extra=""):
    """The tiny run with its bars enabled, printing into capfd's files; what it printed, and its output folder."""
    config = write(tmp_path, TINY_RUN.replace("disable_tqdm: true\n", "") + """invalid_action: end_episode
warmstart_steps: 2
warmstart_batch_size: 8
train_iterations: 4
eval_strategy: steps
eval_steps: 2
save_strategy: steps
save_steps: 2
""" + extra)
    main(["--config", config])
    captured = capfd.readouterr()
    return captured.out + captured.err, tmp_path / "out"


def test_the_console_shows_our_lines_without_bars_and_the_folder_holds_no_leftovers(tmp_path, capfd):
    printed, out = run(tmp_path, capfd, "beta: 0.1\n")  # (a KL reference: saved, then loaded by TRL)
    # No bar, ours or transformers', redraws itself (carriage returns) or the bars above it (cursor-up escapes).
    assert "\r" not in printed and "\x1b[" not in printed, printed[:2000]
    lines = printed.splitlines()
    assert sum(line.startswith("[iter ") for line in lines) == 4
    # Before training, after iterations 2 and 4; the run's end reuses the last one rather than printing it again.
    assert [line.split("]")[0] for line in lines if line.startswith("[eval ")] == ["[eval    0", "[eval    2",
                                                                                   "[eval    4"]
    assert sum(line.startswith("[warm start] 2 steps on ") for line in lines) == 1
    assert "{'loss'" not in printed and "'train_runtime'" not in printed and "Writing model shards" not in printed
    assert "Setting accelerator to CPU" not in printed  # DeepSpeed's probe, on a machine with no GPU
    assert "[warning]" not in printed  # most outputs were valid actions
    summary = json.loads((out / "summary.json").read_text())
    final = f"validation success {summary['success_rate_start']:.2f} -> {summary['success_rate_end']:.2f} in 4"
    assert any(line.startswith(final) for line in lines), lines[-3:]
    assert not (out / ".staging").exists() and not (out / "warmstart").exists()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]

    card = (out / "README.md").read_text()
    assert "DeepSeekMath" not in card and "[None]" not in card and 'model="None"' not in card
    for expected in ("HGPO (Hierarchy-of-Groups Policy Optimization)", "`keydoor`", "`depth=2`", "`alpha=1.0`",
                     "| rollouts per task (G) | 4 |", "| iterations | 4 of 4 |", "a model built in memory",
                     f"**{summary['success_rate_end']:.2f}** after iteration 4", "@inproceedings{he2026hgpo",
                     f"hgpo-eval --config <the YAML config it was trained with> --model_name_or_path {out}"):
        assert expected in card, expected
    assert card.startswith("---\nlibrary_name: transformers\n") and "- hgpo\n" in card


def test_console_metrics_prints_trls_dicts_and_an_invalid_run_says_so(tmp_path, capfd):
    options = "console_metrics: true\nwarmstart_steps: 0\nadmissible_only: true\n"
    printed, out = run(tmp_path, capfd, options + "train_iterations: 2\n")
    assert "{'loss'" in printed and printed.count("[iter ") == 2
    # Without a warm start a tiny model emits almost no valid action: the run says so, once, and what to change.
    assert printed.count("[warning]") == 1 and "of the outputs of iterations 1-2 were invalid actions" in printed
    assert "warmstart_steps" in printed
    # A full run names the checkpoint it saved last in summary.json (it said None unless a signal stopped it).
    assert json.loads((out / "summary.json").read_text())["checkpoint"] == str(out / "checkpoint-2")
    # Resumed, the warning names the iterations it played: 3-4 (it said "iterations 1-5" after a resumed 11-15).
    printed, _ = run(tmp_path, capfd, options + f"train_iterations: 4\nresume_from_checkpoint: {out}/checkpoint-2\n")
    assert printed.count("[warning]") == 1 and "of the outputs of iterations 3-4 were invalid actions" in printed
    assert json.loads((out / "summary.json").read_text())["checkpoint"] == str(out / "checkpoint-4")


def test_a_model_loaded_from_a_folder_draws_no_bar_where_the_console_is_no_terminal(tmp_path, capfd, tiny_model,
                                                                                   tiny_tokenizer):
    from hgpo_trl.models.tiny import save_tiny

    save_tiny(tiny_model, tiny_tokenizer, tmp_path / "model")
    capfd.readouterr()  # (the save's own bar)
    printed, _ = run(tmp_path, capfd, f"model_name_or_path: {tmp_path / 'model'}\ntrain_iterations: 1\n"
                                      "warmstart_steps: 0\neval_strategy: 'no'\nsave_strategy: 'no'\n")
    assert printed.count("[iter ") == 1 and "\r" not in printed and "Loading weights" not in printed, printed[:2000]


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-0.5B-Instruct-not-cached", "hgpo-test/no-such-model"])
def test_a_hub_id_that_is_not_in_the_offline_cache_is_one_line(tmp_path, capfd, model):
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", write(tmp_path, TINY_RUN, model=model)])
    err = capfd.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert f"ModelConfig.model_name_or_path: {model!r} is not a folder, and no model of that hub id" in err


@needs_alfworld  # looked up, not imported: importing alfworld sets ALFWORLD_DATA, which later tests inherited
def test_alfworld_without_data_is_one_line(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", write(tmp_path, TINY_RUN.replace("env_name: keydoor", "env_name: alfworld"))])
    err = capfd.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert "the alfworld tasks of split 'train': no ALFWorld data: pass data_path or set ALFWORLD_DATA" in err


def test_a_gpu_config_on_a_cpu_names_the_fields_to_change(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr("hgpo_trl.rollout.vllm_cpu.cpu_build", lambda: False)  # (vLLM's CPU build would run use_vllm)
    root = Path(__file__).resolve().parents[1]
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(root / "configs" / "webshop" / "hgpo_k2_qwen2.5-1.5b.yaml"),
              "--output_dir", str(tmp_path)])
    err = capfd.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert "this config needs a GPU and no GPU is visible: rehearse it on this CPU with --rehearse" in err
    assert "start from a CPU recipe" in err
    assert "configs/{alfworld,webshop}/tiny_cpu.yaml), or set use_vllm: false, bf16: false" in err
    assert "--use_vllm false --bf16 false" in err
