"""Generation beside training (`async_generation`, issue 57) on hgpo-serve's server on this CPU, run by
tests/vllm_cpu_runs.py in its process (one vLLM import), which hands over a maker of trainers on its server: three
HGPO iterations synchronous and played ahead at max_staleness 0 and 1; a run played ahead that a SIGINT stops,
resumed from the checkpoint the stop saved; two processes played ahead (`accelerate launch`); then the server hung
(SIGSTOP) under a run played ahead, and killed under another (last: the server is gone after). tests/test_vllm_cpu.py checks what they return."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from transformers import TrainerCallback

from hgpo_trl.evaluation.trajectories import read_records
from hgpo_trl.rollout.ahead import RolloutsFailed
from hgpo_trl.trainer import HGPOTrainer
from tests.conftest import unused_port

# make_trainer(name, **config overrides): a trainer of 3 iterations on the server, its output in a folder `name`.
MakeTrainer = Callable[..., HGPOTrainer]
ROOT = Path(__file__).resolve().parents[1]
AHEAD_0 = {"async_generation": True, "max_staleness": 0}
THREAD = "rollouts-ahead"  # the name of the thread that plays ahead (its requests' threads end with their requests)


def weights_digest(model) -> str:
    """A digest of every parameter's bytes: equal only for the very same weights."""
    digest = hashlib.sha256()
    for name, parameter in sorted(model.named_parameters()):
        digest.update(name.encode() + parameter.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


def outcome(trainer: HGPOTrainer) -> dict:
    """Each iteration's steps as dumped in the run's folder (every run that wrote there), the trained weights'
    digest, the losses, staleness and waits logged, and whether a thread that plays ahead is left."""
    logs = [h for h in trainer.state.log_history if "env/success_rate" in h]
    dumps = sorted((Path(trainer.args.output_dir) / "trajectories").glob("iter_*.jsonl"))
    return {"steps": [[(r["episode"], r["step"], r["output"], r["action"], r["reward"]) for r in read_records(dump)]
                      for dump in dumps],
            "weights": weights_digest(trainer.model), "loss": [h["loss"] for h in logs],
            "staleness_max": [h.get("async/staleness/max") for h in logs],
            "rollout_wait": [h.get("time/rollout_wait") for h in logs],
            "thread_left": trainer._ahead is not None or any(t.name == THREAD for t in threading.enumerate())}


def played_ahead(make_trainer: MakeTrainer) -> dict:
    """The same three iterations synchronous, then played ahead with max_staleness 0 and 1."""
    runs = {}
    for name, ahead in (("sync", {}), ("ahead_0", AHEAD_0), ("ahead_1", {**AHEAD_0, "max_staleness": 1})):
        trainer = make_trainer(name, **ahead)
        trainer.train()
        runs[name] = outcome(trainer)
    return runs


class AtStepEnd(TrainerCallback):
    """Calls `action` once, at the end of optimizer step `step` (before the weights are pushed: the push's callback
    is added when the run starts, after this one)."""

    def __init__(self, step: int, action: Callable[[], None]):
        self.step, self.action = step, action

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.action()


def interrupted_and_resumed(make_trainer: MakeTrainer) -> dict:
    """Played ahead (max_staleness 0), a SIGINT at the end of step 1: the run stops at the next iteration's end with
    a checkpoint, the thread (and the rollout it was playing) stopped; a new trainer resumes it there."""
    trainer = make_trainer("interrupted", **AHEAD_0)
    trainer.add_callback(AtStepEnd(1, lambda: signal.raise_signal(signal.SIGINT)))
    trainer.train()
    stopped = {"signal": trainer.signal_stop.signal_name, "global_step": trainer.state.global_step,
               "thread_left": outcome(trainer)["thread_left"], "checkpoint": Path(trainer.signal_stop.checkpoint).name}
    resumed = make_trainer("interrupted", **AHEAD_0)
    resumed.train(resume_from_checkpoint=trainer.signal_stop.checkpoint)
    return {**stopped, "resumed": outcome(resumed)}


def failed_run(make_trainer: MakeTrainer, name: str, step: int, fault: Callable[[], None], **overrides) -> dict:
    """A run played ahead whose server `fault` strikes at the end of optimizer step `step`: the line it stopped
    with, the seconds from the fault to it, the checkpoint it saved, whether a thread is left."""
    trainer, struck = make_trainer(name, **{**AHEAD_0, **overrides}), []
    trainer.add_callback(AtStepEnd(step, lambda: (fault(), struck.append(time.monotonic()))))
    try:
        trainer.train()
        line = None
    except RolloutsFailed as err:
        line = str(err)
    saved = sorted(p.name for p in Path(trainer.args.output_dir).glob("checkpoint-*"))
    return {"line": line, "seconds": time.monotonic() - struck[0] if struck else None, "checkpoints": saved,
            "global_step": trainer.state.global_step, "thread_left": outcome(trainer)["thread_left"]}


def server_failures(make_trainer: MakeTrainer, server: subprocess.Popen) -> dict:
    """The server hung (SIGSTOP, woken after) at the end of step 1 of a run with a 5 s request timeout, then killed
    (its engine's processes too) at the end of step 1 of another run: each stops with one line and a checkpoint."""
    import psutil

    try:
        hung = failed_run(make_trainer, "hung", 1, lambda: os.kill(server.pid, signal.SIGSTOP),
                          vllm_request_timeout=5.0)
    finally:  # (woken however the run ended: the runs after it need the server)
        os.kill(server.pid, signal.SIGCONT)
    engine = psutil.Process(server.pid).children(recursive=True)

    def kill() -> None:
        server.kill()
        for process in engine:
            process.kill()

    return {"hung": hung, "killed": failed_run(make_trainer, "killed", 1, kill, max_staleness=1)}


def two_processes_ahead(path: Path, out: Path, port: int) -> dict:
    """tests/distributed/train_ahead.py under `accelerate launch` of two processes on the server: what each process
    wrote, or the end of the launch's output where it failed."""
    folder = out / "two_processes"
    folder.mkdir()
    # (vLLM set this process's RANK, WORLD_SIZE and MASTER_* for its own torch.distributed: not the launch's)
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu_2proc.yaml",
               "--main_process_port", str(unused_port()), "tests/distributed/train_ahead.py", str(folder),
               f"http://127.0.0.1:{port}", str(path)]
    # A session of its own: however the launch ends (a timeout too), none of its processes is left behind.
    launch = subprocess.Popen(command, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = launch.communicate(timeout=420)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launch.pid, signal.SIGKILL)
    if launch.returncode != 0:
        return {"failed": (stdout[-2000:] + stderr[-4000:])}
    return {"ranks": [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]}
