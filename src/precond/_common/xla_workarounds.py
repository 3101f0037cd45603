"""Workarounds for known XLA problems.

``precond.jax`` applies :func:`avoid_xla_cpu_deadlock` when it is imported (the
one side effect of importing it: a flag added to ``XLA_FLAGS``, which XLA reads
when its first backend starts); ``precond bench``, the test suite and the
benchmark scripts also call it, before JAX is imported.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import warnings

# XLA:CPU (seen with jaxlib 0.10.2 on a 2-core machine) can deadlock, all threads
# idle, while running a large program with several independent vmapped
# triangular-solve/matmul chains (Kron's factor update of a 4-layer transformer).
# Turning off its concurrency-optimized scheduler avoids it at no measured cost.
XLA_CPU_DEADLOCK_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
_DEADLOCK_FLAG_NAME = "xla_cpu_enable_concurrency_optimized_scheduler"

logger = logging.getLogger(__name__)


def _xla_backend_started() -> bool:
    """True once JAX has started a backend (XLA_FLAGS are read then, not at
    ``import jax``)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - a JAX without this module
        return True
    return xla_bridge.backends_are_initialized()


def avoid_xla_cpu_deadlock() -> None:
    """Adds :data:`XLA_CPU_DEADLOCK_FLAG` to ``XLA_FLAGS`` unless that flag is set
    already (either way: a user's explicit choice is kept).

    Must run before JAX starts its backend (before the first array is made);
    afterwards it only logs a warning.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEADLOCK_FLAG_NAME in flags:
        return
    if _xla_backend_started():
        logger.warning(
            "JAX's backend has already started; set XLA_FLAGS=%s before it does to "
            "avoid an XLA:CPU deadlock",
            XLA_CPU_DEADLOCK_FLAG,
        )
        return
    os.environ["XLA_FLAGS"] = f"{flags} {XLA_CPU_DEADLOCK_FLAG}".strip()


def warn_if_xla_cpu_deadlock_possible() -> None:
    """Warns (once per process) when JAX runs on CPU without the deadlock flag:
    its backend started before ``precond.jax`` was imported, with ``XLA_FLAGS``
    not setting it. Starts nothing: a backend not yet started is left alone."""
    if _DEADLOCK_FLAG_NAME in os.environ.get("XLA_FLAGS", ""):
        return
    if not _xla_backend_started():
        return
    import jax

    if jax.default_backend() == "cpu":
        _warn_deadlock_once()


@functools.cache
def _warn_deadlock_once() -> None:
    warnings.warn(
        "JAX started on CPU before precond.jax was imported, without "
        f"XLA_FLAGS={XLA_CPU_DEADLOCK_FLAG}: XLA:CPU (jaxlib 0.10) can deadlock "
        "while running Kron's factor update. Import precond.jax before anything "
        "starts JAX, or set that flag in XLA_FLAGS (README, Known issues).",
        RuntimeWarning,
        stacklevel=4,
    )


def simulate_cpu_devices(count: int) -> None:
    """Makes XLA:CPU present ``count`` devices, and avoids the hangs that can bring.

    Call it before JAX's CPU backend starts (before ``jax`` is imported, or at least
    before the first array is made). Sets the device count (the
    ``--xla_force_host_platform_device_count`` flag, or ``jax_num_cpu_devices``
    once jax is imported) unless ``XLA_FLAGS`` already sets one, and, unless set,
    ``PJRT_NPROC`` = 2·count + 1, the size of XLA:CPU's thread pool.

    The simulated devices share that pool, which defaults to max(cores, devices)
    threads, and in jaxlib 0.10 a device can hold a pool thread while it waits: in
    a collective until every device arrives ("Expected 8 threads to join the
    rendezvous, but only 4 of them arrived"), or in a batched triangular solve
    until its pieces have run on the same pool. When every thread waits, the step
    hangs. 2·count + 1 threads leave one free with two waits per device (a larger
    pool only costs time on a small machine).
    """
    os.environ.setdefault("PJRT_NPROC", str(2 * count + 1))
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    if _xla_backend_started():
        import jax

        jax.config.update("jax_num_cpu_devices", count)
    else:
        flags = os.environ.get("XLA_FLAGS", "")
        flag = f"--xla_force_host_platform_device_count={count}"
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
