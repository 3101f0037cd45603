"""Every ``>>>`` example in precond's docstrings runs and prints what it shows.

Each module under ``src/precond`` whose source holds an example is imported and
its docstrings run with :mod:`doctest` (the module's namespace as globals, the
examples of one docstring sharing their names). A module of a framework that is
not installed is skipped. Examples that need several devices or processes may
carry ``# doctest: +SKIP``; every other example runs on the CPU.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import precond

PACKAGE = Path(precond.__file__).parent
FRAMEWORKS = {"jax": ("jax", "optax"), "torch": ("torch",)}
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_with_examples() -> list[str]:
    """Names of the modules whose source holds a ``>>>`` example."""
    return sorted(
        _module_name(path)
        for path in PACKAGE.rglob("*.py")
        if ">>>" in path.read_text(encoding="utf-8")
    )


def _skip_unless_framework_installed(name: str) -> None:
    framework = name.split(".")[1]
    for module in FRAMEWORKS.get(framework, ()):
        pytest.importorskip(module)


@pytest.mark.parametrize("name", modules_with_examples())
def test_docstring_examples(name):
    _skip_unless_framework_installed(name)
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    report: list[str] = []
    for test in finder.find(module, name):
        runner.run(test, out=report.append)
    assert runner.tries > 0, f"{name}: '>>>' in its source, but no example found"
    assert runner.failures == 0, "".join(report)


def test_examples_are_skipped_only_for_devices_or_processes():
    """``+SKIP`` is kept for examples that need several devices or processes, and
    the lines just above such an example say so."""
    unexplained = []
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            reason = " ".join(lines[max(0, i - 3) : i + 1]).lower()
            if "+SKIP" in line and not ("devices" in reason or "processes" in reason):
                unexplained.append(f"{path.relative_to(PACKAGE.parent)}:{i + 1}")
    assert not unexplained, "examples skipped without a reason: " + ", ".join(
        unexplained
    )
