"""The pilot analysis (issue 6, part 1): oracle groups by whole history, and each estimator's bias against them."""

import numpy as np
import pytest

from hgpo_trl.advantages import StepBatch
from hgpo_trl.diagnostics import advantage_bias, oracle_advantages

# Keydoor's shape: one task group, four rollouts of entrance -> room -> vault. The vault reads the same after
# either room but is worth 10 or 0 after R1 and 3 after R2: context-inconsistent for same-observation groups.
TRAJ = [("E", "R1", "V", 10.0), ("E", "R1", "V", 0.0), ("E", "R2", "V", 3.0), ("E", "R2", "V", 3.0)]


def batch(extra=()):
    rows = [(0, i, t, obs, reward if t == 2 else 0.0)
            for i, (*observations, reward) in enumerate(TRAJ) for t, obs in enumerate(observations)]
    rows += list(extra)
    group, traj, step, obs, reward = (list(column) for column in zip(*rows, strict=True))
    return StepBatch(group=group, traj=traj, step=step, obs=obs, reward=reward, valid=[True] * len(rows))


def test_oracle_groups_share_the_whole_history_hand_computed():
    advantages, qualified = oracle_advantages(batch(), gamma=1.0, norm="mean_norm", invalid_penalty=0.0)
    # Returns (gamma 1) are 10, 0, 3, 3 at every step. Step 0: one group of four (mean 4); steps 1 and 2: the
    # R1 pair (mean 5) and the R2 pair (equal returns: 0).
    expected = np.array([[6, 5, 5], [-4, -5, -5], [-1, 0, 0], [-1, 0, 0]], dtype=float).reshape(-1)
    np.testing.assert_allclose(advantages, expected)
    assert qualified.all()


def test_a_history_no_other_step_shares_does_not_qualify():
    lone = [(1, 4, 0, "E", 0.0), (1, 4, 1, "R3", 0.0), (1, 5, 0, "E", 0.0), (1, 5, 1, "R4", 1.0)]
    advantages, qualified = oracle_advantages(batch(lone), gamma=1.0, norm="mean_norm", invalid_penalty=0.0)
    assert qualified[:12].all() and qualified[12:].tolist() == [True, False, True, False]
    assert advantages[12:].tolist() == [-0.5, 0.0, 0.5, 0.0]


def test_bias_of_each_estimator_against_the_oracle():
    report = advantage_bias(batch(), {
        "hgpo_deepest": {"estimator": "hgpo", "depth": 2, "alpha": 1e3},
        "hgpo_k0": {"estimator": "hgpo", "depth": 0},
        "grpo": {"estimator": "grpo"},
    }, gamma=1.0, norm="mean_norm", invalid_penalty=0.0)
    # HGPO's deepest level here is the whole history: it is the oracle.
    assert report["hgpo_deepest"].steps == 12 and report["hgpo_deepest"].mse == pytest.approx(0.0, abs=1e-18)
    # Level 0 groups by the current observation alone. At step 1 it matches the oracle (R1/R2 tell the
    # contexts apart); at the vault it mixes them: (6, -4, -1, -1) against (5, -5, 0, 0).
    difference = np.array([0, 0, 1, 0, 0, 1, 0, 0, -1, 0, 0, -1], dtype=float)
    assert report["hgpo_k0"].bias == pytest.approx(difference.mean())
    assert report["hgpo_k0"].spread == pytest.approx(difference.std())
    # GRPO gives every step its episode advantage (6, -4, -1, -1).
    grpo = np.array([0, 1, 1, 0, 1, 1, 0, -1, -1, 0, -1, -1], dtype=float)
    assert report["grpo"].mse == pytest.approx(np.mean(grpo ** 2))


def test_a_registered_estimator_is_called_with_the_same_batch(temporary_estimator):
    seen = []

    def shifted_oracle(step_batch, *, gamma=0.95, norm="mean_std_norm", invalid_penalty=0.1):
        seen.append(step_batch)
        return oracle_advantages(step_batch, gamma=gamma, norm=norm, invalid_penalty=invalid_penalty)[0] + 1.0

    temporary_estimator("shifted_oracle_test", shifted_oracle)
    steps = batch()
    report = advantage_bias(steps, {"shifted": {"estimator": "shifted_oracle_test"}}, gamma=0.9)
    assert seen == [steps]
    assert report["shifted"].bias == pytest.approx(1.0) and report["shifted"].spread == pytest.approx(0.0, abs=1e-12)
