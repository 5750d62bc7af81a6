"""Learning curves of every advantage estimator on the quickstart setting (tiny model, keydoor, CPU).

    python benchmarks/learning.py                          # 6 estimators x seeds 0 1 2 (hours on 2 cores)
    python benchmarks/learning.py --estimators grpo hgpo_k2 --seeds 0 --iterations 30 --eval_steps 5
    python benchmarks/learning.py --jobs 2                 # two runs at a time, one process and thread each
    python benchmarks/learning.py --resume                 # after an interruption: only the missing runs
    python benchmarks/learning.py --resume --update-results   # the table and plot into docs/results.md

Each run is train.py's own path (hgpo_trl.commands.train: parse, load_tasks, load_model, HGPOTrainer) on `--config`. Any
option this script does not know (e.g. `--num_eval_tasks 32 --learning_rate 3e-4`) overrides the config as on
train.py's command line; the estimator fields, `seed` and `train_iterations` are set per run here.

Fairness: the warm-started model (tiny model + supervised warm start) is built ONCE per seed and saved under
`output_dir/warmstart/seed<N>`; every estimator of that seed loads it (a weights checksum per run proves it) and
trains with the same seed, so the runs of a seed differ only by their advantage estimator.

Writes to `--output_dir` (default outputs/learning):
- curves.json: per run, training success per iteration and validation success per evaluation (iteration 0 is
  the warm-started model), wall time, the command and the resolved config. Rewritten after every run, so an
  interrupted benchmark continues with `--resume`.
- learning.png: mean validation success per estimator vs iteration, min-max band over seeds; training success.
- learning.md: the table printed at the end (final and best validation success, iterations to `--target`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import multiprocessing
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a checkout's run, nothing installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from transformers import PrinterCallback, ProgressCallback
from trl import get_peft_config

from hgpo_trl.commands.train import ConfigError, load_model, load_tasks, parse, run_warm_start
from hgpo_trl.models.tiny import save_tiny
from hgpo_trl.training.reporting import IterationLine

# Every field an estimator needs is set explicitly, so a label means the same thing whatever the config says;
# alpha, gamma, base_group, omega and progpo_lambda come from the config. K=4 with the quickstart's
# history_length 2 is the paper's setting too (configs/alfworld/hgpo_k4_*): HGPOConfig warns about it.
ESTIMATORS: dict[str, dict[str, Any]] = {
    "grpo": {"estimator": "grpo"},
    "gigpo": {"estimator": "gigpo"},
    "hgpo_k2": {"estimator": "hgpo", "hierarchy_depth": 2, "weighting": "power"},
    "hgpo_k4": {"estimator": "hgpo", "hierarchy_depth": 4, "weighting": "power"},
    "hgpo_k2_inverse_mse": {"estimator": "hgpo", "hierarchy_depth": 2, "weighting": "inverse_mse"},
    "progpo": {"estimator": "progpo", "hierarchy_depth": 2},
    "gigpo_dynamic": {"estimator": "gigpo", "dynamic_sampling": True},  # (not in the default set: --estimators)
}
# Set by this script for every run. logging_steps 1: one training log per iteration (more would average
# iterations together); save_strategy no: runs are resumed whole, checkpoints would only cost time and disk.
FORCED = ("seed", "train_iterations", "logging_steps", "save_strategy", "estimator", "hierarchy_depth",
          "weighting", "max_steps", "resume_from_checkpoint")
START, END = "<!-- learning-curves:start -->", "<!-- learning-curves:end -->"
HEADING = "## Learning curves (benchmarks/learning.py)"


# ---------------------------------------------------------------------------------------------- runs
def config_argv(settings: dict[str, Any], output_dir: Path, seed: int, **fields: Any) -> list[str]:
    """train.py's command line for one run: the config, the user's overrides, then what this script sets
    (last, so it wins)."""
    forced = {"output_dir": output_dir, "seed": seed, "train_iterations": settings["iterations"],
              "logging_steps": 1, "save_strategy": "no", **fields}
    return ["--config", settings["config_file"], *settings["overrides"],
            *[part for key, value in forced.items() for part in (f"--{key}", str(value))]]


def weights_sha256(model) -> str:
    """A checksum of every parameter and buffer, in name order: equal checksums mean equal starting weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        # Raw bytes, whatever the dtype (numpy has no bfloat16).
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def build_warm_start(settings: dict[str, Any], seed: int, folder: Path) -> dict[str, Any]:
    """The model and the warm start of hgpo_trl.commands.train.run for this seed, saved to `folder` for every estimator."""
    env_args, args, model_args = parse(config_argv(settings, folder, seed))
    tick = time.time()
    train_tasks = load_tasks(args, env_args, env_args.train_split, env_args.num_train_tasks)
    model, tokenizer = load_model(model_args, env_args, args, train_tasks)
    metrics = run_warm_start(model, tokenizer, env_args, args, train_tasks) \
        if env_args.warmstart_steps > 0 else {}
    save_tiny(model, tokenizer, folder)  # save_pretrained of both: any model, not only the tiny one
    record = {"seed": seed, "path": str(folder), "sha256": weights_sha256(model),
              "seconds": round(time.time() - tick, 1), **metrics}
    # Written last: a folder without it is an interrupted warm start, rebuilt on --resume.
    (folder / "warmstart.json").write_text(json.dumps(record, indent=2))
    return record


def train_run(settings: dict[str, Any], name: str, seed: int, warm: dict[str, Any], run_dir: Path, command: str,
              verbose: bool) -> dict[str, Any]:
    """One estimator from the seed's warm start: validation before, every eval_steps, and at the end."""
    from hgpo_trl.trainer import HGPOTrainer

    env_args, args, model_args = parse(config_argv(settings, run_dir, seed, **ESTIMATORS[name]))
    model_args.model_name_or_path = warm["path"]  # load_model then reads the saved warm start
    tick, cpu = time.time(), time.process_time()
    train_tasks = load_tasks(args, env_args, env_args.train_split, env_args.num_train_tasks)
    eval_tasks = load_tasks(args, env_args, env_args.eval_split, env_args.num_eval_tasks)
    model, tokenizer = load_model(model_args, env_args, args, train_tasks)
    checksum = weights_sha256(model)
    if checksum != warm["sha256"]:
        raise RuntimeError(f"{name} seed {seed}: the loaded weights differ from the warm start saved in "
                           f"{warm['path']}; the estimators would not start from the same model")
    trainer = HGPOTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=train_tasks,
                          eval_dataset=eval_tasks, peft_config=get_peft_config(model_args))
    # One line per run is the progress report: drop the log dicts printed every iteration (x runs), and the
    # bar; --verbose prints train.py's line per iteration instead.
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    if verbose:
        trainer.add_callback(IterationLine())
    try:
        before = trainer.evaluate()  # the warm start itself: iteration 0 of every estimator's curve
        trainer.train()
        # Optimizer steps per rollout iteration (1 in the quickstart), to put logs on the iteration axis.
        per_iteration = args.max_steps / args.train_iterations
        history = trainer.state.log_history
        tasks = args.tasks_per_device * trainer.accelerator.num_processes
        train = [{"iteration": math.ceil(h["step"] / per_iteration - 1e-9), "success": h["env/success_rate"],
                  "reward": h["env/episode_reward"], "invalid": h["env/invalid_rate"],
                  "groups": h.get("dynamic/groups_kept", tasks), "batches": h.get("dynamic/rollout_batches", 1)}
                 for h in history if "env/success_rate" in h]
        evals = [{"iteration": 0, "success": before["eval_success_rate"],
                  "reward": before["eval_episode_reward"]}]
        evals += [{"iteration": math.ceil(h["step"] / per_iteration - 1e-9), "success": h["eval_success_rate"],
                   "reward": h["eval_episode_reward"]} for h in history if "eval_success_rate" in h]
        # The iterations that ran: all of them, or fewer where the early stop ended the run.
        trained = math.ceil(trainer.state.global_step / per_iteration - 1e-9)
        if evals[-1]["iteration"] != trained:  # eval_steps does not divide the iterations that ran
            after = trainer.evaluate()
            evals.append({"iteration": trained, "success": after["eval_success_rate"],
                          "reward": after["eval_episode_reward"]})
    finally:
        trainer.close_environments()
    return {
        "estimator": name, "seed": seed, "options": ESTIMATORS[name], "train": train, "eval": evals,
        "iterations": trained, "stopped_early": trainer.early_stop.reason,
        "eval_tasks": len(eval_tasks), "wall_seconds": round(time.time() - tick, 1),
        "cpu_seconds": round(time.process_time() - cpu, 1), "groups_trained": sum(r["groups"] for r in train),
        "warmstart_sha256": checksum, "warmstart": warm["path"], "command": command,
        "config": {"env": dataclasses.asdict(env_args), "trainer": args.to_dict(),
                   "model": dataclasses.asdict(model_args)},
    }


def completed(jobs: int, function: Callable[..., Any], calls: list[tuple[Any, tuple]]) -> Iterator[tuple[Any, Any]]:
    """(key, function(*arguments)) for each (key, arguments) of `calls`, as they finish: in this process when
    `jobs` is 1, else in `jobs` fresh processes (spawned: no torch state is forked). A failure stops the rest."""
    if jobs == 1:
        for key, arguments in calls:
            yield key, function(*arguments)
        return
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = {pool.submit(function, *arguments): key for key, arguments in calls}
        for future in as_completed(futures):
            yield futures[future], future.result()
    finally:
        pool.shutdown(cancel_futures=True)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically: an interruption while writing leaves the previous curves.json, never half of one."""
    staging = path.with_suffix(".json.tmp")
    staging.write_text(json.dumps(data, indent=1, default=str))
    os.replace(staging, path)


# ---------------------------------------------------------------------------------------------- reports
def by_estimator(data: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Runs grouped by estimator, in ESTIMATORS order, seeds ascending."""
    groups = {name: sorted((r for r in data["runs"].values() if r["estimator"] == name), key=lambda r: r["seed"])
              for name in ESTIMATORS}
    return {name: runs for name, runs in groups.items() if runs}


def first_reach(run: dict[str, Any], target: float) -> int | None:
    return next((e["iteration"] for e in run["eval"] if e["success"] >= target), None)


def table(data: dict[str, Any], target: float) -> str:
    """estimator | seeds | final validation success mean ± std | best | iterations to target | wall time."""
    lines = [f"| estimator | seeds | final validation success | best | iterations to {target:g} | wall time per run |",
             "|---|---|---|---|---|---|"]
    for name, runs in by_estimator(data).items():
        final = np.array([r["eval"][-1]["success"] for r in runs])
        # Over seeds, the sample std; one seed has none to show.
        final_text = f"{final.mean():.2f} ± {final.std(ddof=1):.2f}" if len(final) > 1 else f"{final[0]:.2f}"
        best = max(e["success"] for r in runs for e in r["eval"])
        reached = [it for r in runs if (it := first_reach(r, target)) is not None]
        to_target = f"{np.mean(reached):.0f} ({len(reached)}/{len(runs)} seeds)" if reached else "not reached"
        wall = np.mean([r["wall_seconds"] for r in runs])
        wall_text = f"{wall:.1f} s" if wall < 10 else f"{wall:.0f} s" if wall < 120 else f"{wall / 60:.1f} min"
        lines.append(f"| {name} | {len(runs)} | {final_text} | {best:.2f} | {to_target} | "
                     f"{wall_text} |")
    return "\n".join(lines)


def notes(data: dict[str, Any], target: float) -> str:
    """What the table's columns are measured on."""
    runs = list(data["runs"].values())
    trainer = runs[0]["config"]["trainer"]
    # eval_steps counts optimizer steps: in iterations for the reader.
    every = trainer["eval_steps"] * trainer["train_iterations"] / trainer["max_steps"]
    when = "after it" if trainer["eval_strategy"] != "steps" else "after every iteration" if every == 1 else \
        f"every {every:g} iterations"
    temperature = "greedy" if trainer["eval_temperature"] == 0 else f"temperature {trainer['eval_temperature']:g}"
    warm = [w["seconds"] for w in data["warmstarts"].values()]
    return (f"{data['config']['iterations']} iterations; validation success on {runs[0]['eval_tasks']} held-out "
            f"tasks ({temperature}) before training and {when}. Final: the last evaluation, "
            f"mean ± std over seeds; best: the highest evaluation of any seed; iterations to {target:g}: the first "
            f"evaluation at or above it, mean over the seeds that reach it. Wall time: training and evaluations "
            f"of one run, without the warm start (built once per seed and shared: {np.mean(warm):.0f} s).")


def plot(data: dict[str, Any], path: Path) -> None:
    """Mean validation success per estimator with its min-max band over seeds; training success below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, runs in by_estimator(data).items():
        # Only the evaluations every seed has (they coincide unless a run was made with other settings).
        curves = [{e["iteration"]: e["success"] for e in r["eval"]} for r in runs]
        iterations = sorted(set.intersection(*(set(c) for c in curves)))
        values = np.array([[c[i] for i in iterations] for c in curves])
        line, = top.plot(iterations, values.mean(0), "o-", markersize=3, label=f"{name} ({len(runs)} seeds)")
        top.fill_between(iterations, values.min(0), values.max(0), color=line.get_color(), alpha=0.15)
        # Training success is noisy per iteration (8 tasks): a moving average over up to 10 iterations.
        length = min(len(r["train"]) for r in runs)
        train = np.mean([[t["success"] for t in r["train"][:length]] for r in runs], axis=0)
        window = max(1, min(10, length))
        smooth = np.convolve(train, np.ones(window) / window, mode="valid")
        x = [t["iteration"] for t in runs[0]["train"][window - 1:length]]
        bottom.plot(x, smooth, color=line.get_color(), label=name)
    top.set_ylabel("validation success (mean, min-max)")
    top.set_ylim(-0.02, 1.02)
    top.legend(loc="best", fontsize=8)
    bottom.set_ylabel("training success (seed mean,\n10-iteration moving average)")
    bottom.set_ylim(-0.02, 1.02)
    bottom.set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def update_results(results_file: Path, data: dict[str, Any], png: Path, target: float) -> None:
    """Replace what lies between the markers of `results_file` (add them, under a heading, at the end if
    absent) and copy the plot beside it; everything outside the markers is left as it was."""
    text = results_file.read_text()
    # outputs/ is not tracked: the plot goes beside the results file, so the committed link resolves.
    picture = "learning_curves.png"
    shutil.copyfile(png, results_file.parent / picture)
    section = (f"{START}\n`{data['command']}`, {datetime.date.today().isoformat()}. {notes(data, target)}\n\n"
               f"{table(data, target)}\n\n![learning curves]({picture})\n{END}")
    if START not in text and END not in text:
        text = f"{text.rstrip()}\n\n{HEADING}\n\n{section}\n"
    elif text.count(START) == 1 and text.count(END) == 1 and text.index(START) < text.index(END):
        head, rest = text.split(START)
        text = head + section + rest.split(END, 1)[1]
    else:
        raise SystemExit(f"learning.py: {results_file} must hold one {START} before one {END}; fix it by hand")
    results_file.write_text(text)


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    # No abbreviations: `--seed 3` must not become `--seeds 3`; unknown options go to train.py's parser.
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--config", default="configs/quickstart.yaml", help="train.py config to train")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, help="rollout iterations per run (default: the config's)")
    parser.add_argument("--estimators", nargs="+", default=[name for name in ESTIMATORS if name != "gigpo_dynamic"],
                        choices=list(ESTIMATORS))
    parser.add_argument("--output_dir", default="outputs/learning")
    parser.add_argument("--target", type=float, default=0.9, help="validation success the table times")
    parser.add_argument("--resume", action="store_true",
                        help="skip the runs already in curves.json (without it, curves.json starts over)")
    parser.add_argument("--update-results", action="store_true",
                        help="write the table into the marked section of --results_file")
    parser.add_argument("--results_file", default="docs/results.md", help="the file --update-results edits")
    parser.add_argument("--verbose", action="store_true", help="one line per iteration, as train.py prints")
    parser.add_argument("--jobs", type=int, default=1,
                        help="warm starts and runs at a time, each in its own process with one thread "
                             "(OMP_NUM_THREADS); the results do not depend on it")
    options, overrides = parser.parse_known_args(argv)
    command = shlex.join(["python", "benchmarks/learning.py", *argv])

    if options.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {options.jobs}")
    reserved = [o for o in overrides if o.startswith("--") and o[2:].split("=")[0] in FORCED]
    if reserved:
        parser.error(f"{', '.join(reserved)}: set per run by this script ({', '.join(FORCED)}); use --seeds, "
                     "--iterations, --estimators")
    out = Path(options.output_dir)
    try:  # the config and the overrides are checked now, not after hours of runs
        env_args, args, _ = parse(["--config", options.config, *overrides, "--output_dir", str(out)])
    except ConfigError as err:
        parser.error(f"configuration error: {err}")
    if env_args.eval_split is None:
        parser.error("the curves need validation tasks: eval_split must name a split")
    iterations = options.iterations or args.train_iterations
    if not iterations:
        parser.error(f"{options.config} sets no train_iterations: pass --iterations")
    settings = {"config_file": options.config, "config_yaml": Path(options.config).read_text(),
                "overrides": overrides, "iterations": iterations}

    curves_path = out / "curves.json"
    data = {"command": command, "config": settings, "warmstarts": {}, "runs": {}}
    if options.resume and curves_path.exists():
        data = json.loads(curves_path.read_text())
        if data["config"] != settings:
            raise SystemExit(f"learning.py: {curves_path} was made with another config, overrides or iteration "
                             "count; use another --output_dir, or drop --resume to start over")
        data["command"] = command
    out.mkdir(parents=True, exist_ok=True)

    todo = [(seed, name) for seed in options.seeds for name in options.estimators
            if f"{name}/seed{seed}" not in data["runs"]]
    for seed, name in [(s, n) for s in options.seeds for n in options.estimators if (s, n) not in todo]:
        print(f"[learning] {name} seed {seed}: in {curves_path}, skipped")
    # Each seed's warm start first: every run of the seed loads it.
    build = []
    for seed in dict.fromkeys(seed for seed, _ in todo):
        folder = out / "warmstart" / f"seed{seed}"
        marker = folder / "warmstart.json"  # the last file a warm start writes
        if options.resume and marker.exists():  # the disk is the truth: the runs load from it
            # The path as seen from here, whichever directory the warm start was built from.
            data["warmstarts"][str(seed)] = {**json.loads(marker.read_text()), "path": str(folder)}
            print(f"[learning] warm start seed {seed}: reused {folder}")
        else:
            build.append((seed, (settings, seed, folder)))
    for seed, warm in completed(options.jobs, build_warm_start, build):
        data["warmstarts"][str(seed)] = warm
        print(f"[learning] warm start seed {seed}: {warm['seconds']:.0f} s -> {warm['path']}", flush=True)
    calls = [((seed, name), (settings, name, seed, data["warmstarts"][str(seed)],
                             out / "runs" / name / f"seed{seed}", command, options.verbose)) for seed, name in todo]
    for index, ((seed, name), run) in enumerate(completed(options.jobs, train_run, calls), 1):
        data["runs"][f"{name}/seed{seed}"] = run
        write_json(curves_path, data)  # after every run: an interruption loses at most the runs in progress
        last = [t["success"] for t in run["train"][-10:]]
        print(f"[learning] run {index}/{len(todo)} {name} seed {seed}: validation {run['eval'][0]['success']:.2f}"
              f" -> {run['eval'][-1]['success']:.2f} (best {max(e['success'] for e in run['eval']):.2f}), "
              f"training success {np.mean(last):.2f} over the last {len(last)} iterations, "
              f"{run['wall_seconds']:.0f} s", flush=True)

    if not data["runs"]:
        raise SystemExit("learning.py: no runs to report")
    write_json(curves_path, data)  # the latest command, even when every run was skipped
    plot(data, out / "learning.png")
    markdown = table(data, options.target)
    (out / "learning.md").write_text(f"# Learning curves: {options.config}\n\n`{command}`\n\n"
                                     f"{notes(data, options.target)}\n\n{markdown}\n\n![learning curves]"
                                     f"(learning.png)\n")
    if options.update_results:
        update_results(Path(options.results_file), data, out / "learning.png", options.target)
        print(f"[learning] updated the learning-curves section of {options.results_file}")
    print(f"\n{markdown}\n\n{curves_path}, {out / 'learning.png'}, {out / 'learning.md'}")
    return data


if __name__ == "__main__":
    main()
