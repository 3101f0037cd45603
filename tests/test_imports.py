"""Import boundaries: `precond` loads no framework, `precond.jax` never loads torch,
`precond.torch` does not load torch's compiler (dynamo: ~1 s of imports);
importing `precond.jax` changes nothing in the process's environment and warns
about nothing, whether JAX started before it or not."""

import os
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
        ("import precond.torch", {"jax", "torch._dynamo"}),
    ],
)
def test_import_boundaries(statement, forbidden):
    loaded = _modules_loaded_by(statement)
    assert not forbidden & loaded, f"{statement} loaded {sorted(forbidden & loaded)}"
    assert statement.split()[-1] in loaded


def test_version_is_exposed():
    import precond

    assert precond.__version__.count(".") >= 2


def _run_clean(script: str) -> subprocess.CompletedProcess:
    """``script`` in a new Python whose environment has no XLA_FLAGS."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=120,
    )


SIDE_EFFECT_SCRIPT = """
import os, warnings
environment = dict(os.environ)
{before}
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import precond.jax as pj
    pj.kron(); pj.xmat(); pj.distributed_shampoo(0.1, block_size=128)
print(dict(os.environ) == environment)
print(len(caught))
"""


@pytest.mark.parametrize(
    "before",
    [
        "",
        "import jax",
        # JAX's backend already started: precond has nothing to ask of it.
        "import jax; jax.numpy.ones(1)",
    ],
)
def test_importing_precond_jax_has_no_side_effects(before):
    lines = _run_clean(SIDE_EFFECT_SCRIPT.format(before=before)).stdout.splitlines()
    assert lines == ["True", "0"], lines
