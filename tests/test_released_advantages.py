"""The released-compatible options (`released_options`) against the released verl-agent code.

1. Fixtures computed by running the released functions unchanged (../shared/data/released-advantages, see its
   README.md): our estimators with `released_options(name)` reproduce every key of every case.
2. Hand-worked batches for what the fixtures do not exercise (they are tie-free and all steps valid): invalid
   steps under the released per-row episode statistics, and the released zero-item filter on ties.

What the release does (read in github.com/zzj1111/alfworldauto; see docs/concepts.md for the departures):
- returns: `compute_step_discounted_returns` (recipe/hgpo/core_hgpo.py, gigpo/core_gigpo.py) discounts the env
  rewards; `apply_invalid_action_penalty` (recipe/hgpo/hgpo_ray_trainer.py) later subtracts 0.1 from the invalid
  row's return only (after discounting: nothing flows backwards) and from the last token of that row's episode
  score, which `EpisodeRewardManager` (agent_system/reward_manager/episode.py) put on every row of the episode.
- episode terms (verl core_algos.compute_grpo_outcome_advantage, gigpo episode_norm_reward, hgpo
  trajectory_advantages): `compute_mean_std_cross_steps=True` (default, never overridden by the trainers) takes
  the mean and `torch.std` (ddof 1) over all step rows of the task group, each row keeping its own score.
- GiGPO's step term (step_norm_reward): `torch.std` (ddof 1) within anchor groups; a singleton gets 0.
- HGPO's levels (hgpo_advantage_estimate): `std(unbiased=False)` (ddof 0); items equal to 0 are dropped, the base
  item included; weights `(k+2)^alpha` (base: 1), normalised by `sum + 1e-6`.
"""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from hgpo_trl.advantages import (
    RELEASED_OPTIONS,
    StepBatch,
    compute_advantages,
    discounted_returns,
    estimator_options,
    released_options,
)
from hgpo_trl.config import HGPOConfig

FOLDER = Path(__file__).resolve().parents[2] / "shared" / "data" / "released-advantages"
EPS = 1e-6  # the std epsilon of mean_std_norm, ours and released
NUM_CASES = 40

# Tolerance against the fixtures. rtol 1e-5: the fixtures are float32 results rounded to 7 decimals, and the
# released weights divide by `sum + 1e-6` (a relative 1e-6 at most, the weights summing to >= 1).
# atol: the release computes in float32, and centring a value x of magnitude `scale` (the largest |score| or
# |return| of the case, ~10) leaves an absolute error of a few float32 ulps of it (2^-24 * scale each, ~6e-7),
# which std normalisation carries over: values near 0 (a member near its group's mean) then differ from float64
# results by ~1e-6 (observed: at most 6 ulps of scale, in mean_std_norm). We allow 8 ulps of scale. A semantic
# difference is far larger: ddof 0 instead of 1 changes a group of n by a relative 1/(2n) (~1e-2, see below).
ATOL_ULPS = 8


@pytest.fixture(scope="module")
def cases():
    if not FOLDER.is_dir():
        pytest.skip(f"the released fixtures' folder {FOLDER} is absent (it lies beside the repository, in "
                    "../shared/data/released-advantages)")
    with gzip.open(FOLDER / "fixtures.json.gz", "rt") as f:
        return json.load(f)["cases"]


def fixture_batch(case) -> StepBatch:
    b = case["batch"]
    return StepBatch(b["group"], b["traj"], b["step"], b["obs"], b["reward"], [True] * len(b["group"]))


def options_for(key: str, gamma: float) -> tuple[str, dict]:
    """A fixture key -> (estimator, our options): the released options plus the key's own settings."""
    name, *parts = key.split("|")
    settings = dict(part.split("=") for part in parts if "=" in part)
    options = released_options(name)
    if name == "hgpo":
        options.update(gamma=gamma, depth=int(settings["K"]), norm=parts[1], alpha=float(settings["alpha"]),
                       base_group=settings["base_group"] == "True")
    elif name == "gigpo":
        options.update(gamma=gamma, norm=parts[0])  # step_advantage_w 1 = omega
    else:
        options["norm"] = "mean_std_norm" if settings["std"] == "True" else "mean_norm"
        if settings["cross_steps"] == "False":
            # One score per trajectory (released: its first row's; all rows are equal here, every step valid).
            options["episode_stats"] = "trajectories"
    return name, options


def tolerance(case) -> dict:
    inputs = case["released_inputs"]
    scale = max(np.abs(inputs["episode_score_per_row"]).max(), np.abs(inputs["step_return_per_row"]).max())
    return {"rtol": 1e-5, "atol": ATOL_ULPS * 2.0**-24 * scale}


def test_fixtures_hold_the_documented_cases_and_keys(cases):
    assert len(cases) == NUM_CASES
    hgpo = {f"hgpo|K={k}|{norm}|alpha={alpha}|base_group={base}" for k in (1, 2, 4)
            for norm in ("mean_norm", "mean_std_norm") for alpha in ("0.0", "1.0", "2.0") for base in (False, True)}
    gigpo = {"gigpo|mean_norm", "gigpo|mean_std_norm"}
    grpo = {f"grpo|std={std}|cross_steps={cross}" for std in (True, False) for cross in (True, False)}
    for case in cases:
        assert set(case["expected"]) == hgpo | gigpo | grpo


@pytest.mark.parametrize("index", range(NUM_CASES))
def test_released_options_reproduce_the_released_code(cases, index):
    case = cases[index]
    batch = fixture_batch(case)
    tol = tolerance(case)
    # The released inputs are ours: each row's episode score (its trajectory's total reward) and its return.
    inputs = case["released_inputs"]
    totals = {}
    for traj, reward in zip(batch.traj, batch.reward, strict=True):
        totals[traj] = totals.get(traj, 0.0) + reward
    np.testing.assert_allclose([totals[t] for t in batch.traj], inputs["episode_score_per_row"], **tol)
    np.testing.assert_allclose(discounted_returns(batch, gamma=case["gamma"]), inputs["step_return_per_row"], **tol)
    for key, expected in case["expected"].items():
        name, options = options_for(key, case["gamma"])
        np.testing.assert_allclose(compute_advantages(name, batch, **options), expected, **tol,
                                   err_msg=f"case {index}, {key}")


def test_the_tolerance_tells_ddof_apart(cases):
    # Our default ddof 0 instead of the released 1 misses the released GRPO in every case.
    for case in cases:
        got = compute_advantages("grpo", fixture_batch(case), norm="mean_std_norm", episode_stats="steps")
        expected = np.array(case["expected"]["grpo|std=True|cross_steps=True"])
        assert not np.allclose(got, expected, **tolerance(case))


def make_batch(trajs):
    """trajs: (obs list, reward list, valid list) per trajectory, all in task group 0; rows in order."""
    cols = {k: [] for k in ("group", "traj", "step", "obs", "reward", "valid")}
    for j, (obs, rewards, valid) in enumerate(trajs):
        for t in range(len(obs)):
            for k, v in zip(cols, (0, j, t, obs[t], rewards[t], valid[t]), strict=True):
                cols[k].append(v)
    return StepBatch(**cols)


# gamma 0.5; rows 0..5 = T1 s0, T1 s1, T2 s0, T2 s1, T3 s0, T3 s1.
# T1: obs [a, b], rewards [0, 6], valid.     Episode reward 6.
# T2: obs [a, b], rewards [0, 6], s1 invalid. Episode reward 6.
# T3: obs [c, b], rewards [0, 0.1], s0 invalid. Episode reward 0.1.
INVALID = make_batch([(["a", "b"], [0, 6], [True, True]), (["a", "b"], [0, 6], [True, False]),
                      (["c", "b"], [0, 0.1], [False, True])])
# Released row scores: episode reward, minus 0.1 on the invalid row only:
#   T1 [6, 6], T2 [6, 5.9] (its valid step sees 6), T3 [0.1 - 0.1, 0.1] = [0, 0.1]. Sum 24, mean 4.
#   Deviations E = [2, 2, 2, 1.9, -4, -3.9]; squares 4 + 4 + 4 + 3.61 + 16 + 15.21 = 46.82; ddof 1: var 46.82 / 5.
E = np.array([2, 2, 2, 1.9, -4, -3.9])
S_E = np.sqrt(46.82 / 5) + EPS
# Returns, the penalty subtracted at the invalid row after discounting:
#   T1 [0.5 * 6, 6] = [3, 6]; T2 [0.5 * 6, 6 - 0.1] = [3, 5.9]; T3 [0.5 * 0.1 - 0.1, 0.1] = [-0.05, 0.1].
# Anchor groups: a = {3, 3} all equal -> 0; c = {-0.05} alone -> 0;
#   b = {6, 5.9, 0.1}: mean 4, deviations [2, 1.9, -3.9], squares 4 + 3.61 + 15.21 = 22.82.
B = np.array([0, 2, 0, 1.9, 0, -3.9])
S_B1 = np.sqrt(22.82 / 2) + EPS  # ddof 1 (GiGPO, released)
S_B0 = np.sqrt(22.82 / 3) + EPS  # ddof 0 (HGPO's levels, released)


def test_released_grpo_and_gigpo_with_invalid_steps():
    released = {"grpo": released_options("grpo"), "gigpo": {**released_options("gigpo"), "gamma": 0.5}}
    np.testing.assert_allclose(compute_advantages("grpo", INVALID, norm="mean_norm", **released["grpo"]), E,
                               rtol=0, atol=1e-12)
    np.testing.assert_allclose(compute_advantages("grpo", INVALID, norm="mean_std_norm", **released["grpo"]),
                               E / S_E, rtol=0, atol=1e-12)
    # GiGPO = E + B: [2 + 0, 2 + 2, 2 + 0, 1.9 + 1.9, -4 + 0, -3.9 - 3.9].
    np.testing.assert_allclose(compute_advantages("gigpo", INVALID, norm="mean_norm", **released["gigpo"]),
                               [2, 4, 2, 3.8, -4, -7.8], rtol=0, atol=1e-12)
    np.testing.assert_allclose(compute_advantages("gigpo", INVALID, norm="mean_std_norm", **released["gigpo"]),
                               E / S_E + B / S_B1, rtol=0, atol=1e-12)
    # Ours by default: one score per trajectory, 0.1 per invalid step: T1 6, T2 5.9, T3 0; mean 11.9 / 3.
    np.testing.assert_allclose(compute_advantages("grpo", INVALID, norm="mean_norm"),
                               np.repeat([6.1 / 3, 5.8 / 3, -11.9 / 3], 2), rtol=0, atol=1e-12)


def test_released_hgpo_with_invalid_steps_and_ties():
    # K = 1, alpha 1: level 0 weight 2, level 1 weight 3, base 1. mean_norm items:
    #   level 0: rows 0, 2 (a, all equal) 0 -> dropped; row 4 (c) alone; rows 1, 3, 5 (b): 2, 1.9, -3.9.
    #   level 1 (t >= 1): (a, b) = rows 1, 3 = {6, 5.9}, mean 5.95 -> +0.05, -0.05; (c, b) = row 5 alone.
    #   base: E.
    # Without base: row 1 (2 * 2 + 3 * 0.05) / 5 = 0.83; row 3 (2 * 1.9 - 3 * 0.05) / 5 = 0.73; row 5 -3.9;
    #   rows 0, 2, 4 have no item -> 0.
    # With base: row 0 = row 2 = 2 and row 4 = -4 (the base alone); row 1 (4 + 0.15 + 2) / 6 = 1.025;
    #   row 3 (3.8 - 0.15 + 1.9) / 6 = 0.925; row 5 (2 * -3.9 - 3.9) / 3 = -3.9.
    kw = {**released_options("hgpo"), "gamma": 0.5, "depth": 1, "alpha": 1.0}
    np.testing.assert_allclose(compute_advantages("hgpo", INVALID, norm="mean_norm", **kw),
                               [0, 0.83, 0, 0.73, 0, -3.9], rtol=0, atol=1e-12)
    np.testing.assert_allclose(compute_advantages("hgpo", INVALID, norm="mean_norm", base_group=True, **kw),
                               [2, 1.025, 2, 0.925, -4, -3.9], rtol=0, atol=1e-12)
    # mean_std_norm: levels with the population std (b: S_B0; (a, b): std 0.05), the base item with ddof 1.
    level1 = 0.05 / (0.05 + EPS)
    want = [E[0] / S_E, (2 * 2 / S_B0 + 3 * level1 + E[1] / S_E) / 6, E[2] / S_E,
            (2 * 1.9 / S_B0 - 3 * level1 + E[3] / S_E) / 6, E[4] / S_E, (2 * -3.9 / S_B0 + E[5] / S_E) / 3]
    np.testing.assert_allclose(compute_advantages("hgpo", INVALID, norm="mean_std_norm", base_group=True, **kw),
                               want, rtol=0, atol=1e-12)


# gamma 1, rewards at the last step only, so R0 = R1; rows 0..7 = T1 s0, T1 s1, ..., T4 s1.
# T1: obs [s, u], return 0; T2: [s, u], 2; T3: [t, u], 3; T4: [t, u], 3.
TIES = make_batch([(["s", "u"], [0, 0], [True] * 2), (["s", "u"], [0, 2], [True] * 2),
                   (["t", "u"], [0, 3], [True] * 2), (["t", "u"], [0, 3], [True] * 2)])


def test_zero_item_filter_on_ties():
    # Level 0, step 0: s = {0, 2} -> -1, +1; t = {3, 3} all equal -> 0, 0.
    # Level 0, step 1: u = {0, 2, 3, 3}, mean 2 -> -2, 0 (T2 exactly at the mean), +1, +1.
    # Level 1: (s, u) = {0, 2} -> -1, +1; (t, u) = {3, 3} all equal -> 0, 0.
    # Weights (alpha 1): level 0: 2, level 1: 3.
    kw = {"gamma": 1.0, "depth": 1, "alpha": 1.0, "norm": "mean_norm"}
    # Kept (ours): T1 s1 (2 * -2 + 3 * -1) / 5 = -1.4; T2 s1 (0 + 3) / 5 = 0.6; T3, T4 s1 (2 + 0) / 5 = 0.4.
    np.testing.assert_allclose(compute_advantages("hgpo", TIES, **kw),
                               [-1, -1.4, 1, 0.6, 0, 0.4, 0, 0.4], rtol=0, atol=1e-12)
    # Dropped (released): T2 s1 and T3, T4 s1 keep one item, +1; T3, T4 s0 have none left -> 0.
    np.testing.assert_allclose(compute_advantages("hgpo", TIES, drop_zero_items=True, **kw),
                               [-1, -1.4, 1, 1, 0, 1, 0, 1], rtol=0, atol=1e-12)
    # base_group: episode scores {0, 2, 3, 3}, mean 2 -> -2, 0 (at the mean), +1, +1, weight 1. The same per step
    # row ("steps", released): every trajectory has 2 rows of its score, mean 16 / 8 = 2.
    # Kept: T1 s0 (2 * -1 - 2) / 3 = -4/3; T2 s0 (2 + 0) / 3 = 2/3; T3, T4 s0 (0 + 1) / 3 = 1/3;
    #   T1 s1 (-4 - 3 - 2) / 6 = -1.5; T2 s1 (0 + 3 + 0) / 6 = 0.5; T3, T4 s1 (2 + 0 + 1) / 6 = 0.5.
    np.testing.assert_allclose(compute_advantages("hgpo", TIES, base_group=True, **kw),
                               [-4 / 3, -1.5, 2 / 3, 0.5, 1 / 3, 0.5, 1 / 3, 0.5], rtol=0, atol=1e-12)
    # Dropped: T2 s0 loses its base 0 -> 1; T3, T4 s0 keep the base alone -> 1; T2 s1 keeps level 1 alone -> 1;
    #   T3, T4 s1 (2 * 1 + 1) / 3 = 1; T1 unchanged.
    dropped = [-4 / 3, -1.5, 1, 1, 1, 1, 1, 1]
    np.testing.assert_allclose(compute_advantages("hgpo", TIES, base_group=True, drop_zero_items=True, **kw),
                               dropped, rtol=0, atol=1e-12)
    np.testing.assert_allclose(compute_advantages("hgpo", TIES, base_group=True, **{**kw, **released_options("hgpo")}),
                               dropped, rtol=0, atol=1e-12)


def test_a_group_of_one_gets_zero_under_ddof_1():
    # A ddof-1 std of one value is undefined: a task group holding one step row gets 0, like every singleton
    # (and HGPO's base item does not contribute). The released episode terms (GRPO, GiGPO's, HGPO's base item)
    # leave such a group unnormalised, mean 0 and std 1: its raw score, 3 here.
    alone = StepBatch(group=[0], traj=[0], step=[0], obs=["s"], reward=[3.0], valid=[True])
    for name in RELEASED_OPTIONS:
        extra = {"base_group": True} if name == "hgpo" else {}
        assert compute_advantages(name, alone, **released_options(name), **extra)[0] == 0.0


@pytest.mark.parametrize("name", sorted(RELEASED_OPTIONS))
def test_released_options_are_the_estimators_and_the_configs(name, tmp_path):
    options = released_options(name)
    assert set(options) <= set(estimator_options(name))
    assert released_options(name) is not RELEASED_OPTIONS[name]  # a copy: callers may update it
    compute_advantages(name, INVALID, **options)  # accepted as they are
    with pytest.raises(ValueError, match="does not take option"):
        compute_advantages(name, INVALID, **options, released=True)
    # HGPOConfig's fields carry the same names: the trainer and the diagnostics pass them on.
    args = HGPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", estimator=name, **options)
    assert options.items() <= args.estimator_options().items()
    assert options.items() <= args.diagnostic_estimators()[name].items()


def test_config_checks_std_ddof(tmp_path):
    with pytest.raises(ValueError, match=r"HGPOConfig.std_ddof must be one of \(0, 1\), got 2"):
        HGPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", std_ddof=2)
