"""Matmul precision names shared by precond's JAX optimizers."""

from __future__ import annotations

import contextlib

import jax

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
