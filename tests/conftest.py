"""Test configuration: 8 simulated CPU devices, set before JAX is imported."""

import os

from precond._common.xla_workarounds import avoid_xla_cpu_deadlock, simulate_cpu_devices

avoid_xla_cpu_deadlock()
simulate_cpu_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402 - after XLA_FLAGS is set

assert jax.device_count() == 8, (
    f"expected 8 simulated CPU devices, got {jax.device_count()}: "
    "was jax imported before tests/conftest.py set XLA_FLAGS?"
)
