"""What the README, the docs and the code's own docstrings and comments tell a newcomer must hold: every path
they name exists, and every command block is marked (run here, GPU, long, or a fragment); the runnable ones run."""

import importlib.util
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SOURCES = [*DOCS, ROOT / "train.py", ROOT / "evaluate.py", ROOT / "Makefile",
           *sorted(p for folder in ("hgpo_trl", "envs", "benchmarks", "examples", "configs")
                   for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".yaml", ".md"))]
PATH = re.compile(r"(?<![\w/.-])((?:configs|docs|examples|benchmarks|hgpo_trl|envs|tests)/[\w./{},*-]*[\w*])")
MARKER = re.compile(r"<!-- block: (run|gpu|long|fragment)((?: [\w-]+)*) -->")
FENCE = re.compile(r"^```(bash|python)\n(.*?)^```", re.S | re.M)
SHARED = ROOT.parent / "shared" / "data"


def expand(path: str) -> list[str]:
    """configs/{alfworld,webshop}/tiny_cpu.yaml -> both paths."""
    parts = re.split(r"\{([^}]*)\}", path.replace("{{", "{").replace("}}", "}"))  # (f-strings double them)
    options = [part.split(",") if i % 2 else [part] for i, part in enumerate(parts)]
    return ["".join(choice) for choice in itertools.product(*options)]


def named_paths():
    for source in SOURCES:
        for match in PATH.finditer(source.read_text(errors="replace")):
            yield source, match.group(1).rstrip(".,:;)`'\"")


def test_every_path_the_docs_and_docstrings_name_exists():
    missing = set()
    for source, path in named_paths():
        for candidate in expand(path):
            if "*" in candidate or "<" in candidate:
                found = any(ROOT.glob(candidate)) if "*" in candidate else True
            else:
                found = (ROOT / candidate).exists()
            if not found:
                missing.add(f"{source.relative_to(ROOT)} names {candidate}")
    assert not missing, "\n".join(sorted(missing))


LINK = re.compile(r"\]\(([^)\s]+)\)")


def headings(doc: Path) -> set[str]:
    """The anchors of `doc`'s headings, as GitHub makes them: lower case, punctuation dropped, spaces to '-'."""
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"^#+ (.*)$", FENCE.sub("", doc.read_text()), re.M)}


def test_every_link_in_the_docs_reaches_its_file_and_heading():
    """The README is a front page of links (issue 54): each relative link names a file that exists and, with a
    #fragment, one of its headings."""
    broken = []
    for doc in [*DOCS, ROOT / "tests" / "README.md"]:
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, fragment = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists() or (fragment and path.suffix == ".md" and fragment not in headings(path)):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)
    assert "set-up" in headings(ROOT / "docs" / "getting-started.md")  # (the check reads headings at all)


def blocks():
    for doc in DOCS:
        text = doc.read_text()
        for fence in FENCE.finditer(text):
            before = text[:fence.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = MARKER.fullmatch(before.strip())
            line = text[:fence.start()].count("\n") + 1
            yield doc, line, fence.group(1), fence.group(2), marker


def test_every_command_block_is_marked():
    unmarked = [f"{doc.relative_to(ROOT)}:{line}" for doc, line, _, _, marker in blocks() if marker is None]
    assert not unmarked, f"command blocks without a <!-- block: run|gpu|long|fragment --> line: {unmarked}"


def runnable():
    """`<!-- block: run [slow] [needs...] -->` blocks: "slow" puts one in the full tier (tests/README.md)."""
    for doc, line, language, body, marker in blocks():
        if marker is not None and marker.group(1) == "run":
            words = marker.group(2).split()
            yield pytest.param(doc, language, body, [w for w in words if w != "slow"], id=f"{doc.name}:{line}",
                               marks=[pytest.mark.slow] if "slow" in words else [])


RUNNABLE = list(runnable())


def checkout_mirror(folder: Path) -> Path:
    """A folder whose entries link to the checkout's: a block runs as from the checkout, and what it writes
    (outputs/...) lands in the test's folder, not in the checkout."""
    folder.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "outputs"):
            (folder / entry.name).symlink_to(entry)
    return folder


@pytest.mark.parametrize(("doc", "language", "body", "needs"), RUNNABLE)
def test_a_runnable_block_runs_as_written(doc, language, body, needs, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": f"{Path(sys.executable).parent}:"
           f"{os.environ['PATH']}"}
    for need in needs:  # what a block needs beyond the base install: data or an optional package
        if need == "alfworld":
            data = os.environ.get("ALFWORLD_DATA") or (SHARED / "alfworld")
            if not Path(data).is_dir():
                pytest.skip(f"needs ALFWorld games (ALFWORLD_DATA or {SHARED / 'alfworld'})")
            env["ALFWORLD_DATA"] = str(data)
        if importlib.util.find_spec(need) is None:  # found, not imported: an import can change the environment
            pytest.skip(f"the block needs the optional package {need}")
    command = [sys.executable, "-c", body] if language == "python" else ["bash", "-euo", "pipefail", "-c", body]
    result = subprocess.run(command, cwd=checkout_mirror(tmp_path / "checkout"), env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"{doc.name} block failed:\n{body}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
