"""The isolation check (tests/isolation.py) fails a test that leaves the process changed, names the change and
puts it back; every test starts from the same RNG state. Run on small test files by pytest itself (pytester)."""

import logging
import os

import pytest

from hgpo_trl.advantages import ESTIMATORS

CONFTEST = "from tests.isolation import isolated, pytest_runtest_setup, pytest_runtest_teardown  # noqa: F401\n"


@pytest.fixture
def run(pytester):
    pytester.makeconftest(CONFTEST)

    def run_tests(source: str, *options: str):
        pytester.makepyfile(test_leaks=source)
        return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", *(options or ["-p", "no:randomly"]))

    return run_tests


def test_a_leaked_variable_fails_its_test_is_named_and_is_put_back(run):
    result = run("""
import os

def test_sets():
    os.environ["HGPO_LEAK_CHECK"] = "1"

def test_after():
    assert "HGPO_LEAK_CHECK" not in os.environ
""")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*test_sets left the process changed*",
                                 "*environment variables: HGPO_LEAK_CHECK: '<unset>' -> '1'*"])
    assert "HGPO_LEAK_CHECK" not in os.environ


def test_a_registered_estimator_the_working_directory_and_torch_settings_are_caught(run, tmp_path):
    result = run(f"""
import os
import torch
from hgpo_trl.advantages import register_estimator

def test_registers():
    register_estimator("leaked", lambda batch: None)

def test_moves():
    os.chdir({str(tmp_path)!r})

def test_dtype():
    torch.set_default_dtype(torch.float64)

def test_clean(monkeypatch):
    monkeypatch.setenv("HGPO_LEAK_CHECK", "1")  # put back by monkeypatch: no leak
""")
    result.assert_outcomes(passed=4, errors=3)
    result.stdout.fnmatch_lines(["*registered estimators: leaked: '<unset>' -> *", "*working directory: *",
                                 "*torch default dtype: torch.float32 -> torch.float64*"])
    assert "leaked" not in ESTIMATORS


def test_a_module_fixture_that_leaks_is_caught_when_its_module_ends(run):
    result = run("""
import os
import pytest

@pytest.fixture(scope="module")
def leaky():
    os.environ["HGPO_LEAK_CHECK"] = "module"
    yield

def test_one(leaky):
    pass

def test_two(leaky):
    pass
""")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*the fixtures of test_leaks.py left the process changed*"])
    assert "HGPO_LEAK_CHECK" not in os.environ


def test_a_logging_level_and_a_folder_left_in_a_cache_under_home_are_caught(run, tmp_path, monkeypatch):
    import tests.isolation

    monkeypatch.setattr(tests.isolation, "HOME", tmp_path)  # not the real $HOME: other workers look at it
    (tmp_path / ".cache").mkdir()
    result = run(f"""
import logging
from pathlib import Path

def test_verbose():
    logging.getLogger().setLevel(logging.DEBUG)

def test_caches():
    (Path({str(tmp_path)!r}) / ".cache" / "some_tool").mkdir()
""")
    # A folder cannot be put back: its test fails, and its module's check at the end says it again.
    result.assert_outcomes(passed=2, errors=2)
    result.stdout.fnmatch_lines(["*logging levels: <root>: 30 -> 10*",
                                 "*test_caches left*", "*caches under $HOME: added*.cache/some_tool*",
                                 "*the fixtures of test_leaks.py left*"])
    assert logging.getLogger().level == logging.WARNING


@pytest.mark.parametrize("order", [["-p", "no:randomly"], ["-p", "randomly", "--randomly-seed=7"]])
def test_every_test_starts_from_the_same_rng_state(run, pytester, order):
    pytester.makeconftest(CONFTEST + "from tests.conftest import pytest_configure  # noqa: F401\n")
    result = run("""
import random
import numpy as np
import pytest
import torch

@pytest.mark.parametrize("test", range(3))
def test_draws_as_from_seed_0(test):
    expected = (random.Random(0).random(), np.random.RandomState(0).rand(),
                torch.rand(1, generator=torch.Generator().manual_seed(0)).item())
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
""", *order)
    result.assert_outcomes(passed=3)
