"""precond.torch.SOAP against precond.jax.soap, in float64: the same parameters
and gradient streams, 21 calls (20 Adam steps, bases refreshed at t = 4, 8, ...),
the parameters equal to a relative 1e-10 after every call.

Both implement ``tests/reference/soap_reference.py``; this checks that the two
frameworks agree with each other in every option at once (blocks, merged dims,
one-sided axes, Adam-only tensors, the eigh refresh, weight decay, bias
correction), which the reference tests check one framework at a time.

Well-posedness (as in the reference tests): every axis with a statistic, of
every block here, is at most the product of the block's other dims, so the first
call's statistics have full rank and distinct eigenvalues and both frameworks'
LAPACK calls find the same bases up to column signs, to which the update is
invariant.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
import torch

import precond.jax as pj
from precond.torch import SOAP

CALLS = 21
SHAPES = {"w": (8, 8), "t": (4, 4, 4), "wide": (4, 12), "m": (2, 3, 12), "b": (7,)}

SETTINGS = {
    "qr_blocks": {"block_size": 4},
    # (2, 3, 12) is preconditioned as (6, 12), one-sided; (8, 8) by Adam alone.
    "eigh_merge": {"refresh": "eigh", "merge_dims": True, "max_precond_dim": 6},
    "decay_no_bias_correction": {
        "weight_decay": 0.3,
        "correct_bias": False,
        "shampoo_beta": 0.9,
        "normalize_grads": True,
    },
}
COMMON = {
    "precondition_frequency": 4,
    "betas": (0.9, 0.95),
    "weight_decay": 0.0,
    "max_precond_dim": 10,  # axes of 12 are one-sided
}


def _streams(seed: int = 0) -> tuple[dict, list[dict]]:
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(size=s) for k, s in SHAPES.items()}
    grads = [
        {k: rng.normal(size=s) * (1 + 0.1 * i) for k, s in SHAPES.items()}
        for i in range(CALLS)
    ]
    return params, grads


def _jax_trajectory(options: dict, params: dict, grads: list[dict]) -> list[dict]:
    b1, b2 = options.pop("betas")
    optimizer = pj.soap(learning_rate=0.02, b1=b1, b2=b2, **options)
    with jax.enable_x64(True):
        p = jax.tree.map(jax.numpy.asarray, params)
        state = optimizer.init(p)
        step = jax.jit(optimizer.update)
        out = []
        for g in grads:
            updates, state = step(jax.tree.map(jax.numpy.asarray, g), state, p)
            p = optax.apply_updates(p, updates)
            out.append(jax.tree.map(np.asarray, p))
    return out


def _torch_trajectory(options: dict, params: dict, grads: list[dict]) -> list[dict]:
    tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in params.items()}
    optimizer = SOAP(list(tensors.values()), lr=0.02, **options)
    out = []
    for g in grads:
        for k, p in tensors.items():
            p.grad = torch.tensor(g[k], dtype=torch.float64)
        optimizer.step()
        out.append({k: p.detach().numpy().copy() for k, p in tensors.items()})
    return out


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_torch_soap_equals_jax_soap_in_float64(setting):
    options = COMMON | SETTINGS[setting]
    params, grads = _streams()
    jax_run = _jax_trajectory(dict(options), params, grads)
    torch_run = _torch_trajectory(dict(options), params, grads)
    for call, (a, b) in enumerate(zip(jax_run, torch_run, strict=True)):
        for name in SHAPES:
            moved = np.abs(a[name] - params[name]).max()
            np.testing.assert_allclose(
                b[name],
                a[name],
                rtol=0,
                atol=1e-10 * max(moved, 1e-3),
                err_msg=f"{name} after call {call + 1}",
            )
