"""Ctrl-C and SIGTERM during training (hgpo_trl.training.interrupts): the first stops the run at the end of the iteration
being played, with a checkpoint there and one line that says how to resume; the resumed run continues from it."""

import json
import os
import signal

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

    def playing(self, tasks, group_size, temperature, description="rollout"):
        if description.endswith("rollout"):  # (a training rollout, "iteration N rollout"; not an evaluation chunk)
            started.append(self._iteration + 1)
            if started[-1] == iteration and started.count(iteration) == 1:
                os.kill(os.getpid(), number)
        return play(self, tasks, group_size, temperature, description)

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
    out, err = capfd.readouterr()
    name = signal.Signals(number).name
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert started == [1, 2] and checkpoint.is_dir()  # iteration 2 was finished, not cut: its checkpoint
    assert f"[stop] {name}: the run stops when iteration 2 ends" in err
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


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_stops_at_once_in_one_line(tmp_path, monkeypatch, capfd, number):
    from hgpo_trl.commands.train import main

    started: list[int] = []
    play = HGPOTrainer._play

    def playing(self, tasks, group_size, temperature, description="rollout"):
        if description.endswith("rollout"):  # (a training rollout, "iteration N rollout"; not an evaluation chunk)
            started.append(self._iteration + 1)
            if len(started) == 2:
                os.kill(os.getpid(), number)
                os.kill(os.getpid(), number)
        return play(self, tasks, group_size, temperature, description)

    monkeypatch.setattr(HGPOTrainer, "_play", playing)
    with pytest.raises(SystemExit) as stop:
        main(["--config", write(tmp_path, RUN)])
    assert stop.value.code == 128 + number and started == [1, 2]  # (as a shell reports a process the signal ended)
    name = signal.Signals(number).name
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1] == (f"train.py: {name} again: stopped at once; nothing since the last checkpoint is saved (the last "
                       "checkpoint: none)") and err[-2].startswith(f"[stop] {name}: the run stops when")
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    assert signal.getsignal(number) in (signal.default_int_handler, signal.SIG_DFL)  # put back, though train() raised


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
    out, err = capfd.readouterr()
    assert "[stop] SIGTERM: the run stops when iteration 2 ends" in err
    assert "train.py: stopped by SIGTERM after iteration 2;" in out


def test_a_ctrl_c_in_a_rehearsal_between_its_launches_exits_130_in_one_line(monkeypatch, capsys):
    import hgpo_trl.rehearsal.rehearse as rehearse_module
    from hgpo_trl.rehearsal.launch import RehearsalError, rehearsal_failed

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(rehearse_module, "rehearsal_report", interrupted)
    with pytest.raises(RehearsalError) as err:
        rehearse_module.rehearse([])
    with pytest.raises(SystemExit) as stop:
        rehearsal_failed(err.value)
    assert stop.value.code == 130
    assert capsys.readouterr().err == "train.py --rehearse: interrupted by SIGINT, with no launch running\n"
