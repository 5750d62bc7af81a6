"""Ctrl-C and SIGTERM during training (hgpo_trl.training.interrupts): the first stops the run at the end of the iteration
being played, with a checkpoint there and one line that says how to resume; the resumed run continues from it."""

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hgpo_trl.trainer import HGPOTrainer
from tests.test_cli import TINY_RUN, write

RUN = TINY_RUN + "train_iterations: 4\nwarmstart_steps: 2\nwarmstart_batch_size: 8\nplots: false\n" \
                 "save_every_iterations: 3\neval_every_iterations: 1\n"


def signal_during(monkeypatch, iteration: int, number: int = signal.SIGINT) -> list[int]:
    """Send `number` to this process as training iteration `iteration` starts its rollout (mid-iteration);
    returns the iterations whose rollouts started, in order."""
    started: list[int] = []
    play = HGPOTrainer._play

    def playing(self, tasks, group_size, temperature, description="rollout", **kwargs):
        if description.endswith("rollout"):  # (a training rollout, "iteration N rollout"; not an evaluation chunk)
            started.append(self._iteration + 1)
            if started[-1] == iteration and started.count(iteration) == 1:
                os.kill(os.getpid(), number)
        return play(self, tasks, group_size, temperature, description, **kwargs)

    monkeypatch.setattr(HGPOTrainer, "_play", playing)
    return started


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_iteration_stops_at_its_end_with_a_checkpoint_and_the_resume_continues(
        tmp_path, monkeypatch, capfd, number):
    from hgpo_trl.commands.train import main

    config = write(tmp_path, RUN)
    started = signal_during(monkeypatch, 2, number)
    with pytest.raises(SystemExit) as stop:
        main(["--config", config])
    assert stop.value.code == 128 + number
    out = capfd.readouterr().out
    name = signal.Signals(number).name
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert started == [1, 2] and checkpoint.is_dir()  # iteration 2 was finished, not cut: its checkpoint
    assert f"[stop] {name}: the run stops when iteration 2 ends" in out
    assert out.strip().splitlines()[-1] == (f"train.py: stopped by {name} after iteration 2; checkpoint {checkpoint}; "
                                            f"resume with: python train.py --config {config} "
                                            f"--resume_from_checkpoint {checkpoint}")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["iterations"], summary["stopped_by_signal"], summary["checkpoint"]) == (2, name, str(checkpoint))
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    assert [h.get("iteration", 0) for h in history if "eval_success_rate" in h] == [0, 1]  # none after iteration 2
    assert signal.getsignal(number) is signal.default_int_handler or signal.getsignal(number) == signal.SIG_DFL

    started.clear()
    main(["--config", config, "--resume_from_checkpoint", str(checkpoint)])
    assert started == [3, 4]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["iterations"], summary["stopped_by_signal"]) == (4, None)


class DefaultAction(BaseException):
    """What a signal's default action would do to this test process (end it), raised instead."""


@pytest.fixture
def default_actions_raise():
    """SIGTERM's and SIGHUP's default action would end this test process: where the code under test takes no such
    signal of its own, the handler it finds raises `DefaultAction` instead."""

    def ending(number, frame):
        raise DefaultAction(f"{signal.Signals(number).name} took its default action: the process would have ended "
                            "without a word")

    previous = {number: signal.signal(number, ending) for number in (signal.SIGTERM, signal.SIGHUP)}
    yield
    for number, handler in previous.items():
        signal.signal(number, handler)


@pytest.mark.parametrize("numbers", [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGTERM)],
                         ids=["a scheduler's SIGTERM and the launcher's forward", "accelerate's SIGTERM after a Ctrl-C"])
def test_a_stop_delivered_again_still_ends_with_its_checkpoint_and_the_resume_line(
        tmp_path, monkeypatch, capfd, numbers, default_actions_raise):
    """A scheduler signals every process of a job and the launcher forwards its own copy; accelerate's one-process
    launcher answers a Ctrl-C with a SIGTERM: each once ended the run at once, nothing saved. The copies (here
    two at iteration 2's start and one more while train.py draws its plots, within the window) are the same
    stop: iteration 2 ends with its checkpoint, the plots and the line that resumes it."""
    import hgpo_trl.commands.train as command
    import hgpo_trl.runtime.signals as signals
    from hgpo_trl.commands.train import main

    monkeypatch.setattr(signals, "REPEAT_SECONDS", 600.0)  # every copy within the window, however slow this machine
    started: list[int] = []
    play, plot = HGPOTrainer._play, command.plot_learning

    def playing(self, tasks, group_size, temperature, description="rollout", **kwargs):
        if description.endswith("rollout"):
            started.append(self._iteration + 1)
            if len(started) == 2:
                for number in numbers:
                    os.kill(os.getpid(), number)
        return play(self, tasks, group_size, temperature, description, **kwargs)

    def plotting(*args):
        os.kill(os.getpid(), numbers[-1])  # (after train(): the command's handler, no longer the trainer's)
        return plot(*args)

    monkeypatch.setattr(HGPOTrainer, "_play", playing)
    monkeypatch.setattr(command, "plot_learning", plotting)
    config = write(tmp_path, RUN.replace("plots: false", "plots: true"))
    with pytest.raises(SystemExit) as stop:
        main(["--config", config])
    name = signal.Signals(numbers[0]).name
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert stop.value.code == 128 + numbers[0] and started == [1, 2] and checkpoint.is_dir()
    out, err = capfd.readouterr()
    assert out.count(f"[stop] {name}: ") == 1 and "again: stopped at once" not in out + err
    assert out.strip().splitlines()[-1] == (f"train.py: stopped by {name} after iteration 2; checkpoint {checkpoint}; "
                                            f"resume with: python train.py --config {config} "
                                            f"--resume_from_checkpoint {checkpoint}")
    assert (tmp_path / "out" / "learning.png").is_file()


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_after_the_window_stops_at_once_in_one_line(tmp_path, monkeypatch, capfd, number):
    """The user's second signal: it comes after the first's window (REPEAT_SECONDS, shortened here)."""
    import hgpo_trl.runtime.signals as signals
    from hgpo_trl.commands.train import main

    monkeypatch.setattr(signals, "REPEAT_SECONDS", 0.2)
    started: list[int] = []
    play = HGPOTrainer._play

    def playing(self, tasks, group_size, temperature, description="rollout", **kwargs):
        if description.endswith("rollout"):  # (a training rollout, "iteration N rollout"; not an evaluation chunk)
            started.append(self._iteration + 1)
            if len(started) == 2:
                os.kill(os.getpid(), number)
                time.sleep(0.3)  # (the handler ran at once, in this thread: the window is over)
                os.kill(os.getpid(), number)
        return play(self, tasks, group_size, temperature, description, **kwargs)

    monkeypatch.setattr(HGPOTrainer, "_play", playing)
    with pytest.raises(SystemExit) as stop:
        main(["--config", write(tmp_path, RUN)])
    assert stop.value.code == 128 + number and started == [1, 2]  # (as a shell reports a process the signal ended)
    name = signal.Signals(number).name
    out, err = capfd.readouterr()
    assert err.strip().splitlines()[-1] == (f"train.py: {name} again: stopped at once; nothing since the last checkpoint "
                                            "is saved (the last checkpoint: none)")
    assert out.strip().splitlines()[-1].startswith(f"[stop] {name}: the run stops when")
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    assert signal.getsignal(number) in (signal.default_int_handler, signal.SIG_DFL)  # put back, though train() raised


def test_a_signal_while_a_resume_loads_its_checkpoint_stops_it_before_its_first_iteration(tmp_path, monkeypatch, capfd):
    """The handlers are in place before the checkpoint loads; the Trainer's on_train_begin used to forget a
    signal that came then (the run announced "iteration 1 ... this one has run 740 s", the time since boot, and
    trained on). Nothing was played since the checkpoint: the run stops before its first iteration, one line
    says so with the command that resumes it."""
    from hgpo_trl.commands.train import main

    config = write(tmp_path, RUN)
    main(["--config", config, "--train_iterations", "1", "--save_every_iterations", "1"])
    checkpoint = tmp_path / "out" / "checkpoint-1"
    load = HGPOTrainer._load_optimizer_and_scheduler

    def loading(self, resume_from_checkpoint):
        os.kill(os.getpid(), signal.SIGTERM)
        return load(self, resume_from_checkpoint)

    monkeypatch.setattr(HGPOTrainer, "_load_optimizer_and_scheduler", loading)
    started = signal_during(monkeypatch, 0)
    capfd.readouterr()
    argv = ["--config", config, "--resume_from_checkpoint", str(checkpoint)]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 128 + signal.SIGTERM and started == []
    assert [p.name for p in (tmp_path / "out").glob("checkpoint-*")] == ["checkpoint-1"]
    out, err = capfd.readouterr()
    assert out.strip().splitlines()[-1].startswith("[stop] SIGTERM: the run stops before its first iteration (it is "
                                                   "starting);")
    assert err.strip().splitlines()[-1] == (
        f"train.py: stopped by SIGTERM before iteration 2 began (it came as the run started); nothing since the last "
        f"checkpoint is saved (the last checkpoint: {checkpoint}); resume with: python train.py --config {config} "
        f"--resume_from_checkpoint {checkpoint}")


def test_a_sigterm_while_the_run_starts_ends_it_in_one_line(tmp_path, monkeypatch, capfd, default_actions_raise):
    """Before train() (the model's build, the warm start, the evaluation before training) a scheduler's SIGTERM
    took its default action: the run ended without a line. It ends as a Ctrl-C there does, in one line."""
    import hgpo_trl.commands.train as command

    load = command.load_model

    def loading(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        return load(*args)

    monkeypatch.setattr(command, "load_model", loading)
    with pytest.raises(SystemExit) as stop:
        command.main(["--config", write(tmp_path, RUN)])
    assert stop.value.code == 128 + signal.SIGTERM
    assert capfd.readouterr().err.strip().splitlines()[-1] == (
        "train.py: interrupted by SIGTERM; nothing since the last checkpoint is saved (the last checkpoint: none)")


def test_the_handlers_are_put_back_when_training_fails(tmp_path, tiny_model, tiny_tokenizer):
    """The Trainer calls no on_train_end when training raises: a notebook kept our handler (a Ctrl-C then only
    asked for a stop, and the trainer stayed alive in it)."""
    from tests.test_trainer import make_config, make_trainer

    before = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path))

    def failing(*args, **kwargs):
        raise RuntimeError("injected: the rollout failed")

    trainer._play = failing
    with pytest.raises(RuntimeError, match="injected"):
        trainer.train()
    assert {number: signal.getsignal(number) for number in before} == before


def test_a_signal_during_an_iteration_s_training_names_that_iteration(tmp_path, monkeypatch, capfd):
    """Under fixed_budget the iteration count moves when the rollout ends, before its training: a signal then
    still waits for that iteration, and the line says which."""
    from hgpo_trl.commands.train import main

    loss = HGPOTrainer.compute_loss

    def computing(self, *args, **kwargs):
        if self._iteration == 2 and not getattr(self, "signalled", False):
            self.signalled = True
            os.kill(os.getpid(), signal.SIGTERM)
        return loss(self, *args, **kwargs)

    monkeypatch.setattr(HGPOTrainer, "compute_loss", computing)
    with pytest.raises(SystemExit):
        main(["--config", write(tmp_path, RUN)])
    out = capfd.readouterr().out
    assert "[stop] SIGTERM: the run stops when iteration 2 ends" in out
    assert "train.py: stopped by SIGTERM after iteration 2;" in out


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_in_a_rehearsal_between_its_launches_is_one_line(stop, monkeypatch, capsys, default_actions_raise):
    """Outside its launches (the model's build, the report) SIGTERM and SIGHUP took their default action: the
    rehearsal ended without a line. Each ends it as a Ctrl-C does, 128 + the signal."""
    import hgpo_trl.rehearsal.rehearse as rehearse_module
    from hgpo_trl.rehearsal.launch import RehearsalError, rehearsal_failed

    def interrupted(argv):
        os.kill(os.getpid(), getattr(signal, stop))
        time.sleep(5)  # (the handler runs before this ends)

    monkeypatch.setattr(rehearse_module, "rehearsal_report", interrupted)
    with pytest.raises(RehearsalError) as err:
        rehearse_module.rehearse([])
    with pytest.raises(SystemExit) as ended:
        rehearsal_failed(err.value)
    assert ended.value.code == 128 + getattr(signal, stop)
    assert capsys.readouterr().err == f"train.py --rehearse: interrupted by {stop}, with no launch running\n"


def test_a_signal_during_the_rehearsals_op_build_stops_the_build(monkeypatch, default_actions_raise):
    """DeepSpeed's op build is a process of its own (a first build runs compilers for minutes): a SIGTERM left it
    running. It is stopped, with whatever it started, and the rehearsal says so in one line."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs the deepspeed extra")
    import psutil

    import hgpo_trl.rehearsal.rehearse as rehearse_module
    from hgpo_trl.rehearsal.launch import RehearsalError, build_deepspeed_op

    builds: list[psutil.Process] = []
    signalled = threading.Event()

    def signal_once_it_builds():
        deadline = time.monotonic() + 60
        while not builds and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):  # (a child that ended as it was read)
                builds.extend(p for p in psutil.Process().children() if "build_shm_op" in " ".join(p.cmdline()))
            time.sleep(0.05)
        if not builds:
            return
        with contextlib.suppress(psutil.Error):
            builds.extend(builds[0].children(recursive=True))
        os.kill(os.getpid(), signal.SIGTERM)
        signalled.set()

    sender = threading.Thread(target=signal_once_it_builds, daemon=True)

    def building(argv):
        sender.start()
        build_deepspeed_op()
        signalled.wait(60)  # (a build faster than the signal: it lands here, still inside the rehearsal)

    monkeypatch.setattr(rehearse_module, "rehearsal_report", building)
    try:
        with pytest.raises(RehearsalError, match="^interrupted by SIGTERM, with no launch running$"):
            rehearse_module.rehearse([])
    finally:
        sender.join(60)  # (no SIGTERM after this test)
    assert builds and not [p for p in builds if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


# ------------------------------------------------------------------ real launches, signalled from outside
ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))


def launch_paused(out: Path, launch: list[str], processes: int) -> subprocess.Popen:
    """`accelerate launch` of tests/resume/train_or_die.py into `out`, in a session of its own (a terminal's Ctrl-C
    reaches its process group, not this test), returned once every process waits inside iteration 2."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    launched = subprocess.Popen([ACCELERATE, "launch", *launch, str(ROOT / "tests" / "resume" / "train_or_die.py"),
                                 str(out), "iterations=4", "pause_at=2"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 400
    while len(list(out.glob("paused-rank*"))) < processes:
        if launched.poll() is not None or time.monotonic() > deadline:
            launched.kill()
            pytest.fail(f"the launch ended or hung before iteration 2:\n{launched.communicate()[0][-3000:]}")
        time.sleep(0.1)
    return launched


def ended(launched: subprocess.Popen, out: Path) -> str:
    """The launch's output once it ended, after it was let go on (the file its processes wait for)."""
    (out / "go").touch()
    return launched.communicate(timeout=300)[0]


@pytest.mark.slow
def test_a_scheduler_s_sigterm_to_every_process_of_a_launch_ends_with_the_checkpoint(tmp_path, free_port):
    """SLURM signals every process of a job at a preemption: the ranks first and the launcher 0.5 s later (the
    stagger of issue 55), whose forward reached each rank a second time; one rank stopped at once and the other
    died in gloo's "Connection closed by peer", nothing saved. The forward is the same stop: iteration 2 ends
    with its checkpoint on both ranks."""
    launched = launch_paused(tmp_path, ["--config_file", "configs/accelerate/cpu_2proc.yaml", "--main_process_port",
                                        str(free_port)], processes=2)
    for rank in sorted(tmp_path.glob("paused-rank*")):
        os.kill(int(rank.read_text()), signal.SIGTERM)
    time.sleep(0.5)
    launched.send_signal(signal.SIGTERM)
    time.sleep(1)  # (the launcher's forward reaches the ranks while they still wait inside iteration 2)
    output = ended(launched, tmp_path)
    assert launched.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-2"], output[-3000:]
    assert output.count("[stop] SIGTERM: the run stops when iteration 2 ends") == 2
    assert "again: stopped at once" not in output
    assert f"[stop] stopped by SIGTERM after iteration 2: {tmp_path / 'checkpoint-2'} holds it" in output


@pytest.mark.slow
def test_a_ctrl_c_under_a_one_process_launch_ends_with_the_checkpoint_and_names_accelerates_kill(tmp_path):
    """accelerate's one-process launcher answers a terminal's Ctrl-C with a SIGTERM to the process the Ctrl-C
    reached, and kills it 5 s later: the SIGTERM stopped the run at once, nothing saved. It is the same stop; the
    iteration ends within the 5 s with its checkpoint, and the first line says what the launcher does."""
    launched = launch_paused(tmp_path, ["--num_processes", "1", "--cpu"], processes=1)
    os.killpg(launched.pid, signal.SIGINT)  # a terminal's Ctrl-C: every process of the foreground group
    output = ended(launched, tmp_path)
    assert launched.returncode == 128 + signal.SIGINT, output[-3000:]
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-2"], output[-3000:]
    assert "[stop] SIGINT: the run stops when iteration 2 ends" in output
    assert "again: stopped at once" not in output
    assert "accelerate launch kills this process 5 s after a Ctrl-C or SIGTERM reaches it" in output
    assert f"[stop] stopped by SIGINT after iteration 2: {tmp_path / 'checkpoint-2'} holds it" in output
