"""The estimator lab (issue 22): its environment, its policy-gradient step, its use of the library's estimators,
and what it must be able to tell apart."""

import json

import numpy as np
import pytest

from hgpo_trl.advantages import compute_advantages
from hgpo_trl.lab.corridor import GO, OPEN, TAKE, build, exact_values, policy_probabilities
from hgpo_trl.lab.learn import Setting, Spec, draws, policy_gradient, rollout, step_batch, train, unit_scale
from hgpo_trl.lab.report import main
from hgpo_trl.lab.sweep import PRESETS, Preset, estimator_specs, run_setting, run_sweep


def test_the_corridor_values_are_exact_for_a_hand_computed_policy():
    corridor = build(history_length=2, length=1)
    uniform = policy_probabilities(corridor, np.zeros((1, corridor.num_contexts, 2)))
    values = exact_values(corridor, uniform, gamma=0.5)
    # take key (1/2) -> keyroom -> section 1: go on (1/2) -> door: open (1/2) pays 10 at step 3.
    assert values.success[0, 0] == pytest.approx(0.5 * 0.5 * 0.5)
    assert values.v[0, 0] == pytest.approx(0.5 * 0.5 * 0.5 * 10 * 0.5 ** 3)
    # At the door with the key: Q(open) = 10, Q(turn back) = 0, V = 5, so A(open) = 5.
    door_with_key = [i for i in range(corridor.nodes) if corridor.has_key[i] and corridor.actions[i] == (OPEN, "turn back")]
    assert values.advantage()[0, door_with_key[0]].tolist() == pytest.approx([5.0, -5.0])


def test_only_hiding_tasks_hide_the_key_and_alias_observations():
    corridor = build()
    clear, hiding = ~corridor.hiding, corridor.hiding
    assert not corridor.aliased[clear].any() and corridor.aliased[hiding].any()
    glints = np.array(["glints" in corridor.observations[o] for o in corridor.obs])
    assert not glints[hiding].any() and (glints[clear] == (corridor.has_key[clear] & (corridor.step[clear] >= 2))).all()
    # In a clear task every observation has exactly one node: one history per observation.
    assert len(set(corridor.obs[clear].tolist())) == clear.sum()


def test_the_policy_sees_the_memory_window_and_the_observation():
    corridor = build(history_length=1)
    for window, observation in corridor.contexts:
        assert len(window) <= 1 and isinstance(observation, str)
    keyroom = corridor.observations.index("You hold the key.")
    node = int(np.flatnonzero(corridor.obs == keyroom)[0])
    window, observation = corridor.contexts[corridor.context[node]]
    assert window == (("You are at the entrance. A key lies on a table.", TAKE),) and observation == "You hold the key."
    assert corridor.actions[node] == (GO,)


def test_one_iteration_update_equals_the_hand_computed_policy_gradient_step():
    setting = Setting(inconsistency=1.0, group_size=2, history_length=2, tasks=1, length=1, learning_rate=0.7)
    corridor = setting.corridor()
    logits = np.random.default_rng(3).normal(size=(1, corridor.num_contexts, 2))
    probabilities = policy_probabilities(corridor, logits)
    values = exact_values(corridor, probabilities, setting.gamma)
    steps = rollout(corridor, probabilities, values, draws([8], 0, 2, corridor.max_steps), 1.0, 2)  # one succeeds
    batch = step_batch(corridor, steps, setting)
    advantages = unit_scale(compute_advantages("gigpo", batch, gamma=setting.gamma, norm=setting.norm), steps.seed, 1)
    update = setting.learning_rate * policy_gradient(corridor, probabilities, steps, advantages, 1)

    expected = np.zeros_like(logits)
    n = len(steps.t)
    for i in range(n):  # d/d theta[c, b] log softmax(theta[c])[a] = 1[a = b] - pi(b | c), averaged over the steps
        c, a = corridor.context[steps.node[i]], steps.action[i]
        pi = probabilities[0, steps.node[i]]
        for b in range(2):
            expected[0, c, b] += setting.learning_rate * advantages[i] * ((a == b) - pi[b]) / n
    assert n >= 4 and np.abs(advantages).max() > 0
    np.testing.assert_allclose(update, expected, rtol=1e-12, atol=1e-15)
    # unit_scale: the advantages of the seed have std 1
    assert np.std(advantages) == pytest.approx(1.0)


def test_the_stacked_batch_keeps_seeds_apart_and_replays_the_same_draws():
    setting = Setting(group_size=4, tasks=2)
    corridor = setting.corridor()
    probabilities = policy_probabilities(corridor, np.zeros((3, corridor.num_contexts, 2)))
    values = exact_values(corridor, probabilities, setting.gamma)
    uniforms = draws([0, 1, 2], 0, 8, corridor.max_steps)
    steps = rollout(corridor, probabilities, values, uniforms, 0.5, 4)
    batch = step_batch(corridor, steps, setting)
    group = np.asarray(batch.group)
    for s in range(3):
        assert set(group[steps.seed == s].tolist()) == {2 * s, 2 * s + 1}
    # Seed 1 alone replays exactly its rows of the stacked batch.
    alone = rollout(corridor, probabilities[1:2], exact_values(corridor, probabilities[1:2], setting.gamma),
                    draws([1], 0, 8, corridor.max_steps), 0.5, 4)
    mine = steps.seed == 1
    assert alone.node.tolist() == steps.node[mine].tolist() and alone.action.tolist() == steps.action[mine].tolist()


def test_at_inconsistency_0_hgpo_at_every_depth_and_the_oracle_groups_agree():
    rows = {r["label"]: r for r in run_setting(Setting(inconsistency=0.0, iterations=15, history_length=2),
                                               _specs(), range(40))}
    # One history per observation: every level is the oracle group, so the runs agree seed by seed (to rounding),
    # which is more than agreeing within their confidence intervals.
    oracle = rows["oracle groups"]
    for label in ("hgpo K=1 alpha=1", "hgpo K=2 alpha=1"):
        np.testing.assert_allclose(rows[label]["per_seed"]["auc"], oracle["per_seed"]["auc"], rtol=0, atol=1e-12)
        assert rows[label]["bias"]["overall"]["bias2"] == pytest.approx(oracle["bias"]["overall"]["bias2"])
    assert rows["gigpo"]["per_seed"]["auc"] != oracle["per_seed"]["auc"]  # GiGPO's episode term differs


def test_the_step_term_gap_between_gigpo_and_hgpo_grows_with_inconsistency():
    # GiGPO's step term A_S is HGPO at K = 0: their gap in squared bias against exact Q - V over all steps, not
    # only the aliased ones (the knob is the share of hiding tasks: it sets how many steps are aliased, not how
    # biased each one is).
    specs = [Spec("A_S", "hgpo", {"depth": 0}), Spec("hgpo K=2", "hgpo", {"depth": 2})]
    gaps = []
    for inconsistency in (0.0, 0.5, 1.0):
        rows = {r["label"]: r for r in run_setting(Setting(inconsistency=inconsistency, iterations=1),
                                                   [*specs, Spec("gigpo", "gigpo")], range(200))}
        gaps.append(rows["A_S"]["bias"]["overall"]["bias2"] - rows["hgpo K=2"]["bias"]["overall"]["bias2"])
    assert gaps[0] == 0.0 and 0.0 < gaps[1] < gaps[2], gaps


def test_a_registered_estimator_shows_up_in_the_lab(temporary_estimator):
    temporary_estimator("lab_test_zero", lambda batch, **_: np.zeros(len(batch)))
    preset = Preset(inconsistency=(1.0,), group_size=(4,), history_length=(1,), seeds=4, iterations=2, quick=True)
    rows = {r["label"]: r for r in run_sweep(preset, progress=False)["rows"]}
    assert "lab_test_zero" in rows
    # Zero advantages never move the uniform policy: success stays where it started.
    assert rows["lab_test_zero"]["curve"]["success"] == pytest.approx([rows["lab_test_zero"]["curve"]["success"][0]] * 3)


@pytest.mark.slow
def test_the_quick_preset_runs_and_writes_its_outputs(tmp_path, capsys):
    assert main(["--quick", "--output_dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "HGPO (alpha 1, any K) vs GiGPO" in printed and "exact Q-V" in printed
    report = json.loads((tmp_path / "lab.json").read_text())
    # 7 estimators, plus any that another module registered (the table includes every registered one).
    assert len(report["rows"]) == 2 * len(estimator_specs(2, quick=True)) >= 2 * 7
    assert report["preset"]["seeds"] == PRESETS["quick"].seeds == 100
    assert all(len(r["per_seed"]["auc"]) == 100 for r in report["rows"])
    assert (tmp_path / "lab.png").stat().st_size > 0 and (tmp_path / "lab.md").read_text().startswith("Estimator lab")


def test_bad_lab_arguments_name_the_problem():
    with pytest.raises(ValueError, match="Setting.inconsistency"):
        Setting(inconsistency=1.5)
    with pytest.raises(ValueError, match="length"):
        build(length=0)
    with pytest.raises(SystemExit):
        main(["--seeds", "1"])


def _specs():
    return [s for s in estimator_specs(2, quick=True) if s.label != "exact Q-V"]


def test_train_is_deterministic_per_seed():
    setting = Setting(iterations=3)
    a = train(setting, Spec("gigpo", "gigpo"), [7, 8])
    b = train(setting, Spec("gigpo", "gigpo"), [8])
    np.testing.assert_array_equal(a.success[1], b.success[0])
