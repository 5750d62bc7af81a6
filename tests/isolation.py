"""No test changes the process for the next one. Every test starts from one global RNG state, and a test (or a
module's fixtures, checked when its module's last test ends) that leaves changed what a later test would
inherit fails, naming what changed: environment variables, the estimator and environment registries, the
working directory, `sys.path`, torch's default dtype, thread count and grad mode, logging levels, files in the
checkout (`git status`, and what ignored folders hold) and caches under $HOME. What it changed is put back, so
one leak fails one test, not the ones after it.

The caches the suite writes on purpose (hgpo-trl's ALFWorld games, matplotlib's font list, the notebook
kernel's IPython profile) are pointed at a folder of the test run's own (`redirect_caches`, called by
conftest.py before any test), which the processes the tests launch inherit. tests/test_isolation.py runs the
check on tests that leak."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOME = Path.home()
SEED = 0
_UNSET = object()
# Written by tools, never read back by a test: not a test's leftovers.
TOOL_FILES = ("__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", ".venv/", ".coverage")
# Set by pytest itself, or by the first import of a library in the process (deepspeed's __init__ sets it).
NOT_A_TESTS_DOING = ("PYTEST_CURRENT_TEST", "PYTORCH_NVML_BASED_CUDA_CHECK")
# Caches a test run writes, pointed at the run's own folder (the variables each program reads).
CACHE_VARIABLES = ("HGPO_TRL_CACHE", "MPLCONFIGDIR", "IPYTHONDIR")


def redirect_caches() -> Path:
    """Point the caches tests write at a fresh folder (removed when the run ends); return it. Under
    pytest-xdist each worker has its own."""
    folder = Path(tempfile.mkdtemp(prefix="hgpo-trl-tests-"))
    for variable in CACHE_VARIABLES:
        os.environ[variable] = str(folder / variable.lower())
    return folder


def _loggers() -> dict[str, int]:
    """Levels of the loggers that exist now, and the libraries' own verbosity switches."""
    import datasets
    import transformers

    levels = {name: logger.level for name, logger in logging.root.manager.loggerDict.items()
              if isinstance(logger, logging.Logger)}
    levels["<root>"] = logging.getLogger().level
    levels["<transformers verbosity>"] = transformers.logging.get_verbosity()
    levels["<transformers progress bars>"] = transformers.logging.is_progress_bar_enabled()
    levels["<datasets verbosity>"] = datasets.logging.get_verbosity()
    levels["<datasets progress bars>"] = not datasets.utils.are_progress_bars_disabled()
    return levels


def process_state() -> dict[str, object]:
    """What one test leaves to the next in this process."""
    import torch

    import hgpo_trl.advantages
    import hgpo_trl.envs.registry

    return {
        "environment variables": {k: v for k, v in os.environ.items() if k not in NOT_A_TESTS_DOING},
        "registered estimators": dict(hgpo_trl.advantages.ESTIMATORS),
        "registered environments": dict(hgpo_trl.envs.registry._REGISTRY),
        "working directory": os.getcwd(),
        "import path (sys.path)": list(sys.path),
        "torch default dtype": torch.get_default_dtype(),
        "torch threads": torch.get_num_threads(),
        "torch grad mode": torch.is_grad_enabled(),
        "logging levels": _loggers(),
    }


def files_state() -> dict[str, object]:
    """What one test leaves to every later one, in any process: files in the checkout (ignored ones too: what is
    written under outputs/ is a leftover as well), caches under $HOME."""
    status = subprocess.run(["git", "status", "--porcelain", "--ignored=matching", "--untracked-files=all"],
                            cwd=ROOT, capture_output=True, text=True, check=False).stdout.splitlines()
    files = set()
    for line in status:
        path = line[3:]
        if not any(tool in path for tool in TOOL_FILES):
            # git names an ignored folder once, whatever it holds: list what it holds
            files.update([path] if not path.endswith("/") else
                         (str(p.relative_to(ROOT)) for p in (ROOT / path).rglob("*")))
    caches = HOME / ".cache"
    return {
        "files in the checkout": files,
        "caches under $HOME": {str(p.relative_to(HOME)) for p in (*HOME.glob("*"), *caches.glob("*"),
                                                                  *caches.glob("*/*"))},
    }


def differences(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """One line per change, naming what changed."""
    lines = []
    for what, old in before.items():
        new = after[what]
        if old == new:
            continue
        if isinstance(old, dict):
            # A logger created by an import is not a change; a variable or a registration added is.
            keys = old if what == "logging levels" else {*old, *new}
            changed = [f"{key}: {old.get(key, '<unset>')!r} -> {new.get(key, '<unset>')!r}"
                       for key in sorted(keys, key=str) if old.get(key, _UNSET) != new.get(key, _UNSET)]
            if changed:
                lines.append(f"{what}: " + "; ".join(changed))
        elif isinstance(old, set):
            lines.append(f"{what}: added {sorted(new - old)}, removed {sorted(old - new)}")
        else:
            lines.append(f"{what}: {old!r} -> {new!r}")
    return lines


def restore(state: dict[str, object]) -> None:
    """Put back what `process_state` saw (files are left for a person to look at)."""
    import datasets
    import torch
    import transformers

    import hgpo_trl.advantages
    import hgpo_trl.envs.registry

    kept = {k: os.environ[k] for k in NOT_A_TESTS_DOING if k in os.environ}
    os.environ.clear()
    os.environ.update({**state["environment variables"], **kept})
    for registry, saved in ((hgpo_trl.advantages.ESTIMATORS, state["registered estimators"]),
                            (hgpo_trl.envs.registry._REGISTRY, state["registered environments"])):
        registry.clear()
        registry.update(saved)
    os.chdir(state["working directory"])
    sys.path[:] = state["import path (sys.path)"]
    torch.set_default_dtype(state["torch default dtype"])
    torch.set_num_threads(state["torch threads"])
    torch.set_grad_enabled(state["torch grad mode"])
    levels = dict(state["logging levels"])
    logging.getLogger().setLevel(levels.pop("<root>"))
    transformers.logging.set_verbosity(levels.pop("<transformers verbosity>"))
    (transformers.logging.enable_progress_bar if levels.pop("<transformers progress bars>")
     else transformers.logging.disable_progress_bar)()
    datasets.logging.set_verbosity(levels.pop("<datasets verbosity>"))
    (datasets.enable_progress_bars if levels.pop("<datasets progress bars>") else datasets.disable_progress_bars)()
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def check(before: dict[str, object], after: dict[str, object], who: str) -> None:
    changes = differences(before, after)
    if changes:
        restore(before)
        pytest.fail(f"{who} left the process changed for the tests after it (see tests/README.md, 'Isolation'):\n  "
                    + "\n  ".join(changes), pytrace=False)


@pytest.fixture(autouse=True)
def isolated(request):
    """Each test from the same RNG state; what it (and its function-scoped fixtures) changed fails it."""
    from transformers import set_seed

    before = {**process_state(), **files_state()}
    set_seed(SEED)  # Python's, numpy's and torch's global generators
    yield
    check(before, {**process_state(), **files_state()}, f"{request.node.nodeid}")


MODULE_START = pytest.StashKey[dict[str, dict[str, object]]]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before a module's first test sets up its module-scoped fixtures: the state its last test must leave."""
    started = item.session.stash.setdefault(MODULE_START, {})
    module = item.nodeid.split("::")[0]
    if module not in started:
        started.clear()
        started[module] = {**process_state(), **files_state()}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test has torn its module-scoped fixtures down: compare (also when that teardown
    failed, the test's own check included: a module's leak must not reach the next module unreported)."""
    try:
        return (yield)
    finally:
        started = item.session.stash.get(MODULE_START, {})
        module = item.nodeid.split("::")[0]
        if (nextitem is None or nextitem.nodeid.split("::")[0] != module) and module in started:
            check(started.pop(module), {**process_state(), **files_state()}, f"the fixtures of {module}")
