"""Kron on flax parameters: linen ``nn.Partitioned`` boxes and nnx states.

Each run equals Kron on the same parameters as a plain dict of arrays with the
partition specs given explicitly (float64, to 1e-12: the same program).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import precond.jax as pj
from tests.jax.helpers import float64

KWARGS = dict(
    preconditioner_update_probability=1.0,
    partition_grads_into_blocks=True,
    block_size=8,
    precond_dtype=jnp.float64,
)


def _mesh():
    return jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(
            16,
            kernel_init=nn.with_partitioning(
                nn.initializers.normal(1.0), ("fsdp", "tp")
            ),
            bias_init=nn.with_partitioning(nn.initializers.zeros, ("tp",)),
        )(x)
        return nn.Dense(
            4, kernel_init=nn.with_partitioning(nn.initializers.normal(1.0), ("tp",))
        )(jnp.tanh(x))


def _loss_and_grads(apply, params, x):
    return jax.grad(lambda p: jnp.sum(apply(p, x) ** 2))(params)


def _steps(optimizer, params, grads_fn, steps=3):
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    outputs = []
    for _ in range(steps):
        updates, state = update(grads_fn(params), state)
        outputs.append(updates)
    return outputs, state


def test_linen_partitioned_boxes_give_the_specs():
    """Boxed params need no spec arguments: the boxes' names are the specs."""
    model, mesh = _Mlp(), _mesh()
    with float64(), jax.set_mesh(mesh):
        x = jax.random.normal(jax.random.PRNGKey(1), (8, 8), jnp.float64)
        boxed = model.init(jax.random.PRNGKey(0), x)
        specs = nn.get_partition_spec(boxed)
        got, state = _steps(
            pj.kron(**KWARGS),
            boxed,
            lambda p: _loss_and_grads(model.apply, p, x),
        )
        plain = nn.unbox(boxed)
        want, _ = _steps(
            pj.kron(**KWARGS, params_partition_specs=specs),
            plain,
            lambda p: _loss_and_grads(model.apply, p, x),
        )
    for got_step, want_step in zip(got, want, strict=True):
        assert isinstance(got_step["params"]["Dense_0"]["kernel"], nn.Partitioned)
        for g, w in zip(
            jax.tree.leaves(nn.unbox(got_step)), jax.tree.leaves(want_step), strict=True
        ):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-15)
    kernel_mu = state[0].mu["params"]["Dense_0"]["kernel"]
    assert kernel_mu.names == ("fsdp", "tp")
    assert kernel_mu.value.sharding.spec == P("fsdp", "tp")


def test_specs_per_box_as_nn_get_partition_spec_gives_them():
    """params_partition_specs may have one entry per box (no box nodes in it)."""
    model = _Mlp()
    with jax.set_mesh(_mesh()):
        boxed = model.init(jax.random.PRNGKey(0), jnp.ones((8, 8)))
        optimizer = pj.kron(params_partition_specs=nn.get_partition_spec(boxed))
        state = optimizer.init(boxed)
    assert state[0].mu["params"]["Dense_1"]["kernel"].value.sharding.spec == P("tp")


class _NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(8, 16, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


def test_nnx_state_equals_plain_dict():
    with float64():
        model = _NnxMlp(nnx.Rngs(0))
        graphdef, state = nnx.split(model, nnx.Param)
        x = jax.random.normal(jax.random.PRNGKey(1), (8, 8), jnp.float64)

        def grads_of_state(s):
            return jax.grad(
                lambda s: jnp.sum(nnx.merge(graphdef, s)(x) ** 2), allow_int=True
            )(s)

        got, _ = _steps(pj.kron(**KWARGS), state, grads_of_state)
        want, _ = _steps(
            pj.kron(**KWARGS),
            nnx.to_pure_dict(state),
            lambda d: nnx.to_pure_dict(grads_of_state(_with_values(state, d))),
        )
    for got_step, want_step in zip(got, want, strict=True):
        got_step = nnx.to_pure_dict(got_step)
        for g, w in zip(jax.tree.leaves(got_step), jax.tree.leaves(want_step)):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-15)


def _with_values(state, pure):
    state = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(state, pure)
    return state
