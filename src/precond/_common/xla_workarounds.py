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
    """Makes XLA:CPU present ``count`` devices, and avoids a deadlock that brings.

    Sets ``--xla_force_host_platform_device_count`` (unless ``XLA_FLAGS`` sets it)
    and, unless set, ``NPROC``, which sizes XLA:CPU's thread pool. The simulated
    devices share that pool, and a collective (all-gather, ...) blocks a pool thread
    per device until every device arrives; with fewer threads than devices (the
    pool defaults to one per core) the late devices never get a thread and the
    program hangs ("Expected 8 threads to join the rendezvous, but only 4 of them
    arrived"). ``NPROC`` = 2·count leaves threads for the work. Must run before
    ``jax`` is imported.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags = f"{flags} --xla_force_host_platform_device_count={count}".strip()
        os.environ["XLA_FLAGS"] = flags
    os.environ.setdefault("NPROC", str(max(2 * count, os.cpu_count() or 1)))
