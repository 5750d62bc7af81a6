"""The estimator lab's sweep: estimators x inconsistency x group size G x memory window H, many seeds each.

    python -m hgpo_trl.lab --quick        # 2 settings x 7 estimators, 100 seeds: seconds
    python -m hgpo_trl.lab                # the full grid below: 24 settings x 14 or 20 estimators, 200 seeds

Every estimator shares one learning rate (`Setting.learning_rate`) on advantages rescaled to unit std per seed
(`learn.py`), so the comparison is of directions, not step sizes. A per-estimator rate was tried and dropped: on
this tabular policy a larger step was better for every estimator up to 256 (held-out seeds), so a grid would
only pick its top; the shared rate is the one where learning takes tens of iterations. Every estimator of a setting plays the same seeds with the same random numbers, so its
difference from GiGPO is a paired comparison. Writes lab.json (raw per-seed results), lab.md (the table) and
lab.png (curves with 95% bands; HGPO minus GiGPO over inconsistency x K) to --output_dir.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from hgpo_trl.advantages import ESTIMATORS, compute_advantages
from hgpo_trl.diagnostics import oracle_advantages
from hgpo_trl.lab.learn import Setting, Spec, Steps, train
from hgpo_trl.lab.stats import ErrorCells, bootstrap_ci, iterations_to

BUILT_IN = ("grpo", "gigpo", "hgpo", "progpo")
TARGET = 0.9  # success for "iterations to target"


def exact_reference(batch, steps: Steps, setting: Setting, norm: str) -> np.ndarray:
    """The true advantage Q(h, a) - V(h) under the acting policy: what an estimator could at best return."""
    return steps.exact


def oracle_reference(batch, steps: Steps, setting: Setting, norm: str) -> np.ndarray:
    """The paper's oracle groups (same whole observation history), `hgpo_trl.diagnostics.oracle_advantages`."""
    return oracle_advantages(batch, gamma=setting.gamma, norm=norm)[0]


def episode_plus_hgpo(depth: int):
    """GiGPO with HGPO's hierarchy as its step term: `A_E + A_HGPO(K)` (GiGPO is `A_E + A_S`, A_S = HGPO at K = 0).
    HGPO as released has no episode term, so this isolates what the hierarchy changes in GiGPO."""
    def advantages(batch, steps: Steps, setting: Setting, norm: str) -> np.ndarray:
        return (compute_advantages("grpo", batch, norm=norm)
                + compute_advantages("hgpo", batch, gamma=setting.gamma, norm=norm, depth=depth))
    return advantages


def estimator_specs(history_length: int, quick: bool = False) -> list[Spec]:
    """The lab's estimators at memory window H: every HGPO depth K = 1..H and alpha 0/1/2 (quick: alpha 1), GiGPO
    with HGPO's step term, the variants, the references, and every estimator registered beyond the built-in ones
    (with its defaults)."""
    h = history_length
    alphas = (1,) if quick else (0, 1, 2)
    specs = [Spec("grpo", "grpo"), Spec("gigpo", "gigpo")]
    specs += [Spec(f"hgpo K={k} alpha={a}", "hgpo", {"depth": k, "alpha": float(a)})
              for k in range(1, h + 1) for a in alphas]
    specs += [Spec(f"A_E + hgpo K={h}", reference=episode_plus_hgpo(h))]
    if not quick:
        specs += [Spec("hgpo K=0 (GiGPO's A_S)", "hgpo", {"depth": 0}),
                  Spec(f"hgpo K={h} inverse_mse", "hgpo", {"depth": h, "weighting": "inverse_mse"}),
                  Spec(f"hgpo K={h} base_group", "hgpo", {"depth": h, "base_group": True}),
                  Spec(f"progpo K={h}", "progpo", {"depth": h})]
    specs += [Spec(name, name) for name in ESTIMATORS if name not in BUILT_IN]
    return [*specs, Spec("oracle groups", reference=oracle_reference), Spec("exact Q-V", reference=exact_reference)]


@dataclass(frozen=True)
class Preset:
    inconsistency: tuple[float, ...]
    group_size: tuple[int, ...]
    history_length: tuple[int, ...]
    seeds: int
    iterations: int
    quick: bool

    def settings(self) -> list[Setting]:
        return [Setting(inconsistency=i, group_size=g, history_length=h, iterations=self.iterations)
                for h, g, i in itertools.product(self.history_length, self.group_size, self.inconsistency)]


PRESETS = {
    "quick": Preset(inconsistency=(0.0, 1.0), group_size=(8,), history_length=(2,), seeds=100,
                    iterations=40, quick=True),
    "full": Preset(inconsistency=(0.0, 1 / 3, 2 / 3, 1.0), group_size=(4, 8, 16), history_length=(2, 4),
                   seeds=200, iterations=40, quick=False),
}


def run_setting(setting: Setting, specs: list[Spec], seeds: range) -> list[dict]:
    """Every estimator on one setting; rows with per-seed results and summaries."""
    corridor = setting.corridor()
    rows = []
    for spec in specs:
        errors: list[ErrorCells] = []

        def measure_errors(batch, steps: Steps, spec=spec, errors=errors):
            # Iteration 0: every seed plays the uniform policy; errors in reward units (mean_norm) per cell.
            error = spec.advantages(batch, steps, setting, "mean_norm") - steps.exact
            errors.append(ErrorCells.of(steps.seed, steps.node * 2 + steps.action, error, len(seeds),
                                        corridor.nodes * 2))

        curves = train(setting, spec, seeds, corridor, on_first_batch=measure_errors)
        auc = curves.success[:, 1:].mean(axis=1)
        to_target = iterations_to(curves.success, TARGET)
        aliased = np.repeat(corridor.aliased, 2)
        everywhere = np.ones_like(aliased)
        mean = curves.success.mean(axis=0)
        half = 1.96 * curves.success.std(axis=0, ddof=1) / np.sqrt(len(seeds))
        rows.append({
            "setting": asdict(setting), "label": spec.label, "estimator": spec.name,
            "options": spec.options, "auc": bootstrap_ci(auc), "final": bootstrap_ci(curves.success[:, -1]),
            "iterations_to_target": float(np.median(to_target)), "reached_target": float(np.isfinite(to_target).mean()),
            "bias": {"overall": errors[0].summary(everywhere), "aliased": errors[0].summary(aliased)},
            "curve": {"success": mean.tolist(), "band": half.tolist(), "value": curves.value.mean(axis=0).tolist()},
            "per_seed": {"auc": auc.tolist(), "final": curves.success[:, -1].tolist()},
        })
    gigpo = np.array(next(r for r in rows if r["label"] == "gigpo")["per_seed"]["auc"])
    for row in rows:
        row["auc_minus_gigpo"] = bootstrap_ci(np.array(row["per_seed"]["auc"]) - gigpo)
    return rows


def run_sweep(preset: Preset, progress: bool = True) -> dict[str, Any]:
    began = time.perf_counter()
    seeds = range(preset.seeds)
    rows = []
    for setting in preset.settings():
        h = setting.history_length
        rows += run_setting(setting, estimator_specs(h, preset.quick), seeds)
        if progress:
            print(f"[lab] inconsistency {setting.inconsistency:.2f}  G {setting.group_size}  H {h}: done "
                  f"({time.perf_counter() - began:.0f} s)", flush=True)
    return {"preset": asdict(preset), "target": TARGET, "rows": rows, "wall_s": time.perf_counter() - began}
