"""Gymnasium: a `gymnasium.Env` with `Text` or `Discrete` actions behind the `TextEnv` protocol, its observations
shown as text.

A task is a seed: `reset(row)` calls `env.reset(seed=row["seed"])` on environment `row["env_id"]` (default: the
adapter's `env_id`), so the G rollouts of a task start from the same state; the environment's own generator
(`np_random`, seeded by that reset) drives any randomness after, so identical actions give identical trajectories.

- Observation: `observation_to_text(observation)` when given (a function, or "module:function"); else the
  observation itself when the observation space is `spaces.Text`; else the `render_mode="ansi"` frame after each
  reset and step, cleaned: ANSI colours become `{text:colour}` (the agent on FrozenLake's start tile is
  `{S:red}`; nested ones listed, outer first: Taxi's taxi on the waiting passenger is `{R:blue,yellow}`), and the
  toy-text line echoing the last action ("  (Down)") is dropped, so that a state reads the same whichever move
  reached it (HGPO groups on it); else the observation written from its space
  (`gymnasium_spaces`: "(14, 10, 0)"), its parts named for a toy-text environment that has no frame
  (Blackjack: "your sum 14, dealer shows 10, usable ace: no"). An observation none of these writes is refused
  when the environment is built, in one line that names `observation_to_text`.
- Actions: `Discrete` spaces have no action names, so the adapter takes them: `action_names` is a list (name i
  is action `start + i`) or a mapping (name -> action). Gymnasium's toy-text environments (FrozenLake, Taxi,
  CliffWalking, Blackjack) have built-in names, goals and success rules (`TOY_TEXT`). Names are matched stripped and
  lower-cased; an unknown name is an invalid move (`info["invalid_move"]`): the environment is not stepped. The
  admissible actions are the names, less those masked by the environment's `info["action_mask"]` (Taxi).
  `spaces.Text` actions are sent as written (an action outside the space is an invalid move); `action_names`
  then lists the admissible actions for the prompt (a mapping also translates them).
- Reward: the environment's, times `reward_scale`; `info["score"]` is the episode's return at the end. `won` is
  judged when the episode ends (terminated, or cut by a time limit: the environment's or `max_steps`) by
  `success`: "reward" (terminated with a positive reward), "terminated", "truncated" (cut, not terminated, after
  `max_steps` real steps or by the environment's own limit: CartPole's pole stayed up; invalid moves do not step it)
  or "is_success" (the last `info["is_success"]`); "auto": the toy-text rule, `CLASSIC_CONTROL`'s, "is_success"
  when the environment reports it, else "reward".

Needs the `gymnasium` extra: `pip install "hgpo-trl[gymnasium]"`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from typing import TYPE_CHECKING, Any, NamedTuple

from hgpo_trl.envs.base import Info, MissingExtraError, _is_int, rules_prompt, split_seeds
from hgpo_trl.envs.gymnasium_frames import clean_frame

if TYPE_CHECKING:  # imported where tasks are built: environment workers never load it (4 s)
    import datasets

SUCCESS = ("auto", "reward", "terminated", "truncated", "is_success")
OBSERVATIONS = ("auto", "text", "ansi")
_INSTALL = 'pip install "hgpo-trl[gymnasium]"'
class ToyText(NamedTuple):
    """What a gymnasium toy-text environment does not say itself."""

    actions: tuple[str, ...]  # the action names, in Discrete order
    goal: str  # the task sentence
    success: str  # the success rule (SUCCESS)
    observation_to_text: Callable[[Any], str] | None = None  # its observation, parts named, where no frame shows it


def _blackjack_text(observation: tuple[int, int, int]) -> str:
    player, dealer, usable_ace = observation
    return (f"your sum {player}, dealer shows {'an ace' if dealer == 1 else dealer}, usable ace: "
            f"{'yes' if usable_ace else 'no'}")


# Gymnasium's toy-text environments, by id prefix.
TOY_TEXT: dict[str, ToyText] = {
    "FrozenLake": ToyText(
        ("left", "down", "right", "up"),
        "Walk from the start S to the goal G over the frozen tiles F without falling into a hole H. The tile "
        "written in red, as {F:red}, is where you stand; on slippery ice a move may slide sideways.", "reward"),
    "Taxi": ToyText(
        ("south", "north", "east", "west", "pickup", "dropoff"),
        "Drive the taxi to the passenger (the blue letter), pick them up, drive to the destination (the magenta "
        "letter) and drop them off. The taxi is the cell written in yellow, as { :yellow}, when empty, in green "
        "when carrying; on a letter it adds its colour to the letter's, as {R:blue,yellow}. Every step costs 1, a "
        "wrong pickup or dropoff 10.", "terminated"),
    "CliffWalking": ToyText(
        ("up", "right", "down", "left"),
        "Walk from the start to the goal T without stepping on the cliff C (it sends you back to the start, "
        "reward -100). x is where you stand; every step costs 1.", "terminated"),
    "Blackjack": ToyText(
        ("stand", "hit"),
        "Beat the dealer at blackjack: end closer to 21 than the dealer without going over. Hit to draw a card, "
        "stand to stop and let the dealer draw; an ace counts 11 while that keeps your sum at 21 or less (a "
        "usable ace), else 1. A win pays 1, a loss costs 1.", "reward", _blackjack_text),
}

# Gymnasium's classic-control environments, by id prefix: what their ending means ("auto"). CartPole terminates when
# the pole falls; MountainCar(Continuous) and Acrobot at their goal, at a reward of -1 or 0. Pendulum never does.
CLASSIC_CONTROL = {"CartPole": "truncated", "MountainCar": "terminated", "Acrobot": "terminated"}


def _import_gymnasium():
    try:
        import gymnasium
    except ImportError as err:
        raise MissingExtraError(f"the Gymnasium environment needs the gymnasium package: {_INSTALL} ({err})") from err
    return gymnasium


def _by_prefix(table: Mapping[str, Any], env_id: str | None) -> Any:
    name = (env_id or "").split("/")[-1].split(":")[-1]  # "module:Id" and "namespace/Id" by their Id
    return next((entry for prefix, entry in table.items() if name.startswith(prefix)), None)


def _renders_ansi(gym, env_id: str) -> bool:
    """Whether registered environment `env_id` ("module:Id" imports the module first) lists the ansi render
    mode, read from its class as `gymnasium.make` reads it, without building it."""
    from gymnasium.envs.registration import load_env_creator

    module, _, name = env_id.rpartition(":")
    if module:
        importlib.import_module(module)
    spec = gym.spec(name)
    creator = spec.entry_point if callable(spec.entry_point) else load_env_creator(spec.entry_point)
    metadata = getattr(creator, "metadata", None)
    return isinstance(metadata, Mapping) and "ansi" in (metadata.get("render_modes") or ())


def _observation_hook(hook: str | Callable[[Any], str] | None) -> Callable[[Any], str] | None:
    """observation_to_text as a function: as given, or imported from "module:function" (the form YAML can give)."""
    if hook is None or callable(hook):
        return hook
    module, _, name = str(hook).partition(":")
    if not isinstance(hook, str) or not module or not name:
        raise ValueError(f"observation_to_text must be a function or a 'module:function' string, got {hook!r}")
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"observation_to_text {hook!r} cannot be imported: {type(err).__name__}: {err}") from None
    if not callable(function):
        raise ValueError(f"observation_to_text {hook!r} is not a function: {type(function).__name__}")
    return function


class _Game:
    """One gymnasium environment with its action table and its observations' text."""

    def __init__(self, env_id: str | Callable[..., Any], make_kwargs: Mapping[str, Any], observation: str,
                 action_names: Sequence[str] | Mapping[str, Any] | None,
                 observation_to_text: Callable[[Any], str] | None):
        gym = _import_gymnasium()
        from gymnasium import spaces

        self.name = env_id if isinstance(env_id, str) else getattr(env_id, "__name__", repr(env_id))
        try:
            if isinstance(env_id, str):
                kwargs = dict(make_kwargs)
                wants_frame = observation_to_text is None and observation != "text"  # a hook never reads it
                if wants_frame and "render_mode" not in kwargs and _renders_ansi(gym, env_id):
                    kwargs["render_mode"] = "ansi"
                self.env = gym.make(env_id, **kwargs)
            else:
                self.env = env_id(**make_kwargs)
        except Exception as err:
            raise ValueError(f"Gymnasium environment {self.name!r} could not be made: {type(err).__name__}: "
                             f"{err}") from err
        if not isinstance(self.env, gym.Env):
            raise ValueError(f"Gymnasium environment {self.name!r} is not a gymnasium.Env: {type(self.env).__name__}")
        self.toy = _by_prefix(TOY_TEXT, env_name := self.env.spec.id if self.env.spec is not None else self.name)
        self.auto_success = self.toy.success if self.toy else _by_prefix(CLASSIC_CONTROL, env_name)
        self.to_text = observation_to_text or self._default_text(observation)
        space = self.env.action_space
        self.text_actions = isinstance(space, spaces.Text)
        if not self.text_actions and not isinstance(space, spaces.Discrete):
            raise ValueError(f"Gymnasium environment {self.name!r}: the action space must be Text or Discrete, "
                             f"got {space}")
        if action_names is None and self.toy is not None:
            action_names = self.toy.actions
        if action_names is None and not self.text_actions:
            raise ValueError(f"Gymnasium environment {self.name!r} has a Discrete action space ({space}), whose "
                             "actions have no names: pass action_names, a list (name i is action start + i) or a "
                             "mapping (name -> action)")
        self.actions = self._action_table(action_names or (), space)
        self.lookup = {n.strip().lower(): a for n, a in self.actions.items()}
        if len(self.lookup) != len(self.actions):
            raise ValueError(f"action_names must differ once stripped and lower-cased (actions are read that "
                             f"way), got {list(self.actions)}")

    def _action_table(self, action_names: Sequence[str] | Mapping[str, Any], space) -> dict[str, Any]:
        """name -> the action the environment takes (for Text actions, the name itself)."""
        if isinstance(action_names, Mapping):
            table = dict(action_names)
        elif isinstance(action_names, str):
            raise ValueError(f"action_names must be a list or a mapping, got the string {action_names!r}")
        else:
            names = list(action_names)
            if not self.text_actions and len(names) != space.n:
                raise ValueError(f"action_names has {len(names)} names for {space} ({space.n} actions) of "
                                 f"Gymnasium environment {self.name!r}")
            table = {n: n for n in names} if self.text_actions else {n: space.start + i for i, n in enumerate(names)}
        bad = [n for n, a in table.items() if not isinstance(n, str) or not n.strip() or not space.contains(a)]
        if bad:
            raise ValueError(f"action_names {bad} are not non-empty strings naming actions of {space}")
        return table

    def _default_text(self, observation: str) -> Callable[[Any], str]:
        """observation -> text when no observation_to_text is given: the ansi frame ("auto" when the environment
        draws one and its observations are not Text), else the toy-text table's, else the space's rendering."""
        from gymnasium import spaces

        from hgpo_trl.envs.gymnasium_spaces import space_renderer

        space = self.env.observation_space
        if observation == "auto":
            observation = "ansi" if self.env.render_mode == "ansi" and not isinstance(space, spaces.Text) else "text"
        if observation == "ansi":
            if self.env.render_mode != "ansi":
                raise ValueError(f"Gymnasium environment {self.name!r} does not render as text (render_mode="
                                 f"{self.env.render_mode!r}, not 'ansi'): leave observation at 'auto', or pass "
                                 "observation_to_text")
            return lambda _: clean_frame(str(self.env.render()))
        if self.toy is not None and self.toy.observation_to_text is not None:
            return self.toy.observation_to_text
        try:
            return space_renderer(space)
        except ValueError as err:
            raise ValueError(f"Gymnasium environment {self.name!r} has no text for its observations: no ansi frame "
                             f"to read, and {err}; pass observation_to_text, a function observation -> str (in YAML, "
                             "env_kwargs {observation_to_text: 'my_module:my_function'})") from None

    def text(self, observation: Any) -> str:
        text = self.to_text(observation)
        if not isinstance(text, str):
            raise ValueError(f"observation_to_text of Gymnasium environment {self.name!r} returned a "
                             f"{type(text).__name__}, not a str")
        return text


class GymnasiumEnv:
    """A gymnasium environment as a `TextEnv` (see the module doc). `env_id`: a registered id (or
    "module:Id"), or a callable returning the environment; `make_kwargs` go to `gymnasium.make` (or the
    callable); `task`: the goal sentence shown in every prompt (default: the toy-text one, or a generic one);
    `observation`: "auto", "ansi" (the frame) or "text" (the observation written out: Text as it is, a toy-text
    environment's by the table, any other from its space);
    `observation_to_text`: a one-argument function, observation -> str, that replaces them all, or its
    "module:function" (the form YAML can give; a callable must pickle for `env_workers`)."""

    def __init__(self, env_id: str | Callable[..., Any] | None = None, action_names: Sequence[str] | Mapping[str, Any]
                 | None = None, task: str | None = None, max_steps: int = 50, success: str = "auto",
                 reward_scale: float = 1.0, observation: str = "auto", make_kwargs: Mapping[str, Any] | None = None,
                 observation_to_text: str | Callable[[Any], str] | None = None):
        if success not in SUCCESS:
            raise ValueError(f"success must be one of {SUCCESS}, got {success!r}")
        if observation not in OBSERVATIONS:
            raise ValueError(f"observation must be one of {OBSERVATIONS}, got {observation!r}")
        if not _is_int(max_steps) or max_steps < 1:
            raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
        if not isinstance(reward_scale, Real) or isinstance(reward_scale, bool):
            raise ValueError(f"reward_scale must be a number, got {reward_scale!r}")
        if env_id is not None and not (isinstance(env_id, str) or callable(env_id)):
            raise ValueError(f"env_id must be a gymnasium id such as 'FrozenLake-v1' or a callable, got {env_id!r}")
        if make_kwargs is not None and not isinstance(make_kwargs, Mapping):
            raise ValueError(f"make_kwargs must be a mapping, got {make_kwargs!r}")
        if observation_to_text is not None and observation != "auto":
            raise ValueError(f"observation_to_text replaces observation={observation!r}: pass one of them")
        _import_gymnasium()
        self.observation_to_text = _observation_hook(observation_to_text)
        self.env_id, self.action_names, self.task, self.max_steps = env_id, action_names, task, int(max_steps)
        self.success, self.reward_scale, self.observation = success, float(reward_scale), observation
        self.make_kwargs = dict(make_kwargs or {})
        self._games: dict[Any, _Game] = {}
        self._game: _Game | None = None
        if env_id is not None:  # built now, so that a bad id or missing action names fail here, not in a worker
            self._make(env_id)

    def _make(self, env_id: str | Callable[..., Any]) -> _Game:
        if env_id not in self._games:
            self._games[env_id] = _Game(env_id, self.make_kwargs, self.observation, self.action_names,
                                        self.observation_to_text)
        return self._games[env_id]

    def reset(self, task: Mapping[str, Any]) -> tuple[str, Info]:
        if not isinstance(task, Mapping):
            raise ValueError(f"Gymnasium task must be a mapping (a dataset row), got {type(task).__name__}")
        env_id, seed = task.get("env_id") or self.env_id, task.get("seed")
        if env_id is None:
            raise ValueError("Gymnasium task names no environment: give the row an 'env_id' or the adapter env_id=")
        if not _is_int(seed) or seed < 0:
            raise ValueError(f"Gymnasium task field 'seed' must be an integer >= 0, got {seed!r}")
        self._game = game = self._make(env_id)
        observation, info = game.env.reset(seed=int(seed))
        self._sentence = self.task or (game.toy.goal if game.toy else f"Play {game.name}: reach its goal.")
        self._steps, self._played, self._return, self._done, self._won = 0, 0, 0.0, False, False
        self._observation, self._mask, self._env_info = game.text(observation), info.get("action_mask"), info
        return self._observation, self._info()

    def step(self, action: str | None) -> tuple[str, float, bool, bool, Info]:
        if self._game is None:
            raise RuntimeError("GymnasiumEnv.step() called before reset(task)")
        if self._done:
            raise RuntimeError("GymnasiumEnv.step() called after the episode ended; call reset(task) first")
        if action is not None and not isinstance(action, str):
            raise ValueError(f"action must be a string or None, got {type(action).__name__}")
        game, raw, reward, terminated, truncated, invalid = self._game, 0.0, 0.0, False, False, None
        if action is not None:
            # A named action is looked up; a Text space also takes any other text, as written.
            value = game.lookup.get(action.strip().lower(), action if game.text_actions else None)
            if value is None or not game.env.action_space.contains(value):
                invalid = (f"unknown action {action!r}; the actions are {list(game.actions)}" if not game.text_actions
                           else f"action {action!r} is not in the action space {game.env.action_space}")
            else:
                observation, raw, terminated, truncated, self._env_info = game.env.step(value)
                self._played += 1  # (an invalid move does not step the environment)
                reward = float(raw) * self.reward_scale
                self._return += reward
                self._observation, self._mask = game.text(observation), self._env_info.get("action_mask")
        self._steps += 1
        lasted = bool(truncated) or self._played >= self.max_steps  # its own time limit, or max_steps real steps
        truncated = bool(truncated) or (not terminated and self._steps >= self.max_steps)
        self._done = bool(terminated) or truncated
        self._won = self._done and self._succeeded(float(raw), bool(terminated), lasted)
        info = {**self._info(), "invalid_move": invalid is not None}
        if invalid is not None:
            info["invalid_reason"] = invalid
        if self._done:
            info["score"] = self._return
        return self._observation, reward, bool(terminated), truncated, info

    def _succeeded(self, reward: float, terminated: bool, lasted: bool) -> bool:
        """Whether the episode, now over (`terminated`, else cut: `lasted` its time limit), is won by `success`."""
        rule, info = self.success, self._env_info
        if rule == "auto":
            rule = self._game.auto_success or ("is_success" if "is_success" in info else "reward")
        if rule == "is_success":
            return bool(info.get("is_success", False))
        return not terminated and lasted if rule == "truncated" else terminated and (rule == "terminated" or reward > 0)

    def _info(self) -> Info:
        names = list(self._game.actions)
        if self._mask is not None and not self._game.text_actions:
            names = [n for n, a in self._game.actions.items() if self._mask[a - self._game.env.action_space.start]]
        return {"admissible_actions": [] if self._done else names, "state_key": self._observation,
                "won": self._won, "task": self._sentence, "step": self._steps}

    def render_prompt(self, task: str, history: Sequence[tuple[str, str]], observation: str,
                      admissible: Sequence[str], step: int) -> str:
        return rules_prompt(task, history, observation, admissible, step, "Answer with one action.")

    def close(self) -> None:
        for game in self._games.values():
            game.env.close()
        self._games.clear()
        self._game = None


def gymnasium_tasks(split: str = "train", env_id: str | None = None, num_tasks: int = 16,
                    seeds: Sequence[int] | None = None) -> datasets.Dataset:
    """One row per reset seed of `split` (`seeds` if given, else `num_tasks` seeds from the split's range: train
    0.., valid 1,000,000.., test 2,000,000..); with `env_id`, each row names the environment too."""
    if env_id is not None and not isinstance(env_id, str):
        raise ValueError(f"env_id must be a gymnasium id such as 'FrozenLake-v1', got {env_id!r}")
    seed_list = split_seeds(split, num_tasks, seeds)
    columns = {"task_id": [f"{env_id or 'env'}/{s}" for s in seed_list], "seed": seed_list,
               "split": [split] * len(seed_list)}
    if env_id is not None:
        columns["env_id"] = [env_id] * len(seed_list)
    import datasets

    return datasets.Dataset.from_dict(columns)
