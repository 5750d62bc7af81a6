"""The rehearsal of a GPU config on CPUs (issue 32): its plan, its projection by hand, its messages, and
2-process rehearsals of paper configs under their own accelerate files."""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from hgpo_trl.commands.arguments import ConfigError, parse_sections
from hgpo_trl.commands.train import main, wants_rehearsal
from hgpo_trl.config import HGPOConfig
from hgpo_trl.rehearsal.launch import cpu_launch_file, read_launch_file
from hgpo_trl.rehearsal.plan import (
    launch_bound,
    micro_batch_structure,
    pads,
    rehearsal_changes,
    rehearsal_config,
)
from hgpo_trl.rehearsal.projection import (
    GIB,
    IterationLoad,
    Placement,
    Workload,
    calibration,
    gpu_seconds_bound,
    host_verdict,
    layer_elements_per_token,
    lora_parameters,
    project_memory,
    verdict,
)
from hgpo_trl.rehearsal.rehearse import CPU_OPTIONS, passed, this_host_gib, user_value, without_own_options
from hgpo_trl.rehearsal.report import iteration_counters, projected_prompt_tokens, table, trained_once
from hgpo_trl.rehearsal.shapes import SHAPES

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
ALFWORLD = Path(os.environ.get("ALFWORLD_DATA") or SHARED / "alfworld")
PAPER = sorted((ROOT / "configs").glob("*/*_qwen2.5-*.yaml"))


# ------------------------------------------------------------------ the plan
@pytest.mark.parametrize("generations", [2, 4, 8, 16])
@pytest.mark.parametrize(("micro", "accumulation"), [(16, 8), (8, 16), (4, 8), (2, 8), (4, 1), (2, 2)])
def test_the_scaled_batches_make_two_optimizer_steps_and_pad_a_micro_batch(generations, micro, accumulation):
    steps = 3 * generations  # one task, ENV_STEPS steps per episode
    m, a = micro_batch_structure(steps, micro, accumulation)
    assert 1 <= m <= micro and 1 <= a <= accumulation
    assert math.ceil(math.ceil(steps / m) / a) >= 2
    # Padded whenever some sizes up to the config's allow it: a short micro-batch first.
    possible = [(k, b) for k in range(1, micro + 1) for b in range(1, accumulation + 1)
                if math.ceil(math.ceil(steps / k) / b) >= 2]
    assert pads(steps, m, a) or not any(pads(steps, *o) for o in possible)
    assert steps % m or not any(steps % k for k, _ in possible)
    assert micro_batch_structure(24, 16, 8) == (11, 2)  # ALFWorld 1.5B: 11 + 11 + 2 rows, 2 windows
    assert micro_batch_structure(24, 2, 8) == (2, 5)  # WebShop 7B: 12 micro-batches, 3 windows, 3 of padding


def parsed(config: Path, *options: str):
    """A paper config as the rehearsal reads it (on a CPU: its GPU fields replaced)."""
    return parse_sections(["--config", str(config), *CPU_OPTIONS, *options], (), "train.py")


@pytest.mark.parametrize("config", PAPER, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_paper_config_names_its_launch_and_its_rehearsal_keeps_what_breaks_at_scale(config, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(ALFWORLD))
    env_args, args, _ = parsed(config)
    launch = read_launch_file(args.accelerate_config, str(config))
    assert launch.processes * args.tasks_per_device == 16  # data.train_batch_size, as released
    assert launch.zero_stage == (3 if "7b" in config.stem else 2) and launch.bf16
    changes = {c.name: c.after for c in rehearsal_changes(args, launch.processes, 2,
                                                          num_eval_tasks=env_args.num_eval_tasks)}
    for kept in ("env_name", "estimator", "history_length", "num_generations", "step_batching", "beta",
                 "gradient_checkpointing", "max_prompt_tokens", "action_mode", "invalid_action", "gamma"):
        assert kept not in changes
    micro = changes.get("per_device_train_batch_size", args.per_device_train_batch_size)
    accumulation = changes["gradient_accumulation_steps"]
    steps = changes["max_env_steps"] * args.num_generations
    assert changes["mini_batch_size"] == micro * accumulation * launch.processes
    assert math.ceil(math.ceil(steps / micro) / accumulation) >= 2 and pads(steps, micro, accumulation)
    assert changes.get("env_workers", args.env_workers) in ((1,) if args.env_workers else (0, None))
    assert changes["num_eval_tasks"] == launch.processes
    assert changes["train_iterations"] == changes["save_every_iterations"] == changes["eval_every_iterations"] == 2


def test_rehearsal_config_turns_a_config_object_into_its_rehearsal(monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(ALFWORLD))
    _, args, _ = parsed(ROOT / "configs/alfworld/hgpo_k4_qwen2.5-1.5b.yaml", "--output_dir", "/tmp/unused")
    rehearsal = rehearsal_config(args, processes=1, cores=2)
    assert isinstance(rehearsal, HGPOConfig) and rehearsal.tasks_per_device == 1 and rehearsal.max_env_steps == 3
    assert (rehearsal.per_device_train_batch_size, rehearsal.gradient_accumulation_steps) == (11, 2)
    assert rehearsal.mini_batch_size == 22 and rehearsal.train_iterations == 2 and rehearsal.estimator == "hgpo"
    assert rehearsal.max_steps == 2 * math.ceil(math.ceil(24 / 11) / 2)  # all_steps' bound, derived again


def test_a_fixed_budget_config_with_step_cadences_rehearses_on_iteration_cadences():
    _, args, _ = parse_sections(["--config", "configs/quickstart.yaml", "--output_dir", "/tmp/unused"], (), "train.py")
    rehearsal = rehearsal_config(args, processes=2, cores=2)
    assert rehearsal.step_batching == "fixed_budget" and rehearsal.per_device_train_batch_size == 4
    assert str(rehearsal.save_strategy) in ("no", "SaveStrategy.NO") and rehearsal.save_every_iterations == 2
    assert rehearsal.eval_every_iterations == 2 and rehearsal.logging_steps == 1
    # 2 optimizer steps an iteration, and a budget that num_generations divides (TRL's check)
    assert rehearsal.steps_per_generation * rehearsal.num_iterations // rehearsal.gradient_accumulation_steps == 2
    assert rehearsal.per_device_train_batch_size * 2 * rehearsal.steps_per_generation % rehearsal.num_generations == 0


def test_the_cpu_launch_file_keeps_processes_zero_stage_and_offloads_in_float32():
    launch = read_launch_file("configs/accelerate/paper_7b_4gpu.yaml", None)
    settings = cpu_launch_file(launch, 29999)
    assert settings["num_processes"] == 4 and settings["deepspeed_config"]["zero_stage"] == 3
    assert settings["deepspeed_config"]["offload_optimizer_device"] == "cpu"
    assert settings["deepspeed_config"]["offload_param_device"] == "cpu"
    assert settings["mixed_precision"] == "no" and settings["use_cpu"] is True and settings["main_process_port"] == 29999


def test_two_deepspeed_machines_on_one_host_use_the_standard_launcher():
    launch = read_launch_file("configs/accelerate/paper_1.5b_2gpu.yaml", None)
    two = type(launch)(launch.path, {**launch.settings, "num_machines": 2})
    settings = cpu_launch_file(two, 29999)
    assert settings["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"  # not pdsh over ssh
    assert settings["main_process_ip"] == "127.0.0.1"


def test_a_bad_launch_file_is_one_line_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match="accelerate_config: nowhere.yaml does not exist"):
        read_launch_file("nowhere.yaml", None)
    (tmp_path / "fsdp.yaml").write_text("distributed_type: FSDP\nnum_processes: 2\n")
    with pytest.raises(ConfigError, match="FSDP"):
        read_launch_file(str(tmp_path / "fsdp.yaml"), None)
    (tmp_path / "other.yaml").write_text("learning_rate: 1.0\n")
    with pytest.raises(ConfigError, match="not an accelerate config file"):
        read_launch_file(str(tmp_path / "other.yaml"), None)


def test_the_launched_runs_do_not_rehearse_again():
    argv = ["--config", "c.yaml", "--rehearse", "--rehearse_tokenizer", "t", "--gpu_memory_gib=40", "--seed", "1"]
    assert without_own_options(argv) == ["--config", "c.yaml", "--seed", "1"]
    assert without_own_options(["--rehearse", "true", "--seed", "1"]) == ["--seed", "1"]
    assert without_own_options(["--rehearse", "yes", "--seed", "1"]) == ["--seed", "1"]
    assert wants_rehearsal(["--rehearse"]) and wants_rehearsal(["--rehearse=true"]) and wants_rehearsal(["--rehearse", "y"])
    assert not wants_rehearsal(["--rehearse", "false"]) and not wants_rehearsal(["--seed", "1"])
    # The user's value as the parser reads it: the last one given.
    assert user_value(["--bf16", "true", "--bf16", "0"], "bf16", None) is False


def test_a_launch_is_bounded_by_what_the_plan_expects_or_by_the_users_timeout(monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(ALFWORLD))
    _, args, _ = parsed(ROOT / "configs/alfworld/hgpo_k4_qwen2.5-1.5b.yaml")  # 8 rollouts x 3 steps a process
    seconds, why = launch_bound(args, processes=2, cores=2, iterations=2)
    assert seconds == 5 * (60 + 2 * 8 * 3 * 2.0) and why.startswith("5 x the ~156 s the plan expects")  # was 3,600
    assert launch_bound(args, processes=4, cores=2, iterations=1)[0] == 5 * 2 * (60 + 8 * 3 * 2.0)  # shared cores
    _, dynamic, _ = parsed(ROOT / "configs/alfworld/hgpo_k4_qwen2.5-1.5b.yaml", "--dynamic_sampling", "true",
                           "--max_rollout_batches", "3")
    assert launch_bound(dynamic, processes=2, cores=2, iterations=1)[0] == 5 * (60 + 3 * 8 * 3 * 2.0)
    assert launch_bound(args, 2, 2, 2, timeout=90.0) == (90.0, "--rehearse_timeout")


# A launcher's process tree as torch elastic makes it: a rank in a session of its own, with a worker of its own;
# each writes its pid.
TREE = textwrap.dedent(r"""
    import os, subprocess, sys, time
    worker = ("import subprocess, sys, time; w = subprocess.Popen([sys.executable, '-c', 'import time; "
              "time.sleep(60)']); open(sys.argv[1], 'a').write(f'{w.pid}\\n'); time.sleep(60)")
    rank = subprocess.Popen([sys.executable, "-c", worker, sys.argv[1]], start_new_session=True)
    open(sys.argv[1], "a").write(f"{os.getpid()}\n{rank.pid}\n")
    time.sleep(60)
""")
# The rehearsal's launch of that tree, its error printed as train.py --rehearse prints it.
LAUNCHER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from hgpo_trl.rehearsal.launch import RehearsalError, rehearsal_failed, run_launches
    tree, pids, log, timeout = sys.argv[1:]
    try:
        run_launches([([sys.executable, tree, pids], Path(log))], dict(os.environ), float(timeout), "the test's")
    except RehearsalError as err:
        rehearsal_failed(err)
""")


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM", "timeout"])
def test_whatever_stops_a_launch_stops_every_process_it_started(stop, tmp_path):
    """Ctrl-C (SIGINT), SIGTERM or the bound: the launcher, the rank in its own session and the rank's worker all
    end, and the rehearsal says so in one line (the bound: with the log to read)."""
    import psutil

    (tmp_path / "tree.py").write_text(TREE)
    pids, log = tmp_path / "pids", tmp_path / "launch1.log"
    # (SIGINT as in a terminal: a test process may have it ignored, which the launched process would inherit)
    parent = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "tree.py"), str(pids), str(log),
                               "2" if stop == "timeout" else "60"], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 30
        while time.time() < deadline and len(pids.read_text().split() if pids.exists() else []) < 3:
            time.sleep(0.1)
        if stop != "timeout":
            parent.send_signal(getattr(signal, stop))
        _, err = parent.communicate(timeout=30)
    finally:
        started = [int(pid) for pid in pids.read_text().split()] if pids.exists() else []
        alive = [pid for pid in started if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        for pid in alive:
            psutil.Process(pid).kill()
        parent.kill()
    assert len(started) == 3 and alive == [], f"{len(alive)} of {started} still ran"
    assert parent.returncode == (1 if stop == "timeout" else 128 + getattr(signal, stop))  # (as a shell reports it)
    if stop == "timeout":
        assert err.startswith("train.py --rehearse: the rehearsal's launch failed (no end within 2 s (the test's): "
                              "hung?)") and f"(read its log: {log}; its end:)" in err
    else:
        assert err == (f"train.py --rehearse: interrupted by {stop}: every process the launch started was stopped "
                       f"(its logs: {log})\n")


# ------------------------------------------------------------------ the projection, by hand
N15 = 1_543_714_304  # Qwen2.5-1.5B's parameters


LAYER15 = (N15 - 151936 * 1536) / 28 * 2  # one layer of Qwen2.5-1.5B in bf16 (its embedding is tied)


@pytest.mark.parametrize(("stage", "weights", "grads", "optimizer", "reference"), [
    # DDP: fp32 weights + autocast's bf16 copies, fp32 gradients + DDP's buckets, AdamW's two moments
    (0, 6 * N15, 8 * N15, 8 * N15, 4 * N15),
    # ZeRO: bf16 weights and gradients, an fp32 gradient partition, fp32 master + moments sharded
    (1, 2 * N15, 2 * N15 + 4 * N15 / 2, 12 * N15 / 2, 2 * N15),
    (2, 2 * N15, (2 + 4) * N15 / 2, 12 * N15 / 2, 2 * N15),
    (3, 2 * N15 / 2 + 2 * LAYER15 + 151936 * 1536 * 2, (2 + 4) * N15 / 2, 12 * N15 / 2, 2 * N15 / 2),
])
def test_memory_by_zero_stage_by_hand(stage, weights, grads, optimizer, reference):
    shape = SHAPES["Qwen/Qwen2.5-1.5B-Instruct"]
    assert shape.parameters == N15
    work = Workload(micro_batch=16, prompt_tokens=1000, completion_tokens=512, vllm_share=0.6)
    gpu = project_memory(shape, Placement(processes=2, zero_stage=stage), work).gpu
    assert gpu["weights"] == pytest.approx(weights / GIB) and gpu["gradients"] == pytest.approx(grads / GIB)
    assert gpu["optimizer states"] == pytest.approx(optimizer / GIB)
    assert gpu["KL reference"] == pytest.approx(reference / GIB) and gpu["vLLM"] == pytest.approx(48.0)
    # One micro-batch: 16 x 1512 tokens x (28 layers x 1536 + one layer's 4 x 8960 + 6 x 1536 + 2 x (12 + 2) x 128)
    # bf16 elements, x the scale.py calibration; the LM head's two 512 x 32768 bf16 tiles.
    elements = 28 * 1536 + 4 * 8960 + 6 * 1536 + 2 * 12 * 128 + 2 * 2 * 128
    assert layer_elements_per_token(shape, True) == elements
    assert gpu["activations (layers)"] == pytest.approx(16 * 1512 * elements * 2 * calibration() / GIB)
    assert gpu["activations (LM head)"] == pytest.approx(2 * 4096 * 32768 * 2 / GIB)


def test_deepspeed_zero_0_in_bf16_keeps_every_fp32_gradient_and_master_weight_on_every_gpu():
    """DeepSpeed's stage 0 in bf16 wraps the optimizer in FP16_UnfusedOptimizer (FP16_Optimizer for its own
    FusedAdam): an fp32 copy of every weight and every gradient, partitioned over no one."""
    shape, n = SHAPES["Qwen/Qwen2.5-7B-Instruct"], SHAPES["Qwen/Qwen2.5-7B-Instruct"].parameters
    place, work = Placement(8, 0, deepspeed=True), Workload(1, 1024, 512, reference=False)
    zero0 = project_memory(shape, place, work, gpu_gib=140)
    assert zero0.gpu["weights"] == pytest.approx(2 * n / GIB)
    assert zero0.gpu["gradients"] == pytest.approx((2 + 4) * n / GIB)  # 42.6 GiB, whatever the processes
    assert zero0.gpu["optimizer states"] == pytest.approx(12 * n / GIB)
    assert verdict(zero0, shape, place, work).startswith("does not fit: 144.8 of 140 GiB")
    one = project_memory(shape, Placement(8, 1, deepspeed=True), work, gpu_gib=140)  # ZeRO-1: its partitions
    assert one.gpu["gradients"] == pytest.approx((2 + 4 / 8) * n / GIB)


def test_offloads_move_the_optimizer_and_the_weights_to_the_host_by_hand():
    shape = SHAPES["Qwen/Qwen2.5-7B-Instruct"]
    n = shape.parameters
    work = Workload(micro_batch=8, prompt_tokens=1000, completion_tokens=512, vllm_share=0.0)
    two = project_memory(shape, Placement(4, 2, offload_optimizer=True), work)
    assert two.gpu["optimizer states"] == 0 and two.gpu["gradients"] == pytest.approx(2 * n / 4 / GIB)
    assert two.host == pytest.approx({"optimizer states": 12 * n / GIB, "gradients (fp32)": 4 * n / GIB})
    three = project_memory(shape, Placement(4, 3, offload_optimizer=True, offload_param=True), work)
    layer, embedding = (n - 152064 * 3584 * 2) / 28 * 2, 152064 * 3584 * 2  # bf16
    assert three.gpu["weights"] == pytest.approx((2 * layer + embedding) / GIB) and three.gpu["KL reference"] == 0
    assert three.host["weights"] == pytest.approx(2 * n / GIB) and three.host["KL reference"] == pytest.approx(2 * n / GIB)
    assert three.host["optimizer states"] == pytest.approx(12 * n / GIB)


def test_the_verdict_names_the_field_to_change():
    shape = SHAPES["Qwen/Qwen2.5-1.5B-Instruct"]  # the paper's 1.5B launch with prompts at the 4,096 cap
    place, work = Placement(2, 2), Workload(micro_batch=16, prompt_tokens=4096, completion_tokens=512, vllm_share=0.6)
    line = verdict(project_memory(shape, place, work), shape, place, work)
    assert line == ("does not fit: 87.7 of 80 GiB per GPU, 7.7 GiB over; set per_device_train_batch_size 9 or "
                    "vllm_gpu_memory_utilization 0.50 or vllm_enable_sleep_mode: true")
    # Every field named fits when set (projected again).
    for change in ({"micro_batch": 9}, {"vllm_share": 0.5}, {"vllm_share": 0.0}):
        assert project_memory(shape, place, dataclasses.replace(work, **change)).fits
    assert not project_memory(shape, place, dataclasses.replace(work, micro_batch=10)).fits
    big, ddp = SHAPES["Qwen/Qwen2.5-7B-Instruct"], Placement(2, 0)
    hopeless = verdict(project_memory(big, ddp, work), big, ddp, work)
    assert hopeless.startswith("does not fit") and "no one field fits it" in hopeless
    fits = Workload(micro_batch=1, prompt_tokens=500, completion_tokens=64)
    assert verdict(project_memory(SHAPES["Qwen/Qwen2.5-0.5B-Instruct"], place, fits), shape, place, fits) \
        .startswith("fits:")


def test_the_host_verdict_covers_the_offloads_and_the_load_and_names_the_field_to_change():
    big = SHAPES["Qwen/Qwen2.5-7B-Instruct"]
    n = big.parameters
    # The paper's 7B launch: 4 processes a machine, ZeRO-3 with both offloads, dtype float32, the KL reference.
    paper, work = Placement(4, 3, offload_optimizer=True, offload_param=True), Workload(8, 1057, 512, vllm_share=0.6)
    roomy = project_memory(big, paper, work, host_gib=256)
    assert roomy.host_need == pytest.approx((12 + 4 + 2 + 2) * n / GIB)  # the offloads, 141.9 GiB, their peak
    assert roomy.load == pytest.approx(4 * 2 * 4 * n / 4 / GIB)  # zero.Init: each process's partition of both models
    assert host_verdict(roomy, big, paper, work) == "fits: 141.9 of 256 GiB per machine (114.1 GiB spare)"
    assert host_verdict(project_memory(big, paper, work), big, paper, work).startswith(
        "not checked: 141.9 GiB per machine at its peak (the offloads); give --host_memory_gib")
    short = project_memory(big, paper, work, host_gib=128)
    assert short.fits and not short.host_fits
    assert host_verdict(short, big, paper, work) == (
        "does not fit: 141.9 of 128 GiB per machine at its peak (the offloads), 13.9 GiB over; set "
        "offload_param_device: none (the accelerate file)")
    # Without zero.Init each process builds its model whole on the CPU, and under DeepSpeed the reference beside it.
    whole = dataclasses.replace(paper, zero3_init=False)
    loading = project_memory(big, whole, work, host_gib=200)
    assert loading.load == pytest.approx(4 * 2 * 4 * n / GIB) and loading.host_need == loading.load  # 227.0 GiB
    assert host_verdict(loading, big, whole, work).endswith(
        "at its peak (loading), 27.0 GiB over; set dtype: bfloat16 or zero3_init_flag: true (the accelerate file)")
    # Plain DDP moves the policy to its GPU before TRL loads the reference: one model at a time.
    ddp = project_memory(SHAPES["Qwen/Qwen2.5-1.5B-Instruct"], Placement(8, 0), work, host_gib=40)
    assert ddp.load == pytest.approx(8 * 4 * N15 / GIB) and not ddp.host_fits  # 46.0 GiB
    assert this_host_gib(processes_per_machine=1) is None  # no GPU here: this host says nothing of the target's


def test_lora_and_the_time_bound_by_hand():
    shape = SHAPES["Qwen/Qwen2.5-1.5B-Instruct"]
    # q_proj (1536 -> 1536) and v_proj (1536 -> 256) of 28 layers at rank 16.
    assert lora_parameters(shape, 16, None) == 28 * 16 * ((1536 + 1536) + (1536 + 256))
    assert lora_parameters(shape, 16, ".*(q|v)_proj") == lora_parameters(shape, 16, ["q_proj", "v_proj"])
    assert lora_parameters(shape, 8, "all-linear") == 28 * 8 * (2 * 1536 + 2 * (1536 + 256) + 2 * 1536
                                                                 + 3 * (1536 + 8960))
    load = IterationLoad(step_samples=10, optimizer_steps=1, generated_tokens=1e6, prompt_tokens=2e6,
                         scored_tokens=3e6, trained_tokens=4e6)
    flops = 2 * N15 * 6e6 + 8 * N15 * 4e6
    assert gpu_seconds_bound(shape, load, gpus=2, tflops=400) == pytest.approx(flops / (2 * 400e12))


def test_the_projected_prompt_adds_the_history_the_rehearsal_did_not_reach():
    lengths = {"prompt": {"max": 900.0}, "prompt_mean_by_step": {"0": 600.0, "1": 700.0, "2": 800.0}}
    assert projected_prompt_tokens(lengths, history_length=4, max_prompt_tokens=4096) == 900 + 2 * 100
    assert projected_prompt_tokens(lengths, history_length=4, max_prompt_tokens=1000) == 1000


def test_the_report_counts_dynamic_samplings_rollout_batches():
    log = [{"iteration": 1, "loss": 0.1, "steps/collected": 12.0, "steps/optimizer_steps": 2.0,
            "dynamic/rollout_batches": 3.0, "dynamic/groups_kept": 4.0, "dynamic/groups_dropped": 8.0}]
    [row] = iteration_counters(log, processes=2)
    assert row == {"iteration": 1, "collected": 24, "optimizer_steps": 2.0, "rollout_batches": 3.0, "groups_kept": 4.0,
                   "groups_dropped": 8.0}
    report = {"run": {"config": "c.yaml", "accelerate_config": None, "processes": 2, "machines": 1,
                      "distribution": "DDP", "model": "m", "twin": "t"}, "launches": [], "iterations": [row],
              "checks": {}}
    # A fixed_budget run samples its steps: no trained counters, said as the checks say it (no "?").
    assert "24 steps collected, trained n/a (fixed_budget samples the steps it trains), 2 optimizer steps" in \
        table(report) and "3 rollout batches (4 groups kept, 8 dropped)" in table(report) and "?" not in table(report)
    trained = {**row, "trained": 24, "trained_passes": 26, "duplicated": 2}
    assert "24 steps collected, 24 trained (26 rows incl. 2 copies)" in table({**report, "iterations": [trained]})


def test_trained_once_reads_the_counters():
    good = [{"collected": 48, "trained": 48, "max_untrained": 0.0, "trained_passes": 50, "duplicated": 2}]
    assert trained_once(good, 1)
    assert not trained_once([{**good[0], "max_untrained": 1.0, "trained": 47}], 1) and not trained_once([], 1)


# ------------------------------------------------------------------ messages
def test_a_gpu_config_on_a_cpu_names_the_rehearsal_first(monkeypatch):
    monkeypatch.setattr("hgpo_trl.rollout.vllm_cpu.cpu_build", lambda: False)  # (vLLM's CPU build would run use_vllm)
    with pytest.raises(ValueError, match=r"^HGPOConfig: this config needs a GPU.*rehearse it on this CPU with --rehearse"):
        HGPOConfig(output_dir="/tmp/unused", use_vllm=True, report_to="none")


def test_a_multi_process_launch_on_a_cpu_without_use_cpu_says_use_cpu(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"launcher started 2 processes .* set use_cpu: true") as err:
        HGPOConfig(output_dir="/tmp/unused", step_batching="all_steps", train_iterations=1, report_to="none",
                   per_device_train_batch_size=2, num_generations=2)
    assert "\n" not in str(err.value)


def test_deepspeed_mixed_precision_against_bf16_is_one_line(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with pytest.raises(ValueError, match=r"mixed_precision: bf16 and this config's bf16: False.*--mixed_precision no"):
        HGPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, report_to="none")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    HGPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, report_to="none")  # agree: fine


def test_a_rehearsal_without_the_tokenizer_offline_says_which_to_give(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ALFWORLD_DATA", str(ALFWORLD))
    with pytest.raises(SystemExit) as stop:
        main(["--config", "configs/alfworld/hgpo_k4_qwen2.5-1.5b.yaml", "--rehearse", "--output_dir",
              str(tmp_path / "out")])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--rehearse_tokenizer FOLDER" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out-rehearsal").exists()  # refused before writing anything


@pytest.mark.parametrize("option", ["--rehearse_timeout", "--host_memory_gib"])
def test_a_rehearsals_own_bounds_must_be_positive(option, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ALFWORLD_DATA", str(ALFWORLD))
    with pytest.raises(SystemExit) as stop:
        main(["--config", "configs/alfworld/hgpo_k4_qwen2.5-1.5b.yaml", "--rehearse", option, "0", "--output_dir",
              str(tmp_path / "out")])
    assert stop.value.code == 2 and capsys.readouterr().err == (
        f"train.py: configuration error: RehearsalArguments.{option[2:]} must be > 0, got 0.0\n")
    assert not (tmp_path / "out-rehearsal").exists()


# ------------------------------------------------------------------ rehearsals, 2 processes
def rehearse_in_a_subprocess(config: str, out: Path, *options: str) -> tuple[dict, str]:
    """`train.py --rehearse` of paper config `config` with the real Qwen2.5 tokenizer, scaled further for the
    suite's budget (2 rollouts a task, 2 steps an episode: options the rehearsal keeps); its report and output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ALFWORLD_DATA": str(ALFWORLD)}
    command = [sys.executable, "train.py", "--config", f"configs/{config}.yaml", "--rehearse",
               "--rehearse_tokenizer", str(SHARED / "qwen2.5-tokenizer"), "--output_dir", str(out),
               "--num_generations", "2", "--max_env_steps", "2", *options]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(Path(f"{out}-rehearsal", "rehearsal.json").read_text())
    assert passed(report) and all(ok is not None for ok in report["checks"].values()), report["checks"]
    assert [r["iteration"] for r in report["iterations"]] == [1, 2, 3]
    assert "check: every collected step trained once           yes" in done.stdout
    assert report["projection"]["verdict"] and "GPU per device" in done.stdout
    assert report["projection"]["host_verdict"] in done.stdout  # (not checked: no GPU here)
    return report, done.stdout


@pytest.mark.slow
def test_the_alfworld_paper_config_rehearses_under_its_own_accelerate_file(tmp_path):
    if not ALFWORLD.is_dir():
        pytest.skip(f"no ALFWorld data at {ALFWORLD}")
    report, _ = rehearse_in_a_subprocess("alfworld/hgpo_k4_qwen2.5-1.5b", tmp_path / "run")
    assert report["run"]["processes"] == 2 and report["run"]["distribution"] == "DeepSpeed ZeRO-2"
    assert 0 < report["tokens"]["prompt"]["max"] <= 4096 and report["tokens"]["completion"]["max"] == 16
    launched = yaml.safe_load((tmp_path / "run-rehearsal" / "accelerate.yaml").read_text())
    assert launched["mixed_precision"] == "no" and launched["deepspeed_config"]["zero_stage"] == 2


@pytest.mark.slow
def test_the_webshop_paper_config_rehearses_on_two_machines_of_one_process(tmp_path):
    """accelerate's num_machines: 2 (DeepSpeed ZeRO-2, as the paper's file) launched as machine ranks 0 and 1
    on this host: the multi-node paths (a machine's own workers and local ranks, files written once,
    checkpoints and the resume) in one rehearsal."""
    machines = {**yaml.safe_load((ROOT / "configs/accelerate/paper_1.5b_2gpu.yaml").read_text()),
                "num_machines": 2, "main_process_ip": "10.0.0.1", "main_process_port": 29500}
    (tmp_path / "two_machines.yaml").write_text(yaml.safe_dump(machines))
    report, _ = rehearse_in_a_subprocess("webshop/gigpo_k2_qwen2.5-1.5b", tmp_path / "run",
                                         "--accelerate_config", str(tmp_path / "two_machines.yaml"))
    assert report["run"]["machines"] == 2 and report["run"]["processes"] == 2
    folder = tmp_path / "run-rehearsal"
    launched = yaml.safe_load((folder / "accelerate.yaml").read_text())
    assert launched["main_process_ip"] == "127.0.0.1" and launched["mixed_precision"] == "no"
    assert launched["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"
    # Each machine rank ran its own launcher; the global main process (machine 0) alone printed and wrote.
    logs = {rank: (folder / f"launch1_machine{rank}.log").read_text() for rank in (0, 1)}
    assert "[iter    1]" in logs[0] and "[iter" not in logs[1]
    checkpoint = folder / "run" / report["resumed_from"]
    assert sorted(p.name for p in checkpoint.glob("hgpo_trainer_state_*.json")) == \
        ["hgpo_trainer_state_0.json", "hgpo_trainer_state_1.json"]
