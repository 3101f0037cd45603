"""Simulated CPU devices, for tests, examples and ``precond bench --devices``.

XLA:CPU presents one device per process unless told otherwise; these helpers
set the count before its backend starts. Nothing here is needed to run precond:
its programs make no call that waits on XLA's thread pool
(:mod:`precond.jax._core.pool_safe_linalg`), so they run whatever ``XLA_FLAGS`` and
``PJRT_NPROC`` say.
"""

from __future__ import annotations

import os
import sys

DEVICE_COUNT_FLAG = "xla_force_host_platform_device_count"


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


def simulate_cpu_devices(count: int) -> None:
    """Makes XLA:CPU present ``count`` devices.

    Call it before JAX's CPU backend starts (before ``jax`` is imported, or at
    least before the first array is made). Sets the
    ``--xla_force_host_platform_device_count`` flag in
    ``XLA_FLAGS`` (or ``jax_num_cpu_devices`` once jax is imported) unless
    ``XLA_FLAGS`` already sets a count, which is kept.

    Args:
      count: how many CPU devices JAX should see.
    """
    if DEVICE_COUNT_FLAG in os.environ.get("XLA_FLAGS", ""):
        return
    if _xla_backend_started():
        import jax

        jax.config.update("jax_num_cpu_devices", count)
    else:
        flags = os.environ.get("XLA_FLAGS", "")
        flag = f"--{DEVICE_COUNT_FLAG}={count}"
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
