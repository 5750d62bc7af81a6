"""Small cases for every estimator, with the expected numbers derived by hand in the comments."""

import numpy as np
import pytest

from hgpo_trl.advantages import StepBatch, compute_advantages, discounted_returns, hgpo_level_stats

EPS = 1e-6  # the std epsilon of mean_std_norm


def make_batch(trajs, group=None):
    """trajs: list of (obs list, reward list[, valid list[, action list]]) in one task group by default."""
    cols = {k: [] for k in ("group", "traj", "step", "obs", "reward", "valid", "action")}
    for j, traj in enumerate(trajs):
        obs, rewards = traj[0], traj[1]
        valid = traj[2] if len(traj) > 2 else [True] * len(obs)
        actions = traj[3] if len(traj) > 3 else [f"act{t}" for t in range(len(obs))]
        for t in range(len(obs)):
            cols["group"].append(0 if group is None else group[j])
            cols["traj"].append(j)
            cols["step"].append(t)
            cols["obs"].append(obs[t])
            cols["reward"].append(rewards[t])
            cols["valid"].append(valid[t])
            cols["action"].append(actions[t])
    return StepBatch(**cols)


def test_returns_reverse_recurrence_and_penalty_only_where_invalid():
    # gamma 0.5, rewards [1, 0, 4], step 1 invalid:
    # R2 = 4; R1 = 0 + 0.5 * 4 = 2, minus 0.1 -> 1.9; R0 = 1 + 0.5 * 2 = 2 (the penalty does not flow back).
    batch = make_batch([(["a", "b", "c"], [1, 0, 4], [True, False, True])])
    np.testing.assert_allclose(discounted_returns(batch, gamma=0.5), [2.0, 1.9, 4.0], rtol=0, atol=1e-15)


def test_returns_of_equal_tails_are_bit_identical():
    batch = make_batch([(["a"] * 5, [0, 3, 0, 0, 10]), (["b"] * 3, [0, 0, 10]), (["c"] * 2, [0, 10])])
    r = discounted_returns(batch, gamma=0.95)
    assert r[2] == r[5] and r[3] == r[6] == r[8] and r[4] == r[7] == r[9]


def test_grpo_trajectory_scores():
    # traj A: rewards [0, 10], valid -> score 10; traj B: rewards [0, 0, 0], one invalid -> score -0.1.
    # mean 4.95; mean_norm: A +5.05, B -5.05; population std 5.05 -> mean_std_norm: +-5.05 / (5.05 + 1e-6).
    batch = make_batch([(["s", "x"], [0, 10]), (["s", "y", "z"], [0, 0, 0], [True, False, True])])
    np.testing.assert_allclose(compute_advantages("grpo", batch, norm="mean_norm"),
                               [5.05, 5.05, -5.05, -5.05, -5.05], rtol=0, atol=1e-12)
    z = 5.05 / (5.05 + EPS)
    np.testing.assert_allclose(compute_advantages("grpo", batch), [z, z, -z, -z, -z], rtol=0, atol=1e-12)


def test_grpo_step_rows_variant():
    # episode_stats="steps": each row scores its episode's reward minus 0.1 if the row is invalid.
    # Rows: A: 10, 10; B: 0, -0.1, 0. Mean = 19.9 / 5 = 3.98; mean_norm subtracts it.
    batch = make_batch([(["s", "x"], [0, 10]), (["s", "y", "z"], [0, 0, 0], [True, False, True])])
    adv = compute_advantages("grpo", batch, norm="mean_norm", episode_stats="steps")
    np.testing.assert_allclose(adv, [6.02, 6.02, -3.98, -4.08, -3.98], rtol=0, atol=1e-12)


def test_gigpo_episode_plus_anchor_step_term():
    # gamma 0.5. T1: obs [s, x], rewards [0, 10] -> R = [5, 10]; T2: obs [s, y], rewards [0, 0] -> R = [0, 0].
    # A_E (mean_norm) = +5 for T1, -5 for T2. Anchor group s = {5, 0} -> +2.5, -2.5; x and y are singletons -> 0.
    # A = A_E + omega * A_S: T1 = [7.5, 5], T2 = [-7.5, -5]; with omega 2: T1 = [10, 5], T2 = [-10, -5].
    batch = make_batch([(["s", "x"], [0, 10]), (["s", "y"], [0, 0])])
    np.testing.assert_allclose(compute_advantages("gigpo", batch, gamma=0.5, norm="mean_norm"),
                               [7.5, 5, -7.5, -5], rtol=0, atol=1e-12)
    np.testing.assert_allclose(compute_advantages("gigpo", batch, gamma=0.5, norm="mean_norm", omega=2.0),
                               [10, 5, -10, -5], rtol=0, atol=1e-12)


# The aliased case: observation h looks the same after a and after b, but is worth 10 or 0 after a and 2 after b.
# gamma 1: returns T1 [10, 10], T2 [0, 0], T3 [2, 2], T4 [2, 2].
ALIASED = [(["a", "h"], [0, 10]), (["a", "h"], [0, 0]), (["b", "h"], [0, 2]), (["b", "h"], [0, 2])]


def test_hgpo_blends_levels_with_power_weights():
    # Step 1 (obs h). Level 0: {10, 0, 2, 2}, mean 3.5 -> a0 = 6.5, -3.5, -1.5, -1.5.
    # Level 1: (a, h) = {10, 0} -> a1 = +5, -5; (b, h) = {2, 2} all equal -> a1 = 0, and it contributes.
    # K = 1, alpha = 1: w0 = 2, w1 = 3. T1: (2 * 6.5 + 3 * 5) / 5 = 5.6; T2: (2 * -3.5 + 3 * -5) / 5 = -4.4;
    # T3, T4: (2 * -1.5 + 3 * 0) / 5 = -0.6.
    # Step 0 has level 0 only: obs a = {10, 0} -> +5, -5; obs b = {2, 2} -> 0.
    batch = make_batch(ALIASED)
    adv = compute_advantages("hgpo", batch, gamma=1.0, depth=1, alpha=1.0, norm="mean_norm")
    np.testing.assert_allclose(adv, [5, 5.6, -5, -4.4, 0, -0.6, 0, -0.6], rtol=0, atol=1e-12)


def test_hgpo_uniform_weights_base_group_and_released_zero_filter():
    batch = make_batch(ALIASED)
    kw = dict(gamma=1.0, depth=1, norm="mean_norm")
    # alpha 0: plain mean of the items. T1 step 1: (6.5 + 5) / 2 = 5.75.
    assert compute_advantages("hgpo", batch, alpha=0.0, **kw)[1] == pytest.approx(5.75, abs=1e-12)
    # base_group: episode scores {10, 0, 2, 2}, mean 3.5 -> base items 6.5, -3.5, -1.5, -1.5, weight 1.
    # T1 step 1: (2 * 6.5 + 3 * 5 + 1 * 6.5) / 6 = 34.5 / 6 = 5.75.
    assert compute_advantages("hgpo", batch, alpha=1.0, base_group=True, **kw)[1] == pytest.approx(5.75, abs=1e-12)
    # drop_zero_items (released): T3 step 1 loses its level-1 zero -> -1.5; T3 step 0 has only a zero -> 0.
    adv = compute_advantages("hgpo", batch, alpha=1.0, drop_zero_items=True, **kw)
    assert adv[5] == pytest.approx(-1.5, abs=1e-12) and adv[4] == 0.0


def test_hgpo_inverse_mse_weights():
    # Pooled returns of the task group {10, 10, 0, 0, 2, 2, 2, 2}: mean 3.5, variance 118 / 8 = 14.75, floor 3.6875.
    # T1 step 1: level 0 {10, 0, 2, 2}: mean 3.5, var 14.75, n 4; level 1 {10, 0}: mean 5, var 25, n 2.
    #   w0 = 1 / ((3.5 - 5)^2 + 14.75 / 4) = 16 / 95; w1 = 1 / (25 / 2) = 2 / 25.
    #   A = (6.5 * 16/95 + 5 * 2/25) / (16/95 + 2/25) = 710 / 118.
    # T3 step 1: level 1 {2, 2}: mean 2, var 0 floored to 3.6875, n 2 -> w1 = 32 / 59; w0 = 1 / (1.5^2 + 3.6875) = 16/95.
    #   A = (-1.5 * 16/95 + 0) / (16/95 + 32/59) = -1416 / 3984.
    batch = make_batch(ALIASED)
    adv = compute_advantages("hgpo", batch, gamma=1.0, depth=1, norm="mean_norm", weighting="inverse_mse")
    assert adv[1] == pytest.approx(710 / 118, abs=1e-12)
    assert adv[5] == pytest.approx(-1416 / 3984, abs=1e-12)


def test_hgpo_level_stats():
    # Level 0: groups {a: 2, b: 2, h: 4} -> 8 steps with peers; level 1 (t >= 1, 4 steps): (a, h) 2, (b, h) 2.
    stats = hgpo_level_stats(make_batch(ALIASED), depth=2)
    assert [(s.level, s.eligible, s.with_peers) for s in stats] == [(0, 8, 8), (1, 4, 4), (2, 0, 0)]
    assert stats[0].group_sizes.tolist() == [0, 0, 2, 0, 1]
    assert stats[1].group_sizes.tolist() == [0, 0, 2]


def test_hgpo_window_caps_levels():
    # If step 1's prompt of T1 showed no history (window 0), it has level 0 only: a0 = 6.5.
    base = make_batch(ALIASED)
    window = [0, 0, 1, 1, 1, 1, 1, 1]
    batch = StepBatch(base.group, base.traj, base.step, base.obs, base.reward, base.valid, window=window)
    adv = compute_advantages("hgpo", batch, gamma=1.0, depth=1, norm="mean_norm")
    # T2 step 1 is now alone at level 1 (its peer T1 is not there): level 0 only -> -3.5.
    assert adv[1] == pytest.approx(6.5) and adv[3] == pytest.approx(-3.5) and adv[5] == pytest.approx(-0.6)


def test_progpo_peer_and_transition_credit():
    # gamma 1, K 0, mean_norm. T1: obs [s, u], actions [x, y], rewards [0, 10] -> R [10, 10];
    # T2: obs [s, u], actions [x, z], rewards [0, 0] -> R [0, 0].
    # Exact-prefix groups: step 0 (s) {10, 0} -> +-5; step 1 ((s, x), u) {10, 0} -> +-5.
    # Potentials (leave-one-out mean of the state's other visits): V(T1 s) = 0, V(T2 s) = 10, V(T1 u) = 0, V(T2 u) = 10.
    # C = r + V(next) - V: T1 = [0 + 0 - 0, 10 + 0 - 0] = [0, 10]; T2 = [0 + 10 - 10, 0 + 0 - 10] = [0, -10].
    # A = A_peer + C: T1 = [5, 15], T2 = [-5, -15].
    batch = make_batch([(["s", "u"], [0, 10], [True, True], ["x", "y"]), (["s", "u"], [0, 0], [True, True], ["x", "z"])])
    adv = compute_advantages("progpo", batch, gamma=1.0, depth=0, norm="mean_norm")
    np.testing.assert_allclose(adv, [5, 15, -5, -15], rtol=0, atol=1e-12)


def test_progpo_semantic_pooling_is_for_potentials_only():
    # "Cabinet 1" and "cabinet 2" differ as anchors (no peer group: A_peer = 0) but pool as states:
    # V(T1) = 0 (T2's return), V(T2) = 10. One-step trajectories: C = r - V -> T1: 10 - 0, T2: 0 - 10.
    batch = make_batch([(["Cabinet 1"], [10]), (["cabinet  2"], [0])])
    adv = compute_advantages("progpo", batch, gamma=1.0, depth=0, norm="mean_norm")
    np.testing.assert_allclose(adv, [10, -10], rtol=0, atol=1e-12)
    # A user key that pools nothing: each state falls back on the task group's mean return, 5.
    adv = compute_advantages("progpo", batch, gamma=1.0, depth=0, norm="mean_norm", state_key=lambda o: o)
    np.testing.assert_allclose(adv, [5, -5], rtol=0, atol=1e-12)


def test_groups_are_separate_and_rows_return_in_input_order():
    # Two task groups with the same observations never mix; shuffled rows come back in input order.
    batch = make_batch([(["s"], [10]), (["s"], [0]), (["s"], [4]), (["s"], [4])], group=[0, 0, 1, 1])
    np.testing.assert_allclose(compute_advantages("gigpo", batch, norm="mean_norm"), [10, -10, 0, 0])
    perm = [3, 1, 0, 2]
    shuffled = StepBatch(*[[getattr(batch, f)[i] for i in perm] for f in ("group", "traj", "step", "obs", "reward", "valid")])
    np.testing.assert_allclose(compute_advantages("gigpo", shuffled, norm="mean_norm"), [0, -10, 10, 0])
