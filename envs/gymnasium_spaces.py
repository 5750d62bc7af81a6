"""Gymnasium observations as text, read from their spaces: how `GymnasiumEnv` shows an environment whose
observations are not text and that draws no ansi frame (Blackjack's `Tuple(Discrete(32), Discrete(11),
Discrete(2))` would read "(14, 10, 0)"; the adapter's toy-text table names its parts instead).

- `Discrete`: the number ("3"); `Text`: the text itself.
- `Box`, `MultiDiscrete`, `MultiBinary` of at most `MAX_NUMBERS` numbers: the number, or a list nested as the
  array is ("[[1, 0], [0, 1]]"); floats are rounded to 3 decimals ("[0.027, -1.5]"), so that nearby states read
  alike and the prompt stays short; booleans read 1 and 0.
- `Tuple`: its parts in parentheses, "(3, [1, 0])"; `Dict`: "{key: value, ...}" in the space's key order; nested
  as the spaces are.

Any other space (a larger array such as an image, `Graph`, `Sequence`, `OneOf`) has no default text:
`space_renderer` refuses it, naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from gymnasium import spaces

MAX_NUMBERS = 64  # an 8x8 board; a bigger array (an image) is no text a language model reads


def space_renderer(space: spaces.Space) -> Callable[[Any], str]:
    """A function observation -> text for `space`; a ValueError naming the part of `space` that has none."""
    if isinstance(space, spaces.Discrete):
        return lambda value: str(int(value))
    if isinstance(space, spaces.Text):
        return str
    if isinstance(space, spaces.Box | spaces.MultiDiscrete | spaces.MultiBinary):
        size = int(np.prod(space.shape))
        if size > MAX_NUMBERS:
            raise ValueError(f"{space} holds {size} numbers, over the {MAX_NUMBERS} written out as text")
        return lambda value: _nested(np.asarray(value).tolist())
    if isinstance(space, spaces.Tuple):
        parts = [space_renderer(part) for part in space.spaces]
        return lambda value: "(" + ", ".join(part(v) for part, v in zip(parts, value, strict=True)) + ")"
    if isinstance(space, spaces.Dict):
        fields = {key: space_renderer(part) for key, part in space.spaces.items()}
        return lambda value: "{" + ", ".join(f"{key}: {field(value[key])}" for key, field in fields.items()) + "}"
    raise ValueError(f"{space} has no default text (Discrete, Text, small Box, MultiDiscrete and MultiBinary, "
                     "and Tuple and Dict of them, have)")


def _nested(item: Any) -> str:
    if isinstance(item, list):
        return "[" + ", ".join(_nested(part) for part in item) + "]"
    if isinstance(item, float):
        return np.format_float_positional(round(item, 3) + 0.0, trim="-")  # + 0.0: -0.0001 reads "0", not "-0"
    return str(int(item))
