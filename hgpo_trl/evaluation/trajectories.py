"""Trajectory dumps: what the agent did, one JSON line per step, and their readers.

    python -m hgpo_trl.evaluation.trajectories show outputs/run/trajectories/iter_000010.jsonl [--episode 3] [--prompt]
    python -m hgpo_trl.evaluation.trajectories summary outputs/run/trajectories/iter_000010.jsonl
    hgpo-view outputs/run        # one self-contained HTML page of the run's dumps (hgpo_trl/evaluation/viewer.py draws it)

A record holds the task, the step index (`step`; dumps before 2026-12-04 named it `t`, still read), the prompt, the
memory window it showed (`window`: that many earlier steps), the raw model output, the parsed action (null when
invalid), validity and an invalid step's `reason` (its action mode's words), the observation the step acted on,
reward, discounted return, advantage, HGPO's groups (`level_groups`: the step's group id at each level k = 0..K, -1
without level k; level 0 is GiGPO's anchor group, similarity clusters where `similarity_threshold` is set), the
levels where it had a peer, the share of each level's item in its advantage (`level_weights`, estimator hgpo), and
the episode's outcome (won, fault, score). An episode aborted by an environment fault, whose steps are never
trained, is one record of its outcome alone (the step's fields null), so that the summary counts every episode
played, as the metrics do (`hgpo_trl.rollout.outcomes`). The trainer writes them every `trajectory_dump_every`
iterations and at every evaluation (`output_dir/trajectories/`).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hgpo_trl.advantages import discounted_returns
from hgpo_trl.advantages.hgpo import hgpo_level_groups, hgpo_level_weights
from hgpo_trl.evaluation.viewer import render
from hgpo_trl.rollout.lockstep import Episode, Rollout
from hgpo_trl.rollout.outcomes import episode_totals, success_and_score

if TYPE_CHECKING:
    from hgpo_trl.config import HGPOConfig

TASK_TYPE_FIELDS = ("task_type", "type")  # a task row's own type (ALFWorld), if it has one


STEP_FIELDS = ("step", "prompt", "window", "output", "prompt_tokens", "completion_tokens", "action", "valid",
               "observation", "reward", "return", "advantage", "level_groups", "peer_levels",
               "level_weights", "reason")  # null in a faulted episode's outcome record


def rollout_records(rollout: Rollout, tasks: Sequence[Mapping[str, Any]], advantages: np.ndarray | None,
                    config: HGPOConfig) -> list[dict[str, Any]]:
    """One record per step of `rollout` (whose task groups index `tasks`), then one outcome record per faulted
    episode. `config`'s gamma and invalid_penalty give the returns, its depth and `similarity_threshold` HGPO's
    groups; with `advantages` from estimator hgpo, its options give each level's share of the advantage."""
    records = []
    if rollout.steps:
        batch = rollout.step_batch()
        returns = discounted_returns(batch, config.gamma, config.invalid_penalty)
        groups = hgpo_level_groups(batch, config.depth, config.similarity_threshold)
        sizes = np.stack([np.bincount(g + 1)[g + 1] for g in groups.T], axis=1)  # (-1: no level k, counted apart)
        weights = hgpo_level_weights(batch, **config.estimator_options()) \
            if advantages is not None and config.estimator == "hgpo" else None
        episodes = {e.traj: e for e in rollout.episodes}
        for i, step in enumerate(rollout.steps):
            records.append({
                **episode_fields(episodes[step.traj], tasks), "step": step.step, "prompt": step.prompt,
                "window": step.shown_history, "output": step.completion.text,
                "prompt_tokens": len(step.completion.prompt_ids),
                "completion_tokens": len(step.completion.completion_ids), "action": step.action, "valid": step.valid,
                "observation": step.observation, "reward": step.reward, "return": float(returns[i]),
                "advantage": None if advantages is None else float(advantages[i]),
                "level_groups": groups[i].tolist(),
                "peer_levels": [int(k) for k in np.flatnonzero((groups[i] >= 0) & (sizes[i] >= 2))],
                "level_weights": None if weights is None else weights[i].tolist(),
                "reason": None if step.valid else invalid_reason(step.completion.text, config.action_mode, step.action),
            })
    return records + [{**episode_fields(e, tasks), **dict.fromkeys(STEP_FIELDS)}
                      for e in rollout.episodes if e.fault is not None]


def episode_fields(episode: Episode, tasks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What every record of `episode` holds: its task, task group, number and outcome."""
    task = dict(tasks[episode.group])
    return {"task": task, "task_type": next((str(task[f]) for f in TASK_TYPE_FIELDS if f in task), None),
            "group": episode.group, "episode": episode.traj, "episode_won": episode.won,
            "episode_fault": episode.fault, "episode_score": episode.score}


def dump_path(output_dir: str | Path, name: str, accelerator) -> Path:
    """Where a run's process dumps the step records `name`: output_dir/trajectories/<name>[_rank<i>].jsonl."""
    rank, several = accelerator.process_index, accelerator.num_processes > 1
    return Path(output_dir) / "trajectories" / (f"{name}_rank{rank}.jsonl" if several else f"{name}.jsonl")


def write_records(path: str | Path, records: Sequence[Mapping[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as file:
        for record in records:
            file.write(json.dumps(record, default=str) + "\n")
    return path


def read_records(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no trajectory dump at {path} (the trainer writes them to "
                                "output_dir/trajectories/ when trajectory_dump_every > 0)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            records += [json.loads(line)] if line.strip() else []
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: line {number} is not a JSON record ({err})") from None
    for record in records:
        if "step" not in record and "t" in record:  # a dump from before the field was named `step`
            record["step"] = record.pop("t")
    return records


def show_episode(records: Sequence[Mapping[str, Any]], episode: int | None = None, prompt: bool = False) -> str:
    """One episode as a person reads it (the first one when `episode` is None), each step's prompt too with
    `prompt`."""
    episodes = sorted({r["episode"] for r in records})
    if not episodes:
        return "(empty dump)"
    chosen = episodes[0] if episode is None else episode
    steps = sorted((r for r in records if r["episode"] == chosen), key=lambda r: r["step"] or 0)
    if not steps:
        raise ValueError(f"episode {chosen} is not in this dump; it holds episodes {episodes}")
    outcome = "won" if steps[0]["episode_won"] else f"failed ({steps[0]['episode_fault']})" \
        if steps[0]["episode_fault"] else "not won"
    lines = [f"episode {chosen} (task group {steps[0]['group']}): {outcome}", f"task: {json.dumps(steps[0]['task'])}"]
    for r in (r for r in steps if r["step"] is not None):  # (a faulted episode's record holds no step)
        advantage = "" if r["advantage"] is None else f"  advantage {r['advantage']:+.3f}"
        action = r["action"] if r["valid"] else f"INVALID ({r['output'][-60:]!r})"
        if prompt:
            lines += [f"[step {r['step']}] prompt:", *(f"    | {line}" for line in r["prompt"].splitlines())]
        lines += [f"[step {r['step']}] {r['observation']}",
                  f"    -> {action}   reward {r['reward']:g}  return {r['return']:.3f}{advantage}"
                  f"  peers at HGPO levels {r['peer_levels']}"]
    return "\n".join(lines)


def invalid_reason(output: str, action_mode: str = "tags", action: str | None = None) -> str:
    """Why a step was invalid, from its output and, in `tool` mode, whether a call was sent (`action`): a sent call
    was answered with an error (it raised, named no tool or could not be read)."""
    text = output.strip()
    if not text:
        return "empty output"
    if action_mode == "tool":
        if action is not None:
            return "the call failed (an error answered it)"
        if "</think>" not in text:
            return "no </think> before the answer"
        return "no answer after </think>" if not text.rsplit("</think>", 1)[1].strip() else "not an admissible call"
    if "<action>" in text and "</action>" not in text:
        return "unclosed <action> tag"
    if "<action>" not in text and "</action>" not in text and "<think>" in text:
        return "no <action> tag"
    return "not an admissible action"


def step_reason(record: Mapping[str, Any]) -> str | None:
    """An invalid step's reason as its dump says it (dumps before 2026-12-05 hold none: read as in tags mode)."""
    return None if record["valid"] else record.get("reason") or invalid_reason(record["output"])


def summarize(records: Sequence[Mapping[str, Any]], top: int = 5) -> dict[str, Any]:
    """Success, faulted episodes and score as the metrics report them (`hgpo_trl.rollout.outcomes`), success by task
    type, why outputs were invalid, and the observations failed episodes ended on."""
    steps = [r for r in records if r["step"] is not None]
    first = {}
    last = {}
    for r in records:
        first.setdefault(r["episode"], r)
    for r in steps:
        if r["episode"] not in last or r["step"] > last[r["episode"]]["step"]:
            last[r["episode"]] = r
    by_type: dict[str, list[bool]] = defaultdict(list)
    for r in first.values():
        by_type[r["task_type"] or "all"].append(bool(r["episode_won"]))
    outcomes = [Episode(r["group"], r["episode"], won=r["episode_won"], fault=r["episode_fault"],
                        score=r.get("episode_score")) for r in first.values()]  # (older dumps hold no score)
    invalid = Counter(step_reason(r) for r in steps if not r["valid"])
    failing = Counter(r["observation"] for r in last.values() if not r["episode_won"])
    return {
        "episodes": len(first), "steps": len(steps), **success_and_score(episode_totals(outcomes)),
        "success_by_task_type": {k: {"episodes": len(v), "success_rate": float(np.mean(v))}
                                 for k, v in sorted(by_type.items())},
        "invalid_steps": sum(invalid.values()), "invalid_reasons": dict(invalid.most_common()),
        "most_common_failing_states": failing.most_common(top),
    }


VIEW_STEP_FIELDS = ("step", "prompt", "window", "output", "prompt_tokens", "completion_tokens", "action", "valid",
                    "observation", "reward", "return", "advantage", "level_groups", "level_weights")


def view_data(name: str, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One dump as the viewer draws it (`hgpo_trl.evaluation.viewer`): its summary and its episodes, task group by task
    group, each with its steps in order (a non-finite number as null: JSON has none)."""
    def finite(x: Any) -> Any:
        return None if isinstance(x, float) and not np.isfinite(x) else x

    episodes: dict[int, dict[str, Any]] = {}
    for r in records:
        episode = episodes.setdefault(r["episode"], {
            "episode": r["episode"], "group": r["group"], "task": json.dumps(r["task"], default=str),
            "task_type": r["task_type"], "won": bool(r["episode_won"]), "fault": r["episode_fault"],
            "score": finite(r.get("episode_score")), "steps": []})
        if r["step"] is not None:
            step = {k: finite(r.get(k)) for k in VIEW_STEP_FIELDS}
            episode["steps"].append({**step, "reason": step_reason(r)})
    for episode in episodes.values():
        episode["steps"].sort(key=lambda st: st["step"])
        episode["reward"] = float(sum(st["reward"] or 0.0 for st in episode["steps"]))
    ordered = sorted(episodes.values(), key=lambda e: (e["group"], e["episode"]))
    summary = summarize(records)
    count = max(len(ordered), 1)
    return {"name": name, "episodes": ordered, "summary": {
        **{k: finite(summary.get(k)) for k in ("episodes", "steps", "success_rate", "score", "faulted")},
        "invalid_rate": summary["invalid_steps"] / max(summary["steps"], 1),
        "mean_reward": sum(e["reward"] for e in ordered) / count, "mean_steps": summary["steps"] / count}}


def dump_paths(source: str | Path, last: int | None = None) -> list[Path]:
    """The dumps `source` names: one dump file, or a run's (`output_dir` or its trajectories/), the `last`
    newest by iteration or step number (all with None)."""
    source = Path(source)
    folder = source / "trajectories" if (source / "trajectories").is_dir() else source
    if source.is_file():
        return [source]
    paths = sorted(folder.glob("*.jsonl"), key=lambda p: (int("0" + "".join(filter(str.isdigit, p.stem))), p.name))
    if not paths:
        raise FileNotFoundError(f"no trajectory dump at {source} (a dump file, or a run's output_dir whose "
                                "trajectories/ the trainer fills when trajectory_dump_every > 0)")
    return paths if last is None else paths[-last:]


def to_html(source: str | Path, path: str | Path | None = None, *, last: int | None = 8) -> Path:
    """Write the trajectory viewer for `source` (a dump file, or a run's output_dir: its `last` newest dumps)
    to `path` (default: beside the dump as .html, or the run's trajectories.html) and return it."""
    dumps = dump_paths(source, last)
    source = Path(source)
    if path is None:
        path = source.with_suffix(".html") if source.is_file() else \
            (source.parent if source.name == "trajectories" else source) / "trajectories.html"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render([view_data(d.stem, read_records(d)) for d in dumps]))
    return path


def to_dataset(path: str | Path):
    """A dump as a `datasets.Dataset`, one row a step (`.to_pandas()` for pandas), the task as JSON text; a
    faulted episode's outcome record has no step and no row."""
    from datasets import Dataset

    rows = [{**r, "task": json.dumps(r["task"], default=str)} for r in read_records(path) if r["step"] is not None]
    return Dataset.from_list(rows)


def view(argv: Sequence[str] | None = None) -> None:
    """`hgpo-view RUN_DIR_OR_DUMP`: write the viewer's HTML file and print where."""
    parser = argparse.ArgumentParser(prog="hgpo-view", description="Write the trajectory viewer: one "
                                     "self-contained HTML file of a run's dumps (or of one dump), opened from disk.")
    parser.add_argument("source", help="a run's output_dir (or its trajectories/), or one .jsonl dump")
    parser.add_argument("-o", "--output", default=None, help="the HTML file (default: RUN_DIR/trajectories.html, "
                        "or the dump's name with .html)")
    parser.add_argument("--last", type=int, default=8, help="a run's newest dumps to include (default 8; 0: all)")
    args = parser.parse_args(argv)
    try:
        print(to_html(args.source, args.output, last=args.last or None))
    except (FileNotFoundError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hgpo_trl.evaluation.trajectories", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="print one episode readably")
    show.add_argument("path")
    show.add_argument("--episode", type=int, default=None, help="episode index (default: the first)")
    show.add_argument("--prompt", action="store_true", help="print each step's prompt (what the model saw)")
    summary = commands.add_parser("summary", help="success by task type, invalid reasons, failing states")
    summary.add_argument("path")
    args = parser.parse_args(argv)
    try:
        records = read_records(args.path)
        print(show_episode(records, args.episode, args.prompt) if args.command == "show"
              else json.dumps(summarize(records), indent=2))
    except (FileNotFoundError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")


if __name__ == "__main__":
    main()
