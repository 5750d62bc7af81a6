"""The layout a newcomer relies on (docs/architecture.md): one idea per module, said in its opening docstring;
no module over ~400 lines; imports that run downhill, so that any module can be read, and imported, without the
ones above it; and the stages' borders (issue 54): each folder imports only the layers below it."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400
# The layers, from the bottom (docs/architecture.md's module map): a module imports only from its own layer and
# the ones below. The estimators and the environments know nothing of models or training; the rollout nothing of
# training; training nothing of evaluation, models or the command line; only the command line (and its
# rehearsal) starts a run.
LAYERS = [
    ("hgpo_trl", "hgpo_trl.moved", "hgpo_trl.runtime"),
    ("hgpo_trl.envs", "hgpo_trl.advantages"),
    ("hgpo_trl.diagnostics",),
    ("hgpo_trl.rollout",),
    ("hgpo_trl.training",),
    ("hgpo_trl.fields", "hgpo_trl.config_checks", "hgpo_trl.config"),
    ("hgpo_trl.evaluation",),
    ("hgpo_trl.models",),
    ("hgpo_trl.trainer",),
    ("hgpo_trl.commands", "hgpo_trl.rehearsal", "hgpo_trl.lab"),
]
# Third-party packages a layer may not import: the estimators are pure numpy (easy to test and benchmark), and an
# environment worker never loads the training stack (the TRL adapter reads TRL's tool-call helpers alone).
NOT_IMPORTED = {"hgpo_trl.advantages": {"torch", "transformers", "trl", "accelerate"},
                "hgpo_trl.envs": {"torch", "accelerate", "deepspeed", "peft", "vllm"}}


def library_modules() -> dict[str, Path]:
    """Module name -> file, for hgpo_trl/ and envs/ (which is imported as hgpo_trl.envs)."""
    modules = {}
    for folder, package in ((ROOT / "hgpo_trl", ["hgpo_trl"]), (ROOT / "envs", ["hgpo_trl", "envs"])):
        for path in sorted(folder.rglob("*.py")):
            parts = [*package, *path.relative_to(folder).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported(path: Path, modules: dict[str, Path] | None = None) -> set[str]:
    """The library modules `path` imports anywhere (in functions too), except under `if TYPE_CHECKING:`; with
    `modules` None, every module it names (third-party ones too)."""
    names: set[str] = set()

    class Imports(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                for statement in node.orelse:
                    self.visit(statement)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            names.update(alias.name for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            assert node.level == 0, f"{path}: a relative import (the library imports by absolute name)"
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & (modules or {}).keys()
            names.update(submodules)  # `from package import module` imports the module, not the package's names
            if len(submodules) < len(node.names):
                names.add(node.module)

    Imports().visit(ast.parse(path.read_text()))
    return {name for name in names if modules is None or name in modules}


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (module -> the modules it imports), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                return [*path[path.index(other):], other]
            if other not in state and (cycle := visit(other)):
                return cycle
        path.pop()
        state[module] = "done"
        return None

    return next((cycle for module in sorted(graph) if module not in state and (cycle := visit(module))), None)


def test_imports_run_downhill():
    modules = library_modules()
    graph = {name: imported(path, modules) - {name} for name, path in modules.items()}
    assert graph["hgpo_trl.trainer"] and graph["hgpo_trl.commands.evaluate"]  # (the graph sees imports at all)
    cycle = import_cycle(graph)
    assert cycle is None, "an import cycle: " + " -> ".join(cycle)


def layer(module: str) -> int:
    """The layer of `module`: the longest prefix named in LAYERS."""
    prefixes = [(len(prefix), i) for i, names in enumerate(LAYERS) for prefix in names
                if module == prefix or module.startswith(prefix + ".")]
    assert prefixes, f"{module} is in no layer of tests/test_layout.py's LAYERS: add it where it belongs"
    return max(prefixes)[1]


def test_every_folder_imports_only_the_layers_below_it():
    modules = library_modules()
    upward = [f"{name} (layer {layer(name)}) imports {other} (layer {layer(other)})"
              for name, path in modules.items() for other in imported(path, modules) - {name}
              if layer(other) > layer(name)]
    assert not upward, "imports that climb a layer:\n" + "\n".join(sorted(upward))
    forbidden = [f"{name} imports {package}" for name, path in modules.items()
                 for prefix, packages in NOT_IMPORTED.items() if name == prefix or name.startswith(prefix + ".")
                 for package in {n.split(".")[0] for n in imported(path)} & packages]
    assert not forbidden, "\n".join(sorted(forbidden))


def test_the_layer_check_sees_a_climb():
    assert layer("hgpo_trl.rollout.memory") < layer("hgpo_trl.training.metrics") < layer("hgpo_trl.trainer")
    assert layer("hgpo_trl") == 0 and layer("hgpo_trl.envs.pool") == 1 and layer("hgpo_trl.config_checks") == 5
    with pytest.raises(AssertionError, match="in no layer"):
        layer("hgpo_trl_other.x")


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_every_module_says_its_idea_and_none_is_over_400_lines():
    long = {}
    for path in library_modules().values():
        text = path.read_text()
        assert ast.get_docstring(ast.parse(text)), f"{path.relative_to(ROOT)} opens with no docstring"
        name = str(path.relative_to(ROOT))
        if len(text.splitlines()) > MAX_LINES:
            long[name] = len(text.splitlines())
    assert not long, f"over {MAX_LINES} lines: {long}; split by concern (docs/architecture.md)"


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def test_the_architecture_page_names_functions_that_exist_and_maps_every_module():
    text = ARCHITECTURE.read_text()
    rows = re.findall(r"^\|[^|]+\|[^|]+\| `([\w/.]+\.py)` \| `([\w.]+)` \|$", text, re.M)
    assert len(rows) >= 10, "the stage table of docs/architecture.md was not read"
    for path, name in rows:
        tree = ast.parse((ROOT / path).read_text())
        scope = tree.body
        for part in name.split("."):
            found = next((node for node in scope if isinstance(node, ast.FunctionDef | ast.ClassDef)
                          and node.name == part), None)
            assert found is not None, f"docs/architecture.md: {path} defines no {name}"
            scope = found.body
    module_map = text.split("## Module map", 1)[1]
    # every module at the top and in the stage folders by its file name; the other folders by theirs
    stages = ("runtime", "rollout", "training", "evaluation", "models", "commands", "rehearsal")
    unmapped = [p.name for p in sorted([*(ROOT / "hgpo_trl").glob("*.py"),
                                        *(f for stage in stages for f in (ROOT / "hgpo_trl" / stage).glob("*.py"))])
                if p.name != "__init__.py" and not re.search(rf"(?<![\w/]){re.escape(p.name)}", module_map)]
    unmapped += [f"{p.name}/" for p in sorted((ROOT / "hgpo_trl").iterdir())
                 if p.is_dir() and (p / "__init__.py").is_file() and p.name != "envs" and f"{p.name}/" not in module_map]
    assert not unmapped, f"modules missing from the module map of docs/architecture.md: {unmapped}"
