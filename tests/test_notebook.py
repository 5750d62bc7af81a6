"""The notebook example runs offline on a CPU as a user would run it, cell after cell."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_notebook_quickstart_runs_and_plots(tmp_path):
    env = {**os.environ, "NOTEBOOK_OUTPUT": str(tmp_path), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "notebook_quickstart.py")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    iterations = [line for line in result.stdout.splitlines() if line.startswith("iteration ")]
    assert len(iterations) == 4, result.stdout[-2000:]
    assert (tmp_path / "learning.png").stat().st_size > 0
    assert "training tasks" in result.stdout and "plot:" in result.stdout
