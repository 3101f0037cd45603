"""The JAX step policy (precond.jax._core.step_policy): keys derived from (seed, step),
saturating step counts, and unusable gradients (NaN, ±Inf, or so large their
squares overflow) skipped without touching the state but its count of skipped
steps."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import precond.jax as pj
from precond._common.pro_layout import BALANCE_EVERY
from precond.jax._core import step_policy as policy
from tests.jax.helpers import without_skip_counts


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
    # A field whose update already kept its old value is taken as it is.
    pair = collections.namedtuple("pair", "small large")
    old, new = pair(jnp.int32(1), jnp.zeros(3)), pair(jnp.int32(2), jnp.ones(3))
    got = policy.fields_unless_skipped(
        jnp.asarray(False), new, old, already_kept=("large",)
    )
    assert int(got.small) == 1
    np.testing.assert_array_equal(got.large, np.ones(3))


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


# ---------------------------------------------------------------- the optimizers
#
# Every optimizer on the policy, through its public alias, in whitening mode (the
# gradient alone: XMat, LRA and Affine fit to the gradient and their own noise
# when no Hessian-vector product is passed). Fits are random (p = 0.5, noise), so
# a skipped step that consumed a draw, advanced a counter or touched a factor
# would show. pro's decoupled weight decay is off: it still applies on a skipped
# step (README), and here the updates must be zero.

POLICY_OPTIMIZERS = {
    "xmat": lambda: pj.xmat(
        learning_rate=0.1, preconditioner_update_probability=0.5, seed=3
    ),
    "lra": lambda: pj.lra(
        learning_rate=0.1,
        preconditioner_update_probability=0.5,
        uvd_rank_of_approximation=2,
        seed=3,
    ),
    "affine": lambda: pj.affine(
        learning_rate=0.1, preconditioner_update_probability=0.5, seed=3
    ),
    "pro": lambda: pj.pro(
        learning_rate=0.1, weight_decay=0.0, preconditioner_update_probability=0.5
    ),
}
POLICY_NAMES = list(POLICY_OPTIMIZERS)
# A finite float32 entry whose square overflows, beside NaN and ±Inf.
BAD_ENTRIES = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "1e30": 1e30}


def _params():
    return {"w": jnp.zeros((4, 3), jnp.float32), "b": jnp.zeros((3,), jnp.float32)}


def _gradient(step: int):
    """Usable gradient number ``step``: fixed, different every step."""
    rng = np.random.default_rng(step)
    return {
        name: jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
        for name, x in _params().items()
    }


def _bad_gradient(step: int, bad: float):
    grads = _gradient(step)
    grads["w"] = grads["w"].at[1, 2].set(bad)
    return grads


@functools.cache
def _jitted(name):
    optimizer = POLICY_OPTIMIZERS[name]()
    return optimizer.init, jax.jit(optimizer.update)


def _leaves_bytes(tree):
    """(structure, each leaf's dtype, shape and bytes): equal iff bitwise equal."""
    leaves, treedef = jax.tree.flatten(jax.device_get(tree))
    return treedef, [(x.dtype, x.shape, np.asarray(x).tobytes()) for x in leaves]


def _assert_bitwise_equal(got, want):
    got_def, got_leaves = _leaves_bytes(got)
    want_def, want_leaves = _leaves_bytes(want)
    assert got_def == want_def
    assert len(got_leaves) == len(want_leaves)
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        assert g == w, f"leaf {i} differs"


def _assert_skipped_once(new_state, state):
    """``new_state`` is ``state`` after one skipped step: bit for bit, but for
    its count of skipped steps, one higher."""
    assert int(pj.skipped_steps(new_state)) == int(pj.skipped_steps(state)) + 1
    _assert_bitwise_equal(without_skip_counts(new_state), without_skip_counts(state))


def _run(name, grads_sequence, state=None):
    """(updates per step, final state) of the jitted update over the gradients."""
    init, update = _jitted(name)
    params = _params()
    if state is None:
        state = init(params)
    out = []
    for grads in grads_sequence:
        updates, state = update(grads, state, params)
        out.append(updates)
    return out, state


@pytest.mark.parametrize("bad", BAD_ENTRIES.values(), ids=list(BAD_ENTRIES))
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_unusable_step_returns_zeros_and_keeps_every_state_leaf(name, bad):
    init, update = _jitted(name)
    params = _params()
    _, after_two = _run(name, [_gradient(1), _gradient(2)])
    for state in (init(params), after_two):  # the first step, and a later one
        updates, new_state = update(_bad_gradient(9, bad), state, params)
        for u in jax.tree.leaves(updates):
            assert u.dtype == jnp.float32
            np.testing.assert_array_equal(u, np.zeros(u.shape, np.float32))
        _assert_skipped_once(new_state, state)


@pytest.mark.parametrize("bad", BAD_ENTRIES.values(), ids=list(BAD_ENTRIES))
def test_pro_skipping_the_step_that_would_rebalance_keeps_its_factors(bad):
    # pro rebalances its two-sided factors every BALANCE_EVERY steps, fit or not;
    # the step that would be number BALANCE_EVERY is skipped here.
    _, update = _jitted("pro")
    _, state = _run("pro", [_gradient(n) for n in range(1, BALANCE_EVERY)])
    _, new_state = update(_bad_gradient(9, bad), state, _params())
    _assert_skipped_once(new_state, state)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_skipped_step_is_invisible_to_the_next_ones(name):
    usable = [_gradient(n) for n in range(1, 6)]
    want, want_state = _run(name, usable)
    for u in jax.tree.leaves(want):
        assert np.all(np.isfinite(u))
        assert np.any(u != 0)
    for bad in BAD_ENTRIES.values():
        skipped = [*usable[:2], _bad_gradient(9, bad), *usable[2:]]
        got, got_state = _run(name, skipped)
        _assert_bitwise_equal(got[:2] + got[3:], want)
        _assert_skipped_once(got_state, want_state)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_state_restored_from_a_copy_repeats_the_updates(name):
    usable = [_gradient(n) for n in range(1, 7)]
    want, want_state = _run(name, usable)
    _, state = _run(name, usable[:3])
    restored = jax.device_get(state)  # host copies: the draws come from the state
    assert not any(isinstance(x, jax.Array) for x in jax.tree.leaves(restored))
    got, got_state = _run(name, usable[3:], state=restored)
    _assert_bitwise_equal(got, want[3:])
    _assert_bitwise_equal(got_state, want_state)


def test_pro_takes_a_zero_size_parameter_of_three_dims():
    # merged_shape used to divide by the zero size of a (2, 0, 3) parameter.
    params = {"empty": jnp.zeros((2, 0, 3)), "w": jnp.zeros((4, 3))}
    optimizer = pj.pro(learning_rate=0.1)
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    for step in (1, 2):
        grads = {"empty": jnp.zeros((2, 0, 3)), "w": _gradient(step)["w"]}
        updates, state = update(grads, state, params)
        assert updates["empty"].shape == (2, 0, 3)
        assert np.all(np.isfinite(updates["w"]))
        assert np.any(updates["w"] != 0)
        params = optax.apply_updates(params, updates)
    assert int(state[0].count) == 2
