"""TextArena: the single-player games of the `textarena` package (0.7.4) behind the `TextEnv` protocol.

A task is a (game, seed) pair: `reset(row)` starts game `row["game"]` (default: the environment's `game`) with
`row["seed"]`, so the G rollouts of a task start from the same state, and identical actions give identical
trajectories (with TextArena's random draws isolated, below).

- Observation (what HGPO groups on): the game's current state, not TextArena's accumulated message log (its
  LLM wrapper's observation grows every turn, so no two steps of an episode would ever share a key). The state
  is the latest board (`GAME_BOARD` message) for games that draw one; for the others (Blackjack, Guess The
  Number, Mastermind, Bandit, Lights Out) the game's latest messages, which are what it says about the state
  (the rest of the state is the history, which HGPO's deeper levels group on). After a first invalid move the
  game's notice comes before the state: the game is in another state then (a second invalid move in a row ends
  it), and the notice says why the move was refused. A game's progress messages that only describe the move
  just made are left out, so two paths to the same board give the same observation.
- Rules: the game's own prompt (its rules and action format) is the task text, shown at the top of every prompt.
  Admissible actions: the board's "Available Actions/Moves:" line when it has one (FrozenLake, Sokoban,
  FifteenPuzzle), else `actions=` if given, else none, and the prompt asks for a move in the rules' format.
- Actions lose any space just inside their brackets ("[ a c ]" -> "[a c]", as word-level tokenizers decode it),
  then go through the game's own action wrappers (most add the brackets: "up" -> "[up]"); its observation
  wrappers are not used (see above).
- Invalid moves follow TextArena's rules: the first one in a row gets a notice and the player tries again, the
  next ends the game with the game's penalty reward. Both are `info["invalid_move"]` (the rollout counts them as
  invalid steps), with the game's reason in `info["invalid_reason"]`.
- Outcome: the game's final reward (1 on a win, the share completed otherwise, some games -1 for an invalid
  ending) is `info["score"]`; `won` is score >= 1. The reward is `win_reward` on a win (`reward="win"`), or
  `win_reward * score` (`reward="score"`, for graded games such as Blackjack), on the last step; 0 before.
  A reward that is not a number (Countdown 0.7.4 swaps the reason and the reward of its invalid moves) scores 0.
- RNG: TextArena draws from Python's global `random` (`State.__init__` calls `random.seed(seed)`; 2048,
  Minesweeper, FrozenLake... draw during play). Each environment keeps its own state of that generator and swaps
  it in around every call into the game (`random.getstate/setstate`), so environments sharing a process do not
  disturb each other, nor the trainer's generator.
- nltk data: word games (Wordle, Hangman, WordLadder, Crosswords, WordSearch) call `nltk.download` when their
  module is imported, which offline fails slowly or hangs. Before `ta.make`, the data the game's modules
  download is read from their source and looked up with `nltk.data.find`: anything missing is one ValueError
  naming all of it. While a game is built or played, `nltk.download` answers from the local data only (nltk's
  own would fetch its index online even for data already installed).

Needs the `textarena` extra: `pip install "hgpo-trl[textarena]"`.
"""

from __future__ import annotations

import contextlib
import io
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from numbers import Real
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hgpo_trl.envs.base import Info, MissingExtraError, _is_int, rules_prompt, split_seeds

if TYPE_CHECKING:  # imported where tasks are built: environment workers never load it (4 s)
    import datasets

REWARDS = ("win", "score")
WIN_REWARD = 10.0
GAME_STARTED = "The game has started."  # the observation of a game that says nothing before the first move
EXAMPLE_GAMES = "'FrozenLake-v0', 'TowerOfHanoi-v0', 'Minesweeper-v0-small', '2048-v0-ultra-easy'"
_INSTALL = 'pip install "hgpo-trl[textarena]"'
_BRACKET_SPACE = re.compile(r"\[\s+|\s+\]")
_AVAILABLE = re.compile(r"^\s*Available (?:Actions|Moves):\s*(.+?)\s*$", re.MULTILINE)
# nltk data package -> its folder in nltk's data tree; others are looked for in every folder.
_NLTK_FOLDERS = {"words": "corpora", "wordnet": "corpora", "stopwords": "corpora", "punkt": "tokenizers",
                 "punkt_tab": "tokenizers", "averaged_perceptron_tagger_eng": "taggers"}
_NLTK_ALL_FOLDERS = ("corpora", "taggers", "tokenizers", "chunkers", "grammars", "misc", "models", "stemmers")
_DOWNLOAD_CALL = re.compile(r"nltk\.download\(([^)]*)\)")
_IMPORT = re.compile(r"^\s*(?:from|import)\s+(textarena\.envs\.[\w.]+)", re.MULTILINE)


def _import_textarena():
    try:
        import textarena
    except ImportError as err:
        raise MissingExtraError(f"the TextArena environment needs the textarena package: {_INSTALL} ({err})") from err
    return textarena


class NltkDataMissing(ValueError):
    """A TextArena game needs nltk data that is not installed (the message says how to get it)."""


def _nltk_found(name: str) -> bool:
    import nltk

    for folder in (_NLTK_FOLDERS[name],) if name in _NLTK_FOLDERS else _NLTK_ALL_FOLDERS:
        with contextlib.suppress(LookupError):
            nltk.data.find(f"{folder}/{name}")
            return True
    return False


def _nltk_error(game: str, missing: Sequence[str]) -> NltkDataMissing:
    names = " ".join(missing)
    return NltkDataMissing(f"TextArena game {game!r} needs the nltk data {names!r}, which nltk does not find "
                           f"(nltk.data.path); fetch it once with network access: python -m nltk.downloader "
                           f"{names} (or set NLTK_DATA to a folder that holds it)")


def nltk_downloads(module: str) -> list[str]:
    """The nltk data packages that textarena `module` and the textarena modules it imports download, read from
    their source (importing them would start the downloads)."""
    root = Path(_import_textarena().__file__).parent
    seen, todo, names = set(), [module], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = root.joinpath(*name.split(".")[1:])
        path = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
        if path.is_file():
            source = path.read_text(encoding="utf-8")
            for call in _DOWNLOAD_CALL.findall(source):
                names.update(re.findall(r"[\"']([\w.-]+)[\"']", call))
            todo += _IMPORT.findall(source)
    return sorted(names)


@contextlib.contextmanager
def _offline_nltk(game: str) -> Iterator[None]:
    """`nltk.download` answers from the local data: True when found, else the one-line error naming the data.
    The source scan before `ta.make` names all the missing data at once; this catches calls it cannot see."""
    import nltk

    download = nltk.download

    def local_download(info_or_id=None, *args, **kwargs) -> bool:
        names = [info_or_id] if isinstance(info_or_id, str) else list(info_or_id or ())
        missing = [name for name in names if isinstance(name, str) and not _nltk_found(name)]
        if missing:
            raise _nltk_error(game, missing)
        return True

    nltk.download = local_download
    try:
        yield
    finally:
        nltk.download = download


class _OwnRandom:
    """A private state of Python's global `random`, swapped in around each call into a game."""

    def __init__(self, seed: int = 0):
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        self.state = random.Random(seed).getstate()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        outer = random.getstate()
        random.setstate(self.state)
        try:
            yield
        finally:
            self.state = random.getstate()
            random.setstate(outer)


class _Game:
    """One single-player TextArena game: the unwrapped environment and its default version's action wrappers."""

    def __init__(self, game: str, rng: _OwnRandom):
        ta = _import_textarena()
        from textarena.envs.registration import ENV_REGISTRY

        if game not in ENV_REGISTRY:
            raise ValueError(f"unknown TextArena game {game!r} (textarena.envs.registration.ENV_REGISTRY); "
                             f"single-player games include {EXAMPLE_GAMES}")
        entry = ENV_REGISTRY[game].entry_point
        if isinstance(entry, str):
            missing = [name for name in nltk_downloads(entry.split(":")[0]) if not _nltk_found(name)]
            if missing:
                raise _nltk_error(game, missing)
        self.name, self.rng, self.types = game, rng, ta.ObservationType
        with self.calling("could not be built"):
            env = ta.make(game)
        self.action_wrappers = []
        while isinstance(env, ta.Wrapper):
            if isinstance(env, ta.ActionWrapper):
                self.action_wrappers.append(env)
            env = env.env
        self.env = env
        # Multi-player games fail this (their states assert their player count), or give another kind of state.
        with self.calling("is not a single-player game: reset(num_players=1) failed"):
            env.reset(num_players=1, seed=0)
        if not isinstance(env.state, ta.SinglePlayerState):
            raise ValueError(f"TextArena game {game!r} is not a single-player game (its state is a "
                             f"{type(env.state).__name__}); single-player games include {EXAMPLE_GAMES}")

    @contextlib.contextmanager
    def calling(self, failure: str) -> Iterator[None]:
        """Around every call into the game: its own `random` state, offline nltk, its prints kept off the training
        log (RushHour and LogicPuzzle print on every reset or step), and errors that name the game."""
        try:
            with self.rng.active(), _offline_nltk(self.name), contextlib.redirect_stdout(io.StringIO()):
                yield
        except NltkDataMissing:
            raise
        except Exception as err:
            raise ValueError(f"TextArena game {self.name!r} {failure}: {type(err).__name__}: {err}") from err

    def messages(self) -> list[tuple[str, Any]]:
        """(text, kind) of the messages the game sent since the last call (some games send numbers)."""
        return [(str(message), kind) for _, message, kind in self.env.get_observation()[1]]

    def action(self, action: str) -> str:
        # "[ a c ]" -> "[a c]": the games' regexes want no space inside the brackets, which word-level
        # tokenizers (hgpo_trl.models.tiny) decode around punctuation, and which models write at times.
        action = _BRACKET_SPACE.sub(lambda m: m[0].strip(), action)
        for wrapper in self.action_wrappers:  # outermost first, as a step through the wrapped game
            action = wrapper.action(action)
        return action


class TextArenaEnv:
    """TextArena's single-player games, one at a time (see the module doc). `game`: the game of task rows that
    name none (built now, so that a bad name fails here and not in a worker); `actions`: admissible actions for
    games that list none on their board; `max_steps`: our own step limit (the games have theirs too)."""

    def __init__(self, game: str | None = None, max_steps: int = 50, reward: str = "win",
                 win_reward: float = WIN_REWARD, actions: Sequence[str] | None = None):
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
        if not _is_int(max_steps) or max_steps < 1:
            raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
        if not isinstance(win_reward, Real) or isinstance(win_reward, bool):
            raise ValueError(f"win_reward must be a number, got {win_reward!r}")
        if actions is not None and (isinstance(actions, str) or not all(isinstance(a, str) for a in actions)):
            raise ValueError(f"actions must be a list of strings, got {actions!r}")
        if game is not None and not isinstance(game, str):
            raise ValueError(f"game must be a TextArena game id such as {EXAMPLE_GAMES}, got {game!r}")
        _import_textarena()
        self.game, self.max_steps, self.reward, self.win_reward = game, int(max_steps), reward, float(win_reward)
        self.actions = list(actions) if actions is not None else None
        self._rng = _OwnRandom()
        self._games: dict[str, _Game] = {}
        self._current: _Game | None = None
        if game is not None:
            self._game(game)

    def _game(self, name: str) -> _Game:
        if name not in self._games:
            self._games[name] = _Game(name, self._rng)
        return self._games[name]

    def reset(self, task: Mapping[str, Any]) -> tuple[str, Info]:
        if not isinstance(task, Mapping):
            raise ValueError(f"TextArena task must be a mapping (a dataset row), got {type(task).__name__}")
        name, seed = task.get("game") or self.game, task.get("seed")
        if not isinstance(name, str):
            raise ValueError("TextArena task names no game: give the row a 'game' column or the environment a game=")
        if not _is_int(seed) or seed < 0:
            raise ValueError(f"TextArena task field 'seed' must be an integer >= 0, got {seed!r}")
        self._current = game = self._game(name)
        # Games that draw before creating their State (which seeds `random` itself) start from the seed too.
        self._rng.reseed(int(seed))
        with game.calling("failed to reset"):
            game.env.reset(num_players=1, seed=int(seed))
            messages = game.messages()
        self._rules = "\n".join(m for m, kind in messages if kind == game.types.PROMPT).strip()
        self._state, self._has_board = GAME_STARTED, False
        self._steps, self._done, self._won = 0, False, False
        self._observation = self._observe(messages)
        return self._observation, self._info()

    def step(self, action: str | None) -> tuple[str, float, bool, bool, Info]:
        if self._current is None:
            raise RuntimeError("TextArenaEnv.step() called before reset(task)")
        if self._done:
            raise RuntimeError("TextArenaEnv.step() called after the episode ended; call reset(task) first")
        if action is not None and not isinstance(action, str):
            raise ValueError(f"action must be a string or None, got {type(action).__name__}")
        reward, invalid, reason, score = 0.0, False, None, None
        if action is not None:  # None: the output did not parse; the game never sees it
            game, state = self._current, self._current.env.state
            errors = state.error_count
            with game.calling("failed to step"):
                done = bool(game.env.step(game.action(action))[0])
                messages = game.messages()
            end = state.game_info[0].get("reason") if done else None
            # A first invalid move raises the error count; the one that ends the game is marked in game_info.
            invalid = bool(state.game_info[0].get("invalid_move")) if done else state.error_count > errors
            if invalid:
                notices = [m for m, kind in messages if kind == game.types.GAME_ADMIN]
                reason = end if done else (notices[-1] if notices else "invalid move")
            self._observation = self._observe(messages, end)
            if done:
                value = (state.rewards or {}).get(0)
                score = float(value) if isinstance(value, Real) and not isinstance(value, bool) else 0.0
                self._won = score >= 1.0
                reward = self.win_reward * (float(self._won) if self.reward == "win" else score)
            self._done = done
        self._steps += 1
        truncated = not self._done and self._steps >= self.max_steps
        terminated, self._done = self._done, self._done or truncated
        info = {**self._info(), "invalid_move": invalid}
        if reason is not None:
            info["invalid_reason"] = reason
        if score is not None:
            info["score"] = score
        return self._observation, reward, terminated, truncated, info

    def _observe(self, messages: Sequence[tuple[str, Any]], end: str | None = None) -> str:
        """The observation after `messages`, this call's messages of the game (see the module doc)."""
        types = self._current.types
        boards = [m for m, kind in messages if kind == types.GAME_BOARD]
        if boards:
            self._state, self._has_board = boards[-1], True
        elif not self._has_board:
            said = [m for m, kind in messages if kind not in (types.PROMPT, types.PLAYER_ACTION, types.GAME_ADMIN)]
            self._state = "\n".join(said) if said else self._state  # an invalid move changes nothing
        parts = [m for m, kind in messages if kind == types.GAME_ADMIN and not end] + [self._state]
        if end:
            parts.append(f"Game over. {end}")
        return "\n".join(p.strip() for p in parts if p.strip())

    def _admissible(self) -> list[str]:
        listed = _AVAILABLE.findall(self._state) if self._has_board else []
        if listed:
            return [a.strip() for a in listed[-1].split(",") if a.strip()]
        return list(self.actions or [])

    def _info(self) -> Info:
        return {"admissible_actions": [] if self._done else self._admissible(), "state_key": self._observation,
                "won": self._won, "task": self._rules, "step": self._steps, "game": self._current.name}

    def render_prompt(self, task: str, history: Sequence[tuple[str, str]], observation: str,
                      admissible: Sequence[str], step: int) -> str:
        return rules_prompt(task, history, observation, admissible, step)

    def close(self) -> None:
        """Drop the games (TextArena holds no files or processes)."""
        self._games.clear()
        self._current = None


def textarena_tasks(split: str = "train", game: str | None = None, games: Sequence[str] | None = None,
                    num_tasks: int = 16, seeds: Sequence[int] | None = None) -> datasets.Dataset:
    """One row per (game, seed): `game`, or every game of `games`, each with the seeds of `split` (`seeds` if
    given, else `num_tasks` seeds from the split's range: train 0.., valid 1,000,000.., test 2,000,000..). With
    neither, the rows name no game and the environment's `game=` plays them. Each game is built once here, so an
    unknown or multi-player game, or missing nltk data, fails before training starts."""
    if game is not None and games is not None:
        raise ValueError("textarena_tasks takes game='FrozenLake-v0' or games=[...], not both")
    if game is not None and not isinstance(game, str):
        raise ValueError(f"game must be a TextArena game id such as {EXAMPLE_GAMES}, got {game!r}")
    if games is not None and (isinstance(games, str) or not games or not all(isinstance(g, str) for g in games)):
        raise ValueError(f"games must be a non-empty list of TextArena game ids, got {games!r}")
    names = [game] if game is not None else list(games or [])
    for name in dict.fromkeys(names):
        _Game(name, _OwnRandom())
    seed_list = split_seeds(split, num_tasks, seeds)
    rows = [(g, s) for g in names for s in seed_list] if names else [(None, s) for s in seed_list]
    columns = {"task_id": [f"{g or 'textarena'}/{s}" for g, s in rows], "seed": [s for _, s in rows],
               "split": [split] * len(rows)}
    if names:
        columns["game"] = [g for g, _ in rows]
    import datasets

    return datasets.Dataset.from_dict(columns)
