"""From a model's completion to an environment action, or None when the output is not a valid action.

`tags` mode: the model thinks inside `<think>...</think>` and answers inside `<action>...</action>`; the action
is the text of the first action tag after the reasoning, stripped, lower-cased, whitespace folded, and an output
that breaks a rule is no action at all (`parse_action`). `plain` mode (tiny models): the completion's first
non-empty line is the action (a small model that keeps writing after its answer still answered). `tool` mode
(TRL environment classes, `envs/trl_env.py`): after the reasoning, the rest of the output is the answer as
written (a tool call or a final answer, its case kept: tool arguments are case-sensitive), under tags mode's rules.
`project_released` reads an output as verl-agent's projection does (`invalid_action="execute"`): looser about
where the tags are, and every output yields some text for the environment, a penalised one too.
Nothing here evaluates or executes the text: it is only searched and sliced.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from hgpo_trl.envs.trl_calls import call_key

ACTION_MODES = ("tags", "plain", "tool")
MAX_ACTION_CHARS = 200
MAX_TOOL_CHARS = 4000  # tool mode: a tool call's JSON is longer than an action
INVALID_TAIL_CHARS = 30  # released: an output with no action block becomes its last 30 characters (ALFWorld)

_HAN = re.compile(r"[\u4e00-\u9fff]")  # the released projection's "Chinese characters"
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
_TAGS = re.compile(r"</?(?:action|think)>")
_SPACES = re.compile(r"\s+")
_BRACKET_SPACES = re.compile(r"\s*([\[\]<>()])\s*")

FORMAT_INSTRUCTIONS = {
    "tags": ("First think step by step inside <think> </think>. Then give exactly one admissible action "
             "inside <action> </action>."),
    "plain": "",
    # In the words of the tool prompt's own last line (trl_env.ANSWERS), which a tiny vocabulary holds.
    "tool": "First think step by step inside <think> </think>. Then call one tool, or answer in plain words to finish.",
}


def parse_action(text: str, mode: str = "tags", *, require_think: bool = True, reject_cjk: bool = True,
                 max_chars: int = MAX_ACTION_CHARS) -> str | None:
    """The action in `text`, or None when the output is not a well-formed action.

    tags mode: `<think>` and `</think>` are required (unless `require_think=False`) and the action is the first
    `<action>...</action>` after the first `</think>` (an action tag inside the reasoning does not count).
    Invalid: no closed action tag, an empty action, a think/action tag inside the action, an action longer than
    `max_chars`, or (with `reject_cjk`, as released) any CJK character in the output.
    tool mode: the same reasoning rule; the answer is all that follows it, stripped and otherwise as written (a
    tool call or a final answer, up to `MAX_TOOL_CHARS`).
    """
    if mode not in ACTION_MODES:
        raise ValueError(f"action mode must be one of {ACTION_MODES}, got {mode!r}")
    if not isinstance(text, str):
        return None
    if reject_cjk and _CJK.search(text):
        return None
    if mode == "plain":
        candidate = next((line for line in text.splitlines() if line.strip()), "")
    elif mode == "tool":
        answer = _after_think(text) if require_think else _drop_think_blocks(text)
        answer = answer.strip() if answer is not None else ""
        return answer if answer and len(answer) <= MAX_TOOL_CHARS and not _TAGS.search(answer) else None
    else:
        answer = _after_think(text) if require_think else _drop_think_blocks(text)
        if answer is None:
            return None
        # str.find, not a lazy regex: on a long output repeating an unclosed tag the regex is quadratic (seconds).
        start = answer.find("<action>")
        end = answer.find("</action>", start + len("<action>")) if start != -1 else -1
        if end == -1:
            return None
        candidate = answer[start + len("<action>"):end]
    action = _SPACES.sub(" ", candidate).strip().lower()
    if not action or len(action) > max_chars or _TAGS.search(action):
        return None
    return action


def match_admissible(action: str | None, admissible: Sequence[str], mode: str = "tags") -> str | None:
    """The admissible action that `action` spells, as the environment writes it; None if none. Text actions match
    up to case and the spaces around brackets (a word-level tokenizer decodes `click[buy now]` as
    `click [ buy now ]`); tool calls (`tool` mode) match as parsed calls, name and arguments (`call_key`)."""
    if action is None:
        return None
    if action in admissible:
        return action
    key = call_key if mode == "tool" else _canonical
    wanted = key(action)
    return next((candidate for candidate in admissible if wanted is not None and key(candidate) == wanted), None)


def _canonical(action: str) -> str:
    return _BRACKET_SPACES.sub(r"\1", _SPACES.sub(" ", action).strip().lower())


def format_action(action: str, mode: str = "tags") -> str:
    """An answer that `parse_action` reads as `action` in `mode`: what a scripted player (random, expert) outputs."""
    if mode not in ACTION_MODES:
        raise ValueError(f"action mode must be one of {ACTION_MODES}, got {mode!r}")
    return {"plain": action, "tool": f"<think> </think>{action}"}.get(mode, f"<think> </think><action>{action}</action>")


def _after_think(text: str) -> str | None:
    """What follows the first `</think>` of an output that opened `<think>` before it; None without both."""
    start, end = text.find("<think>"), text.find("</think>")
    return None if start == -1 or end < start else text[end + len("</think>"):]


def _drop_think_blocks(text: str) -> str:
    """`text` with every closed `<think>...</think>` block replaced by a space."""
    parts, position = [], 0
    while ((start := text.find("<think>", position)) != -1
           and (end := text.find("</think>", start + len("<think>"))) != -1):
        parts += [text[position:start], " "]
        position = end + len("</think>")
    return "".join(parts) + text[position:]


def invalid_tail(text: str, chars: int = INVALID_TAIL_CHARS) -> str:
    """What memory keeps of an invalid output, so the model sees what it did: its last characters."""
    return _SPACES.sub(" ", text if isinstance(text, str) else "").strip()[-chars:] if chars > 0 else ""


def project_released(text: str, tail_chars: int = INVALID_TAIL_CHARS, *, require_think: bool = True,
                     reject_cjk: bool = True) -> tuple[str, bool]:
    """verl-agent's projection (`env_package/{alfworld,webshop}/projection.py`): the text the environment
    receives and whether the output is valid (else penalised). The whole output is lower-cased and searched for
    the first `<action>` and the first `</action>`, anywhere (inside the reasoning too); the action is the text
    between them, stripped (empty when the closing tag comes first: valid). Without both tags the output's last
    `tail_chars` characters are sent instead (invalid). An action is still sent when the output is invalid for
    lacking `<think>` or `</think>` (case-sensitive; unless `require_think=False`) or for holding a character in
    U+4E00-U+9FFF (unless `reject_cjk=False`)."""
    text = text if isinstance(text, str) else ""
    lowered = text.lower()
    start, end = lowered.find("<action>"), lowered.find("</action>")
    if start == -1 or end == -1:
        return lowered[-tail_chars:] if tail_chars > 0 else "", False
    thought = not require_think or ("<think>" in text and "</think>" in text)
    valid = thought and not (reject_cjk and _HAN.search(text))
    return lowered[start + len("<action>"):end].strip(), valid
