"""Workarounds for known XLA problems, applied by precond's own entry points.

Library modules never call these at import (no side effects); the ``precond bench``
command, the test suite and the benchmark scripts do, before JAX is imported.
"""

from __future__ import annotations

import logging
import os
import sys

# XLA:CPU (seen with jaxlib 0.10.2 on a 2-core machine) can deadlock, all threads
# idle, while running a large program with several independent vmapped
# triangular-solve/matmul chains (Kron's factor update of a 4-layer transformer).
# Turning off its concurrency-optimized scheduler avoids it at no measured cost.
XLA_CPU_DEADLOCK_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"

logger = logging.getLogger(__name__)


def avoid_xla_cpu_deadlock() -> None:
    """Adds :data:`XLA_CPU_DEADLOCK_FLAG` to ``XLA_FLAGS`` unless it is set already.

    Must run before ``jax`` is imported; afterwards it only logs a warning.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_enable_concurrency_optimized_scheduler" in flags:
        return
    if "jax" in sys.modules:
        logger.warning(
            "jax is already imported; set XLA_FLAGS=%s before importing it to avoid "
            "an XLA:CPU deadlock",
            XLA_CPU_DEADLOCK_FLAG,
        )
        return
    os.environ["XLA_FLAGS"] = f"{flags} {XLA_CPU_DEADLOCK_FLAG}".strip()


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
    if "jax" in sys.modules:
        import jax

        jax.config.update("jax_num_cpu_devices", count)
    else:
        flags = os.environ.get("XLA_FLAGS", "")
        flag = f"--xla_force_host_platform_device_count={count}"
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
