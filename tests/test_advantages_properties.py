"""The vectorised estimators against the plain-Python reference, and the invariants ALGORITHMS.md states."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hgpo_trl.advantages import StepBatch, compute_advantages, discounted_returns, released_options
from tests import reference

FIELDS = ("group", "traj", "step", "obs", "reward", "valid", "action", "window")
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


SPARSE_REWARDS = st.sampled_from([0.0, 0.0, 1.0, 10.0])


@st.composite
def step_batches(draw, with_window=False, rewards=SPARSE_REWARDS):
    """Random batches with tiny groups, single-step trajectories, repeated observations, shuffled rows."""
    n_groups = draw(st.integers(1, 3))
    obs_alphabet = draw(st.sampled_from([["a"], ["a", "b"], ["a", "b", "c"], ["Cab 1", "cab 2", "x"]]))
    rows = []
    traj_id = 0
    for g in range(n_groups):
        for _ in range(draw(st.integers(1, 4))):
            length = draw(st.integers(1, 5))
            for t in range(length):
                rows.append(dict(
                    group=f"g{g}", traj=traj_id, step=t,
                    obs=draw(st.sampled_from(obs_alphabet)),
                    reward=draw(rewards),
                    valid=draw(st.booleans()) or draw(st.booleans()),
                    action=draw(st.sampled_from(["x", "y", None])),
                    window=draw(st.integers(0, 3)) if with_window else None,
                ))
            traj_id += 1
    order = draw(st.permutations(range(len(rows))))
    rows = [rows[i] for i in order]
    cols = {f: [r[f] for r in rows] for f in FIELDS}
    if not with_window:
        cols["window"] = None
    return StepBatch(**cols)


def assert_matches_reference(name, batch, **options):
    got = compute_advantages(name, batch, **options)
    want = np.array(reference.REFERENCES[name](batch, **options))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, err_msg=f"{name} {options}")


norms = st.sampled_from(["mean_norm", "mean_std_norm"])
gammas = st.sampled_from([0.0, 0.5, 0.95, 1.0])
episode_stats = st.sampled_from(["trajectories", "steps"])
ddofs = st.sampled_from([0, 1])


@SETTINGS
@given(step_batches(), norms, episode_stats, ddofs, st.sampled_from([0.0, 0.1, 1.0]))
def test_grpo_matches_reference(batch, norm, stats, ddof, penalty):
    assert_matches_reference("grpo", batch, norm=norm, episode_stats=stats, std_ddof=ddof, invalid_penalty=penalty)


@SETTINGS
@given(step_batches(), norms, gammas, st.sampled_from([0.0, 1.0, 2.5]), episode_stats, ddofs)
def test_gigpo_matches_reference(batch, norm, gamma, omega, stats, ddof):
    assert_matches_reference("gigpo", batch, norm=norm, gamma=gamma, omega=omega, episode_stats=stats,
                             std_ddof=ddof)


@SETTINGS
@given(step_batches(with_window=True) | step_batches(), norms, gammas, st.integers(0, 4),
       st.sampled_from([0.0, 1.0, 2.0, 7.5]), st.sampled_from(["power", "inverse_mse"]), st.booleans(), st.booleans(),
       episode_stats, ddofs)
def test_hgpo_matches_reference(batch, norm, gamma, k, alpha, weighting, base_group, drop_zero_items, stats, ddof):
    assert_matches_reference("hgpo", batch, norm=norm, gamma=gamma, depth=k, alpha=alpha,
                             weighting=weighting, base_group=base_group, drop_zero_items=drop_zero_items,
                             episode_stats=stats, std_ddof=ddof)


@SETTINGS
@given(step_batches(), norms, gammas, st.integers(0, 3), st.sampled_from([0.0, 1.0, 0.5]))
def test_progpo_matches_reference(batch, norm, gamma, k, lam):
    assert_matches_reference("progpo", batch, norm=norm, gamma=gamma, depth=k, lam=lam)


@SETTINGS
@given(step_batches(), gammas, st.sampled_from([0.0, 0.1]))
def test_returns_match_reference(batch, gamma, penalty):
    want = reference.returns(reference.rows_of(batch), gamma, penalty)
    got = discounted_returns(batch, gamma=gamma, invalid_penalty=penalty)
    np.testing.assert_array_equal(got, [want[i] for i in range(len(batch))])  # same recurrence: bit for bit


@SETTINGS
@given(step_batches(), norms, gammas)
def test_hgpo_with_k0_is_gigpo_step_term(batch, norm, gamma):
    # GiGPO = A_E + A_S and GRPO = A_E, so A_S = GiGPO - GRPO (population std in both).
    step_term = (compute_advantages("gigpo", batch, norm=norm, gamma=gamma)
                 - compute_advantages("grpo", batch, norm=norm))
    hgpo = compute_advantages("hgpo", batch, norm=norm, gamma=gamma, depth=0, alpha=3.0)
    np.testing.assert_allclose(hgpo, step_term, rtol=0, atol=1e-12)


@SETTINGS
@given(step_batches(), norms, st.integers(1, 4))
def test_hgpo_large_alpha_is_the_deepest_contributing_level(batch, norm, k_max):
    rows = reference.rows_of(batch)
    by_traj = reference.trajectories(rows)
    ret = reference.returns(rows, 0.95, 0.1)
    per_level = []
    for k in range(k_max + 1):
        keys = {r["i"]: reference.level_key(r, by_traj, k) for r in rows}
        keys = {i: key for i, key in keys.items() if key is not None}
        per_level.append((reference.normalize_groups(keys, ret, norm), reference.group_members(keys), keys))
    want = []
    for r in rows:
        deepest = 0.0
        for adv, members, keys in per_level:
            if r["i"] in keys and len(members[keys[r["i"]]]) >= 2:
                deepest = adv[r["i"]]
        want.append(deepest)
    got = compute_advantages("hgpo", batch, norm=norm, depth=k_max, alpha=1e4)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@SETTINGS
@given(step_batches(), st.sampled_from(["grpo", "gigpo", "hgpo", "progpo"]), st.booleans(), norms,
       st.randoms(use_true_random=False))
def test_output_does_not_depend_on_row_order(batch, name, released, norm, rnd):
    # Our defaults, and the released-compatible options (per-row episode statistics, ddof 1, the zero filter).
    options = {"norm": norm}
    if released and name != "progpo":
        options.update(released_options(name), **({"base_group": True} if name == "hgpo" else {}))
    perm = list(range(len(batch)))
    rnd.shuffle(perm)
    shuffled = StepBatch(**{f: None if getattr(batch, f) is None else [getattr(batch, f)[i] for i in perm]
                            for f in FIELDS})
    np.testing.assert_array_equal(compute_advantages(name, shuffled, **options),
                                  compute_advantages(name, batch, **options)[perm])


@SETTINGS
@given(step_batches(), norms, st.floats(-100, 100), st.integers(0, 4), episode_stats, ddofs)
def test_all_equal_values_give_exactly_zero(batch, norm, c, k, stats, ddof):
    # Every episode's total reward is c (at its last step): every GRPO group is all-equal.
    last = {}
    for traj, step in zip(batch.traj, batch.step, strict=True):
        last[traj] = max(last.get(traj, 0), step)
    final = [c if step == last[traj] else 0.0 for traj, step in zip(batch.traj, batch.step, strict=True)]
    valid = [True] * len(batch)
    episode_equal = StepBatch(batch.group, batch.traj, batch.step, batch.obs, final, valid)
    # (All valid: under episode_stats="steps" every row of a trajectory carries its episode's score.)
    episode = {"episode_stats": stats, "std_ddof": ddof}
    assert np.all(compute_advantages("grpo", episode_equal, norm=norm, **episode) == 0.0)
    # With gamma 0 and reward c at every step, every return is c: every anchor and level group is all-equal.
    returns_equal = StepBatch(batch.group, batch.traj, batch.step, batch.obs, [c] * len(batch), valid)
    assert np.all(compute_advantages("hgpo", returns_equal, norm=norm, gamma=0.0, depth=k, **episode) == 0.0)
    np.testing.assert_array_equal(compute_advantages("gigpo", returns_equal, norm=norm, gamma=0.0, **episode),
                                  compute_advantages("grpo", returns_equal, norm=norm, **episode))


@SETTINGS
@given(step_batches(with_window=True, rewards=st.floats(-1e6, 1e6)), st.sampled_from(["grpo", "gigpo", "hgpo", "progpo"]),
       norms, gammas, st.booleans())
def test_never_nan_or_inf(batch, name, norm, gamma, released):
    options = {"norm": norm} if name == "grpo" else {"norm": norm, "gamma": gamma}
    if released and name != "progpo":
        options.update(released_options(name))
    assert np.all(np.isfinite(compute_advantages(name, batch, **options)))


def test_all_equal_groups_of_three_are_exactly_zero():
    # The released float32 code gives +-0.5 here; float64 means leave ~1e-15 residues that std-norm blows up.
    r = 10 * 0.95**3 - 0.1
    batch = StepBatch(group=[0, 0, 0], traj=[0, 1, 2], step=[0, 0, 0], obs=["s"] * 3, reward=[r] * 3, valid=[1, 1, 1])
    for name in ("grpo", "gigpo", "hgpo"):
        assert np.all(compute_advantages(name, batch) == 0.0)


def test_empty_batch():
    empty = StepBatch([], [], [], [], [], [], action=[])
    for name in ("grpo", "gigpo", "hgpo", "progpo"):
        assert compute_advantages(name, empty).shape == (0,)


@pytest.mark.parametrize("name", ["grpo", "gigpo", "hgpo", "progpo"])
def test_accepts_numpy_columns_and_integer_observation_keys(name):
    batch = StepBatch(group=np.array([0, 0, 0, 0]), traj=np.array([0, 0, 1, 1]), step=np.array([0, 1, 0, 1]),
                      obs=np.array([7, 9, 7, 9], dtype=np.int64), reward=np.array([0.0, 10.0, 0.0, 0.0]),
                      valid=np.array([True, True, True, True]), action=np.array([1, 2, 1, 3]))
    as_lists = StepBatch(*[getattr(batch, f).tolist() for f in FIELDS[:7]])
    np.testing.assert_array_equal(compute_advantages(name, batch), compute_advantages(name, as_lists))
