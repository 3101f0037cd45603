"""soap's step policy and argument checks: a skipped step (NaN or ±Inf
gradient) leaves the state as it was but for its count of skipped steps,
including on a step that would refresh the bases; every bad argument is refused
at construction with an error naming it; the alias is its transform's chain."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import precond.jax as pj
from tests.jax.helpers import assert_skipped_once

PARAMS = {"w": jnp.ones((4, 3)), "t": jnp.ones((2, 3, 4)), "b": jnp.ones((3,))}


def _grads(seed: int, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(scale * rng.normal(size=p.shape)) for k, p in PARAMS.items()}


# One program for every case.
SKIPPING = pj.soap(1e-2, weight_decay=0.0, precondition_frequency=2)
SKIPPING_UPDATE = jax.jit(SKIPPING.update)


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e30], ids=["nan", "inf", "overflow"])
def test_an_unusable_gradient_skips_the_step(bad):
    """On the first step, an Adam step and a refresh step (frequency 2): zero
    update (weight decay aside), and the state unchanged but ``skipped``."""
    state = SKIPPING.init(PARAMS)
    update = SKIPPING_UPDATE
    for step in range(4):  # the steps before: none, 1, then 2 (a refresh) next
        grads = _grads(step)
        grads["w"] = grads["w"].at[1, 2].set(bad)
        updates, skipped = update(grads, state, PARAMS)
        assert_skipped_once(skipped, state)
        for u in jax.tree.leaves(updates):
            assert not np.any(np.asarray(u))
        _, state = update(_grads(step), state, PARAMS)
    assert int(pj.skipped_steps(state)) == 0
    assert int(state[0].count) == 4


def test_soap_is_its_transform_chained_with_decay_and_learning_rate():
    kwargs = dict(precondition_frequency=2, block_size=3)
    alias = pj.soap(1e-2, weight_decay=0.1, **kwargs)
    chain = optax.chain(
        pj.scale_by_soap(**kwargs),
        optax.add_decayed_weights(0.1),
        optax.scale_by_learning_rate(1e-2),
    )
    a, b = alias.init(PARAMS), chain.init(PARAMS)
    alias_update, chain_update = jax.jit(alias.update), jax.jit(chain.update)
    for step in range(4):
        ua, a = alias_update(_grads(step), a, PARAMS)
        ub, b = chain_update(_grads(step), b, PARAMS)
        jax.tree.map(np.testing.assert_allclose, ua, ub)


BAD = [
    ("learning_rate", -1.0, "must be >= 0.0"),
    ("b1", 1.0, "must be in [0.0, 1.0)"),
    ("b2", -0.1, "must be in [0.0, 1.0)"),
    ("shampoo_beta", 1.0, "must be < 1.0"),
    ("eps", -1e-8, "must be >= 0.0"),
    ("weight_decay", float("nan"), "must be finite and >= 0.0"),
    ("precondition_frequency", 0, "must be >= 1"),
    ("precondition_frequency", 2.0, "must be a Python int"),
    ("max_precond_dim", -1, "must be >= 0"),
    ("merge_dims", 1, "must be True or False"),
    ("precondition_1d", "yes", "must be True or False"),
    ("normalize_grads", None, "must be True or False"),
    ("correct_bias", 0, "must be True or False"),
    ("refresh", "svd", "must be one of 'qr', 'eigh'"),
    ("block_size", 0, "must be >= 1"),
    ("weight_decay_mask", 3, "must be None, a pytree of bools"),
    ("precond_dtype", jnp.int32, "must be a floating dtype"),
    ("precision", "fast", "must be one of None, 'default'"),
    ("params_partition_specs", {"w": "x"}, "must be None or a pytree"),
    ("preconditioner_partition_spec", "x", "must be a jax.sharding.PartitionSpec"),
    ("mesh", "x", "must be None or a jax.sharding.Mesh"),
]


@pytest.mark.parametrize(("name", "value", "rule"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_argument_is_named_at_construction(name, value, rule):
    makers = [pj.soap]
    if name not in ("learning_rate", "weight_decay", "weight_decay_mask"):
        makers.append(pj.scale_by_soap)
    for make in makers:
        with pytest.raises((TypeError, ValueError)) as raised:
            make(**{name: value})
        message = str(raised.value)
        assert message.startswith(f"Invalid {name}={value!r}: "), message
        assert rule in message, message
