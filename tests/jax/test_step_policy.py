"""The JAX step policy (precond.jax._step_policy): keys derived from (seed, step),
saturating step counts, and unusable gradients (NaN, ±Inf, or so large their
squares overflow) skipped without touching the state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precond.jax import _step_policy as policy


def _key_data(key):
    return np.asarray(jax.random.key_data(key))


def test_step_keys_differ_per_step_and_agree_across_calls():
    keys = [_key_data(policy.step_key(7, n)) for n in range(1, 6)]
    assert len({k.tobytes() for k in keys}) == len(keys)
    again = [_key_data(policy.step_key(7, jnp.int32(n))) for n in range(1, 6)]
    np.testing.assert_array_equal(keys, again)
    assert _key_data(policy.step_key(8, 1)).tobytes() != keys[0].tobytes()


def test_step_key_is_fold_in_of_the_seed_key():
    seed_key = jax.random.PRNGKey(7)
    expected = jax.random.fold_in(seed_key, 3)
    np.testing.assert_array_equal(_key_data(policy.step_key(7, 3)), expected)
    np.testing.assert_array_equal(_key_data(policy.step_key(seed_key, 3)), expected)


def test_step_key_under_jit_equals_eager():
    traced = jax.jit(lambda n: policy.step_key(7, n))(jnp.int32(4))
    np.testing.assert_array_equal(_key_data(traced), _key_data(policy.step_key(7, 4)))


def test_next_count_counts_usable_steps_and_saturates():
    assert int(policy.next_count(jnp.int32(4))) == 5
    assert int(policy.next_count(jnp.int32(4), jnp.asarray(False))) == 4
    top = jnp.iinfo(jnp.int32).max
    assert int(policy.next_count(jnp.int32(top))) == top
    assert policy.next_count(jnp.int32(0)).dtype == jnp.int32


@pytest.mark.parametrize(
    "bad", [np.nan, np.inf, -np.inf, 1e20], ids=["nan", "inf", "-inf", "huge"]
)
def test_unusable_gradients(bad):
    grads = {"a": jnp.ones((3, 2)), "b": jnp.ones(4).at[1].set(bad)}
    assert not bool(policy.step_is_usable(grads))
    assert not bool(policy.step_is_usable({"a": jnp.ones(2)}, grads))


def test_usable_gradients():
    grads = {"a": jnp.full((3,), 1e18), "b": jnp.zeros(()), "c": jnp.ones(2) * 1j}
    assert bool(policy.step_is_usable(grads))
    assert bool(policy.step_is_usable({}))
    # float64 leaves are checked in float64: 1e20 squared is finite there.
    with jax.enable_x64(True):
        assert bool(policy.step_is_usable(jnp.asarray([1e20], jnp.float64)))


def test_skipped_step_returns_zeros_and_the_old_state():
    updates = {"a": jnp.ones(2, jnp.float32)}
    like = {"a": jnp.ones(2, jnp.bfloat16)}
    skipped = policy.zeros_unless_usable(jnp.asarray(False), updates, like)
    assert skipped["a"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(skipped["a"], 0)
    kept = policy.zeros_unless_usable(jnp.asarray(True), updates, like)
    np.testing.assert_array_equal(kept["a"], 1)
    old, new = (jnp.int32(1), jnp.zeros(3)), (jnp.int32(2), jnp.ones(3))
    for usable, want in ((False, old), (True, new)):
        got = policy.state_unless_skipped(jnp.asarray(usable), new, old)
        jax.tree.map(np.testing.assert_array_equal, got, want)


def test_overflowed_fit_keeps_the_old_factors():
    old = (jnp.eye(2, dtype=jnp.bfloat16), jnp.ones(3, jnp.float32))
    overflowed = (jnp.full((2, 2), jnp.inf), jnp.ones(3, jnp.float32))
    got = policy.keep_if_overflowed(overflowed, old)
    jax.tree.map(np.testing.assert_array_equal, got, old)
    assert [x.dtype for x in got] == [jnp.bfloat16, jnp.float32]
    fitted = (2 * jnp.eye(2), 3 * jnp.ones(3, jnp.float32))
    got = policy.keep_if_overflowed(fitted, old)
    np.testing.assert_array_equal(got[0], 2 * np.eye(2))
    assert got[0].dtype == jnp.bfloat16
