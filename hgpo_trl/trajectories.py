"""Trajectory dumps: what the agent did, one JSON line per step, and two readers.

    python -m hgpo_trl.trajectories show outputs/run/trajectories/iter_000010.jsonl [--episode 3]
    python -m hgpo_trl.trajectories summary outputs/run/trajectories/iter_000010.jsonl

A record holds the task, t, the prompt, the raw model output, the parsed action (null when invalid), validity,
the observation the step acted on, reward, discounted return, advantage, the HGPO levels where the step had a
peer, and the episode's outcome (won, fault, score). An episode aborted by an environment fault, whose steps are
never trained, is one record of its outcome alone (t and the step's fields null), so that the summary counts every
episode played, as the metrics do (`hgpo_trl.outcomes`). The trainer writes them every `trajectory_dump_every`
iterations and at every evaluation (`output_dir/trajectories/`).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hgpo_trl.advantages import discounted_returns
from hgpo_trl.advantages.hgpo import hgpo_peer_levels
from hgpo_trl.outcomes import episode_totals, success_and_score
from hgpo_trl.rollout import Episode, Rollout

TASK_TYPE_FIELDS = ("task_type", "type")  # a task row's own type (ALFWorld), if it has one


STEP_FIELDS = ("t", "prompt", "output", "prompt_tokens", "completion_tokens", "action", "valid", "observation",
               "reward", "return", "advantage", "peer_levels")  # null in a faulted episode's outcome record


def rollout_records(rollout: Rollout, tasks: Sequence[Mapping[str, Any]], advantages: np.ndarray | None, *,
                    gamma: float, invalid_penalty: float, depth: int,
                    similarity_threshold: float | None = None) -> list[dict[str, Any]]:
    """One record per step of `rollout` (whose task groups index `tasks`), then one outcome record per faulted
    episode; HGPO's peer levels keyed as the run's `similarity_threshold` keys them."""
    records = []
    if rollout.steps:
        batch = rollout.step_batch()
        returns = discounted_returns(batch, gamma, invalid_penalty)
        peers = hgpo_peer_levels(batch, depth, similarity_threshold)
        episodes = {e.traj: e for e in rollout.episodes}
        for i, step in enumerate(rollout.steps):
            records.append({
                **episode_fields(episodes[step.traj], tasks), "t": step.step, "prompt": step.prompt,
                "output": step.completion.text, "prompt_tokens": len(step.completion.prompt_ids),
                "completion_tokens": len(step.completion.completion_ids), "action": step.action, "valid": step.valid,
                "observation": step.observation, "reward": step.reward, "return": float(returns[i]),
                "advantage": None if advantages is None else float(advantages[i]),
                "peer_levels": [int(k) for k in np.flatnonzero(peers[i])],
            })
    return records + [{**episode_fields(e, tasks), **dict.fromkeys(STEP_FIELDS)}
                      for e in rollout.episodes if e.fault is not None]


def episode_fields(episode: Episode, tasks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What every record of `episode` holds: its task, task group, number and outcome."""
    task = dict(tasks[episode.group])
    return {"task": task, "task_type": next((str(task[f]) for f in TASK_TYPE_FIELDS if f in task), None),
            "group": episode.group, "episode": episode.traj, "episode_won": episode.won,
            "episode_fault": episode.fault, "episode_score": episode.score}


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
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def show_episode(records: Sequence[Mapping[str, Any]], episode: int | None = None) -> str:
    """One episode as a person reads it (the first one when `episode` is None)."""
    episodes = sorted({r["episode"] for r in records})
    if not episodes:
        return "(empty dump)"
    chosen = episodes[0] if episode is None else episode
    steps = sorted((r for r in records if r["episode"] == chosen), key=lambda r: r["t"])
    if not steps:
        raise ValueError(f"episode {chosen} is not in this dump; it holds episodes {episodes}")
    outcome = "won" if steps[0]["episode_won"] else f"failed ({steps[0]['episode_fault']})" \
        if steps[0]["episode_fault"] else "not won"
    lines = [f"episode {chosen} (task group {steps[0]['group']}): {outcome}", f"task: {json.dumps(steps[0]['task'])}"]
    for r in (r for r in steps if r["t"] is not None):  # (a faulted episode's record holds no step)
        advantage = "" if r["advantage"] is None else f"  advantage {r['advantage']:+.3f}"
        action = r["action"] if r["valid"] else f"INVALID ({r['output'][-60:]!r})"
        lines += [f"[t={r['t']}] {r['observation']}",
                  f"    -> {action}   reward {r['reward']:g}  return {r['return']:.3f}{advantage}"
                  f"  peers at HGPO levels {r['peer_levels']}"]
    return "\n".join(lines)


def invalid_reason(output: str) -> str:
    text = output.strip()
    if not text:
        return "empty output"
    if "<action>" in text and "</action>" not in text:
        return "unclosed <action> tag"
    if "<action>" not in text and "</action>" not in text and "<think>" in text:
        return "no <action> tag"
    return "not an admissible action"


def summarize(records: Sequence[Mapping[str, Any]], top: int = 5) -> dict[str, Any]:
    """Success, faulted episodes and score as the metrics report them (`hgpo_trl.outcomes`), success by task
    type, why outputs were invalid, and the observations failed episodes ended on."""
    steps = [r for r in records if r["t"] is not None]
    first = {}
    last = {}
    for r in records:
        first.setdefault(r["episode"], r)
    for r in steps:
        if r["episode"] not in last or r["t"] > last[r["episode"]]["t"]:
            last[r["episode"]] = r
    by_type: dict[str, list[bool]] = defaultdict(list)
    for r in first.values():
        by_type[r["task_type"] or "all"].append(bool(r["episode_won"]))
    outcomes = [Episode(r["group"], r["episode"], won=r["episode_won"], fault=r["episode_fault"],
                        score=r.get("episode_score")) for r in first.values()]  # (older dumps hold no score)
    invalid = Counter(invalid_reason(r["output"]) for r in steps if not r["valid"])
    failing = Counter(r["observation"] for r in last.values() if not r["episode_won"])
    return {
        "episodes": len(first), "steps": len(steps), **success_and_score(episode_totals(outcomes)),
        "success_by_task_type": {k: {"episodes": len(v), "success_rate": float(np.mean(v))}
                                 for k, v in sorted(by_type.items())},
        "invalid_steps": sum(invalid.values()), "invalid_reasons": dict(invalid.most_common()),
        "most_common_failing_states": failing.most_common(top),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hgpo_trl.trajectories", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="print one episode readably")
    show.add_argument("path")
    show.add_argument("--episode", type=int, default=None, help="episode index (default: the first)")
    summary = commands.add_parser("summary", help="success by task type, invalid reasons, failing states")
    summary.add_argument("path")
    args = parser.parse_args(argv)
    try:
        records = read_records(args.path)
        print(show_episode(records, args.episode) if args.command == "show"
              else json.dumps(summarize(records), indent=2))
    except (FileNotFoundError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")


if __name__ == "__main__":
    main()
