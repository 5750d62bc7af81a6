"""What a rehearsal says while it runs (issue 46): up front how its processes share this machine's cores and what
the plan expects of each launch; during a launch each [iter] line as it comes and, at least every LINE_SECONDS, the
ranks up, the iterations done, what is left and the end of its log; DeepSpeed's CPU op found where set-up built it
by every command that imports hgpo_trl, and made ready once before a launch."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from hgpo_trl.rehearsal import watch
from hgpo_trl.rehearsal.launch import run_launches
from hgpo_trl.rehearsal.plan import launch_bound
from hgpo_trl.rehearsal.watch import LaunchWatch, plan_line
from hgpo_trl.runtime import progress
from tests.test_rehearsal import ALFWORLD, ROOT, parsed

NAMES = [("launch 1 (iterations 1-2)", 2), ("launch 2 (iteration 3, resumed)", 1)]


def test_the_rehearsal_says_up_front_how_its_processes_share_the_cores_and_what_it_expects(monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(ALFWORLD))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    _, args, _ = parsed(ROOT / "configs/alfworld/hgpo_k4_qwen2.5-7b.yaml")  # 8 rollouts x 3 steps a process
    # 8 processes (an 8-GPU ZeRO-3 file) on 2 cores: each launch's start and steps, x4 (the bound's own figures).
    assert plan_line(args, 8, 2, NAMES, None) == (
        "rehearsal: 8 processes on this machine's 2 cores (4 processes a core, OMP_NUM_THREADS=1); the plan expects "
        "~1,056 s: launch 1 (iterations 1-2) ~624 s, launch 2 (iteration 3, resumed) ~432 s (a process's start "
        "~60 s and 24 rollout steps an iteration at ~2 s, x4 for the shared cores); a launch is stopped as hung "
        "after 5 x its estimate (--rehearse_timeout sets another bound)")
    assert launch_bound(args, 8, 2, 2)[0] == 5 * 624
    assert plan_line(args, 2, 16, NAMES[:1], 90.0) == (
        "rehearsal: 2 processes on this machine's 16 cores (a core or more each, OMP_NUM_THREADS=1); the plan "
        "expects ~156 s: launch 1 (iterations 1-2) ~156 s (a process's start ~60 s and 24 rollout steps an "
        "iteration at ~2 s); a launch is stopped after 90 s (--rehearse_timeout)")


# A launcher as accelerate's: two ranks (RANK 0 and 1) that live as long as it does; rank 0's iterations logged.
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env={**os.environ, "RANK": str(r)})
             for r in range(2)]
    print("loading the model", flush=True)
    time.sleep(1.0)
    print("[iter    1] success 0.00  reward   0.00", flush=True)
    time.sleep(1.5)
    print("[iter    2] success 0.50  reward   0.50", flush=True)
    print("saving checkpoint-2", flush=True)
    time.sleep(1.0)
    for rank in ranks:
        rank.kill()
""")


def test_a_launch_says_where_it_is_as_it_goes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(progress, "LINE_SECONDS", 0.8)
    monkeypatch.setattr(watch, "READ_SECONDS", 0.2)
    watcher = LaunchWatch(*NAMES[0], expected=624.0, processes=2, then="launch 2 (iteration 3, resumed), ~432 s")
    log = tmp_path / "launch1.log"
    run_launches([([sys.executable, "-c", LAUNCHER], log)], dict(os.environ), 60.0, watch=watcher)
    lines = capsys.readouterr().out.splitlines()
    said = [re.sub(r"(, | at )\d+ s", r"\1N s", line) for line in lines]  # (the seconds so far)
    # Each iteration once, as the log gets it; a status line at least every LINE_SECONDS.
    assert [line for line in said if "s: [iter" in line] == [
        "rehearsal: launch 1 (iterations 1-2), N s: [iter    1] success 0.00  reward   0.00",
        "rehearsal: launch 1 (iterations 1-2), N s: [iter    2] success 0.50  reward   0.50"]
    status = [line for line in said if " expected: " in line]
    assert len(status) >= 3, lines
    assert all(line.startswith("rehearsal: launch 1 (iterations 1-2) at N s of ~624 s expected: ") for line in status)
    assert any(re.search(r": 2/2 ranks up, 0/2 iterations done; then launch 2 \(iteration 3, resumed\), ~432 s; its "
                         r'log ends: "loading the model"$', line) for line in status), lines
    assert any(line.endswith('1/2 iterations done; then launch 2 (iteration 3, resumed), ~432 s; its log ends: '
                             '"[iter    1] success 0.00  reward   0.00"') for line in status), lines


def test_every_command_finds_deepspeeds_cpu_op_where_set_up_built_it():
    """hgpo_trl, imported by train.py, accelerate launch's ranks and a notebook alike, points torch's extensions at
    the venv's folder, which make builds at set-up, and puts the venv's ninja (set-up's) first on PATH: with a
    system ninja first, every load rebuilt the op. A folder the user names stays theirs."""
    venv_ops, venv_ninja = Path(sys.prefix) / "torch_extensions", Path(sys.executable).with_name("ninja")
    assert venv_ops.is_dir() and venv_ninja.is_file(), "make (its deepspeed-ops step) builds DeepSpeed's CPU op here"
    code = "import os, shutil, hgpo_trl; print(os.environ.get('TORCH_EXTENSIONS_DIR'), shutil.which('ninja'))"
    env = {**{k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"},  # (PATH: without the venv)
           "PATH": os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                   if Path(p).resolve() != venv_ninja.parent.resolve())}
    found = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert found.stdout.split() == [str(venv_ops), str(venv_ninja)], found.stderr
    own = subprocess.run([sys.executable, "-c", code], env={**env, "TORCH_EXTENSIONS_DIR": "/elsewhere"},
                         capture_output=True, text=True, cwd=ROOT)
    assert own.stdout.split()[0] == "/elsewhere"
