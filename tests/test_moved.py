"""The module paths of 0.1 keep working until 0.2 (issue 54, hgpo_trl/moved.py): each old path is the new module
itself, with a DeprecationWarning naming where it went; the public API answers at the top, imported when used."""

import importlib
import importlib.util
import subprocess
import sys
import warnings

import pytest

import hgpo_trl
from hgpo_trl.moved import BECAME_PACKAGES, MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_new_module_with_a_warning(old, monkeypatch):
    new = importlib.import_module(f"hgpo_trl.{MOVED[old]}")
    monkeypatch.delitem(sys.modules, f"hgpo_trl.{old}", raising=False)
    with pytest.warns(DeprecationWarning, match=rf"hgpo_trl\.{old} moved to hgpo_trl\.{MOVED[old]}; the old path"):
        module = importlib.import_module(f"hgpo_trl.{old}")
    assert module is new  # one module: a patch through either path reaches the same code
    assert new.__file__.endswith(f"/hgpo_trl/{MOVED[old].replace('.', '/')}.py")


def test_every_old_module_is_moved_somewhere_that_exists_and_no_new_module_is_shadowed():
    assert not set(MOVED) & set(BECAME_PACKAGES)
    for old, new in {**MOVED, **BECAME_PACKAGES}.items():
        assert importlib.util.find_spec(f"hgpo_trl.{new}") is not None, new
        assert old.split(".")[0] != new.split(".")[0] or old in BECAME_PACKAGES


def test_the_names_of_the_modules_that_became_packages_answer_with_a_warning():
    from hgpo_trl.evaluation.protocol import play_in_chunks
    from hgpo_trl.rollout.lockstep import run_rollout

    with pytest.warns(DeprecationWarning, match=r"hgpo_trl\.rollout\.run_rollout moved to hgpo_trl\.rollout\.lockstep"):
        from hgpo_trl.rollout import run_rollout as old
    assert old is run_rollout
    with pytest.warns(DeprecationWarning, match=r"hgpo_trl\.evaluation\.play_in_chunks moved"):
        from hgpo_trl.evaluation import play_in_chunks as old_play
    assert old_play is play_in_chunks
    with pytest.raises(ImportError, match="cannot import name 'no_such_name'"):
        from hgpo_trl.rollout import no_such_name  # noqa: F401


def test_the_public_api_answers_at_the_top():
    from hgpo_trl.config import HGPOConfig
    from hgpo_trl.models.tiny import make_tiny
    from hgpo_trl.trainer import HGPOTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (hgpo_trl.HGPOTrainer, hgpo_trl.HGPOConfig, hgpo_trl.make_tiny) == (HGPOTrainer, HGPOConfig, make_tiny)
        for name in hgpo_trl.__all__:
            assert getattr(hgpo_trl, name) is not None
    assert "evaluate_model" in dir(hgpo_trl)
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        hgpo_trl.nothing  # noqa: B018


def test_importing_the_package_imports_no_training_stack_and_an_old_path_runs_as_a_module():
    """`import hgpo_trl` stays light (the API is imported when used), and `python -m` with an old path still runs."""
    code = "import sys, hgpo_trl; print(sorted(m for m in ('torch', 'trl', 'transformers') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
    done = subprocess.run([sys.executable, "-W", "default", "-m", "hgpo_trl.trajectories", "--help"],
                          capture_output=True, text=True, check=True)
    assert "usage: python -m hgpo_trl.evaluation.trajectories" in done.stdout
    assert "hgpo_trl.trajectories moved to hgpo_trl.evaluation.trajectories" in done.stderr
