"""Two processes on the CPU through `accelerate launch`: plain DDP, DeepSpeed ZeRO-2 and ZeRO-3."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "distributed" / "train_keydoor.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")

LAUNCHES = {
    "ddp": ["--config_file", "configs/accelerate/cpu_2proc.yaml"],
    "zero2": ["--config_file", "configs/accelerate/zero2.yaml", "--num_processes", "2", "--mixed_precision", "no"],
    "zero3": ["--config_file", "configs/accelerate/zero3.yaml", "--num_processes", "2", "--mixed_precision", "no"],
}


def launch(kind: str, out: Path, port: int, *options: str) -> list[dict]:
    """SCRIPT's run on 2 processes: what each wrote."""
    run_launch(kind, port, SCRIPT, str(out), *options, out=out)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def run_launch(kind: str, port: int, script: Path, *arguments: str, out: Path | None = None) -> None:
    """`accelerate launch` of `script` on 2 processes, which must succeed; what they printed goes to OUT/launch.out."""
    if kind.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs the deepspeed extra")
    # (a process that aborts prints every thread's Python stack: PYTHONFAULTHANDLER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
           "DS_ACCELERATOR": "cpu", "MASTER_PORT": str(port), "PYTHONFAULTHANDLER": "1"}
    command = [str(ACCELERATE), "launch", *LAUNCHES[kind], "--main_process_port", str(port), str(script), *arguments]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    if out is not None:
        (out / "launch.out").write_text(result.stdout)  # (what both processes printed, for a test to read)


def test_each_launch_is_two_processes_under_the_setting_its_name_says():
    """What the launches below stand on: the accelerate file and the flags that override it give 2 processes in
    float32, plain DDP on the CPU for ddp, DeepSpeed ZeRO at the stage the name says without offload."""
    for kind, options in LAUNCHES.items():
        flags = dict(zip(options[::2], options[1::2], strict=True))
        config = {**yaml.safe_load((ROOT / flags["--config_file"]).read_text()),
                  **{flag.removeprefix("--"): value for flag, value in flags.items() if flag != "--config_file"}}
        assert int(config["num_processes"]) == 2 and config["mixed_precision"] == "no", kind
        if kind == "ddp":
            assert config["use_cpu"] is True and config["distributed_type"] == "MULTI_GPU"
        else:
            deepspeed = config["deepspeed_config"]
            assert config["distributed_type"] == "DEEPSPEED" and deepspeed["zero_stage"] == int(kind[-1]), kind
            assert deepspeed["offload_optimizer_device"] == deepspeed["offload_param_device"] == "none"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "zero2", "zero3"])
def test_two_processes_play_distinct_tasks_and_stay_in_sync(kind, tmp_path, free_port):
    ranks = launch(kind, tmp_path, free_port)
    assert [r["world"] for r in ranks] == [2, 2] and [r["global_step"] for r in ranks] == [2, 2]
    # Each process plays its own tasks in every iteration: task groups never span processes.
    for it in range(2):
        assert not set(ranks[0]["played"][it]) & set(ranks[1]["played"][it])
        assert len(ranks[0]["played"][it]) == len(ranks[1]["played"][it]) == 2
    # The evaluation splits the 3 validation tasks between the processes and gathers the result.
    assert len(ranks[0]["played"][2]) + len(ranks[1]["played"][2]) == 3
    assert ranks[0]["eval"]["eval_tasks"] == ranks[1]["eval"]["eval_tasks"] == 3.0
    # One model: identical parameters on both processes; metrics are gathered (the same logs on both).
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-6)
    ours = ("env/", "adv/", "steps/", "hgpo/", "time/")
    logs = [[{k: v for k, v in h.items() if k.startswith(ours)} for h in r["log_history"] if "steps/collected" in h]
            for r in ranks]
    assert len(logs[0]) == 2 and logs[0] == logs[1]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zero2", "zero3"])
def test_a_warm_start_then_training_under_deepspeed(kind, tmp_path, free_port):
    """train.py's first phase, as the quickstart and the tiny recipes run it: the warm start's Trainer took the
    launch's DeepSpeed plugin, and the RL trainer's second one was refused ("You cannot pass in a deepspeed_plugin
    when creating a second Accelerator"). The warm start trains under plain data parallelism; the RL trainer runs
    under the launch's DeepSpeed."""
    # Under ZeRO-3 from a model folder, as train.py loads a hub model: transformers partitioned it as it loaded
    # (the RL config's ZeRO-3 settings are global), and the warm start then ran on empty weights.
    ranks = launch(kind, tmp_path, free_port, "warmstart=3", *(["model=folder"] if kind == "zero3" else []))
    warm = [r["warmstart"] for r in ranks]
    assert warm[0]["after"] != warm[0]["before"]  # it trained
    assert warm[0] == pytest.approx(warm[1], rel=1e-9)  # one model on both processes
    assert [r["deepspeed"] for r in ranks] == [True, True] and [r["global_step"] for r in ranks] == [2, 2]
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-6)
    # Its line once, not once per process.
    assert (tmp_path / "launch.out").read_text().count("[warm start] 3 steps on ") == 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "zero2", "zero3"])
def test_all_steps_trains_every_step_of_both_processes_once_in_windows_of_the_busiest(kind, tmp_path, free_port):
    """step_batching=all_steps on 2 processes: each process's steps reach its loss exactly once per iteration;
    both run the busiest process's count of micro-batches (ZeRO-3 gathers parameters in every forward, so an
    unequal count would hang) and make the same optimizer steps; parameters stay identical."""
    ranks = launch(kind, tmp_path, free_port, "batching=all_steps")
    for rank in ranks:
        seen = sorted(a for call in rank["seen"] for a in call)
        assert seen == sorted(a for values in rank["estimated"] for a in values)
    collected = [[len(values) for values in rank["estimated"]] for rank in ranks]
    # Micro-batches of 2 rows, windows of 2 micro-batches (a mini-batch of 8 over the two processes).
    windows = [math.ceil(max(math.ceil(n0 / 2), math.ceil(n1 / 2)) / 2) for n0, n1 in zip(*collected, strict=True)]
    assert [len(rank["seen"]) for rank in ranks] == [2 * sum(windows)] * 2
    assert any(not call for rank in ranks for call in rank["seen"])  # the less busy process ran padding alone
    assert [rank["global_step"] for rank in ranks] == [sum(windows)] * 2
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-6)
    logs = [h["steps/optimizer_steps"] for h in ranks[0]["log_history"] if "steps/optimizer_steps" in h]
    assert logs == windows


@pytest.mark.slow
def test_balanced_steps_train_every_row_once_in_mini_batches_of_the_configured_size(tmp_path, free_port):
    """balance_steps on 2 processes whose episodes differ in length (process 1's end after one step), split as
    released (karmarkar_karp; greedy differs in the split alone, tests/test_balance.py): over both processes every
    row reaches the loss exactly once, none twice, none dropped; each optimizer step trains exactly
    mini_batch_size = 8 rows in all (an iteration's last aside); both run as many micro-batches and take fewer
    optimizer steps than unbalanced rows would need; both log the same global_seqlen/*. The rollouts are continuous
    (transformers, no ZeRO-3): each process plays its own turns, process 1 one a rollout where process 0 plays up
    to 5, with no collective per turn, and neither waits for the other inside a rollout."""
    ranks = launch("ddp", tmp_path, free_port, "batching=all_steps", "balance=karmarkar_karp", "uneven=1",
                   "rollout=continuous")
    assert [rank["continuous"] for rank in ranks] == [True, True]
    assert set(ranks[1]["turns"][:2]) == {1} and max(ranks[0]["turns"][:2]) > 1  # (the 2 training rollouts)
    estimated = [[len(values) for values in rank["estimated"]] for rank in ranks]
    assert all(n0 >= 3 * n1 for n0, n1 in zip(*estimated, strict=True))  # deliberately unequal
    assert sorted(a for rank in ranks for call in rank["seen"] for a in call) == \
        sorted(a for rank in ranks for values in rank["estimated"] for a in values)
    assert len(ranks[0]["seen"]) == len(ranks[1]["seen"])
    call, windows, unbalanced = 0, 0, 0
    for n0, n1 in zip(*estimated, strict=True):
        total = n0 + n1
        steps = math.ceil(math.ceil(math.ceil(total / 2) / 2) / 2)  # rows per process, micro-batches of 2, windows of 2
        rows = [sum(len(rank["seen"][call + 2 * k + j]) for rank in ranks for j in (0, 1)) for k in range(steps)]
        assert rows == [8] * (total // 8) + ([total % 8] if total % 8 else []), rows
        call, windows = call + 2 * steps, windows + steps
        unbalanced += math.ceil(math.ceil(max(n0, n1) / 2) / 2)
    assert call == len(ranks[0]["seen"])
    assert [rank["global_step"] for rank in ranks] == [windows] * 2 and windows < unbalanced
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-6)
    counters = [h for h in ranks[0]["log_history"] if "steps/max_untrained" in h]
    assert [h["steps/max_untrained"] for h in counters] == [0.0, 0.0]
    assert [h["steps/trained"] * 2 for h in counters] == [n0 + n1 for n0, n1 in zip(*estimated, strict=True)]
    spread = [[{k: v for k, v in h.items() if k.startswith("global_seqlen/")} for h in rank["log_history"]
               if "global_seqlen/mean" in h] for rank in ranks]
    assert len(spread[0]) == 2 and spread[0] == spread[1]
    assert all(h["global_seqlen/balanced_max"] - h["global_seqlen/balanced_min"] < h["global_seqlen/minmax_diff"]
               for h in spread[0])


@pytest.mark.slow
def test_dynamic_sampling_decides_over_both_processes_which_play_as_many_batches(tmp_path, free_port):
    """Process 0's groups all get equal rewards (dropped), process 1's differ (kept): each batch keeps 2 of the 4
    groups of both processes, so both play 2 batches per iteration, in step, and keep what one process with all
    four tasks would keep; the extra batch plays fresh tasks, distinct between the processes."""
    ranks = launch("ddp", tmp_path, free_port, "dynamic=1")
    assert [r["global_step"] for r in ranks] == [2, 2]
    assert [len(r["played"]) for r in ranks] == [5, 5]  # 2 iterations x 2 batches, then the evaluation
    for batch in range(4):
        assert not set(ranks[0]["played"][batch]) & set(ranks[1]["played"][batch])
    for rank in ranks:
        assert rank["played"][0] != rank["played"][1] and rank["played"][2] != rank["played"][3]
    logs = [[h for h in r["log_history"] if "dynamic/rollout_batches" in h] for r in ranks]
    for log in logs[0]:
        assert (log["dynamic/rollout_batches"], log["dynamic/groups_kept"], log["dynamic/groups_dropped"]) == (2, 4, 4)
        assert log["steps/collected"] == 8  # process 1's 2 kept groups x 4 episodes x 1 step a batch, averaged over 2
    counts = [[{k: v for k, v in h.items() if k.startswith(("dynamic/groups", "dynamic/rollout", "steps/"))}
               for h in log] for log in logs]
    assert counts[0] == counts[1] and len(counts[0]) == 2
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-6)


@pytest.mark.slow
def test_one_process_whose_environments_all_fail_logs_the_same_keys_and_goes_on(tmp_path, free_port):
    """Process 1's episodes all fault in iteration 1 (no step collected there), process 0's are healthy: every
    process still gathers the same metric keys (a shorter vector hangs NCCL, and gloo raises) and the run ends."""
    ranks = launch("ddp", tmp_path, free_port, "fault=envs")
    assert [r["global_step"] for r in ranks] == [2, 2]
    ours = ("env/", "adv/", "steps/", "hgpo/")
    first = [{k: v for k, v in next(h for h in r["log_history"] if "env/faults" in h).items() if k.startswith(ours)}
             for r in ranks]
    assert first[0] == first[1] and first[0]["env/faults"] == 4  # the 8 episodes of process 1, averaged over 2
    assert "hgpo/level0_with_peers" in first[0]
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-6)


@pytest.mark.slow
def test_non_finite_advantages_on_one_process_stop_every_process(tmp_path, free_port):
    """NaN advantages on process 1 only: both stop with the message before training, within the collective
    timeout (a process deciding alone would leave the other waiting in its next collective)."""
    ranks = launch("ddp", tmp_path, free_port, "fault=nan")
    assert all("non-finite advantages at iteration 1" in r["error"] for r in ranks)
    assert [r["global_step"] for r in ranks] == [0, 0]


@pytest.mark.slow
def test_a_non_finite_loss_stops_every_process_before_deepspeed_steps(tmp_path, free_port):
    """Under DeepSpeed the optimizer steps inside the backward of a window's last micro-batch: the check must
    come before it. Process 1's loss is infinite (its gradients finite) in the second optimizer step: both stop,
    the parameters those of the first step."""
    ranks = launch("zero3", tmp_path, free_port, "fault=nanloss")
    for rank in ranks:
        assert "non-finite loss at iteration 2" in rank["error"] and "parameters were not updated" in rank["error"]
        after_first, final = rank["checksums"]
        assert final == after_first and math.isfinite(final)


@pytest.mark.slow
def test_a_process_whose_gloo_worker_still_holds_a_collective_at_exit_leaves_cleanly(free_port):
    """A finished run must not fail its launch at exit (tests/distributed/exit_mid_collective.py): process 0's gloo
    worker completes an all-reduce whose tensor it alone still holds while the main thread keeps the GIL, its process
    group destroyed by hand but kept alive (as a DDP model keeps it), then the interpreter ends. The exit handler that
    HGPOTrainer registers lets the worker take the GIL first; without it process 0 aborted (SIGABRT, 3 launches of
    3), as CI saw by chance at the end of a balanced-steps launch."""
    run_launch("ddp", free_port, ROOT / "tests" / "distributed" / "exit_mid_collective.py")


def test_the_exit_handler_waits_for_gloo_workers_that_run_and_not_for_idle_ones(tmp_path):
    """What the exit handler's wait reads, on this torch, in a process of its own with a gloo group of 1: its
    worker threads by their name, a running thread seen running, and idle workers (the group destroyed) not
    waited for beyond the quiet looks."""
    probe = """
import threading, time, torch
from pathlib import Path
from hgpo_trl.runtime import collective
torch.distributed.init_process_group("gloo", init_method="file://%s", rank=0, world_size=1)
kept = torch.distributed.group.WORLD
torch.distributed.all_reduce(torch.ones(3))
torch.distributed.destroy_process_group()
assert len(collective._gloo_worker_threads()) >= 1, "no gloo worker thread found by its name"
assert collective._running(Path("/proc/self/task", str(threading.get_native_id())))
started = time.monotonic()
collective._let_gloo_workers_finish()
assert time.monotonic() - started < 1.0, time.monotonic() - started
print("ok")
""" % (tmp_path / "store")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert result.stdout.strip() == "ok", result.stderr[-3000:]
