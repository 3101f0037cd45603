"""scale_by_shampoo: Distributed Shampoo's direction, for optax.chain.

Properties, each against an oracle:

* the alias is the chain: ``distributed_shampoo(lr, ...)`` equals
  ``chain(scale_by_shampoo(...), optax.scale_by_learning_rate(lr))`` bit for
  bit (float32 parameters), updates and state, for a constant lr and for a
  schedule (both read the same step count), with and without Nesterov and
  momentum, with grafting, coupled weight decay, roots every other step and
  the quantized memory mode;
* under optax's clip and mask it is the alias on the clipped gradients of the
  unmasked leaves (float64, where the two programs agree to rounding), and the
  masked-out leaf gets −lr times its clipped gradient;
* its arguments are the alias's without those of the learning rate: those are
  refused by name, the rest validated as the alias validates them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import precond.jax as pj
from tests.jax.helpers import float64

SHAPES = {"w": (6, 5), "b": (5,), "conv": (2, 3, 4), "s": ()}
STEPS = 6


def _tree(seed: int, dtype=jnp.float32) -> dict:
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.normal(size=s), dtype) for k, s in SHAPES.items()}


def _trajectory(optimizer, params, grads):
    """Updates and states of ``len(grads)`` jitted steps (params fixed)."""
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    updates, states = [], []
    for g in grads:
        u, state = update(g, state, params)
        updates.append(u)
        states.append(state)
    return updates, states


# Bit for bit holds where XLA computes each value once, as every user's compile
# does (its common-subexpression elimination is on). The suite's unoptimized
# compile (tests/conftest.py) may compute one value in several fusions, and LLVM
# contracts multiply-adds into FMAs fusion by fusion: there even one program's
# update and its stored momentum (the same β₁·m + u, nesterov=False) came out
# one ulp apart (distributed_shampoo(1.0): leaf w at steps 2 and 3; before an
# unrelated change to the step, scale_by_shampoo's scalar leaf at step 3). So
# the bitwise comparisons compile as users do.
BITWISE = pytest.mark.optimized_xla


def _assert_bitwise(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


SCHEDULE = optax.linear_schedule(0.1, 0.01, STEPS)


@pytest.mark.parametrize(
    ("learning_rate", "kwargs"),
    [
        (0.1, {}),
        (SCHEDULE, dict(nesterov=False)),
        (SCHEDULE, dict(beta1=0.0, nesterov=False)),
        (
            SCHEDULE,
            dict(
                graft_type=pj.GraftingType.ADAGRAD,
                moving_average_for_momentum=True,
                weight_decay=0.01,
                preconditioning_compute_steps=2,
            ),
        ),
        (
            SCHEDULE,
            dict(
                graft_type=pj.GraftingType.RMSPROP_NORMALIZED,
                clip_by_scaled_gradient_norm=0.5,
                statistics_compute_steps=2,
                block_size=3,
            ),
        ),
        (
            0.05,
            dict(
                graft_type=pj.GraftingType.SQRT_N,
                best_effort_memory_usage_reduction=True,
                quantize_statistics=True,
            ),
        ),
    ],
    ids=["constant", "schedule", "no-momentum", "adagrad", "rmsprop", "quantized"],
)
@BITWISE
def test_the_alias_is_the_chain_with_the_learning_rate(learning_rate, kwargs):
    """Bit for bit: every update and the Shampoo state after every step."""
    kwargs = dict(block_size=4, start_preconditioning_step=2) | kwargs
    params = _tree(0)
    grads = [_tree(1 + t) for t in range(STEPS)]
    alias = pj.distributed_shampoo(learning_rate, **kwargs)
    chain = optax.chain(
        pj.scale_by_shampoo(**kwargs), optax.scale_by_learning_rate(learning_rate)
    )
    want_updates, want_states = _trajectory(alias, params, grads)
    got_updates, got_states = _trajectory(chain, params, grads)
    for got, want in zip(got_updates, want_updates, strict=True):
        _assert_bitwise(got, want)
    for got, want in zip(got_states, want_states, strict=True):
        assert isinstance(got[0], pj.ShampooState)
        _assert_bitwise(got[0], want)


@BITWISE
def test_scale_by_shampoo_returns_the_unscaled_direction():
    """With lr = 1 the alias's update is −(scale_by_shampoo's direction)."""
    params, grads = _tree(0), [_tree(1 + t) for t in range(3)]
    kwargs = dict(block_size=4, start_preconditioning_step=1)
    want, _ = _trajectory(pj.distributed_shampoo(1.0, **kwargs), params, grads)
    got, _ = _trajectory(pj.scale_by_shampoo(**kwargs), params, grads)
    for g, w in zip(got, want, strict=True):
        _assert_bitwise(jax.tree.map(jnp.negative, g), w)


def test_under_clip_and_mask_it_is_the_alias_on_the_clipped_unmasked_leaves():
    mask = {"w": True, "b": True, "conv": True, "s": False}
    kwargs = dict(block_size=4, start_preconditioning_step=1)
    with float64():
        params = _tree(0, jnp.float64)
        grads = [
            jax.tree.map(lambda g: 3.0 * g, _tree(1 + t, jnp.float64)) for t in range(4)
        ]
        clip = optax.clip_by_global_norm(1.0)
        clipped = [clip.update(g, clip.init(params))[0] for g in grads]
        assert float(optax.tree.norm(grads[0])) > 1.0  # so the clip does something
        chain = optax.chain(
            clip,
            optax.masked(pj.scale_by_shampoo(**kwargs), mask),
            optax.scale_by_learning_rate(SCHEDULE),
        )
        got, states = _trajectory(chain, params, grads)
        unmasked = {k: v for k, v in params.items() if mask[k]}
        want, _ = _trajectory(
            pj.distributed_shampoo(SCHEDULE, **kwargs),
            unmasked,
            [{k: g[k] for k in unmasked} for g in clipped],
        )
        for t, (g, w) in enumerate(zip(got, want, strict=True)):
            for k in unmasked:
                np.testing.assert_allclose(g[k], w[k], rtol=1e-12, atol=1e-15)
            # The schedule of an int32 count, as optax's scale_by_schedule reads it.
            lr = SCHEDULE(jnp.asarray(t, jnp.int32))
            np.testing.assert_allclose(g["s"], -lr * clipped[t]["s"], rtol=1e-15)
        assert isinstance(states[-1][1].inner_state, pj.ShampooState)
        assert isinstance(states[-1][1].inner_state.momentum["s"], optax.MaskedNode)


@pytest.mark.parametrize(
    "name", ["learning_rate", "decoupled_learning_rate", "decoupled_weight_decay"]
)
def test_the_learning_rate_arguments_are_the_alias_s_alone(name):
    with pytest.raises(TypeError, match=name):
        pj.scale_by_shampoo(block_size=4, **{name: 0.1})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(block_size=-1), "Invalid block_size=-1"),
        (dict(beta1=1.5), "Invalid beta1=1.5"),
        (dict(graft_type=9), "Invalid graft_type=9"),
    ],
)
def test_arguments_are_validated_as_the_alias_validates_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        pj.scale_by_shampoo(**({"block_size": 4} | kwargs))
    with pytest.raises(ValueError, match=message):
        pj.distributed_shampoo(0.1, **({"block_size": 4} | kwargs))


def test_inject_hyperparams_traces_the_numbers():
    """Under optax.inject_hyperparams (SCALE_BY_SHAMPOO_STATIC_ARGS kept
    static) the updates are the plain transform's: the numbers, arrays there,
    change nothing but rounding (float64 here)."""
    kwargs = dict(block_size=4, start_preconditioning_step=1, beta1=0.8)
    with float64():
        params = _tree(0, jnp.float64)
        grads = [_tree(1 + t, jnp.float64) for t in range(3)]
        injected = optax.inject_hyperparams(
            pj.scale_by_shampoo, static_args=pj.SCALE_BY_SHAMPOO_STATIC_ARGS
        )(**kwargs)
        got, states = _trajectory(injected, params, grads)
        want, _ = _trajectory(pj.scale_by_shampoo(**kwargs), params, grads)
        assert float(states[-1].hyperparams["beta1"]) == 0.8
        for g, w in zip(got, want, strict=True):
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w), strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
