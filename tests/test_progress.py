"""Progress bars only where they can draw: in a terminal, or as widgets in a notebook kernel that has ipywidgets;
elsewhere (a log file, a pipe, CI, a kernel without ipywidgets) none, and `disable_tqdm` turns them all off.
hgpo-eval's bar counts the turns its lock-step games advance by, not the games, which end together."""

import sys
from functools import partial

import pytest
from tqdm import std

from hgpo_trl import evaluation, progress
from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.pool import make_env_batch
from hgpo_trl.players import random_player
from hgpo_trl.rollout import RolloutSettings


class Stream:
    def __init__(self, terminal: bool):
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize(("stdout", "stderr", "style"), [
    (True, True, "terminal"),
    (False, True, None),  # `> log`: the lines go to the file, so the bars would be alone on the terminal
    (True, False, None),  # `2> log`: the bars would fill the file
    (False, False, None),  # a log file, a pipe, nohup, CI
])
def test_outside_a_kernel_bars_show_where_both_streams_are_a_terminal(monkeypatch, stdout, stderr, style):
    monkeypatch.setattr(progress, "in_jupyter_kernel", lambda: False)
    monkeypatch.setattr(sys, "stdout", Stream(stdout))
    monkeypatch.setattr(sys, "stderr", Stream(stderr))
    assert progress.bar_style(disabled=False) == style
    assert progress.bar_style(disabled=True) is None
    assert progress.progress_bar(total=3, disabled=False).disable is (style is None)


@pytest.mark.parametrize(("widgets", "style"), [(True, "widgets"), (False, None)])
def test_in_a_kernel_bars_are_widgets_or_none(monkeypatch, widgets, style):
    monkeypatch.setattr(progress, "in_jupyter_kernel", lambda: True)
    monkeypatch.setattr(progress, "widgets_installed", lambda: widgets)
    monkeypatch.setattr(sys, "stdout", Stream(False))  # (a kernel's streams are no terminal)
    monkeypatch.setattr(sys, "stderr", Stream(False))
    assert progress.bar_style(disabled=False) == style
    assert progress.bar_style(disabled=True) is None


def test_hgpo_eval_s_bar_counts_turns_and_jumps_by_the_turns_a_chunk_did_not_need(monkeypatch):
    bars: list[std.tqdm] = []
    counts: list[int] = []

    class CountingBar(std.tqdm):  # a terminal's bar, as the console would show it
        def update(self, n=1):
            super().update(n)
            counts.append(self.n)

    def terminal_bar(*, disabled: bool = False, **options):
        bars.append(CountingBar(**options, file=Stream(True), disable=disabled))
        return bars[-1]

    monkeypatch.setattr(evaluation, "progress_bar", terminal_bar)
    tasks = list(make_tasks("keydoor", "valid", num_rooms=3, num_colors=3))  # 11 tasks: 3 chunks of 4 environments
    with make_env_batch(partial(make_env, "keydoor"), 4, 0) as envs:
        episodes = evaluation.play_split(envs, tasks, random_player(0, "plain"),
                                         RolloutSettings(action_mode="plain", max_steps=6), scripted=True,
                                         count_tokens=None, description="random valid seed 0", quiet=False,
                                         dump=None, args=None)
    # A keydoor game of admissible actions ends at a door on its 4th step: each chunk plays 4 of its 6 turns, its
    # games all ending on the last one; the bar moves a turn at a time, then over the 2 turns the chunk did not
    # need, and its total stays (a notebook's widget bar would not follow a new one).
    assert [e.steps for e in episodes] == [4] * 11
    [bar] = bars
    assert bar.n == bar.total == 3 * 6
    assert sorted(set(counts)) == [n for chunk in range(3) for n in range(6 * chunk, 6 * chunk + 4)] + [18]
    assert bar.postfix.startswith("games=11/11, success=")
