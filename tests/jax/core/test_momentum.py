"""The one momentum with bias correction of precond's JAX optimizers
(precond.jax._core.momentum), used by Kron, pro and the PSGD family."""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import numpy as np

from precond.jax._core.momentum import bias_correction, moving_average
from precond.jax.kron import _pro_step, _step
from precond.jax.psgd import _transform


def test_moving_average_is_b1_m_plus_one_minus_b1_g():
    m, g = jnp.asarray([1.0, -2.0, 4.0]), jnp.asarray([3.0, 0.5, -1.0])
    got = moving_average(m, g, 0.9)
    np.testing.assert_allclose(got, 0.9 * np.asarray(m) + 0.1 * np.asarray(g), 1e-6)
    assert got.dtype == jnp.float32


def test_bias_correction_is_one_minus_b1_to_the_step():
    count = jnp.asarray(3, jnp.int32)
    got = bias_correction(0.9, count, jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(float(got), 1 - 0.9**3, rtol=1e-6)
    # Without a dtype, as b1 and the count promote: JAX's default float.
    assert bias_correction(0.9, count).dtype == jnp.asarray(0.9).dtype


def test_every_momentum_of_the_optimizers_is_this_one():
    for module in (_step, _pro_step, _transform):
        source = inspect.getsource(module)
        assert "moving_average(" in source
        assert "bias_correction(" in source
        assert "tree_update_moment" not in source
