"""How a TRL environment's tool calls are shown, written and read (`envs/trl_env.py` plays them): the tools'
JSON schemas (transformers' `get_json_schema`, as TRL describes them), the two call formats ("json": the
`<tool_call>{"name", "arguments"}` JSON that chat templates such as Qwen2.5's and Qwen3's write; "call":
`name(argument=value)`, the tools listed in the prompt), and which format a chat template asks for.
Nothing the model writes is evaluated: a call is parsed (`json`, `ast.literal_eval`) and its values typed by the schema.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

TOOL_FORMATS = ("auto", "json", "call")  # auto: json where the chat template writes such calls, else call
ANSWERS = {"json": "Call one tool, or answer in plain words to finish.",
           "call": "Call one tool as name(argument=value), or answer in plain words to finish."}
_CALL_START = re.compile(r"\s*([A-Za-z_]\w*)\s*\(")
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def tool_schemas(tools: Mapping[str, Callable], owner: str) -> list[dict]:
    """Each tool's JSON schema as TRL and the chat template read it; one line naming the tool when it has none."""
    from transformers.utils import get_json_schema

    schemas = []
    for name, tool in tools.items():
        try:
            schemas.append(get_json_schema(tool))
        except Exception as err:  # (transformers' TypeHintParsingException / DocstringParsingException)
            raise ValueError(f"environment_factory {owner}: tool {name!r} cannot be described ({err}); give it type "
                             "hints and a docstring with an Args section, as TRL requires") from None
    return schemas


def read_call(text: str, tool_format: str) -> tuple[str, dict[str, Any]] | None:
    """(tool name, arguments) of the tool call `text` starts with; None for an answer that calls no tool.
    A call that cannot be read raises ValueError, its message one line."""
    if tool_format == "json":
        match = _TOOL_CALL.search(text)
        body = match.group(1).strip() if match else text.strip()
        if not match and not body.startswith("{"):
            return None
        try:
            call = json.JSONDecoder().raw_decode(body)[0] if not match else json.loads(body)
            name, arguments = call["name"], call.get("arguments", call.get("parameters", {}))
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"unreadable tool call ({type(err).__name__}: {err}): {body[:80]!r}") from None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise ValueError(f"unreadable tool call (a name and a mapping of arguments expected): {body[:80]!r}")
        return name, arguments
    if not _CALL_START.match(text):
        return None
    line = text.strip().splitlines()[0]
    try:
        node = ast.parse(line[:line.rfind(")") + 1], mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("write name(argument=value, ...)")
        # literal_eval reads constants only: nothing the model writes is evaluated.
        return node.func.id, {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except (SyntaxError, ValueError, TypeError) as err:
        raise ValueError(f"unreadable tool call ({str(err).splitlines()[0]}): {line[:80]!r}") from None


def call_key(text: str) -> str | None:
    """What makes two calls the same call, in either format: the tool's name and its arguments, text values
    stripped (a word-level tokenizer decodes `press(button='up')` as `press ( button = ' up ' )`); None for text
    that is no readable call."""
    try:
        call = read_call(text, "json") or read_call(text, "call")
    except ValueError:
        return None
    if call is None:
        return None
    name, arguments = call
    return json.dumps([name, {k: v.strip() if isinstance(v, str) else v for k, v in arguments.items()}],
                      sort_keys=True, default=repr)


def typed_arguments(arguments: dict[str, Any], schema: dict) -> dict[str, Any]:
    """Text arguments made the schema's numbers and booleans, stripped (a word-level tokenizer decodes `"left"`
    as `" left "`)."""
    properties = schema["function"]["parameters"].get("properties", {})
    typed = {}
    for key, value in arguments.items():
        kind = properties.get(key, {}).get("type")
        if isinstance(value, str):
            value = value.strip()
            if kind in ("integer", "number") and re.fullmatch(r"-?\d+(\.\d+)?", value):
                value = int(value) if kind == "integer" and "." not in value else float(value)
            elif kind == "boolean" and value.lower() in ("true", "false"):
                value = value.lower() == "true"
        typed[key] = value
    return typed


def written_call(name: str, arguments: Mapping[str, Any], tool_format: str) -> str:
    """A call as the model writes it in `tool_format`."""
    if tool_format == "json":
        return f'<tool_call>\n{json.dumps({"name": name, "arguments": dict(arguments)})}\n</tool_call>'
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"


def enumerable_calls(schemas: Sequence[dict], tool_format: str) -> list[str]:
    """Every call whose arguments the schemas enumerate (enums, booleans; tools without required free-text
    arguments): the admissible actions of the random players (tiny tokenizer, warm start)."""
    calls = []
    for schema in schemas:
        function = schema["function"]
        choices = [[{}]]
        for key, spec in function["parameters"].get("properties", {}).items():
            values = spec.get("enum") or ([True, False] if spec.get("type") == "boolean" else None)
            if values is None:
                if key in function["parameters"].get("required", []):
                    break
                continue
            choices.append([{key: value} for value in values])
        else:
            combos = [{}]
            for options in choices[1:]:
                combos = [{**combo, **option} for combo in combos for option in options]
            calls += [written_call(function["name"], combo, tool_format) for combo in combos]
    return calls


def tools_text(schemas: Sequence[dict]) -> str:
    """The tools listed for a template that shows none: one line each, its signature and description."""
    lines = ["Tools:"]
    for schema in schemas:
        function = schema["function"]
        arguments = ", ".join(f"{key}: {' | '.join(map(str, spec['enum'])) if 'enum' in spec else spec.get('type')}"
                              for key, spec in function["parameters"].get("properties", {}).items())
        lines.append(f"- {function['name']}({arguments}): {function.get('description', '')}")
    return "\n".join(lines)


def writes_json_calls(tokenizer: Any) -> bool:
    """Whether the chat template shows tools (TRL's `supports_tool_calling`) and writes an assistant's tool call
    in a JSON form that `read_call` reads (Qwen2.5's and Qwen3's `<tool_call>` JSON, a bare `{"name", "parameters"}`
    object): the `json` format then asks for the calls the model was trained to write."""
    from trl.chat_template_utils import supports_tool_calling

    if not supports_tool_calling(tokenizer):
        return False
    asked = [{"role": "user", "content": "x"}]
    call = {"type": "function", "function": {"name": "probe", "arguments": {"a": 1}}}
    try:
        prompt = tokenizer.apply_chat_template(asked, tokenize=False, add_generation_prompt=True)
        text = tokenizer.apply_chat_template([*asked, {"role": "assistant", "content": "", "tool_calls": [call]}],
                                             tokenize=False)
        answer = _drop_think(text[len(prompt):] if text.startswith(prompt) else text)
        return read_call(answer, "json") == ("probe", {"a": 1})
    except Exception:  # (a template that cannot render the probe writes no call we read)
        return False


def _drop_think(text: str) -> str:
    return text.split("</think>", 1)[1] if "</think>" in text else text
