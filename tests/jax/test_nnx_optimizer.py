"""Every JAX optimizer under flax's ``nnx.Optimizer`` and ``nnx.jit``.

nnx keeps the optimizer state as variables and rebuilds it from its own trees
each step, so a state must come back from nnx as the state ``init`` made (a
NamedTuple of arrays per parameter, say, came back as an nnx ``State``, which
the next step refused). The oracle is the plain optax loop on the same model's
parameters as a dict: three jitted steps of ``nnx.Optimizer.update`` give the
same parameters, and the nnx step is traced once (the state's structure does
not change between steps).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import precond.jax as pj

OPTIMIZERS = {
    "kron": lambda: pj.kron(1e-2, preconditioner_update_probability=1.0),
    "pro": lambda: pj.pro(1e-2),
    "affine": lambda: pj.affine(1e-2),
    "xmat": lambda: pj.xmat(1e-2),
    "low_rank_approximation": lambda: pj.low_rank_approximation(1e-2),
    "distributed_shampoo": lambda: pj.distributed_shampoo(
        1e-2, 4, start_preconditioning_step=1
    ),
}
STEPS = 3


class _Mlp(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(4, 6, rngs=rngs)
        self.out = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


X = jax.random.normal(jax.random.PRNGKey(1), (5, 4))


def _loss(model):
    return jnp.mean(model(X) ** 2)


def _nnx_run(make):
    """The parameters (pure dicts) after each step of nnx.Optimizer under
    nnx.jit, and how often the step was traced."""
    model = _Mlp(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, make(), wrt=nnx.Param)
    traces = []

    @nnx.jit
    def step(model, optimizer):
        traces.append(None)
        grads = nnx.grad(_loss)(model)
        optimizer.update(model, grads)

    params = []
    for _ in range(STEPS):
        step(model, optimizer)
        params.append(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return params, len(traces)


def _optax_run(make):
    """The same steps as a plain optax loop on the parameters as a dict."""
    graphdef, state = nnx.split(_Mlp(nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(state)

    def loss(pure):
        replaced = jax.tree.map(lambda x: x, state)
        nnx.replace_by_pure_dict(replaced, pure)
        return _loss(nnx.merge(graphdef, replaced))

    optimizer = make()

    @jax.jit
    def step(params, opt_state):
        updates, opt_state = optimizer.update(jax.grad(loss)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = optimizer.init(params)
    out = []
    for _ in range(STEPS):
        params, opt_state = step(params, opt_state)
        out.append(params)
    return out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_nnx_optimizer_under_nnx_jit_equals_the_optax_loop(name):
    got, traces = _nnx_run(OPTIMIZERS[name])
    want = _optax_run(OPTIMIZERS[name])
    assert traces == 1
    for got_step, want_step in zip(got, want, strict=True):
        assert jax.tree.structure(got_step) == jax.tree.structure(want_step)
        for g, w in zip(jax.tree.leaves(got_step), jax.tree.leaves(want_step)):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
