"""Kron's random draws, all derived from (seed, step, unit): no state, no
communication, and the same draws on any mesh and after a restore.
"""

from __future__ import annotations

from typing import Any

import jax

from precond._common.kron_constants import BALANCE_PROBABILITY
from precond.jax._core import normal_draws

__all__ = ["BALANCE_PROBABILITY", "fit_randomness", "unit_noise"]


def fit_randomness(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The random draws of one factor update: whether to balance, and the noise key.

    ``key`` is ``fold_in(PRNGKey(seed), n)`` at step n. The noise V of each unit is
    drawn by :func:`unit_noise` from the noise key.
    """
    balance_key, noise_key = jax.random.split(key)
    return jax.random.uniform(balance_key) < BALANCE_PROBABILITY, noise_key


def unit_noise(
    noise_key: jax.Array,
    parameter: jax.Array | int,
    unit: jax.Array | int,
    block_shape: tuple[int, ...],
    dtype: Any,
) -> jax.Array:
    """V ~ N(0, I) of one unit: unit ``unit`` (layer-major, then blocks in row-major
    order) of the parameter with leaf index ``parameter``.

    Keyed by the unit's identity, not its place in a stack, so that the draw is the
    same on any number of devices, and every device draws only its own units.
    """
    key = jax.random.fold_in(jax.random.fold_in(noise_key, parameter), unit)
    return normal_draws.standard_normal(key, block_shape, dtype)
