"""Standard normal draws of ``jax.random.normal``'s bits, faster on CPU.

On CPU, JAX lowers the Threefry-2x32 hash under its draws as a rolled loop (an XLA
while loop of 5 iterations, each copying its state), which costs more than the
arithmetic. PSGD's fits draw a normal matrix the size of every parameter, so the
loop is a large part of a fit.
:func:`standard_normal` hashes the same counters with the same key, the hash
written out in full (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC 2011: 20 rounds of add, rotate and xor, the key injected every 4), which XLA
fuses into one elementwise kernel.

It takes JAX's bits for the draws JAX makes in its default configuration: a
Threefry key (``jax.random.PRNGKey`` or ``jax.random.key``),
``jax_threefry_partitionable`` on (the default since JAX 0.5), float32, fewer
than 2³² entries. Entry i (row-major) hashes the counter pair (0, i); its 32 bits
are the xor of the two output words; u = max(lo, 2·(1.bits − 1) + lo), with lo
the float32 just above −1, and the draw is √2·erfinv(u). In every other case it
calls ``jax.random.normal``. Callers reach it as
``normal_draws.standard_normal``, so that a test or a benchmark swaps the draws
of Kron's and pro's fits in this one place.

The uniforms are JAX's bit for bit, and so are the normals of a draw compiled on
its own (``tests/jax/core/test_normal_draws.py``, on every JAX that CI runs). Inside a
larger program XLA:CPU may compile erfinv differently depending on the code
fused around it, and then rounds a few draws one unit in the last place apart
from ``jax.random.normal``'s in the same program (seen in the fits of Kron and
pro): trajectories move by float32 rounding, not by different randomness.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Threefry-2x32's rotation distances, alternating every 4 rounds, and the
# constant of its key schedule (the Skein parity constant).
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KEY_PARITY = np.uint32(0x1BD11BDA)
_FLOAT32_MANTISSA_BITS = 23
_FLOAT32_ONE_BITS = np.uint32(0x3F800000)
_ONE = np.float32(1.0)
_LOWEST = np.nextafter(np.float32(-1.0), np.float32(0.0))  # the draws' floor
_SQRT2 = np.float32(np.sqrt(2))


def _rotate_left(x: jax.Array, distance: int) -> jax.Array:
    return (x << np.uint32(distance)) | (x >> np.uint32(32 - distance))


def threefry2x32(key: jax.Array, x0: jax.Array, x1: jax.Array) -> tuple:
    """Threefry-2x32 (20 rounds) of the counter words (x0, x1) under ``key``, a
    uint32[2]: five groups of four rounds x0 += x1, x1 = rotl(x1, r) ^ x0, the
    key schedule (k0, k1, k0 ^ k1 ^ parity) injected before the first group and
    after each (with the group's index added to the second word)."""
    schedule = (key[0], key[1], key[0] ^ key[1] ^ _KEY_PARITY)
    x0, x1 = x0 + schedule[0], x1 + schedule[1]
    for group in range(5):
        for distance in _ROTATIONS[group % 2]:
            x0 = x0 + x1
            x1 = _rotate_left(x1, distance) ^ x0
        x0 = x0 + schedule[(group + 1) % 3]
        x1 = x1 + schedule[(group + 2) % 3] + np.uint32(group + 1)
    return x0, x1


def _row_major_index(shape: tuple[int, ...]) -> jax.Array:
    """uint32 array of ``shape`` holding each entry's row-major index, as a sum of
    per-axis iotas (which XLA's SPMD partitioner splits without gathering)."""
    index = jnp.zeros(shape, jnp.uint32)
    for axis in range(len(shape)):
        stride = np.uint32(math.prod(shape[axis + 1 :]))
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * stride
    return index


def _config(name: str) -> Any:
    """A JAX configuration value (read by name: the typed ``jax.config`` does not
    list every flag)."""
    return getattr(jax.config, name)


def _is_default_threefry(key: jax.Array) -> bool:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(key)) == "threefry2x32" and key.shape == ()
    return (
        key.dtype == jnp.uint32
        and key.shape == (2,)
        and _config("jax_default_prng_impl") == "threefry2x32"
    )


def standard_normal(key: jax.Array, shape: Sequence[int], dtype: Any) -> jax.Array:
    """``jax.random.normal(key, shape, dtype)``: the same bits, hashed unrolled
    where the module's case holds (its values: see the module docstring)."""
    shape = tuple(int(d) for d in shape)
    size = math.prod(shape)
    if (
        jnp.dtype(dtype) != jnp.float32
        or not _config("jax_threefry_partitionable")
        or not _is_default_threefry(key)
        or size >= 2**32
    ):
        return jax.random.normal(key, shape, dtype)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    counter = _row_major_index(shape)
    word0, word1 = threefry2x32(key, jnp.zeros_like(counter), counter)
    mantissa = (word0 ^ word1) >> np.uint32(32 - _FLOAT32_MANTISSA_BITS)
    one_to_two = jax.lax.bitcast_convert_type(mantissa | _FLOAT32_ONE_BITS, jnp.float32)
    # NumPy scalars: literals in the compiled program, as JAX's own constants are.
    uniform = (one_to_two - _ONE) * (_ONE - _LOWEST) + _LOWEST
    uniform = jax.lax.max(_LOWEST, uniform)
    return _SQRT2 * jax.lax.erf_inv(uniform)
