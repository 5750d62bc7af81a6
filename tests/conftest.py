"""Shared fixtures: a tiny offline model and tokenizer that read the keydoor environment; the isolation check
(tests/isolation.py) for every test."""

import atexit
import fcntl
import os
import shutil
import socket
import sys
from collections.abc import Callable
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


def once_per_run(tmp_path_factory, name: str, produce: Callable[[Path], None]) -> Path:
    """The folder that `produce(folder)` filled, made once per test run however many pytest-xdist workers ask: the
    first to ask produces it while the others wait, then they all read it (a session fixture is one per worker,
    and `--dist loadgroup` groups nothing under pytest 9: xdist 3.8 renames a node through an attribute pytest no
    longer reads). A failure is kept too, so no second worker runs a failing production again."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # (the workers' common folder)
    folder, failed = root / name, root / f"{name}.failed"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if failed.is_file():
            pytest.fail(f"{name}, produced for another worker, failed: {failed.read_text()}")
        if not (folder / ".done").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                produce(folder)
            except BaseException as error:
                failed.write_text(f"{type(error).__name__}: {error}"[-4000:])
                raise
            (folder / ".done").write_text("")
    return folder


def unused_port() -> int:
    """A port no process listens on now, for a rendezvous (an `accelerate launch`'s, vLLM's MASTER_PORT): fixed
    ports collide when two launches run at once (pytest-xdist's workers, or two test runs on one machine)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def free_port() -> int:
    return unused_port()


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
