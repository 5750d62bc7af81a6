# %% [markdown]
# # Bring your own environment: TextWorld games, end to end
#
# A third-party text game engine behind hgpo-trl's environment protocol, registered by name, trained with an
# advantage estimator of your own, then evaluated like the built-in environments. Cells (`# %%`) as in
# `quickstart.ipynb`; it runs offline on a CPU in about a minute. The walk-through is docs/byo_env.md.
#
# TextWorld (Côté et al., 2018) is the engine under ALFWorld; `pip install textworld` (the `alfworld` extra
# brings it). Its `tw-make` generates games offline.

# %%
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # a tiny model is far faster on one thread
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads anything

import re
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import textworld
from textworld.generator import compile_game, make_game

from hgpo_trl.advantages import StepBatch, compute_advantages, discounted_returns, register_estimator
from hgpo_trl.commands.evaluate import main as hgpo_eval
from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_env, make_tasks, register_env
from hgpo_trl.envs.base import compact_prompt
from hgpo_trl.models.tiny import build_tiny_model, build_tiny_tokenizer
from hgpo_trl.models.warmstart import environment_corpus, warm_start
from hgpo_trl.trainer import HGPOTrainer

OUTPUT = Path(os.environ.get("BYO_OUTPUT", "outputs/byo_textworld"))
GAMES = OUTPUT / "games"

# %% [markdown]
# ## 1. Games, generated offline
# One game per seed: two rooms, two objects, a one-step quest ("close the bureau", "unlock the chest with the
# key"), found by exploring. On the command line the same game is
# `tw-make custom --world-size 2 --nb-objects 2 --quest-length 1 --seed 1 --output games/train_1.z8`; here
# TextWorld's Python API makes it, about a second a game. Each game is a `.z8` story file and a `.json` with
# its quest, which TextWorld reads to report `won`, `lost` and the admissible commands.

# %%
SEEDS = {"train": [1, 2, 3], "valid": [4]}


def generate_games(folder: Path, seeds: Mapping[str, Sequence[int]]) -> list[Path]:
    """`<split>_<seed>.z8` for every seed, generated once (a rerun reuses them)."""
    paths = []
    for split, split_seeds in seeds.items():
        for seed in split_seeds:
            path = folder / f"{split}_{seed}.z8"
            if not path.exists():
                options = textworld.GameOptions()
                options.nb_rooms, options.nb_objects, options.quest_length = 2, 2, 1
                options.seeds = seed
                options.path = str(path)
                compile_game(make_game(options), options)
            paths.append(path)
    return paths


game_files = generate_games(GAMES, SEEDS)
print([path.name for path in game_files])

# %% [markdown]
# ## 2. The environment
# The protocol is `envs/base.py`: `reset(task_row) -> (observation, info)`, `step(action | None) ->
# (observation, reward, terminated, truncated, info)`, `render_prompt(...)` and `close()`, with
# `admissible_actions`, `state_key`, `won` and `task` in every `info`. `action=None` is a model output that did
# not parse: the game must not see it. The engine is TextWorld's (`textworld.start`, as `envs/alfworld.py`
# uses it), asked through `EnvInfos` for what the protocol needs.

# %%
WIN_REWARD = 10.0  # the scale of ALFWorld and WebShop, on which the estimators' defaults were set
REQUESTED = textworld.EnvInfos(admissible_commands=True, won=True, lost=True, objective=True, description=True)
# A game's text ends with TextWorld's prompt line (">  -= Room =-0/3"), or after a win with "*** The End ***"
# and a replay menu; neither tells the agent anything.
_TRAILER = re.compile(r"\n>|\*\*\*")


def clean(feedback: str) -> str:
    return " ".join(_TRAILER.split(feedback)[0].split())


class TextWorldEnv:
    """One TextWorld game at a time: `reset(row)` plays the game file `row["game_file"]`. Reward 10 on a win; an
    episode ends when TextWorld says won or lost, or after `max_steps` steps (truncated)."""

    def __init__(self, max_steps: int = 8):
        self.max_steps = max_steps
        self._engine = None  # one engine, loading each new game (a few ms), as AlfWorldEnv does
        self._game_file = None

    def reset(self, task: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        if self._engine is None:
            self._engine = textworld.start(task["game_file"], REQUESTED)
        elif task["game_file"] != self._game_file:
            self._engine.load(task["game_file"])
        self._game_file = task["game_file"]
        self._state = self._engine.reset()
        self._steps, self._done = 0, False
        observation = clean(self._state["description"])  # the room; the banner and the quest text are left out
        return observation, self._info(observation)

    def step(self, action: str | None) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done:
            raise RuntimeError("TextWorldEnv.step() after the episode ended; call reset(task) first")
        if action is None:
            observation = "Nothing happens."
        else:
            self._state, _, _ = self._engine.step(action)
            observation = clean(self._state.feedback)
        self._steps += 1
        won = bool(self._state["won"])
        terminated = won or bool(self._state["lost"])
        truncated = not terminated and self._steps >= self.max_steps
        self._done = terminated or truncated
        return observation, WIN_REWARD if won else 0.0, terminated, truncated, self._info(observation)

    def _info(self, observation: str) -> dict[str, Any]:
        return {"admissible_actions": sorted(self._state["admissible_commands"]), "state_key": observation,
                "won": bool(self._state["won"]), "lost": bool(self._state["lost"]), "task": self._state["objective"]}

    def render_prompt(self, task: str, history: Sequence[tuple[str, str]], observation: str,
                      admissible: Sequence[str], step: int) -> str:
        return compact_prompt(task, history, observation, admissible, step)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None


def textworld_tasks(split: str = "train", games_dir: str | Path = GAMES) -> datasets.Dataset:
    """The games `<split>_*.z8` of `games_dir`, one row each (what `reset` takes)."""
    files = sorted(Path(games_dir).glob(f"{split}_*.z8"))
    if not files:
        raise ValueError(f"no TextWorld games for split {split!r} in {games_dir} (expected {split}_*.z8)")
    return datasets.Dataset.from_dict({"game_file": [str(f) for f in files], "game_id": [f.stem for f in files]})


# fast=True: a step takes ~3 ms, so the trainer steps these environments in its own process. A slow one would be
# stepped by worker processes, which must import the class: put it in a module then, not in a notebook.
# overwrite=True: rerunning the cell replaces the registration.
register_env("textworld", TextWorldEnv, textworld_tasks, fast=True, overwrite=True)

# %% [markdown]
# Play one game through the registry, as the trainer will: the walkthrough TextWorld stored with the game wins.

# %%
train_tasks = make_tasks("textworld", "train", games_dir=GAMES)
env = make_env("textworld", max_steps=8)
observation, info = env.reset(train_tasks[0])
print(info["task"], "|", observation, "|", info["admissible_actions"])
for command in textworld.Game.load(str(Path(train_tasks[0]["game_file"]).with_suffix(".json"))).metadata["walkthrough"]:
    observation, reward, terminated, truncated, info = env.step(command)
    print(f"{command!r} -> {observation!r} reward {reward} terminated {terminated} won {info['won']}")

# %% [markdown]
# ## 3. Your own advantage estimator
# An estimator is a function of one `StepBatch` (the rollout's steps: task group, trajectory, t, observation,
# reward, validity, action) returning one advantage per step. This one subtracts from each step's discounted
# return the mean return of the steps its task group took at the same turn t: a time-indexed baseline. Its
# keyword options are filled from the config's fields of the same name (`gamma`, `invalid_penalty`).

# %%
estimator_calls: list[StepBatch] = []  # every batch the trainer hands over, to look at below


def turn_baseline(batch: StepBatch, *, gamma: float = 0.95, invalid_penalty: float = 0.1) -> np.ndarray:
    estimator_calls.append(batch)
    returns = discounted_returns(batch, gamma, invalid_penalty)
    # One cell per (task group, t); the rollout numbers groups and steps with integers.
    cells = np.unique(np.stack([np.asarray(batch.group), np.asarray(batch.step)], axis=1), axis=0,
                      return_inverse=True)[1].ravel()
    baseline = np.bincount(cells, weights=returns) / np.bincount(cells)
    return returns - baseline[cells]


register_estimator("turn_baseline", turn_baseline, overwrite=True)

# %% [markdown]
# ## 4. Train
# As the quickstart: a tiny model whose word-level tokenizer is trained on the games' text, a short supervised
# warm start on random admissible actions (the answer format, no preference), then RL with `estimator=
# "turn_baseline"`. Five iterations show the pieces working together, not an agent that has learned to play:
# invalid outputs are no-ops here, so every episode runs several steps and the estimator sees whole episodes.

# %%
tokenizer = build_tiny_tokenizer(environment_corpus(env, list(train_tasks), episodes=60))
model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=4)
print(warm_start(model, tokenizer, partial(make_env, "textworld"), list(train_tasks), steps=40,
                 batch_size=32, learning_rate=3e-3))

args = HGPOConfig(
    output_dir=str(OUTPUT), use_cpu=True, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
    env_name="textworld", max_env_steps=8, action_mode="plain", admissible_only=True, invalid_action="noop",
    tasks_per_device=len(train_tasks), num_generations=4, per_device_train_batch_size=32, max_completion_length=12,
    estimator="turn_baseline", history_length=2, learning_rate=3e-4, lr_scheduler_type="constant", beta=0.0,
    train_iterations=5, logging_steps=1,
)
trainer = HGPOTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=train_tasks)
trainer.train()
for entry in trainer.state.log_history:
    if "env/success_rate" in entry:
        print(f"iteration {entry['step']}: success {entry['env/success_rate']:.2f}, "
              f"invalid outputs {entry['env/invalid_rate']:.2f}, episode length {entry['env/episode_length']:.1f}")
trainer.save_model(str(OUTPUT))

# %% [markdown]
# The estimator received the rollout's `StepBatch`, the same object the built-in estimators take:

# %%
batch = estimator_calls[-1]
print(f"{len(estimator_calls)} calls; the last: {len(batch)} steps of {len(set(batch.traj))} episodes")
print("turn_baseline:", np.round(compute_advantages("turn_baseline", batch)[:8], 2))
print("hgpo:         ", np.round(compute_advantages("hgpo", batch, depth=2)[:8], 2))

# %% [markdown]
# ## 5. Evaluate like the built-in environments
# The evaluation command plays any registered environment; called here, in the process that registered it,
# with the training run's settings: the trained model beside a random player on the `valid` games (the default
# split of an environment the command does not know: `eval_split`), three seeds.

# %%
hgpo_eval(["--env_name", "textworld", "--task_kwargs", f'{{"games_dir": "{GAMES}"}}',
           "--policy", "model", "random", "--model_name_or_path", str(OUTPUT), "--output_dir", str(OUTPUT),
           "--max_env_steps", "8", "--action_mode", "plain", "--admissible_only", "true",
           "--max_completion_length", "12", "--use_cpu", "true", "--report_to", "none", "--disable_tqdm", "true"])
print((OUTPUT / "evaluation" / "evaluation.md").read_text())
