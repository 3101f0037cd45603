"""precond's normal draws (:mod:`precond.jax._core.normal_draws`) against their oracle,
``jax.random.normal``: the same bits for every key, shape and context the
optimizers draw in (eager, jit, vmap over keys, sharded outputs, compiled with
XLA's optimizations on), and ``jax.random.normal`` itself in every other case."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from precond.jax._core.normal_draws import standard_normal, threefry2x32

SHAPES = [(), (1,), (7,), (3, 5), (64, 256), (2, 3, 4), (1, 1000)]
KEYS = {
    "PRNGKey": lambda: jax.random.PRNGKey(3),
    "folded": lambda: jax.random.fold_in(
        jax.random.fold_in(jax.random.PRNGKey(42), 9), 2
    ),
    "split": lambda: jax.random.split(jax.random.PRNGKey(7), 5)[4],
    "typed key": lambda: jax.random.key(11),
    "large seed": lambda: jax.random.PRNGKey(2**31 - 1),
}


def assert_same_bits(actual, expected):
    actual, expected = np.atleast_1d(actual), np.atleast_1d(expected)
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(actual.view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("key_name", KEYS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_equals_jax_random_normal_bit_for_bit(key_name, shape):
    key = KEYS[key_name]()
    expected = jax.random.normal(key, shape, jnp.float32)
    assert_same_bits(standard_normal(key, shape, jnp.float32), expected)
    jitted = jax.jit(lambda k: standard_normal(k, shape, jnp.float32))
    assert_same_bits(jitted(key), expected)


def test_equal_under_vmap_over_keys_as_the_fits_draw():
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    draw = jax.jit(jax.vmap(lambda k: standard_normal(k, (32, 48), jnp.float32)))
    expected = jnp.stack([jax.random.normal(k, (32, 48)) for k in keys])
    assert_same_bits(draw(keys), expected)


def test_equal_with_xla_optimizations_on():
    """The suite compiles with most optimizations off (tests/conftest.py); fused
    and optimized, alone and into a consumer, the draws must round the same."""
    key, shape = jax.random.PRNGKey(5), (128, 96)

    def optimized(draw, epilogue):
        return (
            jax.jit(lambda k: epilogue(draw(k, shape, jnp.float32)))
            .lower(key)
            .compile(compiler_options={"xla_backend_optimization_level": 3})
        )

    for epilogue in (lambda v: v, lambda v: v * 1.5 + 0.25):
        expected = optimized(jax.random.normal, epilogue)(key)
        assert_same_bits(optimized(standard_normal, epilogue)(key), expected)


def test_equal_when_sharded_over_a_mesh():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("x", None))
    key, shape = jax.random.PRNGKey(1), (64, 40)
    draw = jax.jit(
        lambda k: standard_normal(k, shape, jnp.float32), out_shardings=sharding
    )
    out = draw(key)
    assert out.sharding == sharding
    assert_same_bits(out, jax.random.normal(key, shape))


def test_threefry_known_answer():
    """Threefry-2x32 with 20 rounds on the reference implementation's test
    vectors (Random123's kat_vectors, also JAX's test): key (0, 0) counter
    (0, 0), key (-1, -1) counter (-1, -1), and digits of π."""
    zero = jnp.zeros((), jnp.uint32)
    out = threefry2x32(jnp.array([0, 0], jnp.uint32), zero, zero)
    assert [int(x) for x in out] == [0x6B200159, 0x99BA4EFE]
    ones = jnp.full((), 0xFFFFFFFF, jnp.uint32)
    out = threefry2x32(jnp.array([0xFFFFFFFF] * 2, jnp.uint32), ones, ones)
    assert [int(x) for x in out] == [0x1CB996FC, 0xBB002BE7]
    key = jnp.array([0x13198A2E, 0x03707344], jnp.uint32)
    counter = jnp.array([0x243F6A88, 0x85A308D3], jnp.uint32)
    out = threefry2x32(key, counter[0], counter[1])
    assert [int(x) for x in out] == [0xC4923A9C, 0x483DF7A0]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_other_dtypes_are_jax_random_normal(dtype):
    key = jax.random.PRNGKey(2)
    assert_same_bits(
        standard_normal(key, (5, 7), dtype), jax.random.normal(key, (5, 7), dtype)
    )


def test_float64_is_jax_random_normal():
    with jax.enable_x64(True):
        key = jax.random.PRNGKey(2)
        assert_same_bits(
            standard_normal(key, (5, 7), jnp.float64),
            jax.random.normal(key, (5, 7), jnp.float64),
        )


def test_other_key_implementations_are_jax_random_normal():
    key = jax.random.key(4, impl="rbg")
    assert_same_bits(
        standard_normal(key, (6, 3), jnp.float32), jax.random.normal(key, (6, 3))
    )


def test_unpartitionable_threefry_is_jax_random_normal():
    key = jax.random.PRNGKey(8)
    with jax.threefry_partitionable(False):
        expected = jax.random.normal(key, (9, 4))
        actual = standard_normal(key, (9, 4), jnp.float32)
    assert_same_bits(actual, expected)
