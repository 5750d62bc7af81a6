"""Whether the console shows progress bars, and every bar of a run made accordingly: in a terminal, tqdm's text
bars; in a Jupyter kernel that has ipywidgets, tqdm's widget bars, which update in place; anywhere else (a log
file, a pipe, nohup, CI, a kernel without ipywidgets) none. Text bars there are a stream of carriage returns and
cursor-up escapes that buries the `[iter]`, `[eval]` and `[warm start]` lines, which print in every case."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from tqdm import std

BarStyle = Literal["terminal", "widgets"] | None


def in_jupyter_kernel() -> bool:
    """Whether this process is a Jupyter kernel (notebook, JupyterLab, VS Code, Colab), as tqdm tells one."""
    return "ipykernel.zmqshell" in sys.modules


def widgets_installed() -> bool:
    """Whether tqdm can draw widget bars: ipywidgets is importable (tqdm.notebook leaves IProgress None if not)."""
    from tqdm.notebook import IProgress

    return IProgress is not None


def bar_style(disabled: bool) -> BarStyle:
    """How bars are shown: 'terminal', 'widgets', or None for no bars (always with `disabled`, e.g. disable_tqdm)."""
    if disabled:
        return None
    if in_jupyter_kernel():  # (a kernel's streams are no terminal, and its frontend draws widgets, not escapes)
        return "widgets" if widgets_installed() else None
    # Both streams: the bars go to stderr and our lines to stdout, and with either redirected (`> log`) the bars
    # would land in the file, or stay on the terminal apart from the lines they frame.
    terminal = all(stream is not None and stream.isatty() for stream in (sys.stdout, sys.stderr))
    return "terminal" if terminal else None


def shows_bars(disabled: bool = False) -> bool:
    return bar_style(disabled) is not None


def progress_bar(*, disabled: bool = False, **options) -> std.tqdm:
    """A tqdm bar with `options`, in the style `bar_style` picks; where bars are off, a disabled bar (it prints
    nothing and counts nothing)."""
    style = bar_style(disabled)
    if style == "widgets":
        from tqdm.notebook import tqdm as widget_tqdm

        return widget_tqdm(**options)
    return std.tqdm(**options, disable=style is None)


@contextmanager
def transformers_bars_off(when: bool = True) -> Iterator[None]:
    """Transformers' own bars (loading and writing weights) off for the block, when `when`: between our lines in a
    terminal, and everywhere bars do not show (`not shows_bars(...)`)."""
    from transformers.utils import logging

    active = when and logging.is_progress_bar_enabled()
    if active:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if active:
            logging.enable_progress_bar()


def transformers_bars_as_ours(disabled: bool):
    """Transformers' own bars (loading and writing weights) off for the block where ours do not show."""
    return transformers_bars_off(when=not shows_bars(disabled))
