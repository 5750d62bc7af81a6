"""The lines each test tier executes, from one coverage run of the whole suite with test contexts:

    make test-all PYTEST_ARGS="--cov=hgpo_trl --cov=envs --cov-context=test --cov-report="
    .venv/bin/python tests/tier_coverage.py [.coverage]

A line counts for the fast tier when a test not marked slow ran it, or when it ran outside any test (imports at
collection). Prints the modules where the fast tier runs fewer lines than the whole suite, and the totals."""

import subprocess
import sys
from pathlib import Path

import coverage

ROOT = Path(__file__).resolve().parents[1]


def slow_tests() -> set[str]:
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow", "-p", "no:randomly"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {line for line in listed.splitlines() if "::" in line}


def main(path: str = ".coverage") -> None:
    data = coverage.CoverageData(path)
    data.read()
    slow = slow_tests()
    totals, untouched = [0, 0], []
    for measured in sorted(data.measured_files()):
        contexts = data.contexts_by_lineno(measured)
        full = [line for line, names in contexts.items() if names]
        fast = [line for line, names in contexts.items() if any(not n or n.split("|")[0] not in slow for n in names)]
        totals[0], totals[1] = totals[0] + len(full), totals[1] + len(fast)
        name = Path(measured).resolve().relative_to(ROOT)
        if full and not fast:
            untouched.append(str(name))
        if len(fast) < len(full):
            print(f"{name!s:40} {len(fast):5} of {len(full):5} lines ({len(fast) / len(full):.0%})")
    only_slow = f"modules only slow tests run: {untouched}" if untouched else "none runs only in slow tests"
    print(f"fast tier: {totals[1]} of the {totals[0]} lines the whole suite runs ({totals[1] / totals[0]:.0%}); "
          f"{len(data.measured_files())} modules, {only_slow}")


if __name__ == "__main__":
    main(*sys.argv[1:])
