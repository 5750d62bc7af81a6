"""TRL's `environment_factory` classes played step by step: one tool call is one environment step.

A TRL environment class (TRL 1.16's `GRPOTrainer(environment_factory=...)`) has a no-argument constructor,
`reset(**row) -> str | None` (the task row's columns), and every public function other than `reset` and
`get_reward` is a tool, described by its type hints and docstring (`transformers.utils.get_json_schema`).
TRL plays a whole episode as one completion; `TRLEnv` plays it as a `TextEnv`: the action is the model's
answer (`action_mode: tool`), a tool call in `tool_format` ("json": the `<tool_call>{"name", "arguments"}`
JSON that tool-calling chat templates such as Qwen2.5's ask for, the tools shown by the template itself;
"call": `name(argument=value)`, the tools listed in the prompt, for templates without tools such as the tiny
model's; `envs/trl_calls.py` writes and reads both), the observation its result, or TRL's `{'error': ...}` text
as an invalid move when it raises, names no tool or cannot be read. An answer that calls no tool ends the
episode, as in TRL.

Conventions read from the class, never offered as tools (define them as attributes or properties, which TRL
does not take for tools either): `done` (the name is the `done` option; an attribute or a method; truthy after
a call ends the episode; None: only an answer without a call ends it), `step_reward` (a step's reward, read
after each call), `state_key` (what GiGPO's and HGPO's groups compare, `info["anchor"]`; default: a digest of
the reset text and every call read so far, parsed (name and arguments, not their spelling), with its result), `won` (the episode's success; default: a final reward > 0).
`get_reward()` is added to the last step's reward. A class with neither `get_reward` nor `step_reward`, or whose
`done` is a method taking arguments, is refused when built: every episode would score 0 or fail.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

from hgpo_trl.envs.base import Info, rules_prompt
from hgpo_trl.envs.registry import make_env
from hgpo_trl.envs.trl_calls import (
    ANSWERS,
    TOOL_FORMATS,
    call_key,
    enumerable_calls,
    read_call,
    tool_schemas,
    tools_text,
    typed_arguments,
    writes_json_calls,
)

if TYPE_CHECKING:  # imported where tasks are built: environment workers never load it (4 s)
    import datasets

CONVENTIONS = ("reset", "get_reward", "state_key", "step_reward", "won")
_STARTS: dict[tuple[str, str], tuple[str, str]] = {}  # (class, row digest) -> the first start seen (see _check_start)


def load_factory(spec: Any, field: str = "environment_factory") -> Callable[[], Any] | dict[str, Callable[[], Any]]:
    """A factory (a class or any no-argument callable), a `module:Class` text, or a dict of them by name."""
    if isinstance(spec, Mapping):
        return {str(name): load_factory(value, f"{field}[{name!r}]") for name, value in spec.items()}
    if isinstance(spec, str):
        module, _, name = spec.partition(":")
        try:
            spec = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as err:
            raise ValueError(f"{field}: cannot import {spec!r} (write it as module:Class): "
                             f"{type(err).__name__}: {err}") from None
    if not callable(spec):
        raise ValueError(f"{field} must be a class, a callable or a 'module:Class' text, got {spec!r}")
    return spec


def environment_tools(instance: Any, done: str | None = "done") -> dict[str, Callable]:
    """The tools TRL finds on `instance`: its class's public functions (not properties), less the conventions."""
    skip = {*CONVENTIONS, done}
    return {name: getattr(instance, name) for name, _ in inspect.getmembers(type(instance), inspect.isfunction)
            if not name.startswith("_") and name not in skip}


def _run(value: Any) -> Any:
    """A sync or async tool's result. Where an event loop already runs in this thread (a notebook's), the
    coroutine runs to its end on a thread of its own: asyncio.run refuses to nest."""
    if not inspect.isawaitable(value):
        return value

    async def result() -> Any:
        return await value

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(result())
    with ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, result()).result()


def _member(instance: Any, name: str | None, default: Any = None) -> Any:
    """An attribute, a property or a method's result; `default` when the class has no such member."""
    if not name or not hasattr(instance, name):
        return default
    return _run(getattr(instance, name)()) if inspect.ismethod(getattr(instance, name)) else getattr(instance, name)


class TRLEnv:
    """One rollout's TRL environment (`environment_factory`: a class, a `module:Class` text, or a dict of them
    chosen by each row's `environment` column, as TRL does), played as a `TextEnv`.

    `tool_format`: "json" or "call" (module docstring; "auto", chosen by the trainer from the chat template, is
    "call" here); `done`: the member that ends the episode (None: only an
    answer without a tool call); `max_steps`: the steps of an episode, then it is truncated (an output that did
    not parse is a step, as the rollout counts it; the trainer caps it at `max_env_steps`)."""

    def __init__(self, environment_factory: Any = None, *, tool_format: str = "auto", done: str | None = "done",
                 max_steps: int = 50):
        if environment_factory is None:
            raise ValueError("environment 'trl' needs env_kwargs environment_factory: a 'module:Class' text (or a "
                             "mapping of them by the rows' environment column)")
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format must be one of {TOOL_FORMATS}, got {tool_format!r}")
        tool_format = "call" if tool_format == "auto" else tool_format
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be an integer >= 1, got {max_steps!r}")
        factories = load_factory(environment_factory)
        self._multi = isinstance(factories, dict)
        self._factories = factories if self._multi else {None: factories}
        self.tool_format, self.done_name, self.max_steps = tool_format, done, max_steps
        self._instances: dict[Any, Any] = {}
        self.schemas = {name: self._tools(name)[1] for name in self._factories}  # every class checked now
        self._env = None

    def _tools(self, name: Any) -> tuple[dict[str, Callable], list[dict]]:
        if name not in self._instances:
            self._instances[name] = self._factories[name]()
            self._check_class(name)
        tools = environment_tools(self._instances[name], self.done_name)
        return tools, tool_schemas(tools, self._owner(name))

    def _check_class(self, name: Any) -> None:
        """What would fail every episode, refused in one line before any runs."""
        owner, instance, missing = self._owner(name), self._instances[name], object()
        if not callable(getattr(instance, "reset", None)):
            raise ValueError(f"environment_factory {owner}: the class needs a reset method")
        # TRL also takes rewards from reward_funcs(environments=...); HGPOTrainer does not (docs/byo_env.md).
        if not callable(getattr(type(instance), "get_reward", None)) and \
                inspect.getattr_static(instance, "step_reward", missing) is missing:
            raise ValueError(f"environment_factory {owner}: no reward source: give the class a get_reward() method "
                             "or a step_reward member (HGPOTrainer takes rewards from the environment, not "
                             "reward_funcs: docs/byo_env.md)")
        done = inspect.getattr_static(type(instance), self.done_name or "", None)
        if inspect.isfunction(done):
            needed = [p.name for p in list(inspect.signature(done).parameters.values())[1:]
                      if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            if needed:
                raise ValueError(f"environment_factory {owner}: {self.done_name}({', '.join(needed)}) takes "
                                 "arguments, but the episode's end is read by calling it with none after each call; "
                                 f"to offer it as a tool, set env_kwargs done: null (or the member that ends it)")

    def _owner(self, name: Any) -> str:
        factory = self._factories[name]
        return getattr(factory, "__qualname__", repr(factory)) + (f" (environment {name!r})" if self._multi else "")

    def all_schemas(self) -> list[dict]:
        """Every environment's tools once (a dict of factories shows their union in the chat template)."""
        unique = {json.dumps(s, sort_keys=True): s for schemas in self.schemas.values() for s in schemas}
        return list(unique.values())

    def reset(self, task: Mapping[str, Any]) -> tuple[str, Info]:
        row = dict(task)  # TRL's reset(**row): every column, less the routing `environment` of a dict
        name = row.pop("environment", None) if self._multi else None
        if name not in self._factories:
            raise ValueError(f"the row's environment {name!r} is none of environment_factory's {list(self._factories)}")
        if name not in self._instances:
            self._tools(name)
        self._name, self._env = name, self._instances[name]
        self._tools_now = environment_tools(self._env, self.done_name)
        self._schema = {s["function"]["name"]: s for s in self.schemas[name]}
        observation = _run(self._env.reset(**row))
        self._observation = "" if observation is None else str(observation)
        self._steps, self._done, self._won = 0, False, False
        self._digest = hashlib.blake2b(self._observation.encode(), digest_size=16)
        self._task = _prompt_text(task.get("prompt", ""))
        if self.tool_format == "call":
            self._task = f"{self._task}\n{tools_text(self.schemas[name])}".strip()
        self._check_start(task)
        return self._observation, self._info(False)

    def _anchor(self) -> str:
        key = _member(self._env, "state_key")
        return self._digest.hexdigest() if key is None else key if isinstance(key, str) else repr(key)

    def _info(self, invalid: bool) -> Info:
        return {"admissible_actions": [] if self._done else enumerable_calls(self._schema.values(), self.tool_format),
                "anchor": self._anchor(), "state_key": self._anchor(), "won": self._won, "task": self._task,
                "step": self._steps, "invalid_move": invalid}

    def _check_start(self, task: Mapping[str, Any]) -> None:
        """G rollouts of a task share a start only if `reset` is seeded from the row: a second reset of a row seen
        before that starts elsewhere (another text or state key) is said once per class."""
        owner = self._owner(self._name)
        row = hashlib.blake2b(repr(sorted(task.items(), key=str)).encode(), digest_size=8).hexdigest()
        start, first = (self._observation, self._anchor()), _STARTS.setdefault((owner, row), (self._observation,
                                                                                               self._anchor()))
        if start != first and (owner, "said") not in _STARTS:
            _STARTS[(owner, "said")] = ("", "")
            warnings.warn(f"environment_factory {owner}: two resets of one task row started differently "
                          f"({first[0][:40]!r} vs {start[0][:40]!r}): the rollouts of a task do not share a start, "
                          "so GiGPO/HGPO compare different states; seed reset from a column of the row",
                          UserWarning, stacklevel=2)

    def step(self, action: str | None) -> tuple[str, float, bool, bool, Info]:
        if self._env is None:
            raise RuntimeError("step before reset")
        if self._done:  # (a finished episode takes no call)
            return self._observation, 0.0, True, False, self._info(False)
        # An output that did not parse (None: nothing is sent) is a step too: the rollout counts it against
        # max_env_steps, so the episode's last step is the same here and there, and get_reward() is scored on it.
        self._steps += 1
        reward, invalid = self._call(action) if action is not None else (0.0, False)
        truncated = not self._done and self._steps >= self.max_steps
        if self._done or truncated:
            final = float(_member(self._env, "get_reward", 0.0) or 0.0)
            reward += final
            self._won = bool(_member(self._env, "won", final > 0))
        terminated = self._done
        self._done = self._done or truncated
        return self._observation, reward, terminated, truncated, self._info(invalid)

    def _call(self, action: str) -> tuple[float, bool]:
        """Play the tool call `action` (the observation, the done flag and the path's digest follow it); its step
        reward and whether it was an invalid move."""
        invalid, reward = False, 0.0
        try:
            call = read_call(action, self.tool_format)
            if call is not None:
                name, arguments = call
                if name not in self._tools_now:
                    raise ValueError(f"Tool {name} not found.")  # (TRL's words)
                result = _run(self._tools_now[name](**typed_arguments(arguments, self._schema[name])))
                reward = float(_member(self._env, "step_reward", 0.0) or 0.0)
        except Exception as err:  # the tool's own failure, whatever its type: TRL answers it with the error
            call, invalid, result = (), True, {"error": str(err).splitlines()[0] if str(err) else type(err).__name__}
        if call is None:  # an answer without a tool call ends the episode, as in TRL
            self._done, self._observation = True, ""
        else:
            self._observation = result if isinstance(result, str) else str(result)
            self._done = bool(_member(self._env, self.done_name, False))
        key = call_key(action)  # (the call parsed: one written with other spacing is the same call, the same path)
        if key is not None:  # an unreadable call reached no tool: the path is the same as before it
            self._digest.update(json.dumps([key, self._observation]).encode())
        return reward, invalid

    def render_prompt(self, task: str, history: Sequence[tuple[str, str]], observation: str,
                      admissible: Sequence[str], step: int) -> str:
        return rules_prompt(task, history, observation, (), step, ANSWERS[self.tool_format])

    def close(self) -> None:
        # Dropped, not closed: a public `close` of the class would be one of its tools.
        self._instances.clear()
        self._env = None


def _prompt_text(prompt: Any) -> str:
    """The text of TRL's `prompt` column: a string, or every message of a conversation in order, one a line (TRL
    renders them all: a system message's rules too), those other than system and user messages after their role."""
    if isinstance(prompt, str):
        return prompt
    lines = []
    for message in (m for m in prompt or [] if isinstance(m, Mapping)):
        content = message.get("content") or ""
        if not isinstance(content, str):  # a list of parts, as multimodal rows write it: their texts
            content = " ".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping)).strip()
        role = message.get("role")
        lines += [content if role in ("system", "user") else f"{role}: {content}"] if content else []
    return "\n".join(lines)


def trl_tasks(split: str = "train", *, rows: Any = None, data_files: Any = None) -> datasets.Dataset:
    """The task rows TRL's `train_dataset` would hold: `rows` (a list of mappings) or `data_files` (a JSON, JSONL,
    CSV or Parquet file as `datasets` reads it); either may be a mapping by split. Not by split, they are the
    'train' split alone."""
    import datasets

    if (rows is None) == (data_files is None):
        raise ValueError("the trl tasks need task_kwargs rows (a list of rows) or data_files (a file), one of them")
    source = rows if rows is not None else data_files
    if isinstance(source, Mapping):
        if split not in source:
            raise ValueError(f"the trl tasks name no split {split!r} (they name {list(source)})")
        source = source[split]
    elif split != "train":  # (the same rows for every split: an evaluation would score the training rows)
        raise ValueError(f"one list of rows is the 'train' split alone: give rows or data_files by split, e.g. "
                         f"{{train: [...], {split}: [...]}}, or turn the evaluation off (--eval_split null)")
    if rows is not None:
        if not isinstance(source, list) or not source or not all(isinstance(r, Mapping) for r in source):
            raise ValueError(f"task_kwargs rows must be a non-empty list of mappings, got {source!r:.80}")
        return datasets.Dataset.from_list([dict(r) for r in source])
    kind = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}.get(str(source).rsplit(".", 1)[-1])
    if kind is None:
        raise ValueError(f"task_kwargs data_files: {source!r} is not a .json, .jsonl, .csv or .parquet file")
    try:
        return datasets.load_dataset(kind, data_files=str(source), split="train")
    except FileNotFoundError as err:
        raise ValueError(f"task_kwargs data_files: {source!r}: {str(err).splitlines()[0]}") from None


def within_episode_limit(options: Mapping[str, Any] | None, max_env_steps: int) -> dict[str, Any]:
    """A TRL environment's options with `max_steps` at most `max_env_steps` (its default): the rollout ends an
    episode there, so the class's own end, where get_reward() is scored, must not come later."""
    options = dict(options or {})
    asked = options.get("max_steps", max_env_steps)
    options["max_steps"] = min(asked, max_env_steps) if isinstance(asked, int) else asked  # (TRLEnv refuses others)
    return options


def tool_setup(options: Mapping[str, Any], tokenizer: Any,
               chat_template_kwargs: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """A TRL environment's options and the chat-template options for `tokenizer`'s model: `tool_format` "auto"
    made "json" where the template writes JSON calls (`writes_json_calls`), else "call"; in json, the tools'
    schemas passed to the template. The trainer and hgpo-eval both take them from here, so a model is evaluated
    with the prompts it trained on."""
    options, kwargs = dict(options), dict(chat_template_kwargs or {})
    if options.get("tool_format", "auto") == "auto":
        options["tool_format"] = "json" if writes_json_calls(tokenizer) else "call"
    probe = TRLEnv(**options)  # every class's tools checked before any model runs
    if options["tool_format"] == "json":
        kwargs["tools"] = probe.all_schemas()
    return options, kwargs


def trainer_environment(trainer: Any, env_factory: Callable | None,
                        environment_factory: Any) -> tuple[Callable, dict[str, Any]]:
    """HGPOTrainer's environment factory and chat-template options. A TRL environment (`environment_factory`, or
    `env_name: trl` with it in `env_kwargs`) gets `max_steps` from `max_env_steps` and its tools as `tool_setup`
    says; every other environment is built as before."""
    if environment_factory is not None and env_factory is not None:
        raise ValueError("HGPOTrainer: give env_factory or environment_factory, not both")
    args, chat_template_kwargs = trainer.args, trainer.chat_template_kwargs or {}
    options = dict(args.env_kwargs or {})
    if environment_factory is None and (env_factory is not None or args.env_name != "trl"):
        return env_factory or partial(make_env, args.env_name, **options), dict(chat_template_kwargs)
    if environment_factory is not None:
        options["environment_factory"] = environment_factory
    options, kwargs = tool_setup(within_episode_limit(options, args.max_env_steps), trainer.processing_class, chat_template_kwargs)
    return partial(TRLEnv, **options), kwargs
