"""Iterations (one rollout each) as the unit of a run: its stop, learning-rate schedule, progress bar, evaluation
and checkpoint cadence. Under `step_batching="all_steps"` an iteration makes as many optimizer steps as its steps
fill, so optimizer-step counts (`max_steps`, `eval_steps`, `save_steps`) cannot say when an iteration ends; the
trainer can (`IterationTrainer`: what these callbacks read of it; `HGPOTrainer` is one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch.optim.lr_scheduler import LambdaLR
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from hgpo_trl.envs.base import EnvironmentFaults
from hgpo_trl.runtime.collective import any_process
from hgpo_trl.runtime.progress import progress_bar

if TYPE_CHECKING:
    from hgpo_trl.rollout.lockstep import Rollout


class IterationTrainer(Protocol):
    """What the iteration callbacks, the fault streak and the stop on a signal read of a trainer (HGPOTrainer is
    one): TRL's state and arguments, and where the run stands in iterations."""

    args: Any
    state: Any
    accelerator: Any
    model: Any
    _iteration: int  # the iteration being played or trained (1-based)
    _iterations: IterationCount

    @property
    def completed_iterations(self) -> int: ...

    @property
    def at_iteration_boundary(self) -> bool: ...

    def _save_checkpoint(self, model: Any, trial: Any) -> None: ...


@dataclass
class FaultStreak:
    """Iterations in a row in which more than half the episodes of some process failed by environment faults: a
    broken environment must stop the run after `limit` of them (0: never), not let it train on nothing for days."""

    limit: int
    count: int = 0

    def update(self, accelerator, rollout: Rollout) -> str | None:
        """Count `rollout` (every process at once: the decision is collective); at the limit, an example fault
        ("on another process" when this one has none), else None."""
        faults = [e.fault for e in rollout.episodes if e.fault is not None]
        self.count = self.count + 1 if any_process(accelerator, 2 * len(faults) > len(rollout.episodes)) else 0
        if self.limit and self.count >= self.limit:
            return faults[0] if faults else "on another process"
        return None

    def stop_if_broken(self, trainer: IterationTrainer, rollout: Rollout, extra_batches: int | None = None) -> None:
        """After `limit` mostly-faulted iterations in a row: save a checkpoint and raise, on every process. The
        checkpoint resumes the iteration that stopped: dynamic sampling's task stream goes back to
        `extra_batches`, its position when the iteration started."""
        if (example := self.update(trainer.accelerator, rollout)) is not None:
            if extra_batches is not None:
                trainer._iterations.extra_batches = extra_batches
            trainer._save_checkpoint(trainer.model, trial=None)
            raise EnvironmentFaults(
                f"environment faults: more than half the episodes failed in {self.limit} iterations in a row "
                f"(iteration {trainer._iteration}; e.g. {example}). A checkpoint was saved in "
                f"{trainer.args.output_dir}; fix the environment (or raise env_step_timeout / max_faulty_iterations) "
                "and resume with --resume_from_checkpoint")


@dataclass
class IterationCount:
    started: int = 0  # rollouts started: the 1-based number of the iteration being played or trained
    extra_batches: int = 0  # dynamic sampling's extra rollout batches played: the position of their task stream


class IterationCadence(TrainerCallback):
    """At the end of an iteration's last optimizer step: evaluate every `eval_every_iterations` and save every
    `save_every_iterations` (checkpoints land on iteration boundaries only), both also after the last iteration
    (as the release validates and saves at its last step); under all_steps, stop after `train_iterations`.
    A multiple crossed counts even when the iterations on it collected no step (they make no optimizer step)."""

    def __init__(self, trainer: IterationTrainer):
        self.trainer = trainer
        self.previous = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.previous = self.trainer.completed_iterations  # a resumed run's

    def on_step_end(self, args, state, control, **kwargs):
        if not self.trainer.at_iteration_boundary:
            return
        done, previous = self.trainer.completed_iterations, self.previous
        self.previous = done
        last = args.train_iterations is not None and done >= args.train_iterations
        for every, flag in ((args.eval_every_iterations, "should_evaluate"),
                            (args.save_every_iterations, "should_save")):
            if every and (done // every > previous // every or last):
                setattr(control, flag, True)
        if args.step_batching == "all_steps" and last:
            control.should_training_stop = True


class EarlyStop(TrainerCallback):
    """Stops the run once validation success has been at or above `early_stop_success` for
    `early_stop_patience` evaluations in a row during training (the success rate is the gathered one, so every
    process stops together), and checkpoints the weights it stopped at; `reason` says why for the summary.
    Evaluations before training (cli's, `eval_on_start`) and after it, and a resumed run's past, do not count.
    A stop decided inside an iteration (`eval_steps` under fixed_budget) waits for the iteration's last optimizer
    step: checkpoints and the iteration count hold at iteration boundaries only."""

    def __init__(self, trainer: IterationTrainer):
        self.trainer = trainer
        self.streak = 0
        self.training = self.pending = False
        self.reason: str | None = None  # why the run stopped, once it has
        self.decision = ""

    def on_train_begin(self, args, state, control, **kwargs):
        self.streak, self.training, self.pending, self.reason = 0, True, False, None

    def on_step_end(self, args, state, control, **kwargs):
        if self.pending and self.trainer.at_iteration_boundary:
            self.pending = False
            if not self._last(args, state):  # (the iteration that ended was the run's last: nothing to stop)
                self._stop(control)

    def on_train_end(self, args, state, control, **kwargs):
        self.training = False

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        success = (metrics or {}).get("eval_success_rate")
        if args.early_stop_success is None or success is None or not self.training or state.global_step == 0:
            return
        self.streak = self.streak + 1 if success >= args.early_stop_success else 0
        if self.streak >= args.early_stop_patience and not self._last(args, state) and not self.pending:
            self.decision = (f"stopped early: validation success >= {args.early_stop_success:g} at "
                             f"{self.streak} evaluation{'s' * (self.streak > 1)} in a row")
            if self.trainer.at_iteration_boundary:
                self._stop(control)
            else:
                self.pending = True

    def _last(self, args, state) -> bool:
        return (self.trainer.completed_iterations >= args.train_iterations if args.train_iterations is not None
                else state.global_step >= state.max_steps)

    def _stop(self, control) -> None:
        control.should_training_stop = True
        control.should_save = True  # (decided after on_evaluate; a best-checkpoint strategy still applies)
        self.reason = self.decision


class IterationProgress(ProgressCallback):
    """The Trainer's progress bar, counted in iterations when the run is (its own counts optimizer steps up to
    `max_steps`, which under all_steps is only an upper bound) and made as every bar is (`progress_bar`: none
    where the console is no terminal), without the Trainer's printed metrics dicts unless `console_metrics` asks
    for them (`reporting.IterationLine` prints one line per log instead)."""

    def __init__(self, trainer: IterationTrainer):
        super().__init__()
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.current_step = self._done(args, state)  # a resumed run's
        if state.is_world_process_zero:
            in_iterations = args.train_iterations is not None
            # (where bars do not show, no lines of its own: each iteration prints its [iter] line)
            self.training_bar = progress_bar(total=args.train_iterations if in_iterations else state.max_steps,
                                             initial=self.current_step, unit="iteration" if in_iterations else "it",
                                             dynamic_ncols=True, lines=False)

    def on_step_end(self, args, state, control, **kwargs):
        done = self._done(args, state)
        if state.is_world_process_zero and done > self.current_step:
            self.training_bar.update(done - self.current_step)
        self.current_step = done

    def on_log(self, args, state, control, logs=None, **kwargs):
        if args.console_metrics:  # (printed with tqdm.write, which a bar that is off still does)
            super().on_log(args, state, control, logs=logs, **kwargs)

    def _done(self, args, state) -> int:
        """What the bar counts: completed iterations, or optimizer steps when the run is not counted in those."""
        return self.trainer.completed_iterations if args.train_iterations is not None else state.global_step


def iteration_schedule(scheduler: LambdaLR, completed_iterations: Callable[[], int]) -> LambdaLR:
    """The Trainer's schedule (built with `train_iterations` as its length) evaluated at the completed
    iterations rather than at the optimizer-step count, so every optimizer step of an iteration has the same
    learning rate and warm-up / decay are counted in iterations."""
    if not isinstance(scheduler, LambdaLR):
        raise ValueError(f"step_batching='all_steps' schedules the learning rate by iteration and needs a schedule "
                         f"defined by a function of the step (constant, linear, cosine, ...); "
                         f"{type(scheduler).__name__} is not one: choose another lr_scheduler_type")
    lambdas = [lambda _step, f=f: f(completed_iterations()) for f in scheduler.lr_lambdas]
    return LambdaLR(scheduler.optimizer, lambdas)
