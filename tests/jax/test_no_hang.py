"""No hang, whatever the flags and the import order: plain training scripts
(tests/jax/plain_script.py) in new processes whose environment sets neither
XLA_FLAGS nor PJRT_NPROC, JAX started before precond.jax is imported, every JAX
optimizer on the bench's char-lm transformer, and Kron and pro sharded over 8
simulated devices that the script asks for itself.

XLA:CPU (jaxlib 0.10) hung such scripts within their first steps when two
batched LAPACK calls blocked every thread of its pool
(precond.jax._core.pool_safe_linalg). A hang is nondeterministic, so each script
runs three times; the runs after the first reuse its compiled programs (a
persistent compilation cache), so that the repeats cost little but running.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("plain_script.py")
REPO_ROOT = SCRIPT.parents[2]
RUNS = 3
STEPS = 24
# Seconds per run: the first compiles (tens of seconds on a busy 2-core
# machine); a hung run never ends.
TIMEOUT = 300

GROUPS = {
    "kron-pro": ["kron", "pro"],
    "xmat-lra-affine": ["xmat", "lra", "affine"],
    "shampoo-soap": ["shampoo", "shampoo-eigh", "soap"],
}


def _plain_environment(cache: pathlib.Path) -> dict[str, str]:
    """The suite's environment less what tests/conftest.py sets for JAX (flags,
    pool size, optimizations off), plus a compilation cache."""
    removed = ("XLA_FLAGS", "PJRT_NPROC", "JAX_DISABLE_MOST_OPTIMIZATIONS")
    env = {k: v for k, v in os.environ.items() if k not in removed}
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def _run_repeatedly(
    names: list[str], cache: pathlib.Path, options: tuple[str, ...] = ()
) -> None:
    """The script with optimizers ``names`` (and ``options``), RUNS times."""
    arguments = [*names, *options, "--steps", str(STEPS)]
    command = [sys.executable, str(SCRIPT), *arguments]
    for run in range(RUNS):
        try:
            result = subprocess.run(
                command,
                cwd=REPO_ROOT,
                env=_plain_environment(cache),
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
            )
        except subprocess.TimeoutExpired as hung:
            pytest.fail(
                f"run {run + 1} of {' '.join(arguments)} did not finish in "
                f"{TIMEOUT} s (a hang); it printed: {hung.stdout!r}"
            )
        assert result.returncode == 0, result.stderr[-3000:]
        assert [line.split(":")[0] for line in result.stdout.splitlines()] == names


@pytest.mark.parametrize("group", list(GROUPS))
def test_plain_scripts_never_hang(group, tmp_path):
    _run_repeatedly(GROUPS[group], tmp_path)


def test_sharded_plain_scripts_never_hang(tmp_path):
    """Width 128: the default width's factors did not hang there before. SOAP
    is not in this run: sharded, its first run compiles for over 3 minutes on
    the 2-core machine (its refreshes are shard_maps of per-device loops); it is
    sharded in tests/jax/soap, in the suite's environment."""
    _run_repeatedly(["kron", "pro"], tmp_path, ("--devices", "8", "--d-model", "128"))
