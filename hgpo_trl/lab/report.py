"""The lab's outputs: the table, the findings in words, the plot, and the command line.

    python -m hgpo_trl.lab [--quick] [--seeds N] [--output_dir outputs/lab]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from hgpo_trl.lab.stats import bootstrap_ci


def _ci(stat: Sequence[float], digits: int = 3) -> str:
    mean, low, high = stat
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def format_table(report: dict[str, Any]) -> str:
    p = report["preset"]
    lines = [f"Estimator lab: key corridor, {p['seeds']} seeds x {p['iterations']} iterations per row; success = "
             f"exact success probability of the policy; AUC = its mean over iterations 1..{p['iterations']}; "
             f"[95% bootstrap CI]; delta = paired AUC difference from gigpo on the same seeds; bias^2 and variance "
             f"of the advantage against exact Q - V at iteration 0 (mean_norm), at the aliased states."]
    setting = None
    for row in report["rows"]:
        s = row["setting"]
        key = (s["inconsistency"], s["group_size"], s["history_length"])
        if key != setting:
            setting = key
            lines += ["", f"inconsistency {key[0]:.2f}, G {key[1]}, H {key[2]} (lr {s['learning_rate']}, "
                          f"{s['tasks']} task groups per seed and iteration)",
                      f"{'estimator':<26}{'AUC':>24}{'final':>8}{'it->' + str(report['target']):>8}"
                      f"{'delta AUC vs gigpo':>28}{'bias^2@al':>11}{'var@al':>9}"]
        to_target = row["iterations_to_target"]
        aliased = row["bias"]["aliased"]
        lines.append(f"{row['label']:<26}{_ci(row['auc']):>24}{row['final'][0]:>8.3f}"
                     f"{('>' + str(p['iterations'])) if not np.isfinite(to_target) else f'{to_target:.0f}':>8}"
                     f"{_ci(row['auc_minus_gigpo']):>28}{aliased['bias2']:>11.3f}{aliased['variance']:>9.3f}")
    lines += ["", *findings(report), f"Wall time: {report['wall_s']:.0f} s"]
    return "\n".join(lines)


def _rows(report: dict[str, Any], label: str) -> list[dict[str, Any]]:
    return [r for r in report["rows"] if r["label"] == label]


def _verdict(delta: Sequence[float]) -> int:
    """+1: the paired CI lies above 0, -1: below, 0: it holds 0."""
    return 1 if delta[1] > 0 else (-1 if delta[2] < 0 else 0)


def _paired(report: dict[str, Any], label: str, reference: dict[str, Any]) -> tuple[float, float, float]:
    """AUC of `label` minus that of the `reference` row, paired by seed, in the reference row's setting."""
    row = next(r for r in report["rows"] if r["label"] == label and r["setting"] == reference["setting"])
    return bootstrap_ci(np.array(row["per_seed"]["auc"]) - np.array(reference["per_seed"]["auc"]))


def findings(report: dict[str, Any]) -> list[str]:
    """What the sweep says about HGPO vs GiGPO, the paper's alpha reading, inverse_mse and ProGPO, in words."""
    out = []
    hgpo = [r for r in report["rows"] if r["estimator"] == "hgpo" and "alpha=1" in r["label"]]
    verdicts = [_verdict(r["auc_minus_gigpo"]) for r in hgpo]
    out.append(f"HGPO (alpha 1, any K) vs GiGPO over {len(hgpo)} (setting, K) cells: better in "
               f"{verdicts.count(1)}, worse in {verdicts.count(-1)}, no difference in {verdicts.count(0)} (paired "
               f"95% CI of the AUC difference).")
    hybrid = [r for r in report["rows"] if r["label"].startswith("A_E + hgpo")]
    if hybrid:
        v = [_verdict(r["auc_minus_gigpo"]) for r in hybrid]
        by_level = {}
        for r in hybrid:
            by_level.setdefault(r["setting"]["inconsistency"], []).append(r["auc_minus_gigpo"][0])
        out.append(f"GiGPO with HGPO's step term (A_E + hgpo K=H) vs GiGPO: better in {v.count(1)}, worse in "
                   f"{v.count(-1)}, no difference in {v.count(0)} of {len(v)} settings; mean AUC difference by "
                   "inconsistency " + ", ".join(f"{k:.2f}: {np.mean(d):+.3f}" for k, d in sorted(by_level.items()))
                   + ".")
    if hgpo:
        best = max(hgpo, key=lambda r: r["auc_minus_gigpo"][0])
        s = best["setting"]
        out.append(f"HGPO's best difference from GiGPO: {best['label']} at inconsistency {s['inconsistency']:.2f}, "
                   f"G {s['group_size']}, H {s['history_length']}: {_ci(best['auc_minus_gigpo'])}.")
    for k in (2, 4):  # the paper: "alpha = 0 performs comparatively better at K = 2, whereas alpha = 1 and
        # alpha = 2 improve when K increases to 4"; paired AUC differences from alpha 1 at the same K and setting.
        for alpha in (0, 2):
            if not any(r["label"] == f"hgpo K={k} alpha={alpha}" for r in report["rows"]):
                continue  # the quick preset runs alpha 1 only
            v = [_verdict(_paired(report, f"hgpo K={k} alpha={alpha}", r)) for r in report["rows"]
                 if r["label"] == f"hgpo K={k} alpha=1"]
            if v:
                out.append(f"K={k}: alpha {alpha} vs alpha 1: better in {v.count(1)}, worse in {v.count(-1)}, no "
                           f"difference in {v.count(0)} of {len(v)} settings.")
    for variant in ("inverse_mse", "base_group"):
        pairs = [(r, _paired(report, r["label"], by)) for r in report["rows"] if r["label"].endswith(variant)
                 for by in report["rows"] if by["setting"] == r["setting"]
                 and by["label"] == r["label"].replace(variant, "alpha=1")]
        if pairs:
            v = [_verdict(delta) for _, delta in pairs]
            out.append(f"HGPO {variant} vs power alpha 1 at the same K: better in {v.count(1)}, worse in "
                       f"{v.count(-1)}, no difference in {v.count(0)} of {len(v)} settings (mean AUC difference "
                       f"{np.mean([delta[0] for _, delta in pairs]):+.3f}).")
    progpo = [r for r in report["rows"] if r["estimator"] == "progpo"]
    if progpo:
        v = [_verdict(r["auc_minus_gigpo"]) for r in progpo]
        out.append(f"ProGPO vs GiGPO: better in {v.count(1)}, worse in {v.count(-1)}, no difference in {v.count(0)} "
                   f"of {len(v)} settings.")
    return out


def plot(report: dict[str, Any], path: str | Path) -> Path:
    """Left: success curves with 95% bands per inconsistency (largest G and H); right: HGPO (alpha 1) minus GiGPO
    AUC over inconsistency x K, starred where the paired CI excludes 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    g, h = max(r["setting"]["group_size"] for r in rows), max(r["setting"]["history_length"] for r in rows)
    shown = [r for r in rows if r["setting"]["group_size"] == g and r["setting"]["history_length"] == h]
    levels = sorted({r["setting"]["inconsistency"] for r in shown})
    labels = ["grpo", "gigpo", f"hgpo K={h} alpha=1", "oracle groups", "exact Q-V"]
    fig, axes = plt.subplots(1, len(levels) + 1, figsize=(4 * (len(levels) + 1), 3.6))
    for ax, level in zip(axes, levels, strict=False):
        for r in shown:
            if r["setting"]["inconsistency"] == level and r["label"] in labels:
                mean, band = np.array(r["curve"]["success"]), np.array(r["curve"]["band"])
                ax.plot(mean, label=r["label"])
                ax.fill_between(np.arange(mean.size), mean - band, mean + band, alpha=0.2)
        ax.set(title=f"inconsistency {level:.2f} (G {g}, H {h})", xlabel="iteration", ylabel="success", ylim=(0, 1))
    axes[0].legend(fontsize=7)
    depths = list(range(1, h + 1))
    grid = np.full((len(levels), len(depths)), np.nan)
    ax = axes[-1]
    for r in shown:
        for j, k in enumerate(depths):
            if r["label"] == f"hgpo K={k} alpha=1":
                i = levels.index(r["setting"]["inconsistency"])
                grid[i, j] = r["auc_minus_gigpo"][0]
                star = "*" if r["auc_minus_gigpo"][1] > 0 or r["auc_minus_gigpo"][2] < 0 else ""
                ax.text(j, i, f"{grid[i, j]:+.3f}{star}", ha="center", va="center", fontsize=8)
    bound = np.nanmax(np.abs(grid)) if np.isfinite(grid).any() else 1.0
    image = ax.imshow(grid, cmap="RdBu", vmin=-bound, vmax=bound, origin="lower", aspect="auto")
    ax.set(xticks=range(len(depths)), xticklabels=depths, yticks=range(len(levels)),
           yticklabels=[f"{v:.2f}" for v in levels], xlabel="K", ylabel="inconsistency",
           title="HGPO (alpha 1) - GiGPO, AUC")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    from hgpo_trl.lab.sweep import PRESETS, run_sweep

    parser = argparse.ArgumentParser(prog="python -m hgpo_trl.lab", description="The estimator lab (issue 22): "
                                     "how fast each advantage estimator makes a tabular policy learn the corridor.")
    parser.add_argument("--quick", action="store_true", help="2 settings x 7 estimators: seconds")
    parser.add_argument("--seeds", type=int, help="seeds per row (default: the preset's: 100 quick, 200 full)")
    parser.add_argument("--output_dir", default="outputs/lab", help="where lab.json, lab.md and lab.png go")
    parser.add_argument("--no-plot", action="store_true", help="skip lab.png")
    args = parser.parse_args(argv)
    preset = PRESETS["quick" if args.quick else "full"]
    if args.seeds is not None:
        if args.seeds < 2:
            parser.error("--seeds must be >= 2 (confidence intervals need at least two)")
        preset = replace(preset, seeds=args.seeds)
    report = run_sweep(preset)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    report["command"] = "python -m hgpo_trl.lab " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / "lab.json").write_text(json.dumps(report))
    table = format_table(report)
    (out / "lab.md").write_text(table + "\n")
    print(table)
    if not args.no_plot:
        print(f"Plot: {plot(report, out / 'lab.png')}")
    return 0
