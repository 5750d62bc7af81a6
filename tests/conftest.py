"""Shared fixtures: a tiny offline model and tokenizer that read the keydoor environment."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import pytest

from hgpo_trl.actions import FORMAT_INSTRUCTIONS
from hgpo_trl.advantages import ESTIMATORS, register_estimator
from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.keydoor import COLORS, ROOMS
from hgpo_trl.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny


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
