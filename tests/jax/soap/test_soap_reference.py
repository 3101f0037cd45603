"""soap against the float64 NumPy reference (tests/reference/soap_reference.py),
leaf by leaf and step by step, with x64 enabled (parameters, moments, statistics
and bases in float64).

Each case is one optimizer on a tree of several parameters, each parameter (or,
with ``block_size``, each block) compared with its own ``SoapReference``: the
update of every step, with atol = rtol·max|expected| (a norm-wise check).

Well-posed bases. An eigenbasis is unique up to column signs (the update does
not depend on them) and, for a repeated eigenvalue, up to a rotation inside its
eigenspace (the update does depend on that). The first step takes the eigenbasis
of one gradient's gram, so every statistic here has, at its first step, no
eigenvalue of multiplicity above one: its block axis k of length n has at least
n − 1 columns in the other axes (square matrices, 3-D tensors whose other axes
outnumber each axis, a (12, 11) matrix in blocks (6, 6) and (6, 5), whose 6×6
gram of rank 5 has a single zero eigenvalue, and the 1-D parameter of length 2,
whose gram g·gᵀ has eigenvalues |g|² and 0). Later statistics sum many
gradients and are full rank.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precond.jax as pj
from tests.jax.helpers import float64
from tests.reference.soap_reference import SoapReference

STEPS = 26  # 25 Adam steps after the first; refreshes at t = 3, 6, ..., 24
RTOL = 1e-10


def SCHEDULE(count):
    """A learning-rate schedule of the step count, in float64 (optax's own
    schedules divide its int32 count in float32, which jit and eager round apart
    by an ulp)."""
    return 3e-2 / (1.0 + 0.1 * jnp.asarray(count, jnp.float64))


# The reference's arguments for the optimizer's (its names: lr, betas).
SHARED = dict(precondition_frequency=3, weight_decay=0.05)


def _reference_kwargs(kwargs: dict) -> dict:
    kwargs = dict(kwargs)
    kwargs["betas"] = (kwargs.pop("b1", 0.95), kwargs.pop("b2", 0.95))
    kwargs.pop("block_size", None)
    return kwargs


CASES = {
    # A matrix, a 3-D tensor, one-sided (a dim above max_precond_dim), Adam (all
    # dims above; and a 1-D tensor without precondition_1d), weight decay and a
    # learning-rate schedule.
    "matrix-3d-one-sided-adam": (
        dict(SHARED, max_precond_dim=20, b1=0.9, b2=0.99),
        {
            "w": (6, 6),
            "t": (3, 4, 5),
            "one_sided": (6, 40),
            "adam": (30, 40),
            "b": (2,),
        },
    ),
    # precondition_1d, merge_dims ((2, 3, 6) → (6, 6)), normalize_grads.
    "merge-1d-normalized": (
        dict(
            SHARED,
            max_precond_dim=6,
            merge_dims=True,
            precondition_1d=True,
            normalize_grads=True,
        ),
        {"merged": (2, 3, 6), "b": (2,)},
    ),
    # refresh by eigh, no bias correction, statistics with their own β.
    "eigh-no-bias-correction": (
        dict(SHARED, refresh="eigh", correct_bias=False, shampoo_beta=0.8),
        {"w": (5, 5), "t": (2, 3, 4)},
    ),
    # Blocks: each its own SOAP (remainder blocks (6, 5), and (4, 6, 5) twice).
    "blocks": (
        dict(SHARED, block_size=6),
        {"w": (12, 11), "t": (4, 12, 5)},
    ),
}


def _blocks(shape: tuple[int, ...], block: int | None) -> list[tuple[slice, ...]]:
    """The index of every block of a tensor of ``shape`` (remainders last)."""
    if block is None:
        return [tuple(slice(None) for _ in shape)]
    axes = [[slice(s, min(s + block, d)) for s in range(0, d, block)] for d in shape]
    grid = np.meshgrid(*[np.arange(len(a)) for a in axes], indexing="ij")
    return [
        tuple(axes[k][i[k]] for k in range(len(shape)))
        for i in zip(*(g.ravel() for g in grid))
    ]


@pytest.mark.parametrize("name", list(CASES))
def test_updates_equal_the_float64_reference(name):
    kwargs, shapes = CASES[name]
    rng = np.random.default_rng(0)
    params = {k: rng.normal(size=s) for k, s in shapes.items()}
    references = {
        k: [
            (
                index,
                SoapReference(np.empty(s)[index].shape, **_reference_kwargs(kwargs)),
            )
            for index in _blocks(s, kwargs.get("block_size"))
        ]
        for k, s in shapes.items()
    }
    with float64():
        optimizer = pj.soap(SCHEDULE, **kwargs)
        state = optimizer.init(jax.tree.map(np.asarray, params))
        update = jax.jit(optimizer.update)
        for step in range(STEPS):
            grads = {k: rng.normal(size=s) for k, s in shapes.items()}
            updates, state = update(grads, state, params)
            learning_rate = float(SCHEDULE(step))
            for k, p in params.items():
                expected = np.empty_like(p)
                for index, reference in references[k]:
                    reference.lr = learning_rate
                    expected[index] = (
                        reference.step(p[index], grads[k][index]) - p[index]
                    )
                got = np.asarray(updates[k])
                np.testing.assert_allclose(
                    got,
                    expected,
                    rtol=RTOL,
                    atol=RTOL * np.max(np.abs(expected)),
                    err_msg=f"{k} at step {step}",
                )
                params[k] = p + got
    assert int(state[0].count) == STEPS
