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


def _resolved_dtype(dtype) -> np.dtype | None:
    try:
        return np.dtype(dtype)
    except TypeError:
        return None


def check_floating_dtype(name: str, dtype) -> None:
    """Checks an optional state dtype (``precond_dtype``) is a real floating
    dtype: an integer factor would round every update to zero."""
    if dtype is None:
        return
    resolved = _resolved_dtype(dtype)
    if resolved is None or not jnp.issubdtype(resolved, jnp.floating):
        raise ValueError(
            f"Invalid {name}={dtype!r}: must be a floating dtype (e.g. jnp.float32, "
            "jnp.bfloat16) or None"
        )


def check_momentum_dtype(name: str, dtype) -> None:
    """Checks an optional momentum dtype (``mu_dtype``) is a floating or complex
    dtype, as optax's ``mu_dtype`` may be: an integer or bool momentum would
    round every update to zero. (A real parameter's complex momentum keeps a
    zero imaginary part; a complex parameter's momentum is complex, in the
    precision of ``mu_dtype``.)"""
    if dtype is None:
        return
    resolved = _resolved_dtype(dtype)
    if resolved is None or not jnp.issubdtype(resolved, jnp.inexact):
        raise ValueError(
            f"Invalid {name}={dtype!r}: must be a floating dtype (e.g. jnp.float32, "
            "jnp.bfloat16), a complex one (e.g. jnp.complex64) or None"
        )
