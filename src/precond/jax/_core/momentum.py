"""Momentum with bias correction, shared by every JAX optimizer that keeps one:
m ← β₁m + (1−β₁)g and m̂ = m / (1 − β₁ⁿ), each optimizer choosing the dtypes
its steps are computed in.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def moving_average(m: jax.Array, g: jax.Array, b1: Any) -> jax.Array:
    """(1−β₁)g + β₁m, in the dtype the arrays (and ``b1``) promote to.

    The terms are added in optax's order (``optax.tree_utils.tree_update_moment``'s):
    XLA fuses this sum into the code around it, and the other order moves the
    PSGD family's recorded trajectories by an ulp.

    Args:
        m: the momentum.
        g: the gradient (or any new value), shaped as ``m``.
        b1: the decay β₁, a float or a scalar array.

    Returns:
        The new momentum, uncast.
    """
    return (1 - b1) * g + b1 * m


def bias_correction(b1: Any, count: jax.Array, dtype: Any = None) -> jax.Array:
    """1 − β₁ⁿ, the denominator of the bias-corrected momentum m̂ = m / (1 − β₁ⁿ).

    Args:
        b1: the decay β₁, a float or a scalar array.
        count: n, the 1-based step count (an int32 array).
        dtype: the dtype β₁ⁿ is computed in; None: as ``b1`` and ``count``
            promote (a Python float gives JAX's default float dtype).

    Returns:
        A scalar array.
    """
    base = b1 if dtype is None else jnp.asarray(b1, dtype)
    return 1 - base**count
