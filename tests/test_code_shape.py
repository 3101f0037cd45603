"""The code's shape: modules of at most 600 lines, folders that show the
design, and, in the optimizers, small functions: none over 80 lines.

Counted from ``def`` (its decorators excluded) to the last line of the body,
less its docstring (arguments are documented on the public functions, optax's
style, however many they take), over ``src/precond`` outside ``bench/`` (the
benchmark runner, which the rule does not cover). Ruff's C901 (complexity 15)
is the other half of the rule and runs in CI's lint step.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src" / "precond"
MAX_LINES = 80


def _docstring_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
        and first.end_lineno is not None
    ):
        return first.end_lineno - first.lineno + 1
    return 0


def _length(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1 - _docstring_lines(node)


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{path.relative_to(SOURCE)}:{node.lineno} {node.name} ({_length(node)} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and _length(node) > MAX_LINES
    ]


def test_no_function_of_the_optimizers_is_over_80_lines():
    files = [p for p in sorted(SOURCE.rglob("*.py")) if "bench" not in p.parts]
    assert len(files) > 40  # the tree was found
    assert [f for path in files for f in _long_functions(path)] == []


MAX_MODULE_LINES = 600
# Each framework's folders: one per family on a shared core (DESIGN.md §3).
FRAMEWORKS = {
    "jax": ["_core", "kron", "psgd", "shampoo", "soap"],
    "torch": ["_core", "kfac", "kron", "shampoo", "soap"],
}


def test_no_module_of_src_precond_is_over_600_lines():
    """Every module of the package, the bench's and the shared core's too."""
    lengths = {p: len(p.read_text().splitlines()) for p in sorted(SOURCE.rglob("*.py"))}
    assert len(lengths) > 40  # the tree was found
    long = [
        f"{path.relative_to(SOURCE)} ({n} lines)"
        for path, n in lengths.items()
        if n > MAX_MODULE_LINES
    ]
    assert long == []


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_a_framework_is_subpackages_on_a_shared_core(framework):
    """One folder per family on ``_core``, at most eight modules left flat, and
    each folder says what it is in a three-line docstring."""
    root = SOURCE / framework
    folders = sorted(p.name for p in root.iterdir() if (p / "__init__.py").exists())
    assert folders == FRAMEWORKS[framework]
    assert len(list(root.glob("*.py"))) <= 8
    for folder in folders:
        tree = ast.parse((root / folder / "__init__.py").read_text())
        docstring = ast.get_docstring(tree, clean=True)
        assert docstring is not None, folder
        assert len(docstring.splitlines()) == 3, folder
