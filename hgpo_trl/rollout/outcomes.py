"""Success and score, one definition (the HGPO paper's) for every number that reports them: the trainer's metrics
(`env/`, `eval_`), `hgpo-eval` and `evaluate_model`, and the trajectory dumps' summary. Success is episodes won /
episodes played; the score is the mean over every episode played, an episode the environment did not score (one
aborted by an environment fault among them) counting 0; the faulted episodes are counted apart (`faulted`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hgpo_trl.rollout.lockstep import Episode


def episode_totals(episodes: Sequence[Episode]) -> dict[str, float]:
    """Sums over `episodes`, which add up across seeds or processes: episodes, wins, reward, steps, invalid
    outputs, faulted episodes, the score (a faulted or unscored episode adds 0) and how many episodes the
    environment scored."""
    return {"episodes": len(episodes), "won": sum(e.won for e in episodes),
            "reward": sum(e.total_reward for e in episodes), "steps": sum(e.steps for e in episodes),
            "invalid": sum(e.invalid for e in episodes), "faulted": sum(e.fault is not None for e in episodes),
            "score": sum(e.score or 0.0 for e in episodes if e.fault is None),
            "scored": sum(e.score is not None for e in episodes)}


def success_and_score(totals: Mapping[str, float]) -> dict[str, float]:
    """`success_rate` and `faulted`, and `score` where the environment scored any episode (it grades outcomes),
    from `episode_totals` (summed over processes or not)."""
    played = max(totals["episodes"], 1)
    rates = {"success_rate": totals["won"] / played, "faulted": totals["faulted"]}
    if totals["scored"]:
        rates["score"] = totals["score"] / played
    return rates
