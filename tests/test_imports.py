"""Import boundaries: `precond` loads no framework, `precond.jax` never loads torch."""

import subprocess
import sys

import pytest


def _modules_loaded_by(statement: str) -> set[str]:
    script = f"{statement}\nimport sys\nprint(' '.join(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    return set(result.stdout.split())


@pytest.mark.parametrize(
    ("statement", "forbidden"),
    [
        ("import precond", {"jax", "torch", "optax", "numpy"}),
        ("import precond.jax", {"torch"}),
        ("import precond.bench.cli", {"jax", "torch"}),
    ],
)
def test_import_boundaries(statement, forbidden):
    loaded = _modules_loaded_by(statement)
    assert not forbidden & loaded, f"{statement} loaded {sorted(forbidden & loaded)}"
    assert statement.split()[-1] in loaded


def test_version_is_exposed():
    import precond

    assert precond.__version__.count(".") >= 2
