"""Test configuration: 8 simulated CPU devices, set before JAX is imported."""

import os

from precond._common.cpu_devices import simulate_cpu_devices

simulate_cpu_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiling is much of the suite's time, and XLA compiles about a third faster
# with its optimizations off (the whole suite: 9% less time). The properties
# tested (float64 references, identities, sharded == unsharded, resume ==
# uninterrupted) do not depend on them. Set in the environment, so the
# processes the tests start inherit it. Tests marked `optimized_xla` (those that
# run thousands of steps, and bitwise comparisons of two programs) turn them
# back on (_optimized_xla).
# JAX_DISABLE_MOST_OPTIMIZATIONS=0 runs the suite fully optimized; `.ci/run`'s
# bench runs compile every optimizer as a user's program does.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# XLA:CPU's older elemental emitter compiles the suite's small programs about
# twice as fast as its fusion emitters (Kron's update of three small leaves:
# 0.8 s vs 1.7 s); the whole suite took 350 s instead of 608 s (2 cores, quiet).
# Set XLA_FLAGS=--xla_cpu_use_fusion_emitters=true to test with them.
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_use_fusion_emitters=false".strip()

# One intra-op thread per torch process: pytest-xdist already runs one worker per
# core, and torch's own threads on top of it made small kernels (a triu on a tiny
# matrix) take milliseconds instead of microseconds (the torch convention and
# parity tests: 9.5 s with torch's default, 7.2 s with one thread, 2 workers).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402 - after XLA_FLAGS is set
import pytest  # noqa: E402

assert jax.device_count() == 8, (
    f"expected 8 simulated CPU devices, got {jax.device_count()}: "
    "was jax imported before tests/conftest.py set XLA_FLAGS?"
)

# Files whose tests start processes or train for many steps (10-60 s each). Run
# first: started last, one of them keeps an xdist worker busy while the other
# has nothing left (measured on 2 cores: 617 s before, 608 s after).
LONGEST_FIRST = (
    "test_parity_shampoo.py",
    "test_examples.py",
    "test_bench.py",
    "test_kron_multiprocess.py",
    "test_readme.py",
    "test_torchrun_examples.py",
    "test_kfac_distributed.py",
    "test_kron_distributed.py",
    "test_kron_fsdp.py",
    "test_kfac_fsdp.py",
)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)


@pytest.fixture(autouse=True)
def _optimized_xla(request):
    """Tests marked ``optimized_xla`` compile with JAX_DISABLE_MOST_OPTIMIZATIONS
    off, as users' programs do: Shampoo's 2000-step convergence test runs in 6 s
    instead of 14 s, and two programs compared bit for bit compute each value
    once (tests/jax/shampoo/test_scale_by_shampoo.py says why that matters). The flag
    is read when a program is compiled, so it is set for the test and restored
    after it."""
    if request.node.get_closest_marker("optimized_xla") is None:
        yield
        return
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


# --- where the suite's time goes -------------------------------------------------

# Seconds per test file (setup, call and teardown of its tests, on every worker),
# summed as the reports arrive, and printed at the end of the run: the README's
# test command has a time budget (issue 64: 600 s of pytest on 2 cores), and this
# says which files spend it.
_SECONDS_PER_FILE: dict[str, float] = {}
FILES_SHOWN = 15


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _SECONDS_PER_FILE[path] = _SECONDS_PER_FILE.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _SECONDS_PER_FILE:
        return
    total = sum(_SECONDS_PER_FILE.values())
    slowest = sorted(_SECONDS_PER_FILE.items(), key=lambda item: -item[1])
    terminalreporter.section(
        f"test seconds per file (all workers: {total:.0f} s in all)"
    )
    for path, seconds in slowest[:FILES_SHOWN]:
        terminalreporter.write_line(
            f"{seconds:8.1f} s {100 * seconds / total:5.1f}%  {path}"
        )
