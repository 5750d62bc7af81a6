"""Similarity-based anchor groups (`similarity_threshold`, released GiGPO's `enable_similarity`): the clusters of the
released rule (tests/reference.py, written from gigpo/core_gigpo.py), exact grouping at 1.0, independent of row
order, and refused in one line for observations that are not text."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.advantages import OBJECTS, alfworld_text_batch, listing
from hgpo_trl.advantages import StepBatch, compute_advantages, estimator_options, observation_keys
from hgpo_trl.advantages.batch import sort_steps
from hgpo_trl.advantages.similarity import similar_observations
from tests import reference

# Two ALFWorld observations whose difflib ratio depends on the argument order (0.476 one way, 0.704 the other).
DRAWER_3 = ("You open the drawer 3. The drawer 3 is open. In it, you see a butterknife 3, a saltshaker 3, a soapbottle 1, "
            "a cup 1, a spatula 3, and a peppershaker 1.")
DRAWER_4 = ("You open the drawer 4. The drawer 4 is open. In it, you see a lettuce 3, a tomato 1, a pan 3, a fork 3, a "
            "egg 1, a pot 2, a spatula 2, and a butterknife 2.")


@pytest.fixture(scope="module")
def batch():
    """Rows in rollout order (trajectory by trajectory, steps in time order), as the release's batch."""
    return alfworld_text_batch(groups=3, rollouts=4, max_steps=25, seed=2)


def partition(labels) -> list[int]:
    """Labels renamed by first appearance: equal lists iff the same partition of the rows."""
    names: dict = {}
    return [names.setdefault(label, len(names)) for label in labels]


def ours(batch: StepBatch, threshold: float) -> list[int]:
    steps = sort_steps(batch)
    return partition(steps.unsort(similar_observations(steps, batch.obs, threshold)).tolist())


@pytest.mark.parametrize("threshold", [0.8, 0.95, 0.99])
def test_the_clusters_are_the_released_rules(batch, threshold):
    released = partition(reference.released_similarity_groups(batch.group, batch.obs, threshold))
    assert ours(batch, threshold) == released
    exact = len(set(zip(batch.group, batch.obs, strict=True)))
    if threshold <= 0.95:  # the batch's near-duplicates merge: the option changes the groups
        assert len(set(released)) < exact


def test_long_near_duplicates_where_autojunk_acts():
    """A table of 16 objects seen by 6 rollouts, each after taking a different object or none: listings over 200
    characters (difflib treats their frequent characters as junk) that differ by one object."""
    rng = np.random.default_rng(0)
    things = [f"{o} {rng.integers(1, 4)}" for o in rng.choice(OBJECTS, 16, replace=False)]
    rows = {field: [] for field in ("group", "traj", "step", "obs")}
    for traj in range(6):
        for t in range(8):
            left = [x for x in things if x not in rng.choice(things, rng.integers(0, 3), replace=False)]
            place = f"diningtable {rng.integers(1, 3)}"
            rows["group"].append(0), rows["traj"].append(traj), rows["step"].append(t)
            rows["obs"].append(f"You arrive at {place}. On the {place}, you see {listing(left)}.")
    assert min(map(len, rows["obs"])) >= 200
    batch = StepBatch(**rows, reward=[0.0] * 48, valid=[True] * 48)
    for threshold in (0.9, 0.95, 0.97, 0.985):
        released = partition(reference.released_similarity_groups(batch.group, batch.obs, threshold))
        assert ours(batch, threshold) == released
        assert 1 < len(set(released)) < len(set(batch.obs))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 2), st.text("ab c1é→", max_size=12)), min_size=1, max_size=30),
       st.sampled_from([0.3, 0.5, 0.75, 0.9, 0.95, 0.999]))
def test_random_texts_cluster_as_released(rows, threshold):
    """Short texts of a small alphabet (ties, empty texts, characters beyond ASCII): each row its own trajectory,
    in rollout order."""
    group = [g for g, _ in rows]
    obs = [text for _, text in rows]
    batch = StepBatch(group, list(range(len(rows))), [0] * len(rows), obs, [0.0] * len(rows), [True] * len(rows))
    assert ours(batch, threshold) == partition(reference.released_similarity_groups(group, obs, threshold))


@pytest.mark.parametrize("threshold", [0.8, 0.95])
@pytest.mark.parametrize("norm", ["mean_norm", "mean_std_norm"])
def test_gigpo_matches_the_reference_with_the_released_clusters(batch, threshold, norm):
    got = compute_advantages("gigpo", batch, similarity_threshold=threshold, norm=norm, std_ddof=1)
    want = reference.gigpo(batch, similarity_threshold=threshold, norm=norm, std_ddof=1)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    assert not np.allclose(got, compute_advantages("gigpo", batch, norm=norm, std_ddof=1))


def test_the_ratio_is_taken_in_the_released_argument_order():
    """ratio(new step's obs, representative): DRAWER_4 joins DRAWER_3's cluster, not the other way round."""
    assert reference.released_similarity_groups([0, 0], [DRAWER_3, DRAWER_4], 0.6) == [(0, 0), (0, 0)]
    assert reference.released_similarity_groups([0, 0], [DRAWER_4, DRAWER_3], 0.6) == [(0, 0), (0, 1)]
    for first, second, together in ((DRAWER_3, DRAWER_4, True), (DRAWER_4, DRAWER_3, False)):
        two_steps = StepBatch(group=[0, 0], traj=[0, 0], step=[0, 1], obs=[first, second], reward=[0.0, 0.0],
                              valid=[True, True])
        assert (ours(two_steps, 0.6) == [0, 0]) == together


def test_a_step_joins_the_first_similar_cluster_not_the_most_similar():
    texts = ["You arrive at drawer 1. In it, you see a cup 1, and a pan 2.",   # founds cluster 0
             "You arrive at drawer 2. In it, you see a pan 2, and a cup 1.",   # 0.883 with the first: founds 1
             "You arrive at drawer 1. In it, you see a pan 1, and a cup 2."]   # 0.933 with 0, 0.95 with 1: joins 0
    one_trajectory = StepBatch(group=[0] * 3, traj=[0] * 3, step=[0, 1, 2], obs=texts, reward=[0.0] * 3,
                               valid=[True] * 3)
    assert ours(one_trajectory, 0.9) == [0, 1, 0]
    assert partition(reference.released_similarity_groups([0] * 3, texts, 0.9)) == [0, 1, 0]


@pytest.mark.parametrize("name", ["gigpo", "hgpo"])
def test_threshold_one_is_exact_grouping(batch, name):
    np.testing.assert_array_equal(compute_advantages(name, batch, similarity_threshold=1.0),
                                  compute_advantages(name, batch))


@pytest.mark.parametrize("name", ["gigpo", "hgpo"])
def test_row_order_does_not_change_the_result(batch, name):
    """The first member of a cluster is the first in (trajectory, step) order, whatever order rows come in."""
    perm = np.random.default_rng(0).permutation(len(batch))
    shuffled = StepBatch(**{field: [getattr(batch, field)[i] for i in perm]
                            for field in ("group", "traj", "step", "obs", "reward", "valid", "action")})
    want = compute_advantages(name, batch, similarity_threshold=0.9)
    np.testing.assert_array_equal(compute_advantages(name, shuffled, similarity_threshold=0.9), want[perm])


def test_hgpo_levels_compare_the_clusters(batch):
    """Ours, not in the paper: HGPO with similarity_threshold is HGPO on observations renamed to their cluster."""
    order = sorted(range(len(batch)), key=lambda i: (batch.traj[i], batch.step[i]))
    labels = reference.released_similarity_groups([batch.group[i] for i in order], [batch.obs[i] for i in order],
                                                  0.9)
    renamed = [None] * len(batch)
    for i, label in zip(order, labels, strict=True):
        renamed[i] = str(label)
    relabelled = StepBatch(batch.group, batch.traj, batch.step, renamed, batch.reward, batch.valid)
    np.testing.assert_allclose(compute_advantages("hgpo", batch, depth=2, similarity_threshold=0.9),
                               compute_advantages("hgpo", relabelled, depth=2), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["gigpo", "hgpo"])
def test_observations_that_are_not_text_are_refused_in_one_line(batch, name):
    keys = StepBatch(batch.group, batch.traj, batch.step, observation_keys(batch.obs), batch.reward, batch.valid)
    with pytest.raises(ValueError, match=r"^similarity_threshold compares observation text, but StepBatch\.obs "
                                         r"holds int64 numbers") as err:
        compute_advantages(name, keys, similarity_threshold=0.95)
    assert "\n" not in str(err.value)
    mixed = StepBatch([0, 0], [0, 0], [0, 1], ["You are in the hall.", 7], [0.0, 0.0], [True, True])
    with pytest.raises(ValueError, match=r"^similarity_threshold .* row 1 holds int 7$"):
        compute_advantages(name, mixed, similarity_threshold=0.95)


@pytest.mark.parametrize("threshold", [0.0, -0.5, 1.5, float("nan"), True, "0.9"])
def test_a_threshold_outside_0_1_is_refused(batch, threshold):
    with pytest.raises(ValueError, match=r"similarity_threshold must be None or in \(0, 1\]"):
        compute_advantages("gigpo", batch, similarity_threshold=threshold)


def test_the_option_belongs_to_gigpo_and_hgpo_and_is_off_by_default(batch):
    assert "similarity_threshold" in estimator_options("gigpo") and "similarity_threshold" in estimator_options("hgpo")
    assert "similarity_threshold" not in estimator_options("grpo")
    np.testing.assert_array_equal(compute_advantages("gigpo", batch, similarity_threshold=None),
                                  compute_advantages("gigpo", batch))


@pytest.mark.parametrize("name", ["gigpo", "hgpo"])
def test_the_config_field_reaches_the_estimator_and_the_diagnostics(name, tmp_path):
    from hgpo_trl.config import HGPOConfig

    args = HGPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", estimator=name,
                      similarity_threshold=0.95)
    assert args.estimator_options()["similarity_threshold"] == 0.95
    assert args.diagnostic_estimators()[name]["similarity_threshold"] == 0.95
    assert HGPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none").similarity_threshold is None
    with pytest.raises(ValueError, match=r"HGPOConfig\.similarity_threshold must be None or in \(0, 1\]"):
        HGPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", similarity_threshold=0.0)


def test_the_trainer_trains_with_it(tmp_path, tiny_model, tiny_tokenizer):
    """The trainer's batch carries observation text: HGPO with the option trains, logs its levels and diagnostics."""
    from tests.test_trainer import make_config, make_trainer

    args = make_config(tmp_path, estimator="hgpo", similarity_threshold=0.9, diagnostics_every=1, train_iterations=1)
    trainer = make_trainer(tiny_model, tiny_tokenizer, args)
    trainer.train()
    log = next(h for h in trainer.state.log_history if "env/success_rate" in h)
    assert np.isfinite(log["diag/hgpo_bias"]) and trainer.last_level_stats[0].with_peers >= 1
