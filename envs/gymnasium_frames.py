"""Gymnasium's ansi frames (toy-text environments' `render()`) as plain text for a prompt: each coloured run
written `{text:colour}` (the agent's cell, the taxi, the passenger), the last action's echo line dropped."""

from __future__ import annotations

import re

_COLOURS = {0: "black", 1: "red", 2: "green", 3: "yellow", 4: "blue", 5: "magenta", 6: "cyan", 7: "white"}
_SGR = re.compile(r"\x1b\[([\d;]*)m")  # a colour code (Select Graphic Rendition)
_ACTION_ECHO = re.compile(r"^\s*\(\w+\)\s*$")


def _colour(code: int) -> str | None:
    for base in (30, 40, 90, 100):
        if base <= code < base + 8:
            return _COLOURS[code - base]
    return None


def _coloured_runs(frame: str) -> list[tuple[str, tuple[str, ...]]]:
    """The frame as (text, colours) runs: a code adds its colour (foreground or background) to those in effect
    until a reset (0), so nested spans give their cell every colour, outer first (Taxi's waiting passenger,
    blue, around its taxi, yellow: `\\x1b[34;1m\\x1b[43mR\\x1b[0m\\x1b[0m`); a terminal would let a later
    foreground hide an earlier one (Taxi's last frame: the passenger's blue over the destination's magenta)."""
    runs: list[tuple[str, tuple[str, ...]]] = []
    colours: tuple[str, ...] = ()
    for i, part in enumerate(_SGR.split(frame)):
        if i % 2 == 0:
            if runs and runs[-1][1] == colours:
                runs[-1] = (runs[-1][0] + part, colours)
            elif part:
                runs.append((part, colours))
            continue
        for code in [int(c) for c in part.split(";") if c.isdigit()] or [0]:  # "\\x1b[m" resets too
            if code == 0:
                colours = ()
            elif (name := _colour(code)) and name not in colours:
                colours = (*colours, name)
    return runs


def clean_frame(frame: str) -> str:
    """An ansi frame as plain text: coloured runs as `{text:colour}` (`{R:blue,yellow}` under two colours),
    each line apart, the last action's echo line dropped."""
    text = "".join("\n".join(f"{{{line}:{','.join(colours)}}}" if line and colours else line
                             for line in run.split("\n")) for run, colours in _coloured_runs(frame))
    lines = [line.rstrip() for line in text.splitlines() if not _ACTION_ECHO.match(line)]
    return "\n".join(lines).strip("\n")
