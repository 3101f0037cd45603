"""The optimizers' code stays in small functions: none over 80 lines.

Counted from ``def`` (its decorators excluded) to the last line of the body,
docstring included, over ``src/precond`` outside ``bench/`` (the benchmark
runner, which the rule does not cover). Ruff's C901 (complexity 15) is the other
half of the rule and runs in CI's lint step.
"""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "precond"
MAX_LINES = 80


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{path.relative_to(SOURCE)}:{node.lineno} {node.name} "
        f"({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_LINES
    ]


def test_no_function_of_the_optimizers_is_over_80_lines():
    files = [p for p in sorted(SOURCE.rglob("*.py")) if "bench" not in p.parts]
    assert len(files) > 40  # the tree was found
    assert [f for path in files for f in _long_functions(path)] == []
