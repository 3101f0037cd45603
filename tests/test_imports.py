"""Import boundaries: `precond` loads no framework, `precond.jax` never loads torch,
`precond.torch` does not load torch's compiler (dynamo: ~1 s of imports);
importing `precond.jax` sets XLA:CPU's deadlock workaround, or warns once that it
could not."""

import os
import subprocess
import sys

import pytest

from precond._common.xla_workarounds import XLA_CPU_DEADLOCK_FLAG


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


DEADLOCK_SCRIPT = """
import os, warnings
{before}
import precond.jax as pj
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    pj.kron(); pj.xmat(); pj.kron()
print(repr(os.environ.get("XLA_FLAGS", "")))
print(sum("deadlock" in str(w.message) for w in caught))
"""


@pytest.mark.parametrize(
    ("before", "flag_set", "warnings"),
    [
        # precond.jax first (also after `import jax`: XLA reads its flags when
        # the backend starts): the flag is added, nothing to warn about.
        ("", True, 0),
        ("import jax", True, 0),
        # The backend already started without the flag: one warning.
        ("import jax; jax.numpy.ones(1)", False, 1),
        # A user's explicit choice is kept, and not warned about.
        (
            "os.environ['XLA_FLAGS'] = "
            "'--xla_cpu_enable_concurrency_optimized_scheduler=true'",
            False,
            0,
        ),
    ],
)
def test_importing_precond_jax_avoids_the_xla_cpu_deadlock(before, flag_set, warnings):
    lines = _run_clean(DEADLOCK_SCRIPT.format(before=before)).stdout.splitlines()
    assert (XLA_CPU_DEADLOCK_FLAG in lines[0]) == flag_set, lines
    assert int(lines[1]) == warnings, lines
