"""The optimizers' code stays in small functions: none over 80 lines.

Counted from ``def`` (its decorators excluded) to the last line of the body,
less its docstring (arguments are documented on the public functions, optax's
style, however many they take), over ``src/precond`` outside ``bench/`` (the
benchmark runner, which the rule does not cover). Ruff's C901 (complexity 15)
is the other half of the rule and runs in CI's lint step.
"""

from __future__ import annotations

import ast
from pathlib import Path

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


JAX = SOURCE / "jax"
MAX_MODULE_LINES = 600


def test_no_module_of_precond_jax_is_over_600_lines():
    lengths = {p: len(p.read_text().splitlines()) for p in sorted(JAX.rglob("*.py"))}
    long = [
        f"{path.relative_to(SOURCE)} ({n} lines)"
        for path, n in lengths.items()
        if n > MAX_MODULE_LINES
    ]
    assert long == []


def test_precond_jax_is_subpackages_on_a_shared_core():
    """One folder per family on ``_core``, at most eight modules left flat, and
    each folder says what it is in a three-line docstring."""
    folders = sorted(p.name for p in JAX.iterdir() if (p / "__init__.py").exists())
    assert folders == ["_core", "kron", "psgd", "shampoo"]
    assert len(list(JAX.glob("*.py"))) <= 8
    for folder in folders:
        tree = ast.parse((JAX / folder / "__init__.py").read_text())
        docstring = ast.get_docstring(tree, clean=True)
        assert docstring is not None, folder
        assert len(docstring.splitlines()) == 3, folder
