"""One installed name (issue 16): the environments are `hgpo_trl.envs`, from a wheel, the editable install and
a bare source checkout alike, and nothing generic such as `envs` is installed at top level."""

import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)

# Imports the environments, builds keydoor tasks and plays one episode to its end; prints where they came from.
PLAY_ONE_EPISODE = """
import hgpo_trl.envs as envs
from hgpo_trl.envs import make_env, make_tasks
env = make_env("keydoor", max_steps=8)
row = make_tasks("keydoor", "train")[0]
observation, info = env.reset(row)
gold = row["gold"]
for action in [f"take {gold} key", "go to hall", "go to vault", f"open {gold} door"]:
    observation, reward, terminated, truncated, info = env.step(action)
assert terminated and info["won"] and reward > 0, (observation, reward, info)
import hgpo_trl.envs.webshop.env as webshop_env
print(envs.__file__)
print(webshop_env.__file__)
"""


def run_python(python: Path | str, code: str, cwd: Path, **env) -> list[str]:
    result = subprocess.run([str(python), "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--wheel-dir", str(out), str(ROOT)], check=True, timeout=240)
    (path,) = out.glob("hgpo_trl-*.whl")
    return path


def bare_venv(where: Path) -> Path:
    """A fresh venv outside the repository that sees the project venv's dependencies but not hgpo-trl: a .pth
    line adds their site-packages (whose own .pth files, the editable install's among them, are not run)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    purelib = run_python(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])", where)[0]
    Path(purelib, "project_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_the_wheel_installs_one_top_level_package_with_every_environment_module(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"hgpo_trl", wheel.name.split("-py")[0] + ".dist-info"}
    tracked = subprocess.run(["git", "ls-files", "envs"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    modules = [name for name in tracked if name.endswith(".py")]
    assert len(modules) > 10
    assert {f"hgpo_trl/{name}" for name in modules} <= set(names)
    assert "hgpo_trl/envs/__init__.py" in names and not any("__pycache__" in name for name in names)
    assert "hgpo_trl/evaluation/viewer.html" in names  # the trajectory viewer's page, which viewer.py reads at run time


@pytest.mark.slow
def test_the_wheel_in_a_fresh_venv_outside_the_repository_plays_keydoor(wheel, tmp_path):
    python = bare_venv(tmp_path / "venv")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--no-index", str(wheel)], check=True, timeout=120)
    installed = Path(run_python(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])", tmp_path)[0])
    code = "import importlib.util\nassert importlib.util.find_spec('envs') is None\n" + PLAY_ONE_EPISODE
    init, webshop = run_python(python, code, cwd=tmp_path)
    assert Path(init) == installed / "hgpo_trl" / "envs" / "__init__.py"
    assert Path(webshop) == installed / "hgpo_trl" / "envs" / "webshop" / "env.py"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["from the repository root", "PYTHONPATH=."])
def test_a_source_checkout_without_any_install_finds_the_environments_in_envs(tmp_path, how):
    python = bare_venv(tmp_path / "venv")
    cwd, env = (ROOT, {}) if how == "from the repository root" else (tmp_path, {"PYTHONPATH": str(ROOT)})
    init, webshop = run_python(python, PLAY_ONE_EPISODE, cwd=cwd, **env)
    assert Path(init) == ROOT / "hgpo_trl" / "envs" / "__init__.py"
    assert Path(webshop) == ROOT / "envs" / "webshop" / "env.py"


@pytest.mark.slow
def test_the_editable_install_works_from_any_folder(tmp_path):
    init, webshop = run_python(sys.executable, PLAY_ONE_EPISODE, cwd=tmp_path)
    assert (Path(init), Path(webshop)) == (ROOT / "hgpo_trl" / "envs" / "__init__.py", ROOT / "envs" / "webshop" / "env.py")


@pytest.mark.slow
def test_a_module_named_envs_earlier_on_the_path_does_not_shadow_ours(tmp_path):
    """PyPI's `envs` or a user's own `envs/` folder: both stay theirs, and ours is still `hgpo_trl.envs`."""
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "__init__.py").write_text("THEIRS = True\n")
    code = "import importlib\ntheirs = importlib.import_module('envs')\nassert theirs.THEIRS\n" + PLAY_ONE_EPISODE
    init, _ = run_python(sys.executable, code, cwd=tmp_path, PYTHONPATH=str(tmp_path))
    assert Path(init) == ROOT / "hgpo_trl" / "envs" / "__init__.py"


def test_make_install_adds_the_named_extras_to_the_clones_venv():
    """`make install EXTRAS=...`: what `pip install "hgpo-trl[...]"` is inside a clone (dry run: -n prints, -B as
    if nothing were installed yet)."""
    commands = subprocess.run(["make", "-n", "-B", "install", "EXTRAS=alfworld,textarena"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
    assert '-e ".[alfworld,textarena]"' in commands and "touch .venv/.installed-alfworld,textarena" in commands


def test_set_up_builds_each_source_only_package_once_per_machine(tmp_path):
    """`make`'s source-wheels: a wheel of SOURCE_ONLY missing from WHEELHOUSE is built into it (here by a stand-in
    for `python -m pip wheel` that writes an empty one), one already there is not built again, and the install finds
    them there; the pinned versions are those the alfworld extra installed (another would be built from source)."""
    makefile = (ROOT / "Makefile").read_text()
    pins = dict(pin.split("==") for pin in re.search(r"^SOURCE_ONLY := (.+)$", makefile, re.MULTILINE)[1].split())
    assert pins == {name: importlib.metadata.version(name) for name in pins} and "fast-downward-textworld" in pins
    bin_, wheels, calls = tmp_path / "bin", tmp_path / "wheels", tmp_path / "calls"
    bin_.mkdir()
    (bin_ / "python").write_text(f"""#!/bin/sh
# python -m pip wheel --quiet --no-deps -w FOLDER NAME==VERSION
echo "$8" >> {calls}
name=$(echo "${{8%%==*}}" | tr - _)
touch "$7/$name-${{8##*==}}-py3-none-any.whl"
""")
    (bin_ / "python").chmod(0o755)
    for _ in range(2):
        subprocess.run(["make", "--no-print-directory", "source-wheels", f"BIN={bin_}", f"WHEELHOUSE={wheels}"],
                       cwd=ROOT, check=True, capture_output=True)
    assert calls.read_text().split() == list(map("==".join, pins.items()))  # each once, in the first run
    assert sorted(p.name for p in wheels.iterdir()) == sorted(
        f"{name.replace('-', '_')}-{version}-py3-none-any.whl" for name, version in pins.items())
    commands = subprocess.run(["make", "-n", "-B", "install", "EXTRAS=alfworld", f"WHEELHOUSE={wheels}"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
    assert f"echo --find-links {wheels})" in commands


def test_set_up_from_nothing_creates_the_venv_before_it_builds_the_source_wheels(tmp_path):
    """Issue 53: a machine with no venv and an empty WHEELHOUSE walks the whole set-up rule in order: the venv, the
    wheels of SOURCE_ONLY (built with the venv's python), uv, the install that finds them. Every command is a
    stand-in that records its call (the real ones take minutes); the old Makefile built the wheels with a venv it
    had not made yet ('.venv/bin/python: not found')."""
    venv, wheels, calls = tmp_path / "venv", tmp_path / "wheels", tmp_path / "calls"
    venv_python = tmp_path / "venv_python"
    venv_python.write_text(f"""#!/bin/sh
# the venv's python: `-m pip wheel --quiet --no-deps -w FOLDER NAME==VERSION` writes an empty wheel,
# `-m pip install --quiet uv` a uv that records its call
echo "venv-python $*" >> {calls}
if [ "$3" = wheel ]; then touch "$7/$(echo "${{8%%==*}}" | tr - _)-${{8##*==}}-py3-none-any.whl"; fi
if [ "$3" = install ]; then printf '#!/bin/sh\\necho "uv $*" >> {calls}\\n' > {venv}/bin/uv; chmod +x {venv}/bin/uv; fi
""")
    python = tmp_path / "python"
    python.write_text(f"""#!/bin/sh
# the machine's python: `-m venv DIR` makes a venv of stand-ins, anything else is the real interpreter
if [ "$1" = -m ] && [ "$2" = venv ]; then
    echo "python -m venv $3" >> {calls}; mkdir -p "$3/bin"; cp {venv_python} "$3/bin/python"; exit 0
fi
exec {sys.executable} "$@"
""")
    for script in (python, venv_python):
        script.chmod(0o755)
    done = subprocess.run(["make", "--no-print-directory", f"{venv}/.installed-alfworld", f"VENV={venv}",
                           f"PYTHON={python}", f"WHEELHOUSE={wheels}"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = [line.split()[:4] for line in calls.read_text().splitlines()]
    assert steps == [["python", "-m", "venv", str(venv)],
                     ["venv-python", "-m", "pip", "wheel"], ["venv-python", "-m", "pip", "wheel"],
                     ["venv-python", "-m", "pip", "install"], ["uv", "pip", "install", "--quiet"]], steps
    assert f"--find-links {wheels}" in calls.read_text().splitlines()[-1]
    assert len(list(wheels.glob("*.whl"))) == 2 and (venv / ".installed-alfworld").exists()
