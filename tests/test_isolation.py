"""The isolation check (tests/isolation.py) fails a test that leaves the process changed, names the change and
puts it back; every test starts from the same RNG state. Run on small test files by pytest itself (pytester)."""

import os

import pytest

from hgpo_trl.advantages import ESTIMATORS

CONFTEST = "from tests.isolation import isolated, pytest_runtest_setup, pytest_runtest_teardown  # noqa: F401\n"


@pytest.fixture
def run(pytester):
    pytester.makeconftest(CONFTEST)

    def run_tests(source: str):
        pytester.makepyfile(test_leaks=source)
        return pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:cacheprovider", "-p", "no:xdist")

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


def test_every_test_starts_from_the_same_rng_state(run):
    result = run("""
import random
import numpy as np
import torch

DRAWS = []

def test_first():
    DRAWS.append((random.random(), np.random.rand(), torch.rand(1).item()))

def test_second():
    DRAWS.append((random.random(), np.random.rand(), torch.rand(1).item()))
    assert DRAWS[0] == DRAWS[1]
""")
    result.assert_outcomes(passed=2)
