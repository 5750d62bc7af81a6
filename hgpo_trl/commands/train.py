"""`train.py` / `hgpo-train`: YAML + command-line configuration (TRL's `TrlParser`) into a training run.

    python train.py --config configs/quickstart.yaml [--learning_rate 1e-3 ...]   # one process
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml train.py --config ...   # several
    python train.py --help        # our fields with their help text (--help-all: TRL's and Transformers' too)

Three sections, all top-level keys of the YAML: `EnvArguments` (below), `HGPOConfig` (the trainer) and TRL's
`ModelConfig` (model path, dtype, LoRA). `model_name_or_path: tiny` builds the offline tiny model and tokenizer.
One process runs without a launcher: accelerate's one-process launcher kills a run 5 s after a Ctrl-C, before the
iteration's checkpoint (docs/trainer.md, "Stops that keep what was learned").
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from accelerate import PartialState
from trl import ModelConfig, get_peft_config

from hgpo_trl.commands.arguments import (
    TINY,
    TRAIN_SECTIONS,
    ConfigError,
    EnvArguments,
    entry_point_scope,
    flag_value,
    parse,
)
from hgpo_trl.commands.parser import answered_help, command_name
from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.base import EnvironmentFaults
from hgpo_trl.evaluation.trajectories import to_html
from hgpo_trl.rollout.ahead import RolloutsFailed
from hgpo_trl.runtime.signals import interrupting
from hgpo_trl.training.reporting import (
    EvaluationBeforeTraining,
    plot_learning,
    plot_levels,
    start_evaluation,
    write_summary,
)

__all__ = ["TINY", "ConfigError", "EnvArguments", "load_model", "load_tasks", "main", "parse", "run"]


def load_tasks(args: HGPOConfig, env_args: EnvArguments, split: str | None, limit: int | None):
    if split is None:
        return None
    try:
        tasks = make_tasks(args.env_name, split, **(env_args.task_kwargs or {}))
    except (ValueError, FileNotFoundError) as err:  # e.g. no ALFWorld data: the environment's message, one line
        raise ConfigError(f"the {args.env_name} tasks of split {split!r}: {err}") from None
    return tasks.select(range(min(limit, len(tasks)))) if limit is not None else tasks


def check_environment(args: HGPOConfig) -> None:
    """One environment built and closed before any model loads: options it refuses (a ValueError, a missing
    extra) fail here in one line, not in a traceback from the tiny model's vocabulary or the first rollout."""
    try:
        make_env(args.env_name, **(args.env_kwargs or {})).close()
    except ValueError as err:  # (MissingExtraError is one)
        raise ConfigError(f"HGPOConfig.env_kwargs: environment {args.env_name!r} cannot be built: {err}") from None


def load_model(model_args: ModelConfig, env_args: EnvArguments, args: HGPOConfig, train_tasks):
    """(model, tokenizer): the offline tiny model built for the environment's vocabulary, or any hub id/path."""
    if model_args.model_name_or_path == TINY:
        from hgpo_trl.models.tiny import make_tiny

        return make_tiny(args.env_name, list(train_tasks), tokenizer=env_args.tiny_tokenizer,
                         env_kwargs=args.env_kwargs, history_length=args.history_length, max_steps=args.max_env_steps,
                         hidden_size=env_args.tiny_hidden_size, num_layers=env_args.tiny_num_layers,
                         num_heads=env_args.tiny_num_heads, vocab_rows=env_args.tiny_vocab_rows, seed=args.seed,
                         progress=not args.disable_tqdm)
    from contextlib import nullcontext

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hgpo_trl.models.warmstart import without_deepspeed_config
    from hgpo_trl.runtime.progress import transformers_bars_as_ours

    kwargs = {"revision": model_args.model_revision, "trust_remote_code": args.trust_remote_code}
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, **kwargs)
        # A model to warm-start loads whole: under ZeRO-3 from_pretrained would partition it. Its "Loading
        # weights" bar shows only where bars do.
        with without_deepspeed_config() if env_args.warmstart_steps > 0 else nullcontext(), \
                transformers_bars_as_ours(args.disable_tqdm):
            model = AutoModelForCausalLM.from_pretrained(
                model_args.model_name_or_path, dtype=model_args.dtype or "auto",
                attn_implementation=model_args.attn_implementation, **kwargs)
    except OSError as err:  # not found, no network, no access: transformers' own message, one line
        raise ConfigError(f"ModelConfig.model_name_or_path: cannot load {model_args.model_name_or_path!r}: "
                          f"{str(err).strip().splitlines()[0]}") from None
    return model, tokenizer


def run_warm_start(model, tokenizer, env_args: EnvArguments, args: HGPOConfig, train_tasks) -> dict[str, float]:
    """The configured supervised warm start of `model` (in place) on random admissible actions; its metrics."""
    from hgpo_trl.models.warmstart import warm_start

    return warm_start(model, tokenizer, partial(make_env, args.env_name, **(args.env_kwargs or {})),
                      list(train_tasks), steps=env_args.warmstart_steps,
                      history_length=args.history_length, max_steps=args.max_env_steps,
                      action_mode=args.action_mode, format_instruction=args.format_instruction,
                      batch_size=env_args.warmstart_batch_size, learning_rate=env_args.warmstart_learning_rate,
                      seed=args.seed, use_cpu=args.use_cpu, progress=not args.disable_tqdm,
                      gradient_checkpointing=args.gradient_checkpointing)


def run(env_args: EnvArguments, args: HGPOConfig, model_args: ModelConfig) -> dict[str, Any]:
    from hgpo_trl.trainer import HGPOTrainer

    start = time.time()
    train_tasks = load_tasks(args, env_args, env_args.train_split, env_args.num_train_tasks)
    eval_tasks = load_tasks(args, env_args, env_args.eval_split, env_args.num_eval_tasks)
    check_environment(args)
    model, tokenizer = load_model(model_args, env_args, args, train_tasks)
    warmstart = {}
    source = model.config._name_or_path  # the model card names it: a warm start changes the weights, not that
    if env_args.warmstart_steps > 0:
        if not args.resume_from_checkpoint:  # a resumed run's checkpoint holds the warm-started weights
            warmstart = run_warm_start(model, tokenizer, env_args, args, train_tasks)
        if args.beta != 0.0 or model_args.use_peft:
            # The run starts from weights made in memory, not the loaded path's: the trainer saves them (reused on
            # a resume) as the KL reference, or with PEFT as the base model that the adapter names.
            model.config._name_or_path = ""
    trainer = HGPOTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=train_tasks,
                          eval_dataset=eval_tasks, peft_config=get_peft_config(model_args))
    trainer.base_model = source
    trainer.clock.start = start
    trainer.signal_stop.announce = False  # (main's last line names the checkpoint, with the command that resumes it)
    if eval_tasks is not None and env_args.eval_before_training and not args.resume_from_checkpoint:
        # (a resumed run has it in its log history)
        trainer.add_callback(EvaluationBeforeTraining(trainer.evaluate()))
    from hgpo_trl.training.checkpoints import ResumeError

    try:
        trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    except ResumeError as err:  # refused before any step
        raise ConfigError(str(err)) from None
    stopped = trainer.signal_stop.signal_name  # a signal's stop: its checkpoint, no final save or evaluation
    if not stopped:
        trainer.save_model(args.output_dir)  # before the final evaluation: nothing trained is lost if it fails
    before = start_evaluation(trainer.state.log_history)
    # The cadence may just have evaluated these weights (eval_every_iterations evaluates after the last iteration).
    last = next((h for h in reversed(trainer.state.log_history) if "eval_success_rate" in h), {})
    fresh = last.get("step") == trainer.state.global_step and not args.load_best_model_at_end
    after = (last if fresh or stopped else trainer.evaluate()) if eval_tasks is not None else {}
    if not stopped:
        trainer.create_model_card()  # again, now with the final evaluation
    summary = {
        "success_rate_start": before.get("eval_success_rate"),
        "success_rate_end": after.get("eval_success_rate"),
        "iterations": trainer.completed_iterations,
        "stopped_early": trainer.early_stop.reason,  # None: every train_iteration ran
        # A signal's stop: which signal, and the checkpoint it saved; else the newest checkpoint (None: none).
        "stopped_by_signal": stopped,
        "checkpoint": trainer.signal_stop.checkpoint if stopped else last_checkpoint(args.output_dir),
        "optimizer_steps": trainer.state.global_step,
        # A resumed run: the runs it continues (each up to its checkpoint), then its own.
        "wall_seconds": round(sum(segments := trainer.clock.segments()), 1), "wall_seconds_segments": segments,
        **warmstart,
        "config": {"env": dataclasses.asdict(env_args), "trainer": args.to_dict(),
                   "model": dataclasses.asdict(model_args)},
    }
    if trainer.accelerator.is_main_process:
        if args.trajectory_dump_every:  # the run's dumps drawn for a browser (hgpo-view)
            summary["trajectory_view"] = str(to_html(args.output_dir))
        write_summary(args.output_dir, summary)
        if env_args.plots:
            plot_learning(trainer.state.log_history, Path(args.output_dir) / "learning.png")
            if trainer.last_level_stats:
                plot_levels(trainer.state.log_history, [s.group_sizes.tolist() for s in trainer.last_level_stats],
                            Path(args.output_dir) / "hgpo_levels.png")
    trainer.close_environments()
    return summary


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if answered_help(argv, TRAIN_SECTIONS, "train.py"):
        return
    if wants_rehearsal(argv):
        rehearse_main(argv)
    with entry_point_scope(), interrupting():  # (SIGTERM as Ctrl-C: one line, wherever the run is)
        args = None
        try:
            env_args, args, model_args = parse(argv)
            summary = run(env_args, args, model_args)
        except ConfigError as err:  # the command line, or found while loading the tasks or the model
            print(f"{command_name('train.py')}: configuration error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        except (EnvironmentFaults, RolloutsFailed) as err:  # environments, a server failing: the line says what was saved
            print(f"{command_name('train.py')}: {err}", file=sys.stderr)
            raise SystemExit(1) from None
        except KeyboardInterrupt as err:  # outside training, as it started, or a second signal during it
            checkpoint = last_checkpoint(args.output_dir) if args else None
            resume = f"; resume with: {resume_command(argv, checkpoint)}" if checkpoint else ""
            print(f"{command_name('train.py')}: {err or 'interrupted'}; nothing since the last checkpoint is saved "
                  f"(the last checkpoint: {checkpoint or 'none'}){resume}", file=sys.stderr)
            raise SystemExit(128 + getattr(err, "signal", signal.SIGINT)) from None
        if summary["stopped_by_signal"]:
            if PartialState().is_main_process:  # (every process stopped; one line)
                print(f"{command_name('train.py')}: stopped by {summary['stopped_by_signal']} after iteration "
                      f"{summary['iterations']}; checkpoint {summary['checkpoint']}; resume with: "
                      f"{resume_command(argv, summary['checkpoint'])}")
            raise SystemExit(128 + getattr(signal, summary["stopped_by_signal"], signal.SIGTERM))
    early = f" ({summary['stopped_early']})" if summary["stopped_early"] else ""
    view = f"; what the agent did: {summary['trajectory_view']}" if "trajectory_view" in summary else ""
    print(f"validation success {rounded(summary['success_rate_start'])} -> {rounded(summary['success_rate_end'])} in "
          f"{summary['iterations']} iterations{early}, {summary['wall_seconds']:.0f} s; see "
          f"{args.output_dir}/summary.json{view}")


def last_checkpoint(output_dir: str) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(output_dir) if Path(output_dir).is_dir() else None


def resume_command(argv: list[str], checkpoint: str) -> str:
    """The command line that continues this run from `checkpoint`: the same options, resume_from_checkpoint set."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg.split("=")[0] == "--resume_from_checkpoint":
            skip = not skip and "=" not in arg
            continue
        kept.append(arg)
    launch = "accelerate launch [the same launch options]" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "python"
    return f"{launch} {shlex.join(['train.py', *kept, '--resume_from_checkpoint', checkpoint])}"


def rounded(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def wants_rehearsal(argv: list[str]) -> bool:
    """Whether the command line says --rehearse (alone, or with a true value)."""
    for i, arg in enumerate(argv):
        if arg.split("=")[0] == "--rehearse":
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "true")
            return flag_value(value) is not False
    return False


def rehearse_main(argv: list[str]) -> None:
    """`--rehearse`: the rehearsal's report; exit 0 when every check passed, 1 when one failed or a launch
    did, 2 on a configuration error, 128 + the signal that stopped it."""
    from hgpo_trl.rehearsal.launch import RehearsalError, rehearsal_failed
    from hgpo_trl.rehearsal.rehearse import passed, rehearse

    with entry_point_scope():
        try:
            report = rehearse(argv)
        except ConfigError as err:
            print(f"{command_name('train.py')}: configuration error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        except RehearsalError as err:
            rehearsal_failed(err)  # one line; exit 1, or 128 + the signal that stopped it
    raise SystemExit(0 if passed(report) else 1)


if __name__ == "__main__":  # the rehearsal's launches run `python -m hgpo_trl.commands.train`
    main()
