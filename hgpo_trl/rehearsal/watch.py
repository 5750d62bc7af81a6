"""What a rehearsal says while it runs, where each launch is minutes of subprocesses that write only to their log
files: up front, how its processes share this machine's cores and what the plan expects of each launch; then each
iteration's `[iter]` line as a launch logs it, and at least every `LINE_SECONDS` a line saying which launch, how long
it has run of what the plan expects, how many of its ranks are up, the iterations it has done, what the plan still
has to do, and the last line its log holds (so that a slow rehearsal can be told from a hung one)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import psutil

from hgpo_trl.config import HGPOConfig
from hgpo_trl.rehearsal.launch import MARK
from hgpo_trl.rehearsal.plan import HUNG, START_SECONDS, STEP_SECONDS, launch_expected, rollout_steps
from hgpo_trl.runtime import progress

ITERATION_LINE = re.compile(r"\[iter\s+\d+\]")
READ_SECONDS = 2.0  # how often a launch's log is read for new [iter] lines


def plan_line(args: HGPOConfig, processes: int, cores: int, launches: list[tuple[str, int]],
              timeout: float | None) -> str:
    """The rehearsal's opening line: how `processes` share `cores`, and what the plan expects of each of
    `launches` (name, iterations) and in all."""
    expected = [launch_expected(args, processes, cores, iterations) for _, iterations in launches]
    share = processes / cores
    shared = (f"{share:.2g} processes a core" if share > 1 else "a core or more each")
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    each = ", ".join(f"{name} ~{seconds:,.0f} s" for (name, _), seconds in zip(launches, expected, strict=True))
    bound = (f"a launch is stopped after {timeout:,.0f} s (--rehearse_timeout)" if timeout is not None else
             f"a launch is stopped as hung after {HUNG} x its estimate (--rehearse_timeout sets another bound)")
    return (f"rehearsal: {processes} processes on this machine's {cores} cores ({shared}, OMP_NUM_THREADS={threads}); "
            f"the plan expects ~{sum(expected):,.0f} s: {each} (a process's start ~{START_SECONDS:.0f} s and "
            f"{rollout_steps(args)} rollout steps an iteration at ~{STEP_SECONDS:.0f} s"
            + (f", x{share:.2g} for the shared cores" if share > 1 else "") + f"); {bound}")


@dataclass
class LaunchWatch:
    """The lines of one launch, called by `launch.run_launches` while it waits (`elapsed` seconds in)."""

    name: str  # e.g. "launch 1 (iterations 1-2)"
    iterations: int
    expected: float  # seconds the plan expects
    processes: int
    then: str = ""  # what the plan has to do after this launch
    done: int = 0  # the [iter] lines said
    read: int = 0  # the log's bytes read so far, whole lines (a launch's log grows for minutes: read once)
    last_logged: str = ""  # the log's last non-empty line so far
    last_line: float = 0.0
    last_read: float = -1.0

    def __call__(self, elapsed: float, mark: str, log: Path) -> None:
        """`log`: machine rank 0's, where the [iter] lines go."""
        if elapsed - self.last_read < READ_SECONDS:  # (the process table is read for each status line alone)
            return
        self.last_read = elapsed
        for line in self.new_lines(log):
            if ITERATION_LINE.match(line):
                self.done += 1
                print(f"rehearsal: {self.name}, {elapsed:,.0f} s: {line.strip()}", flush=True)
            self.last_logged = line.strip() or self.last_logged
        if elapsed - self.last_line >= progress.LINE_SECONDS:
            self.last_line = elapsed
            last = self.last_logged
            ends = f'; its log ends: "{last[:100]}"' if last else "; its log is empty yet"
            print(f"rehearsal: {self.name} at {elapsed:,.0f} s of ~{self.expected:,.0f} s expected: "
                  f"{ranks_up(mark)}/{self.processes} ranks up, {self.done}/{self.iterations} iterations "
                  f"done{'; then ' + self.then if self.then else ''}{ends}", flush=True)

    def new_lines(self, log: Path) -> list[str]:
        """The whole lines `log` got since the last call (a line still being written waits for the next)."""
        if not log.is_file():
            return []
        with log.open("rb") as f:
            f.seek(self.read)
            new = f.read()
        whole = new[: new.rfind(b"\n") + 1]
        self.read += len(whole)
        return whole.decode(errors="replace").splitlines()


def ranks_up(mark: str) -> int:
    """How many ranks of the launch marked `mark` have started: the distinct RANK of its processes (torch elastic
    sets it for each rank, and a rank's environment workers inherit it), or rank 0 for a process other than a
    launcher without one (accelerate runs a single process without torch elastic)."""
    ranks = set()
    for proc in psutil.process_iter():
        try:
            environ, command = proc.environ(), " ".join(proc.cmdline())
        except psutil.Error:  # gone, a zombie, or another user's
            continue
        if environ.get(MARK) == mark and ("RANK" in environ or "accelerate.commands.launch" not in command):
            ranks.add(environ.get("RANK", "0"))
    return len(ranks)
