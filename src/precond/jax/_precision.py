"""Matmul precisions and state dtypes: the names and checks shared by precond's
JAX optimizers."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

# Precision names accepted by jax.default_matmul_precision (None: JAX's default).
MATMUL_PRECISIONS = (
    None,
    "default",
    "high",
    "highest",
    "bfloat16",
    "tensorfloat32",
    "float32",
)


def matmul_precision(precision: str | None):
    """A context in which matmuls run at ``precision`` (no-op for None)."""
    if precision is None:
        return contextlib.nullcontext()
    return jax.default_matmul_precision(precision)


def check_floating_dtype(name: str, dtype) -> None:
    """Checks an optional state dtype (``mu_dtype``, ``precond_dtype``) is a real
    floating dtype: an integer momentum would round every update to zero."""
    if dtype is None:
        return
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or not jnp.issubdtype(resolved, jnp.floating):
        raise ValueError(
            f"Invalid {name}={dtype!r}: must be a floating dtype (e.g. jnp.float32, "
            "jnp.bfloat16) or None"
        )
