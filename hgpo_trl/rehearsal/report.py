"""What a rehearsal exercised, read from its run's own files (trainer_state.json, the trajectory dumps, the saved
folders), and the table it prints: the checks, the lengths seen with the real tokenizer, and the projection of
the real run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from hgpo_trl.evaluation.trajectories import read_records


def iteration_counters(log_history: list[dict[str, Any]], processes: int) -> list[dict[str, Any]]:
    """Per training iteration, over all processes: steps collected and trained, copies, optimizer steps, the
    padding share and dynamic sampling's rollout batches and groups (the logs hold means over processes, maxima
    for max_*)."""
    by_iteration: dict[int, dict[str, Any]] = {}
    for entry in log_history:
        if "iteration" not in entry or "loss" not in entry:
            continue
        row = by_iteration.setdefault(int(entry["iteration"]), {"iteration": int(entry["iteration"])})
        for name in ("steps/collected", "steps/duplicated", "steps/trained", "steps/trained_passes"):
            if name in entry:
                row[name.split("/")[1]] = round(entry[name] * processes)
        for name in ("steps/max_untrained", "steps/optimizer_steps", "steps/padded_fraction",
                     "dynamic/rollout_batches", "dynamic/groups_kept", "dynamic/groups_dropped"):
            if name in entry:  # (dynamic/*: totals over the processes already)
                row[name.split("/")[1]] = entry[name]
    return [by_iteration[k] for k in sorted(by_iteration)]


def trained_once(rows: list[dict[str, Any]], num_iterations: int) -> bool:
    """Every collected step reached the loss, once per pass (copies that fill a micro-batch aside)."""
    return bool(rows) and all(
        r.get("trained") == r.get("collected") and r.get("max_untrained") == 0
        and r.get("trained_passes") == (r["collected"] + r.get("duplicated", 0)) * num_iterations for r in rows)


def token_lengths(run_dir: Path) -> dict[str, Any]:
    """Prompt and completion tokens of every training step dumped (the real tokenizer's counts): mean, p95, max,
    and the mean prompt by step of the episode (its growth is the history's)."""
    records = [r for path in sorted((run_dir / "trajectories").glob("iter_*.jsonl")) for r in read_records(path)
               if r["step"] is not None]  # (a faulted episode's outcome record holds no step)
    if not records:
        return {}
    prompt = np.array([r["prompt_tokens"] for r in records], dtype=float)
    completion = np.array([r["completion_tokens"] for r in records], dtype=float)
    by_step = {}
    for t in sorted({r["step"] for r in records}):
        by_step[t] = float(np.mean([r["prompt_tokens"] for r in records if r["step"] == t]))

    def summary(values: np.ndarray) -> dict[str, float]:
        return {"mean": float(values.mean()), "p95": float(np.percentile(values, 95)), "max": float(values.max())}

    return {"steps": len(records), "prompt": summary(prompt), "completion": summary(completion),
            "prompt_mean_by_step": by_step}


def projected_prompt_tokens(lengths: dict[str, Any], history_length: int, max_prompt_tokens: int | None) -> float:
    """The longest prompt of the real run, from the rehearsal's: its longest plus the growth per step of history
    for each pair the real run's longer episodes add (up to history_length), capped at max_prompt_tokens."""
    by_step = {int(k): v for k, v in lengths["prompt_mean_by_step"].items()}
    last = max(by_step)
    growth = max(0.0, (by_step[last] - by_step[0]) / last) if last else 0.0
    projected = lengths["prompt"]["max"] + max(0, history_length - last) * growth
    return min(projected, max_prompt_tokens) if max_prompt_tokens else projected


def files_saved(run_dir: Path) -> dict[str, Any]:
    """The final model, its card, the summary and the checkpoints of a run folder."""
    checkpoints = sorted(p.name for p in run_dir.glob("checkpoint-*") if p.is_dir())
    return {"model": any(run_dir.glob("*.safetensors")) or (run_dir / "adapter_config.json").is_file(),
            "model_card": (run_dir / "README.md").is_file(), "summary": (run_dir / "summary.json").is_file(),
            "checkpoints": checkpoints}


def read_state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "trainer_state.json"
    if not path.is_file():  # the final save writes none; the last checkpoint's has the whole history
        checkpoints = sorted(run_dir.glob("checkpoint-*/trainer_state.json"), key=lambda p: p.stat().st_mtime)
        path = checkpoints[-1] if checkpoints else path
    return json.loads(path.read_text()) if path.is_file() else {}


def table(report: dict[str, Any]) -> str:
    """The report as one two-column table."""
    rows: list[tuple[str, str]] = []
    run = report["run"]
    rows.append(("config", f"{run['config']} under {run['accelerate_config'] or 'no accelerate file (1 process)'}"))
    rows.append(("launch", f"{run['processes']} processes on {run['machines']} machine(s), "
                           f"{run['distribution']}, float32 on CPUs"))
    rows.append(("model", f"{run['model']} -> a tiny twin ({run['twin']}) with the real tokenizer"))
    for launch in report["launches"]:
        rows.append((f"launch {launch['name']}", f"{launch['wall_s']:.0f} s"))
    for row in report["iterations"]:
        # fixed_budget samples the steps it trains: no counters of what reached the loss (its check says n/a too)
        trained = (f"{row['trained']} trained ({row.get('trained_passes', 0)} rows incl. {row.get('duplicated', 0)} "
                   "copies)" if "trained" in row else "trained n/a (fixed_budget samples the steps it trains)")
        rows.append((f"iteration {row['iteration']}",
                     f"{row.get('collected', 0)} steps collected, {trained}, "
                     f"{row.get('optimizer_steps', 0):.0f} optimizer steps, padding "
                     f"{100 * row.get('padded_fraction', 0):.0f} %" + (
                         f", {row['rollout_batches']:.0f} rollout batches ({row['groups_kept']:.0f} groups kept, "
                         f"{row['groups_dropped']:.0f} dropped)" if "rollout_batches" in row else "")))
    checks = report["checks"]
    for name, ok in checks.items():
        rows.append((f"check: {name}", "n/a" if ok is None else "yes" if ok else "NO"))
    lengths = report.get("tokens") or {}
    if lengths:
        p, c = lengths["prompt"], lengths["completion"]
        projected = report["sizes"].get("projected_prompt_tokens")
        rows.append(("prompt tokens", f"mean {p['mean']:.0f}, p95 {p['p95']:.0f}, max {p['max']:.0f} "
                                      f"(max_prompt_tokens {report['sizes']['max_prompt_tokens']}"
                                      + (f"; projected longest at full history {projected:.0f})" if projected
                                         else ")")))
        rows.append(("completion tokens", f"mean {c['mean']:.0f}, max {c['max']:.0f} (the rehearsal's cap; the "
                                          f"real run's max_completion_length {report['sizes']['max_completion_length']})"))
    projection = report.get("projection")
    if projection:
        for part, gib in projection["gpu"].items():
            rows.append((f"GPU: {part}", f"{gib:.1f} GiB"))
        rows.append(("GPU per device", projection["verdict"]))
        for part, gib in projection["host"].items():
            rows.append((f"host: {part}", f"{gib:.1f} GiB per machine"))
        rows.append(("host: loading", f"{projection['host_load']:.1f} GiB per machine, before the training state"))
        rows.append(("host per machine", projection["host_verdict"]))
        load = projection["iteration"]
        rows.append(("largest iteration", f"<= {load['step_samples']:.0f} step samples, <= "
                                             f"{load['optimizer_steps']:.0f} optimizer steps, <= "
                                             f"{load['generated_tokens'] / 1e6:.1f}M generated and "
                                             f"{load['trained_tokens'] / 1e6:.1f}M trained tokens"))
        rows.append(("GPU time bound", f">= {projection['gpu_seconds_bound']:.0f} s for that iteration "
                                       f"({projection['iterations']} of them: >= "
                                       f"{projection['gpu_seconds_bound'] * projection['iterations'] / 3600:.1f} h; "
                                       "a bound, not a forecast; shorter episodes scale it down)"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def json_ready(value: Any) -> Any:
    """JSON-friendly: floats to 4 significant digits, recursively."""
    if isinstance(value, float):
        return value if not math.isfinite(value) or value == 0 else float(f"{value:.4g}")
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    return value
