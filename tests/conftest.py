"""Shared fixtures: a tiny offline model and tokenizer that read the keydoor environment; the isolation check
(tests/isolation.py) for every test."""

import atexit
import os
import shutil
import socket
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# DeepSpeed's CPU runs compile a collective op on first use: `make` builds it into the venv at set-up.
if sys.prefix != sys.base_prefix:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

import pytest

from hgpo_trl.advantages import ESTIMATORS, register_estimator
from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.keydoor import COLORS, ROOMS
from hgpo_trl.models.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny
from hgpo_trl.rollout.actions import FORMAT_INSTRUCTIONS
from tests.isolation import (  # noqa: F401 (the check's fixture and hooks, for every test)
    isolated,
    pytest_runtest_setup,
    pytest_runtest_teardown,
    redirect_caches,
)

atexit.register(shutil.rmtree, redirect_caches(), ignore_errors=True)  # before any test: the run's own caches
pytest_plugins = ["pytester"]  # tests/test_isolation.py runs pytest on tests that leak


def pytest_configure(config):
    """pytest-randomly reseeds Python's and numpy's generators before each test from the run's seed: keep the
    one state every test starts from (tests/isolation.py), so a test draws the same in either tier."""
    if hasattr(config.option, "randomly_reset_seed"):
        config.option.randomly_reset_seed = False


def pytest_collection_modifyitems(items):
    """The modules that hold slow tests first, each kept whole (their module fixtures are built once): under
    pytest-xdist the long tests start at once and the short ones fill the gaps, instead of one long test
    ending the run alone."""
    slow_modules = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow_modules)


@pytest.fixture
def free_port() -> int:
    """A port no process listens on now, for an `accelerate launch`'s rendezvous: fixed ports collide when two
    launches run at once (pytest-xdist's workers, or two test runs on one machine)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def temporary_estimator():
    """`register_estimator` for one test: the registry is global, and an estimator left in it shows up in later
    tests (the lab's table lists every registered one), so those registered through this are removed after it."""
    names = []

    def register(name, fn, **kwargs):
        register_estimator(name, fn, **kwargs)
        names.append(name)

    yield register
    for name in names:
        ESTIMATORS.pop(name, None)


def keydoor_corpus() -> list[str]:
    """Every text a keydoor prompt can hold, for the word-level tokenizer."""
    env = make_env("keydoor")
    texts = [FORMAT_INSTRUCTIONS["tags"], "Nothing happens.", " ".join(ROOMS), " ".join(COLORS)]
    for row in make_tasks("keydoor", "train", num_rooms=len(ROOMS), num_colors=len(COLORS)).select(range(50)):
        observation, info = env.reset(row)
        texts.append(env.render_prompt(info["task"], [(observation, "go to hall")], observation,
                                       info["admissible_actions"], 1))
        for action in [*info["admissible_actions"], "go to hall", "go to vault", f"open {row['color1']} door"]:
            texts.append(env.step(action)[0])
            texts.append(action)
    return texts


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer(keydoor_corpus())


@pytest.fixture
def tiny_model(tiny_tokenizer):
    return build_tiny_model(tiny_tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)


@pytest.fixture(scope="session")
def tiny_model_path(tiny_tokenizer, tmp_path_factory):
    model = build_tiny_model(tiny_tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    return str(save_tiny(model, tiny_tokenizer, tmp_path_factory.mktemp("tiny")))
