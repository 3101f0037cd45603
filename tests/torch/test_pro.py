"""precond.torch.Pro against precond.jax.pro and AdamW.

(1) The torch generation-2 kernels with sampled norm bounds equal
    ``precond.jax._kron_math.update_factors_gen2`` given the same normal draws,
    and whole steps of ``Pro`` equal steps of ``precond.jax.pro`` when both make
    the same draws (each framework's draw function is replaced by one that
    returns fixed arrays, a function of the requested shape).
(2) Per kind of parameter: it trains faster than AdamW at the same step scale,
    a resumed run is the uninterrupted one bit for bit, a NaN gradient changes
    nothing; bad arguments raise the standard message.
(3) The stacks it fits are ``precond.jax.pro``'s (the planner is shared,
    ``precond._common.pro_layout``): checked once, on what Pro actually fits.

Float32 throughout: the frameworks differ by float32 rounding (batched versus
vmapped matmuls, summation order), hence tolerances of 1e-5 relative.
"""

from __future__ import annotations

import copy
import io
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import precond.jax as pj
import precond.torch.pro as pro_module
from precond._common.pro_layout import _plan, merged_shape
from precond.jax import _kron_math as jkm
from precond.torch import Pro
from precond.torch import _kron_math as tkm


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _fixed_normal(shape) -> np.ndarray:
    """The draw both frameworks return for ``shape`` (a function of it alone)."""
    shape = tuple(int(d) for d in shape)
    rng = np.random.default_rng([len(shape), *shape])
    return rng.standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------ (1) kernels

# (id, factor kinds per side ('dense' or 'diagonal'), block shape)
KERNEL_CASES = [
    ("dense", ("dense", "dense"), (6, 5)),
    ("one_sided", ("diagonal", "dense"), (7, 4)),
    ("diagonal", ("diagonal", "diagonal"), (5, 3)),
    ("vector", ("diagonal",), (9,)),
]
UNITS = 2  # stack entries of the torch call, each compared to its own JAX call


@pytest.mark.parametrize("style", ["PRO", "QUAD"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_gen2_fit_equals_jax_with_the_same_draws(case, style):
    _, kinds, shape = case
    rng = np.random.default_rng(0)
    factors, lipschitz = [], []
    for d, kind in zip(shape, kinds, strict=True):
        if kind == "dense":  # not symmetric, so the rotation has work to do
            Q = np.eye(d) + 0.2 * rng.standard_normal((UNITS, d, d))
        else:
            Q = 1 + 0.2 * np.abs(rng.standard_normal((UNITS, d)))
        factors.append(Q.astype(np.float32))
        lipschitz.append(rng.uniform(0, 50, UNITS).astype(np.float32))
    G = rng.standard_normal((UNITS, *shape)).astype(np.float32)
    diagonal = [k == "diagonal" for k in kinds]
    draws = []  # the torch call's draws, in order: (UNITS, k, d) each

    def torch_draw(generator, draw_shape, dtype, device):
        W = np.random.default_rng(len(draws)).standard_normal(draw_shape)
        draws.append(W.astype(np.float32))
        return torch.from_numpy(draws[-1]).to(dtype)

    generator = torch.Generator().manual_seed(0)
    new_t, L_t = tkm.update_factors_gen2(
        [torch.from_numpy(Q) for Q in factors],
        [torch.from_numpy(L) for L in lipschitz],
        torch.from_numpy(G),
        tkm.whitening_targets(shape, diagonal, torch.zeros(())),
        0.5,
        style,
        [None if diag else generator for diag in diagonal],
        torch_draw,
    )
    dense_sides = sum(not d for d in diagonal)
    assert len(draws) == dense_sides * (2 if style == "PRO" else 1)
    for b in range(UNITS):
        calls = iter(range(len(draws)))

        def jax_draw(key, draw_shape, dtype, b=b, calls=calls):
            W = draws[next(calls)][b]
            assert W.shape == tuple(draw_shape)
            return jnp.asarray(W, dtype)

        new_j, L_j = jkm.update_factors_gen2(
            [jnp.asarray(Q[b]) for Q in factors],
            [jnp.asarray(L[b]) for L in lipschitz],
            jnp.asarray(G[b]),
            jkm.whitening_targets([jnp.ones(d, bool) for d in shape], diagonal),
            0.5,
            style,
            [None if diag else jax.random.PRNGKey(1) for diag in diagonal],
            jax_draw,
        )
        assert next(calls, None) is None  # JAX made exactly torch's draws
        for side in range(len(shape)):
            assert _relative(new_t[side][b], new_j[side]) <= 1e-5, side
            assert _relative(L_t[side][b], L_j[side]) <= 1e-5, side


# ------------------------------------------------------------------ (1) steps

# Every layout path (block_size 16, max_size_dense 45), as the JAX parity test.
SHAPES = {
    "blocked": (40, 16),
    "diagonal_both": (50, 60),
    "diagonal_left": (50, 16),
    "diagonal_right": (16, 50),
    "row": (1, 7),
    "scalar": (),
    "tensor": (2, 8, 16),
    "vector": (8,),
}  # sorted: JAX flattens a dict in key order, torch takes this order
LAYOUT = dict(block_size=16, max_size_dense=45)
STEP_CASES = [
    ("PRO", dict(LAYOUT, learning_rate=1.0), 3),
    (
        "QUAD-plain-normalized",
        dict(
            LAYOUT,
            learning_rate=0.5,
            preconditioner_update_style="QUAD",
            b1=0.0,
            lr_style=None,
            normalize_grads=True,
            noise_scale=1e-6,
            preconditioner_init_scale=0.5,
        ),
        3,
    ),
    (
        "sometimes-fit",
        dict(LAYOUT, learning_rate=1.0, preconditioner_update_probability=0.5),
        4,
    ),
]


def _problem(steps):
    rng = np.random.default_rng(1)
    params = {
        n: np.asarray(0.1 * rng.standard_normal(s), np.float32)
        for n, s in SHAPES.items()
    }
    grads = [
        {
            n: np.asarray((1 + i) * rng.standard_normal(s), np.float32)
            for i, (n, s) in enumerate(SHAPES.items())
        }
        for _ in range(steps)
    ]
    return params, grads


@pytest.mark.parametrize("case", STEP_CASES, ids=[c[0] for c in STEP_CASES])
def test_steps_equal_precond_jax_pro_with_the_same_draws(case, monkeypatch):
    _, kwargs, steps = case
    params, grads = _problem(steps)

    def jax_normal(key, shape=(), dtype=jnp.float32, **_):
        return jnp.asarray(_fixed_normal(shape), dtype)

    def torch_normal(generator, shape, dtype, device):
        # (units, *block): every unit gets the block's fixed draw, as JAX's
        # vmapped fit does with a draw that ignores its key.
        W = torch.from_numpy(_fixed_normal(shape[1:])).to(dtype=dtype, device=device)
        return W.expand(shape)

    optimizer = pj.pro(draws="compact", **kwargs)
    jax_params = {n: jnp.asarray(p) for n, p in params.items()}
    with monkeypatch.context() as patch:
        patch.setattr(jax.random, "normal", jax_normal)
        state = optimizer.init(jax_params)
        update = jax.jit(optimizer.update)
        jax_steps = []
        for g in grads:
            u, state = update(
                {n: jnp.asarray(x) for n, x in g.items()}, state, jax_params
            )
            jax_params = optax.apply_updates(jax_params, u)
            jax_steps.append(u)

    monkeypatch.setattr(pro_module, "draw_normal", torch_normal)
    torch_kwargs = {k: v for k, v in kwargs.items() if k != "learning_rate"}
    tensors = {n: torch.tensor(p, requires_grad=True) for n, p in params.items()}
    opt = Pro(list(tensors.values()), lr=kwargs["learning_rate"], **torch_kwargs)
    for t, g in enumerate(grads):
        before = {n: p.detach().clone() for n, p in tensors.items()}
        for n, p in tensors.items():
            p.grad = torch.from_numpy(g[n])
        opt.step()
        for n, p in tensors.items():
            delta = (p.detach() - before[n]).numpy()
            assert _relative(delta, jax_steps[t][n]) <= 1e-5, (t, n)
