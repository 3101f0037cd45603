"""Every JAX alias lists its ``scale_by_*`` transformation's arguments, unchanged.

optax's convention is an alias (``kron``, ``pro``, ``distributed_shampoo``,
``xmat``, ``lra``, ``affine``, ``soap``) that chains a ``scale_by_*``
transformation with weight decay and a learning rate. Both are public with
explicit signatures (the seeds' contracts, checked against the seeds by the
parity tests), so each
argument is written twice. This table makes them one decision: the alias has
every argument of its transformation with the same kind and default, in the
same relative order, plus only the arguments of the steps it adds.
"""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import numpy as np
import pytest

import precond.jax as pj

# alias → (its transformation, the arguments only the alias has).
ALIASES = {
    "kron": ("scale_by_kron", {"learning_rate", "weight_decay", "weight_decay_mask"}),
    "pro": ("scale_by_pro", {"learning_rate", "weight_decay", "weight_decay_mask"}),
    "distributed_shampoo": (
        "scale_by_shampoo",
        {
            "learning_rate",
            "decoupled_learning_rate",
            "decoupled_weight_decay",
            "sharded_init_fns",
        },
    ),
    "xmat": ("scale_by_xmat", {"learning_rate", "weight_decay", "mask"}),
    "lra": ("scale_by_lra", {"learning_rate", "weight_decay", "mask"}),
    "affine": ("scale_by_affine", {"learning_rate", "weight_decay", "mask"}),
    "soap": ("scale_by_soap", {"learning_rate", "weight_decay", "weight_decay_mask"}),
}


def _same_default(ours, theirs) -> bool:
    """Equal values; two schedules are equal when they agree on many steps."""
    if ours is not inspect.Parameter.empty and callable(ours) and callable(theirs):
        steps = jnp.arange(0, 6000, 7)
        return bool(np.array_equal(ours(steps), theirs(steps)))
    return ours is theirs or ours == theirs


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_the_alias_has_its_transformation_s_arguments(alias):
    transformation, alias_only = ALIASES[alias]
    outer = inspect.signature(getattr(pj, alias)).parameters
    inner = {
        name: p
        for name, p in inspect.signature(getattr(pj, transformation)).parameters.items()
        if p.kind is not inspect.Parameter.VAR_KEYWORD  # scale_by_kron's **kwargs
    }
    assert set(outer) - set(inner) == alias_only
    assert [name for name in outer if name in inner] == list(inner)
    for name, p in inner.items():
        assert outer[name].kind is p.kind, name
        assert outer[name].annotation == p.annotation, name
        assert _same_default(outer[name].default, p.default), name
