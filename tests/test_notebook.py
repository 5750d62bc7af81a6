"""The notebook example runs offline on a CPU as a user runs it, cell after cell in a real kernel, and shows
learning: validation success rises by a margin within its budget."""

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the dev extra installs nbformat, nbclient and ipykernel")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"


def test_the_notebook_is_committed_without_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)


@pytest.mark.slow
def test_the_notebook_runs_and_learns(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTEBOOK_OUTPUT", str(tmp_path))  # the kernel inherits the environment
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
                            ).execute()
    printed = "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for output in cell.outputs)
    before, after = map(float, re.search(r"validation success (\S+) -> (\S+) on \d+ held-out tasks", printed).groups())
    assert after >= before + 0.25, printed[-2000:]
    assert (tmp_path / "learning.png").stat().st_size > 0
    assert any(output.get("output_type") == "execute_result" and "image/png" in output.get("data", {})
               for output in notebook.cells[-3].outputs)
    # The trajectory viewer, inline: the page in an iframe, its dumps inside.
    [shown] = [o["data"]["text/html"] for o in notebook.cells[-1].outputs if o.get("output_type") == "execute_result"]
    assert shown.startswith("<iframe srcdoc=") and "id=&quot;dump-0&quot;" in shown
    assert (tmp_path / "trajectories.html").stat().st_size > 0
