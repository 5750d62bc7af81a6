"""Progress bars only where they can draw: in a terminal, or as widgets in a notebook kernel that has ipywidgets;
elsewhere (a log file, a pipe, CI, a kernel without ipywidgets) none, and `disable_tqdm` turns them all off.
hgpo-eval's bar counts the turns its lock-step games advance by, not the games, which end together."""

import re
import sys
import threading
import time
from functools import partial

import pytest
from tqdm import std

from hgpo_trl.commands.players import random_player
from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.pool import make_env_batch
from hgpo_trl.evaluation import protocol
from hgpo_trl.rollout.lockstep import RolloutSettings
from hgpo_trl.runtime import progress


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

    monkeypatch.setattr(protocol, "progress_bar", terminal_bar)
    tasks = list(make_tasks("keydoor", "valid", num_rooms=3, num_colors=3))  # 11 tasks: 3 chunks of 4 environments
    with make_env_batch(partial(make_env, "keydoor"), 4, 0) as envs:
        episodes = protocol.play_split(envs, tasks, random_player(0, "plain"),
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


class Clock:
    """time.monotonic as the test sets it."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def test_where_bars_do_not_show_a_bar_prints_a_line_every_line_seconds_with_what_is_left(monkeypatch, capsys):
    monkeypatch.setattr(progress, "bar_style", lambda disabled: None)  # (a log file)
    monkeypatch.setattr(progress, "time", clock := Clock())
    bar = progress.progress_bar(total=10, desc="warm start", unit="step")
    for now in (10, 20, 31, 40, 62):
        clock.now = now
        bar.update()
        bar.set_postfix(loss="2.310", refresh=False)
    assert capsys.readouterr().out == (  # a line once LINE_SECONDS (30 s) passed since the start or the last one
        "[warm start] 3/10 steps (30%) in 31 s, 10.3 s/step, ~72 s left; loss=2.310\n"
        "[warm start] 5/10 steps (50%) in 62 s, 12.4 s/step, ~62 s left; loss=2.310\n")
    assert bar.disable and bar.n == 5  # (no bar is drawn; it counts)
    bar.close()
    clock.now = 100
    for _ in progress.progress_bar(iterable=range(3), desc="random episodes", unit="episode", leave=False):
        clock.now += 31
    assert capsys.readouterr().out.splitlines() == [
        f"[random episodes] {n}/3 episodes ({n / 3:.0%}) in {31 * n} s, 31 s/episode, ~{31 * (3 - n)} s left"
        for n in (1, 2, 3)]
    # Off: with disable_tqdm, for a bar that the [iter] lines stand for (lines=False), and on every process but
    # the first.
    assert type(progress.progress_bar(total=3, disabled=True)) is std.tqdm
    assert type(progress.progress_bar(total=3, lines=False)) is std.tqdm
    monkeypatch.setenv("RANK", "1")
    assert type(progress.progress_bar(total=3)) is std.tqdm


def test_a_turn_that_stalls_still_prints_a_line_every_line_seconds(monkeypatch, capsys):
    """A line on a clock, not on progress: a bar that printed only as its count moved was silent through one long
    environment step (4 s of silence with LINE_SECONDS 0.5), and forever through a hung one (env_step_timeout is
    None by default). Here hgpo-eval's first turn stalls until a line has printed (20 s at most); its clock stops
    with its bar."""
    monkeypatch.setattr(progress, "bar_style", lambda disabled: None)  # (a log file)
    monkeypatch.setattr(progress, "LINE_SECONDS", 0.2)
    during_the_stall: list[str] = []
    play = random_player(0, "plain")
    calls = 0

    def stalling_player(prompts, infos):
        nonlocal calls
        calls += 1
        deadline = time.monotonic() + 20
        while calls == 1 and not during_the_stall and time.monotonic() < deadline:
            time.sleep(0.05)
            during_the_stall.extend(capsys.readouterr().out.splitlines())
        return play(prompts, infos)

    tasks = list(make_tasks("keydoor", "valid", num_rooms=3, num_colors=3))[:2]
    with make_env_batch(partial(make_env, "keydoor"), 2, 0) as envs:
        protocol.play_split(envs, tasks, stalling_player, RolloutSettings(action_mode="plain", max_steps=6),
                            scripted=True, count_tokens=None, description="stalled", quiet=False, dump=None, args=None)
    assert during_the_stall and re.fullmatch(r"\[stalled\] 0/6 turns \(0%\) in \d+ s", during_the_stall[0])
    assert not clocks_left_running()
    # A bar that is iterated closes with its loop, a break included.
    for _ in progress.progress_bar(iterable=range(3), desc="random episodes", unit="episode"):
        break
    assert not clocks_left_running()


def test_an_interrupted_warm_start_s_lines_stop(monkeypatch, tiny_model, tiny_tokenizer):
    """The warm start's bar of steps closes at the end of training, which an interrupted warm start does not reach:
    its clock went on printing its line (a notebook keeps the traceback, and with it the bar). Here the model's
    second forward raises KeyboardInterrupt, as a Ctrl-C there would."""
    from hgpo_trl.envs.keydoor import KeyDoorEnv
    from hgpo_trl.models.warmstart import warm_start

    monkeypatch.setattr(progress, "bar_style", lambda disabled: None)  # (a log file)
    forwards = 0

    def interrupt_at_the_second(module, inputs):
        nonlocal forwards
        forwards += 1
        if forwards == 2:
            raise KeyboardInterrupt

    tiny_model.register_forward_pre_hook(interrupt_at_the_second)
    tasks = list(make_tasks("keydoor", "train", num_tasks=4))
    with pytest.raises(KeyboardInterrupt) as interrupted:
        warm_start(tiny_model, tiny_tokenizer, KeyDoorEnv, tasks, steps=3, batch_size=4, max_steps=6, progress=True)
    assert not clocks_left_running() and interrupted.traceback  # (with the traceback still held)


def clocks_left_running() -> list[threading.Thread]:
    """The bars' clock threads still running once each had 5 s to end."""
    clocks = [thread for thread in threading.enumerate() if thread.name.startswith("progress lines")]
    for clock in clocks:
        clock.join(timeout=5)
    return [clock for clock in clocks if clock.is_alive()]


def test_a_run_whose_output_goes_to_a_file_prints_where_each_long_phase_is(tmp_path, monkeypatch, capfd):
    """The warm start (its random episodes, then its steps and loss), each rollout's turns and each evaluation's, as
    lines in a non-terminal's output (capfd's file); LINE_SECONDS 0 here: a line at each step of each."""
    from hgpo_trl.commands.train import main
    from tests.test_cli import TINY_RUN, write

    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)
    main(["--config", write(tmp_path, TINY_RUN.replace("disable_tqdm: true\n", "") + "warmstart_steps: 3\n"
                            "warmstart_batch_size: 8\ntrain_iterations: 1\n")])
    printed = capfd.readouterr().out
    assert "\r" not in printed and "\x1b[" not in printed
    lines = printed.splitlines()

    def matching(pattern: str) -> list[str]:
        return [line for line in lines if re.fullmatch(pattern, line)]

    assert matching(r"\[warm start: random episodes\] \d+/\d+ episodes \(\d+%\) in \d+ s, .*, ~\d+ s left")
    steps = matching(r"\[warm start\] (\d)/3 steps \(\d+%\) in \d+ s, [\d.]+ (s/step|steps/s), ~\d+ s left.*")
    # (each step's line at least once: the bar's clock adds lines while a step runs)
    assert sorted({line.split("/")[0] for line in steps}) == ["[warm start] 1", "[warm start] 2", "[warm start] 3"]
    assert all(re.search(r"; loss=\d+\.\d{3}$", line) for line in steps  # (logged after the first step)
               if not line.startswith("[warm start] 1/"))
    assert matching(r"\[iteration 1 rollout\] \d/5 turns \(\d+%\) in \d+ s, .* left; live_episodes=\d+")
    assert matching(r"\[evaluation 1/1\] \d/5 turns \(\d+%\) in \d+ s, .* left; live_episodes=\d+")
    assert lines.index(steps[-1]) < next(i for i, line in enumerate(lines) if line.startswith("[iter "))
