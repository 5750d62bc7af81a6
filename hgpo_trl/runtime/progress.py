"""Whether the console shows progress bars, and every bar of a run made accordingly: in a terminal, tqdm's text
bars; in a Jupyter kernel that has ipywidgets, tqdm's widget bars, which update in place; anywhere else (a log
file, a pipe, nohup, a scheduler's output file, CI, a kernel without ipywidgets) no bars, which there are a stream of
carriage returns and cursor-up escapes that buries the `[iter]`, `[eval]` and `[warm start]` lines, which print in
every case. There a bar is a `LineBar`: a plain line every `LINE_SECONDS` while its phase lasts (where it is, its
rate and an estimate of what is left), so that a long phase (the warm start, a rollout, an evaluation) is never
silent and a slow run can be told from a hung one."""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from tqdm import std

BarStyle = Literal["terminal", "widgets"] | None
LINE_SECONDS = 30.0  # where bars do not show: a phase's line at least this often


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


def progress_bar(*, disabled: bool = False, lines: bool = True, **options) -> std.tqdm:
    """A tqdm bar with `options`, in the style `bar_style` picks. Where bars are off: with `lines`, a `LineBar`
    (lines from the first process alone), else a disabled bar; `disabled` (e.g. disable_tqdm) prints nothing."""
    style = bar_style(disabled)
    if style == "widgets":
        from tqdm.notebook import tqdm as widget_tqdm

        return widget_tqdm(**options)
    if style is None and lines and not disabled and os.environ.get("RANK", "0") == "0":
        return LineBar(**options)
    return std.tqdm(**options, disable=style is None)


class LineBar(std.tqdm):
    """A bar where bars do not show: it draws nothing (a disabled tqdm, as `progress_bar` gave before) but counts,
    and prints one line when `LINE_SECONDS` have passed since its start or its last line: its description, the
    count of its total, its rate, the time spent and an estimate of the time left, and its postfix (e.g.
    `[warm start] 40/200 steps (20%) in 65 s, 1.63 s/step, ~261 s left; loss=2.31`). The lines come on a clock
    (a thread of its own until `close`), not only as the count moves: a turn stuck in one environment step, or a
    hung one, still prints where it is."""

    def __init__(self, iterable=None, desc: str | None = None, total: float | None = None, unit: str = "it",
                 initial: float = 0, **options):
        super().__init__(iterable, desc=desc, total=total, unit=unit, initial=initial, **{**options, "disable": True})
        self.desc, self.unit, self.postfix = desc or "", unit, ""
        if self.total is None and iterable is not None and hasattr(iterable, "__len__"):
            self.total = len(iterable)
        self.started = self.last_line = time.monotonic()
        self.first = initial
        self.line_lock, self.closing = threading.Lock(), threading.Event()
        threading.Thread(target=tick, args=(weakref.ref(self), self.closing), name=f"progress lines: {self.desc}",
                         daemon=True).start()

    def __iter__(self):
        try:
            for item in self.iterable:
                yield item
                self.update()
        finally:  # (a loop that ends, breaks or raises ends the bar's clock)
            self.close()

    def update(self, n: float = 1) -> bool | None:
        self.n += n
        self.line_if_due()
        return None

    def line_if_due(self) -> None:
        with self.line_lock:  # (the clock and `update` both print: one line when due, not two)
            if time.monotonic() - self.last_line >= LINE_SECONDS:
                self.print_line()

    def close(self) -> None:
        self.closing.set()
        super().close()

    def print_line(self) -> None:
        self.last_line = now = time.monotonic()
        spent, done = now - self.started, self.n - self.first
        units = self.unit if self.unit == "it" else f"{self.unit}s"
        line = f"[{self.desc}] " if self.desc else ""
        line += f"{self.n:,.0f}" + (f"/{self.total:,.0f} {units} ({self.n / self.total:.0%})" if self.total else
                                    f" {units}")
        line += f" in {spent:,.0f} s"
        if done > 0:
            rate = done / spent
            line += f", {number(rate)} {units}/s" if rate >= 1 else f", {number(1 / rate)} s/{self.unit}"
            if self.total:
                line += f", ~{max(self.total - self.n, 0) / rate:,.0f} s left"
        std.tqdm.write(line + (f"; {self.postfix}" if self.postfix else ""), file=sys.stdout)


def tick(bar: weakref.ref[LineBar], closing: threading.Event) -> None:
    """A `LineBar`'s clock: wake when its next line is due (at most 10 times a second) and print it unless one came
    since, until the bar closes. It holds the bar weakly, so that a bar dropped unclosed is collected (tqdm's
    `__del__` closes it) and its lines stop."""
    while (due := getattr(bar(), "last_line", None)) is not None:
        if closing.wait(max(due + LINE_SECONDS - time.monotonic(), 0.1)):
            return
        if (live := bar()) is not None:
            live.line_if_due()
        del live  # (no strong reference while waiting)


def number(value: float) -> str:
    """3 significant digits, without an exponent (12.4, 0.6, 1,234)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


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
