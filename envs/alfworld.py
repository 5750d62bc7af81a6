"""ALFWorld: the real text games of the `alfworld` package behind the `TextEnv` protocol.

Each task is one game, named by its `<task folder>/<trial folder>` id. The games come either from a standard
`json_2.1.1/<split>/<task>/<trial>/` tree (what `alfworld-download` fetches) or from packed files
`<split>.jsonl.gz`, one game a line; a packed game is unpacked into a cache folder the first time it is played.
`reset(row)` loads exactly that game into the TextWorld engine, so the G rollouts of a task start from the same
game (alfworld's own `AlfredTWEnv` cycles through games in file-system order instead).

Reward (10 on a win), prompt and, with `raw_observations=True`, observations are those of verl-agent, on which
the GiGPO and HGPO results were obtained. Needs the `alfworld` extra: `pip install "hgpo-trl[alfworld]"`.
"""

from __future__ import annotations

import copy
import functools
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hgpo_trl.envs.base import Info

if TYPE_CHECKING:  # imported where tasks are built: environment workers never load it (4 s)
    import datasets

SPLITS = ("train", "valid_seen", "valid_unseen", "valid_train")
TASK_TYPES = ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
              "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place")
STATE_KEYS = ("observation", "facts")
WIN_REWARD = 10.0
NOTHING = "Nothing happens."
GAME_FILE = "game.tw-pddl"
_BANNER = "-= Welcome to TextWorld, ALFRED! =-"
_TASK_PREFIX = "Your task is to: "
_INSTALL = 'pip install "hgpo-trl[alfworld]"'

# verl-agent's templates verbatim (agent_system/environments/prompts/alfworld.py, spaces included), and its action
# list (quoted, joined by "\n "), so that prompts read as the released checkpoints were trained on.
_INSTRUCTION = ("Now it's your turn to take an action.\n"
                "You should first reason step-by-step about the current situation. This reasoning process MUST "
                "be enclosed within <think> </think> tags. \n"
                "Once you've finished your reasoning, you should choose an admissible action for current step "
                "and present it within <action> </action> tags.\n")
_TEMPLATE_NO_HISTORY = ("\nYou are an expert agent operating in the ALFRED Embodied Environment.\n"
                        "Your current observation is: {observation}\n"
                        "Your admissible actions of the current situation are: [{actions}].\n\n" + _INSTRUCTION)
_TEMPLATE = ("\nYou are an expert agent operating in the ALFRED Embodied Environment. Your task is to: {task}\n"
             "Prior to this step, you have already taken {step} step(s). Below are the most recent {length} "
             "observations and the corresponding actions you took: {history}\n"
             "You are now at step {current} and your current observation is: {observation}\n"
             "Your admissible actions of the current situation are: [{actions}].\n\n" + _INSTRUCTION)


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _import_alfworld() -> None:
    """Fail early, with the install command, when the extra is missing."""
    saved = os.environ.get("ALFWORLD_DATA")
    if saved is None:
        # alfworld.info creates the folder ALFWORLD_DATA names (~/.cache/alfworld when unset) and sets the
        # variable: name an existing folder for the import, then leave the caller's environment as it was.
        os.environ["ALFWORLD_DATA"] = tempfile.gettempdir()
    try:
        import alfworld.agents.environment.alfred_tw_env  # noqa: F401
        import textworld  # noqa: F401
    except ImportError as err:
        raise ImportError(f"the ALFWorld environment needs the alfworld package: {_INSTALL} ({err})") from err
    finally:
        if saved is None:
            os.environ.pop("ALFWORLD_DATA", None)


def _playable(game_id: str, task_type: str) -> bool:
    """alfworld's rule (AlfredTWEnv): movable-receptacle and sliced-object games are not supported."""
    return task_type in TASK_TYPES and "movable" not in game_id and "Sliced" not in game_id


@functools.cache
def _md5(path: Path, size: int, mtime_ns: int) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class _Pack:
    """Games packed one JSON line each: id, task_type, pddl_params, goal, pddl_problem. `records()` yields the
    playable ones as (game_id, task_type, goal), like `_Tree.records()`."""

    path: Path

    def records(self) -> Iterator[tuple[str, str, str]]:
        with gzip.open(self.path, "rt", encoding="utf-8") as lines:
            for line in filter(str.strip, lines):
                game = json.loads(line)
                if _playable(game["id"], game["task_type"]):
                    yield game["id"], game["task_type"], game["goal"]

    def game_file(self, game_id: str, cache_dir: Path) -> Path:
        stat = self.path.stat()
        folder = cache_dir / _md5(self.path, stat.st_size, stat.st_mtime_ns) / game_id
        if not (folder / GAME_FILE).is_file():
            self._unpack(game_id, folder)
        return folder / GAME_FILE

    def _unpack(self, game_id: str, folder: Path) -> None:
        """Write the two files alfworld reads; the domain and grammar are the installed package's."""
        _import_alfworld()  # the first import of alfworld.info, made without changing the caller's environment
        from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

        with gzip.open(self.path, "rt", encoding="utf-8") as lines:
            # Parse only the lines that mention the id: a full parse of the train pack takes seconds.
            found = (json.loads(line) for line in lines if game_id in line)
            game = next((g for g in found if g["id"] == game_id), None)
        if game is None:
            raise ValueError(f"ALFWorld game {game_id!r} is not in {self.path}")
        grammar = Path(ALFRED_TWL2_PATH).read_text().replace("UNKNOWN GOAL", game["goal"])
        game_data = {"pddl_domain": Path(ALFRED_PDDL_PATH).read_text(), "grammar": grammar,
                     "pddl_problem": game["pddl_problem"], "solvable": True}
        folder.parent.mkdir(parents=True, exist_ok=True)
        # Write aside, then rename: another process unpacking the same game sees no folder or a whole one.
        tmp = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=folder.parent))
        try:
            (tmp / GAME_FILE).write_text(json.dumps(game_data))
            (tmp / "traj_data.json").write_text(json.dumps({"task_type": game["task_type"],
                                                             "pddl_params": game["pddl_params"]}))
            try:
                os.rename(tmp, folder)
            except OSError:
                if not (folder / GAME_FILE).is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class _Tree:
    """A `json_2.1.1/<split>` folder of `<task>/<trial>/` game folders."""

    root: Path

    def records(self) -> Iterator[tuple[str, str, str]]:
        for task in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for trial in sorted(p for p in task.iterdir() if p.is_dir()):
                game_id, task_type = f"{task.name}/{trial.name}", task.name.split("-")[0]
                if not (_playable(game_id, task_type) and (trial / "traj_data.json").is_file()
                        and (trial / GAME_FILE).is_file()):
                    continue
                game = json.loads((trial / GAME_FILE).read_text())
                if game.get("solvable"):
                    goal = re.search(r"Your task is to: ([^\"\n]*?)\.?\"", game["grammar"])
                    yield game_id, task_type, goal.group(1) if goal else ""

    def game_file(self, game_id: str, cache_dir: Path) -> Path:
        path = self.root / game_id / GAME_FILE
        if not path.is_file():
            raise ValueError(f"ALFWorld game {game_id!r} is not in {self.root} (no {path})")
        return path


def _source(data_path: str | os.PathLike | None, split: str) -> _Pack | _Tree:
    """The games of `split` under `data_path` (default `$ALFWORLD_DATA`); at least one must be playable, since
    alfworld waits forever for a game in an empty list."""
    if split not in SPLITS:
        raise ValueError(f"ALFWorld split must be one of {SPLITS}, got {split!r}")
    data_path = data_path or os.environ.get("ALFWORLD_DATA")
    if not data_path:
        raise ValueError("no ALFWorld data: pass data_path or set ALFWORLD_DATA to a folder holding json_2.1.1/ "
                         "(from alfworld-download) or the packed games <split>.jsonl.gz")
    folder = Path(data_path).expanduser()
    if (folder / f"{split}.jsonl.gz").is_file():
        source = _Pack(folder / f"{split}.jsonl.gz")
    elif (folder / "json_2.1.1" / split).is_dir():
        source = _Tree(folder / "json_2.1.1" / split)
    elif (folder / split).is_dir():
        source = _Tree(folder / split)
    else:
        raise ValueError(f"no ALFWorld games for split {split!r} in {folder}: expected {split}.jsonl.gz, "
                         f"json_2.1.1/{split}/ or {split}/ there (data_path or ALFWORLD_DATA)")
    if next(source.records(), None) is None:
        raise ValueError(f"no playable ALFWorld games for split {split!r} in {folder}")
    return source


@functools.cache
def _sorted_records(source: _Pack | _Tree) -> tuple[tuple[str, str, str], ...]:
    return tuple(sorted(source.records()))


def alfworld_tasks(split: str = "train", data_path: str | os.PathLike | None = None, num_tasks: int | None = None,
                   seed: int | None = None, task_types: Sequence[str] | None = None) -> datasets.Dataset:
    """The games of `split`, one row each (`game_id`, `task_type`, `goal`, `split`), sorted by `game_id`,
    shuffled with `seed` when given; `task_types` keeps those types only; `num_tasks` keeps the first rows.
    The `split` column lets one environment play the train and the evaluation tasks."""
    if num_tasks is not None and (not _is_int(num_tasks) or num_tasks < 1):
        raise ValueError(f"num_tasks must be a positive integer or None, got {num_tasks!r}")
    if isinstance(task_types, str) or (task_types is not None and not set(task_types) <= set(TASK_TYPES)):
        raise ValueError(f"task_types must be a list of {TASK_TYPES}, got {task_types!r}")
    records = list(_sorted_records(_source(data_path, split)))
    if task_types is not None:
        records = [r for r in records if r[1] in task_types]
    if seed is not None:
        random.Random(seed).shuffle(records)
    if num_tasks is not None:
        if num_tasks > len(records):
            raise ValueError(f"num_tasks={num_tasks} but ALFWorld split {split!r} has {len(records)} games "
                             f"of the requested types")
        records = records[:num_tasks]
    if not records:
        raise ValueError(f"ALFWorld split {split!r} has no games of types {task_types}")
    game_ids, types, goals = zip(*records, strict=True)
    import datasets

    return datasets.Dataset.from_dict({"game_id": list(game_ids), "task_type": list(types), "goal": list(goals),
                                       "split": [split] * len(records)})


@functools.lru_cache(maxsize=8)
def _translated(translate, domain: str, problem: str, verbose: bool, optimize: bool) -> tuple[Any, str]:
    return translate(domain, problem, verbose=verbose, optimize=optimize)


def _remember_translations() -> None:
    """TextWorld translates a game's PDDL to a planning task (fast-downward's pddl2sas, a pure function of the
    texts) twice on every load and twice on every reset: 80 % of a reset's time, and the G rollouts of a task
    reset into the same game. Translations are kept per process (the last 8; each caller gets its own copy of
    the task): a reset of 4 environments into each of 3 games takes 12 s instead of 39 s, with the same
    observations and admissible actions (tests/test_alfworld.py)."""
    global _remembering
    if _remembering:
        return
    import fast_downward

    translate = fast_downward.pddl2sas

    def pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False) -> tuple[Any, str]:
        task, sas = _translated(translate, domain, problem, verbose, optimize)
        return copy.deepcopy(task), sas

    pddl2sas.original = translate
    fast_downward.pddl2sas = pddl2sas  # textworld calls fast_downward.pddl2sas by attribute
    _remembering = True


_remembering = False  # once per process


def _start_engine(game_file: Path, expert: bool, facts: bool) -> Any:
    """A TextWorld PDDL environment with alfworld's wrappers, playing `game_file`; later games are `load`ed into
    it. One engine per `AlfWorldEnv`, kept across games: every engine loads its own copy of fast-downward's
    library, which TextWorld never unloads (textworld.gym makes one per game: ~3 MB more a game)."""
    import textworld

    _remember_translations()
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredExpert, AlfredExpertType

    wrappers = [functools.partial(AlfredDemangler, shuffle=False)]
    if expert:
        wrappers.append(functools.partial(AlfredExpert, expert_type=AlfredExpertType.HANDCODED))
    return textworld.start(str(game_file), textworld.EnvInfos(won=True, admissible_commands=True, facts=facts),
                           wrappers)


class AlfWorldEnv:
    """One ALFWorld game at a time; `reset(row)` plays the game `row["game_id"]` of `row["split"]` (default
    `split`).

    `state_key="observation"` keys states by the observation text (what the papers group on); `"facts"` by a
    hash of the engine's true state (the sorted TextWorld facts). `expert=True` adds the handcoded expert's next
    action as `info["expert_action"]` (alfworld's expert breaks ties with Python's global `random`). On a
    2-core machine a reset into a new game takes 2-3 s (grammar parsing and PDDL grounding), ~1 s when another
    environment of the process translated that game already (`_remember_translations`), a step ~90 ms.
    Observations drop TextWorld's banner ("-= Welcome to TextWorld, ALFRED! =-", which tells nothing) and the
    whitespace around the game's text; `raw_observations=True` shows the game's text exactly as TextWorld writes
    it, as the release does (the paper configs set it).
    """

    def __init__(self, split: str = "train", data_path: str | os.PathLike | None = None, expert: bool = False,
                 state_key: str = "observation", max_steps: int = 50,
                 cache_dir: str | os.PathLike | None = None, raw_observations: bool = False):
        if state_key not in STATE_KEYS:
            raise ValueError(f"state_key must be one of {STATE_KEYS}, got {state_key!r}")
        if not _is_int(max_steps) or max_steps < 1:
            raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
        if not isinstance(raw_observations, bool):
            raise ValueError(f"raw_observations must be true or false, got {raw_observations!r}")
        self._sources = {split: _source(data_path, split)}
        _import_alfworld()
        self._data_path = data_path
        self.split, self.expert, self.state_key, self.max_steps = split, bool(expert), state_key, int(max_steps)
        self.raw_observations = raw_observations
        default_cache = Path(os.environ.get("HGPO_TRL_CACHE", "~/.cache/hgpo_trl")) / "alfworld"
        self.cache_dir = Path(cache_dir or default_cache).expanduser()
        self._engine = self._game_file = self._state = self._task = None

    def vocabulary(self, tasks: Sequence[Mapping[str, Any]]) -> list[str]:
        """Texts holding the words ALFWorld's observations, goals and commands are made of, without playing (a
        new game costs 2-3 s): the installed grammar's templates, every ALFRED object and receptacle name as
        the games write them, object numbers, the command verbs and the tasks' goals (a tiny tokenizer's corpus)."""
        from alfworld.gen import constants
        from alfworld.info import ALFRED_TWL2_PATH

        names = [name.lower() for name in (*constants.OBJECTS, *constants.RECEPTACLES)]
        commands = "go to take from put in on open close toggle heat with cool clean slice use examine look inventory"
        return [Path(ALFRED_TWL2_PATH).read_text(), " ".join(names), " ".join(map(str, range(100))), commands,
                *(str(task.get("goal", "")) for task in tasks)]

    def reset(self, task: Mapping[str, Any]) -> tuple[str, Info]:
        if not isinstance(task, Mapping) or not isinstance(task.get("game_id"), str):
            raise ValueError(f"ALFWorld task must be a mapping (a dataset row) with a string 'game_id', got {task!r}")
        split = task.get("split", self.split)
        if split not in self._sources:
            self._sources[split] = _source(self._data_path, split)
        game_file = self._sources[split].game_file(task["game_id"], self.cache_dir)
        if self._engine is None:
            self._engine = _start_engine(game_file, self.expert, self.state_key == "facts")
        elif game_file != self._game_file:
            self._game_file = None  # until loaded: a failed load leaves no game to restart
            self._engine.load(str(game_file))
        # Same game: reset alone restarts it (loading again would parse the grammar and ground the PDDL twice).
        self._game_file = game_file
        self._state = self._engine.reset()
        observation = self._observation()  # the room description and the task
        if _TASK_PREFIX not in observation:
            raise RuntimeError(f"ALFWorld game {task['game_id']!r} shows no task: {observation!r}")
        self._task = observation[observation.index(_TASK_PREFIX) + len(_TASK_PREFIX):].strip()
        self._steps, self._done, self._won = 0, False, False
        return observation, self._info(observation)

    def step(self, action: str | None) -> tuple[str, float, bool, bool, Info]:
        if self._task is None:
            raise RuntimeError("AlfWorldEnv.step() called before reset(task)")
        if self._done:
            raise RuntimeError("AlfWorldEnv.step() called after the episode ended; call reset(task) first")
        if action is not None and not isinstance(action, str):
            raise ValueError(f"action must be a string or None, got {type(action).__name__}")
        if action is None:
            observation = NOTHING
        else:
            # Sent as is, admissible or not: the game answers "Nothing happens." to what it cannot do.
            self._state, _, _ = self._engine.step(action)
            observation = self._observation()
            self._won = bool(self._state["won"])
        self._steps += 1
        truncated = not self._won and self._steps >= self.max_steps
        self._done = self._won or truncated
        return observation, WIN_REWARD if self._won else 0.0, self._won, truncated, self._info(observation)

    def _observation(self) -> str:
        feedback = self._state.feedback
        return feedback if self.raw_observations else feedback.replace(_BANNER, "").strip()

    def _info(self, observation: str) -> Info:
        if self.state_key == "facts":
            facts = "\n".join(sorted(map(str, self._state["facts"])))
            state_key = hashlib.blake2b(facts.encode(), digest_size=16).hexdigest()
        else:
            state_key = observation
        info = {"admissible_actions": [a for a in self._state["admissible_commands"] if a != "help"],
                "state_key": state_key, "won": self._won, "task": self._task, "step": self._steps}
        if self.expert:
            info["expert_action"] = self._state["extra.expert_plan"][0]
        return info

    def render_prompt(self, task: str, history: Sequence[tuple[str, str]], observation: str,
                      admissible: Sequence[str], step: int) -> str:
        """verl-agent's prompt. Without history the task shows only inside the observation, which holds it at
        step 0 ("Your task is to: ..."), as in the release."""
        actions = "\n ".join(f"'{a}'" for a in admissible)
        if not history:
            return _TEMPLATE_NO_HISTORY.format(observation=observation, actions=actions)
        first = step - len(history) + 1
        lines = "\n".join(f"[Observation {first + i}: '{past_observation}', Action {first + i}: '{past_action}']"
                          for i, (past_observation, past_action) in enumerate(history))
        return _TEMPLATE.format(task=task, step=step, length=len(history), history=lines, current=step + 1,
                                observation=observation, actions=actions)

    def close(self) -> None:
        """Drop the engine; the next reset starts a new one. Its copy of fast-downward's library (~2.5 MB) stays
        loaded until the process exits: unloading it (`fast_downward.close_lib`) while another engine lives made
        the interpreter crash at exit."""
        self._engine = self._game_file = self._task = None
