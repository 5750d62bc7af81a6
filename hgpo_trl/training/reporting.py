"""What a person sees of a run: one line per iteration, `summary.json`, and PNG plots in `output_dir`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tqdm import tqdm
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from hgpo_trl.runtime.progress import progress_bar


class IterationLine(TrainerCallback):
    """Prints one readable line per iteration (success, reward, invalid rate, the time split) and per evaluation:
    the console's default; the full metrics go to `report_to` and trainer_state.json (`console_metrics`: also
    to the console)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if "env/success_rate" in logs:
            tqdm.write(f"[iter {logs.get('iteration', state.global_step):>4}] success {logs['env/success_rate']:.2f}  "
                       f"reward {logs['env/episode_reward']:6.2f}  invalid {logs['env/invalid_rate']:.2f}  "
                       f"length {logs['env/episode_length']:4.1f}  | gen {logs['time/generation']:.1f}s  "
                       f"env {logs['time/env']:.1f}s  adv {1e3 * logs['time/advantages']:.1f}ms  "
                       f"train {logs['time/training']:.1f}s")
        elif "eval_success_rate" in logs:
            score = f"  score {logs['eval_score']:.2f}" if "eval_score" in logs else ""
            tqdm.write(f"[eval {logs.get('iteration', state.global_step):>4}] success {logs['eval_success_rate']:.2f} "
                       f"on {int(logs['eval_tasks'])} task{'s' * (logs['eval_tasks'] != 1)}  reward {logs['eval_episode_reward']:.2f}{score}")


class InvalidOutputWarning(TrainerCallback):
    """Says so, once, when most outputs of the run's first `window` iterations (a resumed run's own: it named
    iterations 1-5 after a resumed 11-15) were invalid actions: such a run learns next to nothing, and its flat
    curve alone does not say why."""

    def __init__(self, window: int = 5, threshold: float = 0.5):
        self.window, self.threshold, self.rates, self.iterations = window, threshold, [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "env/invalid_rate" not in logs:
            return
        self.rates.append(logs["env/invalid_rate"])
        self.iterations.append(logs.get("iteration", state.global_step))
        first = self.iterations[0]
        last = min(self.window, args.train_iterations - first + 1 if args.train_iterations else self.window)
        if len(self.rates) == last and sum(self.rates) / last > self.threshold:
            span = f"iteration {first}" if last == 1 else f"iterations {first}-{self.iterations[-1]}"
            tqdm.write(f"[warning] {sum(self.rates) / last:.0%} of the outputs of {span} were invalid "
                       "actions, so most steps teach nothing. A tiny model needs a longer warm start "
                       "(warmstart_steps); a pretrained one, the answer format it is asked for (action_mode, "
                       "format_instruction) and room to write it (max_completion_length). env/invalid_rate tracks it.")


class BarOnly(ProgressCallback):
    """The Trainer's progress bar, made as every bar is (`progress_bar`: lines where bars do not show), counting
    `unit`s under `desc`, with the last logged loss and without the metrics dicts the Trainer prints (a warm
    start's run statistics)."""

    def __init__(self, desc: str | None = None, unit: str = "it"):
        super().__init__()
        self.desc, self.unit = desc, unit

    def on_train_begin(self, args, state, control, **kwargs):
        self.current_step = state.global_step
        if state.is_world_process_zero:
            self.training_bar = progress_bar(total=state.max_steps, initial=self.current_step, desc=self.desc,
                                             unit=self.unit, dynamic_ncols=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and "loss" in (logs or {}):
            self.training_bar.set_postfix(loss=f"{logs['loss']:.3f}", refresh=False)

    def close(self) -> None:
        """The bar closed where train() raised before its end closed it (where bars do not show, its lines would
        go on)."""
        if self.training_bar is not None:
            self.training_bar.close()
            self.training_bar = None


def set_up_reporting(trainer) -> None:
    """The console of a run: the progress bar, `IterationLine`'s lines and `InvalidOutputWarning`; TRL's metrics
    dicts only with `console_metrics` (HF's PrinterCallback prints them under disable_tqdm, `IterationProgress`
    otherwise, which replaces the Trainer's bar, or its HTML bar in a notebook, to show bars only where
    `progress.bar_style` says). TensorBoard writes into output_dir: its writer opens at the first log, and
    evaluate() before train() would otherwise put it in ./runs."""
    from transformers.integrations import TensorBoardCallback
    from transformers.integrations.integration_utils import default_logdir
    from transformers.trainer import DEFAULT_PROGRESS_CALLBACK

    from hgpo_trl.training.iterations import IterationProgress

    handler, args = trainer.callback_handler, trainer.args
    for callback in handler.callbacks:
        if isinstance(callback, TensorBoardCallback) and callback.logging_dir is None:
            callback.logging_dir = os.path.join(args.output_dir, default_logdir())
    if not args.console_metrics:
        handler.remove_callback(PrinterCallback)
    if not args.disable_tqdm:
        handler.remove_callback(DEFAULT_PROGRESS_CALLBACK)
        handler.add_callback(IterationProgress(trainer))
    if not any(isinstance(callback, IterationLine) for callback in handler.callbacks):
        handler.add_callback(IterationLine())
    handler.add_callback(InvalidOutputWarning())


class EvaluationBeforeTraining(TrainerCallback):
    """train() starts a fresh log history: put the evaluation made before it back at its head (as step 0), so
    the checkpoints carry it and a resumed run still knows, plots and reports where the run started."""

    def __init__(self, metrics: dict[str, Any]):
        self.record = {**metrics, "step": 0}

    def on_train_begin(self, args, state, control, **kwargs):
        state.log_history.insert(0, self.record)


def start_evaluation(log_history: list[dict[str, Any]]) -> dict[str, Any]:
    """The evaluation before training (step 0) in a log history, or {} when none was made."""
    return next((h for h in log_history if h.get("step") == 0 and "eval_success_rate" in h), {})


def write_summary(output_dir: str | Path, summary: dict[str, Any]) -> Path:
    path = Path(output_dir) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, default=str))
    return path


def iteration_axis(log_history: list[dict[str, Any]]) -> list[float]:
    """Per record, the iteration it belongs to: training logs carry it, an evaluation takes the last training
    log's (0 before training). Histories written before logs carried it fall back to the optimizer step."""
    if not any("iteration" in h for h in log_history):
        return [h.get("step", 0) for h in log_history]
    axis, current = [], 0
    for h in log_history:
        current = h.get("iteration", current)
        axis.append(current)
    return axis


def plot_learning(log_history: list[dict[str, Any]], path: str | Path) -> Path:
    """Success rate and episode reward per iteration (training rollouts), with the evaluations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    at = list(zip(iteration_axis(log_history), log_history, strict=True))
    train = [(x, h) for x, h in at if "env/success_rate" in h]
    evals = [(x, h) for x, h in at if "eval_success_rate" in h]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for axis, key, eval_key in ((top, "env/success_rate", "eval_success_rate"),
                                (bottom, "env/episode_reward", "eval_episode_reward")):
        axis.plot([x for x, _ in train], [h[key] for _, h in train], label="training rollouts")
        axis.plot([x for x, _ in evals], [h[eval_key] for _, h in evals], "o-", label="validation")
    top.set_ylabel("success rate")
    top.set_ylim(-0.02, 1.02)
    top.legend(loc="lower right")
    bottom.set_ylabel("episode reward")
    bottom.set_xlabel("iteration")
    _titled(fig, "Learning: success and reward per iteration",
            "lines: the training rollouts of each iteration; dots: the validation games at each evaluation")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_levels(log_history: list[dict[str, Any]], group_sizes: list[list[int]], path: str | Path) -> Path:
    """HGPO's levels: the share of steps with a peer at each level per iteration, and the group-size histogram
    of each level in the last rollout (the paper's group-size figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    train = [(x, h) for x, h in zip(iteration_axis(log_history), log_history, strict=True)
             if "hgpo/level0_with_peers" in h]
    levels = sorted(int(k.removeprefix("hgpo/level").removesuffix("_with_peers"))
                    for k in (train[0][1] if train else {}) if k.startswith("hgpo/level"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for k in levels:
        left.plot([x for x, _ in train], [h[f"hgpo/level{k}_with_peers"] for _, h in train], label=f"level {k}")
    left.set_xlabel("iteration")
    left.set_ylabel("share of steps with a peer")
    left.set_ylim(-0.02, 1.02)
    left.legend()
    width = 0.8 / max(len(group_sizes), 1)
    for k, histogram in enumerate(group_sizes):
        sizes = [s for s, count in enumerate(histogram) if count and s > 0]
        offset = (k - (len(group_sizes) - 1) / 2) * width  # the levels' bars side by side, centred on the size
        right.bar([s + offset for s in sizes], [histogram[s] for s in sizes], width=width, label=f"level {k}")
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_xlabel("group size (steps)")
    right.set_ylabel("groups in the last rollout")
    if group_sizes:
        right.legend()
    _titled(fig, "HGPO's hierarchy of groups",
            "level k: the steps of a task group that share the current observation and the k (observation, action) "
            "pairs before it")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _titled(fig, title: str, line: str) -> None:
    """A figure's title and, under it in smaller type, the one line that says how to read it."""
    inches = fig.get_figheight()  # the two lines take the same room (in inches) whatever the figure's height
    fig.suptitle(title, y=1 - 0.08 / inches, va="top", fontsize=12)
    fig.text(0.5, 1 - 0.34 / inches, line, ha="center", va="top", fontsize=8.5, color="0.3")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.55 / inches))
