"""The evaluation protocol, one for the trainer's `evaluate()` and `hgpo-eval`: every task played once, as many
at a time as there are environments, its step records numbered across those chunks; the episodes' totals, and
from them success, score and episode length; per seed, success per task type, and mean and std over seeds as the
HGPO paper reports them; the report as JSON and a Markdown table."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import TextEnv, make_env
from hgpo_trl.evaluation.trajectories import TASK_TYPE_FIELDS, rollout_records, write_records
from hgpo_trl.rollout.lockstep import Episode, Policy, Rollout, RolloutSettings, ScriptedPolicy, run_rollout
from hgpo_trl.rollout.outcomes import episode_totals, success_and_score
from hgpo_trl.runtime.collective import elementwise_process_sum
from hgpo_trl.runtime.progress import progress_bar

DEFAULT_SPLITS = {"alfworld": ("valid_seen", "valid_unseen"), "webshop": ("test",), "keydoor": ("valid",)}
SPLIT_LABELS = {("alfworld", "valid_seen"): "in-distribution", ("alfworld", "valid_unseen"): "out-of-distribution"}


def play_in_chunks(tasks: Sequence[Mapping[str, Any]], chunk_size: int,
                   play_chunk: Callable[[list[Mapping[str, Any]], int, int], Rollout], *, min_chunks: int = 0,
                   record_args: HGPOConfig | None = None) -> tuple[list[Episode], list[dict[str, Any]]]:
    """Every task played once, `chunk_size` at a time by `play_chunk(tasks, chunk_index, chunks)` (one rollout
    per task), in at least `min_chunks` calls: a process whose tasks are done still plays empty chunks while
    another's are not (generation may be collective). The episodes in task order and, with `record_args` (the
    config, as `rollout_records` reads it), the step records, episodes numbered across chunks so that a
    reader keeps them apart."""
    chunks = max(min_chunks, math.ceil(len(tasks) / chunk_size))
    episodes: list[Episode] = []
    records: list[dict[str, Any]] = []
    for c in range(chunks):
        chunk = list(tasks[c * chunk_size:(c + 1) * chunk_size])
        rollout = play_chunk(chunk, c, chunks)
        episodes += rollout.episodes  # one rollout per task: episode k played chunk[k]
        if record_args is not None:
            for record in rollout_records(rollout, chunk, None, record_args):
                record["episode"] += c * chunk_size
                records.append(record)
    return episodes, records


def play_shared(tasks: Sequence[Mapping[str, Any]], chunk_size: int,
                play_chunk: Callable[[list[Mapping[str, Any]], int, int], Rollout], accelerator, *,
                record_args: HGPOConfig | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """`play_in_chunks` with the tasks shared out among the processes (process i plays every i-th task), every
    process playing as many chunks as the busiest one (generation may be collective): the episode totals over
    every process, and this process's step records. Every process must call it."""
    processes = accelerator.num_processes
    busiest = max(1, math.ceil(math.ceil(len(tasks) / processes) / chunk_size))
    episodes, records = play_in_chunks(tasks[accelerator.process_index::processes], chunk_size, play_chunk,
                                       min_chunks=busiest, record_args=record_args)
    totals = episode_totals(episodes)
    return dict(zip(totals, elementwise_process_sum(accelerator, list(totals.values())), strict=True)), records


def validation_metrics(totals: Mapping[str, float], prefix: str = "eval") -> dict[str, float]:
    """The trainer's evaluation metrics from the totals over every process: `prefix`_success_rate, _score and
    _faulted as hgpo-eval reports them (`hgpo_trl.rollout.outcomes`), the episode's mean reward and length, the tasks."""
    count = max(totals["episodes"], 1.0)
    return {**{f"{prefix}_{name}": value for name, value in success_and_score(totals).items()},
            f"{prefix}_episode_reward": totals["reward"] / count, f"{prefix}_episode_length": totals["steps"] / count,
            f"{prefix}_tasks": count}


def seeded_env(seed: int, name: str, kwargs: Mapping[str, Any]) -> TextEnv:
    """A new environment, with Python's global `random` seeded in the process that steps it (a worker, for slow
    environments): ALFWorld's expert breaks ties with it."""
    random.seed(seed)
    return make_env(name, **kwargs)


def play_split(envs, tasks: Sequence[Mapping[str, Any]], player: Policy | ScriptedPolicy, settings: RolloutSettings, *,
         scripted: bool, count_tokens: Callable[[str], int] | None, description: str, quiet: bool,
         dump: Path | None, args: HGPOConfig) -> list[Episode]:
    """hgpo-eval's play of one split: every task once, len(envs) at a time; the episodes in task order. A progress
    bar counts the turns played: a chunk's games play in lock-step and tend to end together, so a count of games
    would stand still and then jump, and its rate and ETA would mean nothing. Its total is `max_steps` a chunk (a
    chunk that ends sooner jumps by the turns it did not need: a notebook's widget bar keeps its first total);
    the games done and the success so far follow it.
    `dump` receives the trajectories (hgpo_trl.evaluation.trajectories reads them)."""
    chunks = math.ceil(len(tasks) / len(envs))
    with progress_bar(total=chunks * settings.max_steps, desc=description, unit="turn", disabled=quiet,
                      dynamic_ncols=True) as bar:
        played = ended = wins = 0  # turns of the chunks played (max_steps each); games ended and won

        def on_turn(turn: int, live: int) -> None:  # (called as turn `turn` of the chunk starts)
            bar.update(played + turn - bar.n)

        def on_episode_end(episode: Episode) -> None:
            nonlocal ended, wins
            ended, wins = ended + 1, wins + episode.won
            bar.set_postfix(games=f"{ended}/{len(tasks)}", success=f"{wins / ended:.3f}", refresh=False)

        def play_chunk(chunk: list[Mapping[str, Any]], index: int, chunks: int) -> Rollout:
            nonlocal played
            rollout = run_rollout(envs, chunk, 1, player, settings, on_turn=on_turn, on_episode_end=on_episode_end,
                                  count_tokens=count_tokens, scripted=scripted)
            played += settings.max_steps
            bar.update(played - bar.n)
            return rollout

        episodes, records = play_in_chunks(tasks, len(envs), play_chunk, record_args=args if dump else None)
    if dump is not None:
        write_records(dump, records)
    return episodes


def seed_outcome(seed: int, tasks: Sequence[Mapping[str, Any]], episodes: Sequence[Episode]) -> dict[str, Any]:
    """One seed's row: success, faulted episodes and (when the environment grades outcomes) score, as
    `hgpo_trl.rollout.outcomes` defines them, episode length, invalid outputs, and success per task type when tasks
    have one."""
    totals = episode_totals(episodes)
    row: dict[str, Any] = {"seed": seed, **success_and_score(totals),
                           "episode_length": totals["steps"] / totals["episodes"],
                           "invalid_rate": totals["invalid"] / max(totals["steps"], 1)}
    won = np.array([e.won for e in episodes], dtype=float)
    types = np.array([task_type(task) for task in tasks])
    if all(types):
        row["task_types"] = {t: float(won[types == t].mean()) for t in sorted(set(types))}
    return row


def task_type(task: Mapping[str, Any]) -> str:
    """The task row's own type (ALFWorld's `task_type`), "" when it has none."""
    return next((str(task[f]) for f in TASK_TYPE_FIELDS if f in task), "")


def mean_std(values: Sequence[float]) -> dict[str, float]:
    """Mean and population std over seeds."""
    return {"mean": float(np.mean(values)), "std": float(np.std(values))}


def summarize(env_name: str, policy: str, split: str, tasks: Sequence[Mapping[str, Any]],
              rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One player's result on one split: mean and std over the seeds' rows, which it keeps."""
    result: dict[str, Any] = {"policy": policy, "split": split, "label": SPLIT_LABELS.get((env_name, split)),
                              "tasks": len(tasks), "success_rate": mean_std([r["success_rate"] for r in rows])}
    if all("score" in r for r in rows):
        result["score"] = mean_std([r["score"] for r in rows])
    if all("task_types" in r for r in rows):
        types = [task_type(task) for task in tasks]
        result["task_types"] = {t: {"tasks": types.count(t), **mean_std([r["task_types"][t] for r in rows])}
                                for t in rows[0]["task_types"]}
    result["seeds"] = list(rows)
    return result


def percent(value: dict[str, float] | float) -> str:
    """A fraction, or its mean ± std over seeds, in percent."""
    if isinstance(value, dict):
        return f"{100 * value['mean']:.1f} ± {100 * value['std']:.1f}"
    return f"{100 * value:.1f}"


def markdown(report: Mapping[str, Any]) -> str:
    """The results as a Markdown table in percent, the paper's unit: a row per seed, then mean ± std."""
    results = report["results"]
    types = sorted({t for r in results for t in r.get("task_types", {})})
    scored = any("score" in r for r in results)
    header = ["policy", "split", "seed", "tasks", "success", *(["score"] if scored else []), *types]
    model = f"model `{report['model']}` ({report['backend']}), " if report["model"] else ""
    lines = [f"# Evaluation on {report['env']}", "",
             f"{model}temperature {report['temperature']}, seeds {', '.join(map(str, report['seeds']))}, at most "
             f"{report['max_env_steps']} steps. Success{' and score' if scored else ''} in %; mean ± std "
             "(population) over the seeds.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        split = f"{r['split']} ({r['label']})" if r["label"] else r["split"]
        for row in [*r["seeds"], None]:
            source = r if row is None else row  # None: the mean ± std row
            cells = [r["policy"], split, "mean ± std" if row is None else str(row["seed"]), str(r["tasks"]),
                     percent(source["success_rate"])]
            if scored:
                cells.append(percent(source["score"]) if "score" in source else "–")
            cells += [percent(source["task_types"][t]) if t in source.get("task_types", {}) else "–" for t in types]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(report: Mapping[str, Any], output_dir: Path) -> None:
    """evaluation.json and evaluation.md in `output_dir`."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "evaluation.json").write_text(json.dumps(report, indent=2) + "\n")
    (output_dir / "evaluation.md").write_text(markdown(report))

