"""OpenEnv environments (Meta's environment standard, `openenv-core`, extra `openenv`) as a `TextEnv`.

Two ways to reach one: an `Environment` subclass built in this process (`environment`: the class or a
`module:Class` text), or a server of one on this machine (`base_url`, e.g. `http://127.0.0.1:8000`, which
OpenEnv's `create_app` serves), driven by OpenEnv's `GenericEnvClient` (dicts, no package of the environment's).

The model's answer becomes an action by `to_action` (a `module:function` from the text to the action's fields),
else as the text of the action's one text field (`action_field` names it when there are several, and for a
server, whose action class is not known here). An observation becomes text by `to_text`, else its fields
other than `done`, `reward` and `metadata` (one text field alone, or `name: value` lines). `cumulative: true`
(an environment whose observations repeat the episode so far, as OpenEnv's TextArena server's do) shows only the
new part. The reward and the end are the observation's `reward` and `done`; a task row's `seed` goes to `reset`.
The state's fields other than `episode_id` and `step_count`, where it has any, are the step's anchor for
GiGPO/HGPO (`info["anchor"]`), else the observation is.
"""

from __future__ import annotations

import importlib
import json
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hgpo_trl.envs.base import Info, MissingExtraError, rules_prompt, split_seeds

if TYPE_CHECKING:  # imported where tasks are built: environment workers never load it (4 s)
    import datasets

RESERVED = ("done", "reward", "metadata")
STATE_IDS = ("episode_id", "step_count")


def _import(spec: Any, field: str) -> Any:
    if not isinstance(spec, str):
        return spec
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"openenv {field}: cannot import {spec!r} (write it as module:name): "
                         f"{type(err).__name__}: {err}") from None


def _openenv() -> Any:
    try:
        from openenv import core
    except ImportError:
        raise MissingExtraError("OpenEnv environments need the openenv extra: pip install 'hgpo-trl[openenv]' "
                                "(openenv-core)") from None
    return core


def _as_dict(value: Any) -> dict[str, Any]:
    return value.model_dump() if hasattr(value, "model_dump") else dict(value or {})


class _InProcess:
    """An OpenEnv `Environment` built here; its action class from the class's generic arguments."""

    def __init__(self, environment: Any, action_class: Any):
        core = _openenv()
        cls = _import(environment, "environment")
        self.env = cls() if isinstance(cls, type) else cls
        if not isinstance(self.env, core.Environment):
            raise ValueError(f"openenv environment must be an openenv Environment, got {type(self.env).__name__}")
        self.action_class = _import(action_class, "action_class") or next(
            (arg for base in getattr(type(self.env), "__orig_bases__", ()) for arg in typing.get_args(base)
             if isinstance(arg, type) and issubclass(arg, core.Action)), None)
        if self.action_class is None:
            raise ValueError(f"openenv {type(self.env).__name__}: name its Action class (action_class: module:Class)")

    def reset(self, **kwargs: Any) -> dict[str, Any]:
        return _as_dict(self.env.reset(**kwargs))

    def step(self, action: dict[str, Any]) -> dict[str, Any]:
        return _as_dict(self.env.step(self.action_class(**action)))

    def state(self) -> dict[str, Any]:
        return _as_dict(self.env.state)

    def text_fields(self) -> list[str]:
        return [name for name, info in self.action_class.model_fields.items()
                if name != "metadata" and info.annotation is str]

    def close(self) -> None:
        self.env.close()


class _Client:
    """A server of an OpenEnv environment, through OpenEnv's dict client (its WebSocket session)."""

    def __init__(self, base_url: str, timeout: float):
        core = _openenv()
        self.base_url = base_url
        self.client = core.GenericEnvClient(base_url=base_url, connect_timeout_s=timeout,
                                            message_timeout_s=timeout).sync()

    def _call(self, what: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self.client, what)(*args, **kwargs)
        except Exception as err:  # (refused, timed out, closed: the client's own types)
            raise RuntimeError(f"the OpenEnv server at {self.base_url} did not answer {what} "
                               f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None

    def reset(self, **kwargs: Any) -> dict[str, Any]:
        return self._result(self._call("reset", **kwargs))

    def step(self, action: dict[str, Any]) -> dict[str, Any]:
        return self._result(self._call("step", action))

    @staticmethod
    def _result(result: Any) -> dict[str, Any]:
        return {**_as_dict(result.observation), "done": bool(result.done), "reward": result.reward}

    def state(self) -> dict[str, Any]:
        return _as_dict(self._call("state"))

    def text_fields(self) -> list[str]:
        return []

    def close(self) -> None:
        self.client.close()


class OpenEnvEnv:
    """One OpenEnv environment, in process (`environment`) or on a server (`base_url`), played as text."""

    def __init__(self, environment: Any = None, *, base_url: str | None = None, action_class: Any = None,
                 action_field: str | None = None, to_action: Any = None, to_text: Any = None,
                 cumulative: bool = False, task: str = "Play the environment.", timeout: float = 30.0,
                 max_steps: int = 50):
        if (environment is None) == (base_url is None):
            raise ValueError("openenv needs env_kwargs environment (an OpenEnv Environment class, module:Class) "
                             "or base_url (a server, e.g. http://127.0.0.1:8000), one of them")
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"openenv max_steps must be an integer >= 1, got {max_steps!r}")
        self._to_action: Callable[[str], Any] | None = _import(to_action, "to_action")
        self._to_text: Callable[[Any], str] | None = _import(to_text, "to_text")
        self.cumulative, self.task, self.max_steps = bool(cumulative), str(task), max_steps
        self._session = _InProcess(environment, action_class) if base_url is None else _Client(base_url, timeout)
        fields = self._session.text_fields()
        self.action_field = action_field or (fields[0] if len(fields) == 1 else None)
        if self._to_action is None and self.action_field is None:
            raise ValueError("openenv: give action_field (the action's text field) or to_action (module:function); "
                             f"the action's text fields are {fields or 'unknown (a server)'}")

    def reset(self, task: Mapping[str, Any]) -> tuple[str, Info]:
        kwargs = {"seed": int(task["seed"])} if task.get("seed") is not None else {}
        observation = self._session.reset(**kwargs)
        self._steps, self._done, self._reward, self._full = 0, bool(observation.get("done")), 0.0, ""
        return self._text(observation), self._info(False)

    def step(self, action: str | None) -> tuple[str, float, bool, bool, Info]:
        if action is None or self._done:  # an output that did not parse: nothing is sent
            return self._shown, 0.0, self._done, False, self._last_info
        self._steps += 1
        sent = self._to_action(action) if self._to_action else {self.action_field: action}
        observation = self._session.step(_as_dict(sent))
        reward = float(observation.get("reward") or 0.0)
        self._reward += reward
        self._done = bool(observation.get("done"))
        truncated = not self._done and self._steps >= self.max_steps
        terminated, self._done = self._done, self._done or truncated
        return self._text(observation), reward, terminated, truncated, self._info(terminated)

    def _text(self, observation: dict[str, Any]) -> str:
        if self._to_text is not None:
            text = str(self._to_text(observation))
        else:
            shown = {k: v for k, v in observation.items() if k not in RESERVED}
            strings = [v for v in shown.values() if isinstance(v, str)]
            text = strings[0] if len(shown) == 1 and strings else "\n".join(
                f"{k}: {v if isinstance(v, str) else json.dumps(v, default=str)}" for k, v in shown.items())
        if self.cumulative:  # only what is new since the last observation
            text, self._full = (text[len(self._full):].strip() if text.startswith(self._full) else text), text
        self._shown = text
        return text

    def _info(self, terminated: bool) -> Info:
        state = {k: v for k, v in self._session.state().items() if k not in STATE_IDS}
        info: Info = {"admissible_actions": [], "task": self.task, "state_key": self._shown,
                      "won": terminated and self._reward > 0, "step": self._steps}
        if state:
            info["anchor"] = info["state_key"] = json.dumps(state, sort_keys=True, default=str)
        self._last_info = info
        return info

    def render_prompt(self, task: str, history: Sequence[tuple[str, str]], observation: str,
                      admissible: Sequence[str], step: int) -> str:
        return rules_prompt(task, history, observation, admissible, step, "Answer with one action.")

    def close(self) -> None:
        self._session.close()


def openenv_tasks(split: str = "train", num_tasks: int = 16, seeds: Sequence[int] | None = None) -> datasets.Dataset:
    """One row per reset seed of `split` (`base.split_seeds`: train 0, 1, ...; valid from 1,000,000)."""
    import datasets

    return datasets.Dataset.from_dict({"seed": split_seeds(split, num_tasks, seeds)})
