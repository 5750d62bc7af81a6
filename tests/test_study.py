"""The exact study (issue 6, part 2): exact advantages by DP over histories, and the library's estimators."""

import json

import numpy as np
import pytest

from hgpo_trl.advantages import ESTIMATORS, compute_advantages
from hgpo_trl.diagnostics import study
from hgpo_trl.diagnostics.study import (
    ESTIMATOR_SPECS,
    Settings,
    estimate,
    exact_leaves,
    keydoor_policy,
    run_study,
    sample_batch,
    step_table,
)
from hgpo_trl.envs.keydoor import KeyDoorTask

TASK = KeyDoorTask("kitchen", "library", "red", "blue", gold="red")
GOLD_KEY, COIN_KEY = "take red key", "take blue key"


def leaves_by_actions(p_key, p_door, gamma):
    return {leaf.actions: leaf for leaf in exact_leaves(TASK, keydoor_policy(p_key, p_door), gamma)}


def test_exact_advantages_by_hand_gamma_1():
    leaves = leaves_by_actions(0.5, 0.5, 1.0)
    assert len(leaves) == 4 and all(leaf.probability == 0.25 for leaf in leaves.values())
    gold_own = leaves[(GOLD_KEY, "go to hall", "go to vault", "open red door")]
    gold_other = leaves[(GOLD_KEY, "go to hall", "go to vault", "open blue door")]
    coin_own = leaves[(COIN_KEY, "go to hall", "go to vault", "open blue door")]
    coin_other = leaves[(COIN_KEY, "go to hall", "go to vault", "open red door")]
    # Vault with the gold key: Q = 10 (own door) or 0 (locked), V = 5. With the coin key: Q = 3 or 0, V = 1.5.
    # Entrance: Q(gold key) = 5, Q(coin key) = 1.5, V = 3.25. Room and hall have one action: A = 0.
    assert gold_own.values == (3.25, 5.0, 5.0, 5.0) and coin_own.values == (3.25, 1.5, 1.5, 1.5)
    assert gold_own.advantages == (1.75, 0.0, 0.0, 5.0) and gold_other.advantages == (1.75, 0.0, 0.0, -5.0)
    assert coin_own.advantages == (-1.75, 0.0, 0.0, 1.5) and coin_other.advantages == (-1.75, 0.0, 0.0, -1.5)
    assert gold_own.rewards == (0.0, 0.0, 0.0, 10.0) and coin_own.rewards[-1] == 3.0 and coin_other.rewards[-1] == 0


def test_exact_advantages_by_hand_gamma_095():
    leaves = leaves_by_actions(0.5, 0.5, 0.95)
    gold = leaves[(GOLD_KEY, "go to hall", "go to vault", "open red door")]
    coin = leaves[(COIN_KEY, "go to hall", "go to vault", "open red door")]
    # The vault reward comes 3 steps after the entrance: Q(gold key) = 0.95^3 * 5 = 4.286875,
    # Q(coin key) = 0.95^3 * 1.5 = 1.2860625, V = 2.78646875; the vault itself is undiscounted.
    np.testing.assert_allclose(gold.values, [2.78646875, 0.95 ** 2 * 5, 0.95 * 5, 5.0])
    np.testing.assert_allclose(gold.advantages, [1.50040625, 0.0, 0.0, 5.0], atol=1e-12)
    np.testing.assert_allclose(coin.advantages, [-1.50040625, 0.0, 0.0, -1.5], atol=1e-12)
    # Skewed policy (p_key 0.25, p_door 0.7): vault V = 7 (gold key), 2.1 (coin key); entrance by hand.
    skewed = leaves_by_actions(0.25, 0.7, 0.95)[(COIN_KEY, "go to hall", "go to vault", "open blue door")]
    v0 = 0.95 ** 3 * (0.25 * 7 + 0.75 * 2.1)
    np.testing.assert_allclose(skewed.values, [v0, 0.95 ** 2 * 2.1, 0.95 * 2.1, 2.1])
    np.testing.assert_allclose(skewed.advantages, [0.95 ** 3 * 2.1 - v0, 0, 0, 0.9], atol=1e-12)


def test_step_table_marks_the_hall_and_vault_aliased_and_advantages_average_to_zero():
    table = step_table([TASK, KeyDoorTask("attic", "cellar", "green", "white", gold="white")],
                       keydoor_policy(0.5, 0.7), 0.95)
    np.testing.assert_array_equal(table.aliased, np.isin(table.step, [2, 3]))
    assert table.cells == 2 * (2 + 2 + 2 + 4)  # per task: 2 keys at t = 0, 1, 2, and 2 keys x 2 doors at t = 3
    # E_pi[A(h, a)] = 0 at every history: weight each leaf's steps by the leaf's probability.
    for start, probability in zip(table.leaf_start, table.leaf_probability, strict=True):
        weighted = sum(p * table.exact[s:s + 4] for s, p in zip(start, probability, strict=True))
        np.testing.assert_allclose(weighted, 0.0, atol=1e-12)


def test_sampled_batch_has_the_trainer_layout():
    table = step_table([TASK] * 3, keydoor_policy(0.5, 0.7), 0.95)
    batch, rows = sample_batch(table, 5, np.random.default_rng(0))
    assert len(batch) == 3 * 5 * 4 and np.bincount(batch.group).tolist() == [20, 20, 20]
    assert batch.step.tolist() == [0, 1, 2, 3] * 15 and batch.valid.all()
    assert batch.obs[2] == "You are in the hall." and batch.obs == table.obs[rows].tolist()
    assert set(batch.action[3::4]) <= {"open red door", "open blue door"}


def test_the_study_runs_the_librarys_own_estimators(monkeypatch):
    assert {name for name, _ in ESTIMATOR_SPECS.values()} <= set(ESTIMATORS)
    calls = {}
    for name in ("grpo", "gigpo", "hgpo", "progpo"):
        def spy(batch, _original=ESTIMATORS[name], _name=name, **options):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(batch, **options)
        monkeypatch.setitem(ESTIMATORS, name, spy)
    settings = Settings(batches=3, tasks=2, group_size=4)
    run_study(settings)
    per_name = {}
    for name, _ in ESTIMATOR_SPECS.values():
        per_name[name] = per_name.get(name, 0) + settings.batches
    assert calls == per_name
    # The study's numbers are those of direct compute_advantages calls on the same batch...
    table = step_table([TASK], keydoor_policy(0.5, 0.7), 0.95)
    batch, _ = sample_batch(table, 8, np.random.default_rng(1))
    direct = compute_advantages("hgpo", batch, gamma=0.95, norm="mean_norm", depth=2, alpha=1.0)
    np.testing.assert_array_equal(estimate(batch, "hgpo K=2 alpha=1", 0.95), direct)
    # ...and replacing the registry's functions replaces them: stubs answering 0 give the zero estimator's errors.
    for name in ("grpo", "gigpo", "hgpo", "progpo"):
        monkeypatch.setitem(ESTIMATORS, name, lambda batch, **options: np.zeros(len(batch)))
    report = run_study(settings)
    for result in report["results"]:
        assert result["overall"]["mse"] == pytest.approx(report["zero_estimator"]["overall"]["mse"], rel=1e-12)


@pytest.fixture(scope="module")
def report():
    labels = ["hgpo K=0 (= GiGPO A_S)", "hgpo K=1 alpha=2", "hgpo K=2 alpha=2", "progpo K=2 lam=0 (oracle groups)",
              "grpo", "gigpo (A_E + A_S)"]
    return run_study(Settings(batches=200, seed=0), labels=labels)


def test_deeper_history_groups_are_less_biased_at_the_aliased_states(report):
    rows = {r["label"]: r for r in report["results"]}
    assert report["aliased_steps"] == [2, 3]
    aliased = {label: r["aliased"]["bias2"] for label, r in rows.items()}
    vault = {label: r["by_step"]["3"]["bias2"] for label, r in rows.items()}
    # A chain with wide margins (seed 0, 200 batches: about 4.4 > 2.6 > 0.7 > 0.4).
    assert aliased["hgpo K=0 (= GiGPO A_S)"] > 1.3 * aliased["hgpo K=1 alpha=2"]
    assert aliased["hgpo K=1 alpha=2"] > 2 * aliased["hgpo K=2 alpha=2"]
    assert aliased["hgpo K=2 alpha=2"] > aliased["progpo K=2 lam=0 (oracle groups)"]
    # At the vault, level 1 (hall, vault) is still aliased: K = 1 is no better than GiGPO's step term there.
    assert vault["hgpo K=1 alpha=2"] == pytest.approx(vault["hgpo K=0 (= GiGPO A_S)"])
    assert vault["hgpo K=2 alpha=2"] < 0.5 * vault["hgpo K=0 (= GiGPO A_S)"]
    # Before the aliased states all level-based estimators see one group: the same numbers.
    assert rows["hgpo K=2 alpha=2"]["by_step"]["0"] == rows["hgpo K=0 (= GiGPO A_S)"]["by_step"]["0"]
    # GiGPO as the library defines it adds the episode term: most biased of all.
    assert max(aliased, key=aliased.get) == "gigpo (A_E + A_S)"


def test_mse_is_bias_squared_plus_variance(report):
    for result in report["results"]:
        for part in [result["overall"], result["aliased"], *result["by_step"].values()]:
            assert part["mse"] == pytest.approx(part["bias2"] + part["variance"], rel=1e-9, abs=1e-12)
            assert part["bias2"] >= 0 and part["variance"] >= 0
    overall = [r["overall"]["mse"] for r in report["results"]]
    assert overall == sorted(overall)


def test_cli_json_parses_and_table_prints(capsys):
    assert study.main(["--batches", "3", "--tasks", "2", "--json"]) == 0
    parsed = json.loads(capsys.readouterr().out)
    assert len(parsed["results"]) == len(ESTIMATOR_SPECS) and parsed["settings"]["norm"] == "mean_norm"
    assert study.main(["--batches", "3", "--tasks", "2", "--p-door", "0.9"]) == 0
    out = capsys.readouterr().out
    assert "p_door=0.9" in out and "hgpo K=2 inverse_mse" in out and "Wall time" in out
    with pytest.raises(SystemExit):
        study.main(["--p-key", "1.5"])
