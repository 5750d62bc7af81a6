"""Bad input raises ValueError naming the field or option at fault."""

import math

import numpy as np
import pytest

from hgpo_trl.advantages import (
    StepBatch,
    compute_advantages,
    estimator_options,
    register_estimator,
    released_options,
)


def good(**overrides):
    cols = dict(group=[0, 0, 0, 0], traj=[0, 0, 1, 1], step=[0, 1, 0, 1], obs=["a", "b", "a", "c"],
                reward=[0.0, 10.0, 0.0, 0.0], valid=[True, True, False, True], action=["x", "y", None, "z"])
    cols.update(overrides)
    return StepBatch(**cols)


BAD_BATCHES = [
    (good(obs=["a", "b", "a"]), "equal lengths.*obs has 3"),
    (good(action=["x"]), "equal lengths.*action has 1"),
    (good(reward=[0.0, math.nan, 0.0, 0.0]), "reward must be finite: row 1 is nan"),
    (good(reward=[0.0, 0.0, math.inf, 0.0]), "reward must be finite: row 2 is inf"),
    (good(reward=["0", "x", "1", "2"]), "reward must hold numbers"),
    (good(step=[0, 0, 0, 1]), r"duplicate \(traj, step\) pairs: traj 0 step 0"),
    (good(step=[0, 2, 0, 1]), "step has a gap: trajectory 0 has step 2 where step 1"),
    (good(step=[1, 2, 0, 1]), "step has a gap: trajectory 0 has step 1 where step 0"),
    (good(step=[0, -1, 0, 1]), "step must be >= 0"),
    (good(step=[0, 0.5, 0, 1]), "step must hold integers"),
    (good(group=[0, 1, 1, 1]), "group: trajectory 0 spans two groups"),
    (good(valid=["yes", "no", "no", "yes"]), "valid must hold booleans"),
    (good(obs=[["a"], "b", "a", "c"]), "obs must hold hashable values"),
    (good(window=[0, -1, 0, 0]), "window must be >= 0"),
]


@pytest.mark.parametrize("name", ["grpo", "gigpo", "hgpo", "progpo"])
@pytest.mark.parametrize(("batch", "message"), BAD_BATCHES)
def test_bad_batches_name_the_field(name, batch, message):
    with pytest.raises(ValueError, match=message):
        compute_advantages(name, batch)


BAD_OPTIONS = [
    ("nope", {}, "unknown estimator 'nope'; known: .*'hgpo'"),
    ("hgpo", {"norm": "z_score"}, "norm must be one of .*'z_score'"),
    ("gigpo", {"norm": "std"}, "norm must be one of"),
    ("grpo", {"norm": "std"}, "norm must be one of"),
    ("progpo", {"norm": "std"}, "norm must be one of"),
    ("grpo", {"depth": 2}, r"'grpo' does not take option\(s\) \['depth'\]"),
    ("hgpo", {"histroy_length": 2}, r"does not take option\(s\) \['histroy_length'\]"),
    ("hgpo", {"depth": -1}, "depth must be an integer >= 0"),
    ("hgpo", {"depth": 1.5}, "depth must be an integer >= 0"),
    ("hgpo", {"alpha": -1.0}, "alpha must be finite and >= 0"),
    ("hgpo", {"alpha": math.inf}, "alpha must be finite and >= 0"),
    ("hgpo", {"weighting": "mse"}, "weighting must be one of"),
    ("hgpo", {"gamma": 1.5}, r"gamma must be in \[0, 1\]"),
    ("gigpo", {"gamma": -0.1}, r"gamma must be in \[0, 1\]"),
    ("gigpo", {"omega": math.nan}, "omega must be finite"),
    ("grpo", {"episode_stats": "episodes"}, "episode_stats must be one of"),
    ("gigpo", {"episode_stats": "rows"}, "episode_stats must be one of"),
    ("hgpo", {"episode_stats": "rows"}, "episode_stats must be one of"),  # checked with base_group off too
    ("grpo", {"std_ddof": 2}, r"std_ddof must be one of \(0, 1\), got 2"),
    ("gigpo", {"std_ddof": -1}, "std_ddof must be one of"),
    ("hgpo", {"std_ddof": 0.5}, "std_ddof must be one of"),
    ("hgpo", {"std_ddof": True}, "std_ddof must be one of .*True"),
    ("progpo", {"std_ddof": 1}, r"'progpo' does not take option\(s\) \['std_ddof'\]"),
    ("grpo", {"drop_zero_items": True}, r"'grpo' does not take option\(s\) \['drop_zero_items'\]"),
    ("hgpo", {"invalid_penalty": math.nan}, "invalid_penalty must be finite"),
    ("progpo", {"lam": math.inf}, "lam must be finite"),
]


@pytest.mark.parametrize(("name", "options", "message"), BAD_OPTIONS)
def test_bad_options_name_the_option(name, options, message):
    with pytest.raises(ValueError, match=message):
        compute_advantages(name, good(), **options)


def test_released_options_exist_only_for_released_estimators():
    with pytest.raises(ValueError, match="'progpo' has no released counterpart"):
        released_options("progpo")


def test_progpo_needs_actions():
    with pytest.raises(ValueError, match="progpo needs StepBatch.action"):
        compute_advantages("progpo", good(action=None))


def test_register_custom_estimator_receives_the_batch(temporary_estimator):
    seen = {}

    def constant(batch, *, value=1.0):
        seen["batch"] = batch
        return np.full(len(batch), value)

    temporary_estimator("test_constant", constant)
    batch = good()
    np.testing.assert_array_equal(compute_advantages("test_constant", batch, value=2.0), [2.0] * 4)
    assert seen["batch"] is batch
    assert estimator_options("test_constant") == ["value"]
    with pytest.raises(ValueError, match="already registered"):
        register_estimator("test_constant", constant)
    register_estimator("test_constant", lambda b: np.zeros(3), overwrite=True)
    with pytest.raises(ValueError, match=r"returned shape \(3,\), expected \(4,\)"):
        compute_advantages("test_constant", batch)
    with pytest.raises(ValueError, match="must be callable"):
        register_estimator("broken", 3)
