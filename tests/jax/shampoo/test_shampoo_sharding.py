"""Distributed Shampoo's state placed on a mesh of 8 (simulated) devices by
``jax.jit(init)`` itself (DESIGN.md §6).

With ``params_partition_specs`` (or the params' types on an explicit mesh) the
momentum, grafting momentum and grafting accumulator follow their parameter,
and with ``shard_optimizer_states`` the stacks are split along their rows: each
device holds 1/8 of every leaf but the step count and the root errors (a few
floats per parameter). The oracle of the numbers is the same optimizer on one
device, without any placement argument.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import precond.jax as pj
from tests.jax.helpers import float64

# Every dim that a spec splits is a multiple of 8: each device holds exactly 1/8.
SHAPES = {"w": (64, 24), "b": (24,), "t": (16, 8, 3), "e": (40, 16)}
SPECS = {"w": P("x"), "b": P(), "t": P("x", None, None), "e": P(None, "x")}
BLOCK = 16
STACKS = P("x", None, None)
# Small per-leaf state that replicates by design.
REPLICATED = ("count", "skipped", "training_metrics", "scales", "['b']")
SHARDED = dict(
    shard_optimizer_states=True,
    statistics_partition_spec=STACKS,
    sharded_init_fns=False,  # init returns the state, not the seed's triple
    precondition_with_previous_roots=False,  # the steps of the unsharded mode
    graft_type=pj.GraftingType.RMSPROP,  # both grafting buffers
)


def _mesh(axis_type=AxisType.Auto):
    return jax.make_mesh((8,), ("x",), axis_types=(axis_type,))


def _params(mesh=None, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.normal(size=s), dtype) for k, s in SHAPES.items()}
    if mesh is None:
        return params
    return {
        k: jax.device_put(p, NamedSharding(mesh, SPECS[k])) for k, p in params.items()
    }


def _gradients(params, step):
    """Gradients placed as the params."""
    rng = np.random.default_rng(100 + step)
    return jax.tree.map(
        lambda p: jax.device_put(rng.normal(size=p.shape).astype(p.dtype), p.sharding),
        params,
    )


def _leaves(state):
    return [
        (jax.tree_util.keystr(path), x)
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
    ]


def _assert_each_device_holds_an_eighth(state):
    for path, x in _leaves(state):
        if any(name in path for name in REPLICATED):
            continue
        shard = x.addressable_shards[0].data
        assert shard.nbytes * 8 == x.nbytes, f"{path}: {x.sharding.spec}"


@pytest.mark.parametrize("memory_mode", [False, True], ids=["float32", "int8"])
def test_jit_init_places_every_leaf_on_an_eighth_of_the_devices(memory_mode):
    """No out_shardings: jit(init) alone puts 1/8 of every leaf on each device,
    and 1/8 of the whole state (up to the replicated small leaves)."""
    mesh = _mesh()
    optimizer = pj.distributed_shampoo(
        0.1,
        BLOCK,
        **SHARDED,
        best_effort_memory_usage_reduction=memory_mode,
        params_partition_specs=SPECS,
        mesh=mesh,
    )
    with jax.set_mesh(mesh):
        state = jax.jit(optimizer.init)(_params(mesh))
    _assert_each_device_holds_an_eighth(state)
    if memory_mode:
        assert state.momentum["w"].values.dtype == jnp.int8
    total = sum(x.nbytes for _, x in _leaves(state))
    per_device = sum(x.addressable_shards[0].data.nbytes for _, x in _leaves(state))
    assert per_device <= total / 8 * 1.05


def test_without_specs_init_places_nothing_as_before():
    """The default is today's behaviour: momenta are not split (what the
    arguments fix), while the stacks follow statistics_partition_spec."""
    mesh = _mesh()
    optimizer = pj.distributed_shampoo(0.1, BLOCK, **SHARDED)
    with jax.set_mesh(mesh):
        state = jax.jit(optimizer.init)(_params(mesh))
    momentum = state.momentum["w"]
    assert momentum.addressable_shards[0].data.nbytes == momentum.nbytes
    assert state.statistics[0].sharding.spec[0] == "x"


def test_explicit_mesh_places_the_state_by_the_params_types():
    """On a mesh with Explicit axes the specs come from the params' types."""
    mesh = _mesh(AxisType.Explicit)
    optimizer = pj.scale_by_shampoo(
        BLOCK, **{k: v for k, v in SHARDED.items() if k != "sharded_init_fns"}
    )
    with jax.set_mesh(mesh):
        params = _params(mesh)
        state = jax.jit(optimizer.init)(params)
        abstract = jax.eval_shape(optimizer.init, params)
        _, state = jax.jit(optimizer.update)(_gradients(params, 0), state, params)
    _assert_each_device_holds_an_eighth(state)
    for k, p in params.items():
        spec = jax.typeof(p).sharding.spec
        assert jax.typeof(state.momentum[k]).sharding.spec == spec, k
        assert jax.typeof(state.diagonal_statistics[k]).sharding.spec == spec, k
    # eval_shape of init carries the shardings jit(init) gives (the count, a
    # scalar, has none).
    for shape, leaf in zip(jax.tree.leaves(abstract), jax.tree.leaves(state)):
        if leaf.ndim:
            assert shape.sharding.spec == jax.typeof(leaf).sharding.spec


def _run(optimizer, params, steps):
    state = jax.jit(optimizer.init)(params)
    update = jax.jit(optimizer.update)
    outputs = []
    for step in range(steps):
        updates, state = update(_gradients(params, step), state, params)
        outputs.append(updates)
        params = optax.apply_updates(params, updates)
    return outputs, state


def test_sharded_steps_equal_the_unsharded_ones():
    """Four steps (Shampoo from step 1) with the state placed give the updates
    of one device, and leave every leaf where init put it.

    float64: after a few steps the statistics have low rank (condition ~1e6
    with the ridge), so float32 rounding differences between the batched and
    per-device matmul kernels grow to ~1e-3 in the roots; in float64 the same
    logic agrees to 1e-9 (as test_shampoo_optimizer's sharded tests).
    """
    kwargs = dict(start_preconditioning_step=1, weight_decay=1e-3)
    with float64():
        unsharded = pj.distributed_shampoo(
            0.1, BLOCK, graft_type=SHARDED["graft_type"], **kwargs
        )
        want, _ = _run(unsharded, _params(dtype=jnp.float64), 4)
        mesh = _mesh()
        sharded = pj.distributed_shampoo(
            0.1, BLOCK, **SHARDED, **kwargs, params_partition_specs=SPECS, mesh=mesh
        )
        with jax.set_mesh(mesh):
            got, state = _run(sharded, _params(mesh, jnp.float64), 4)
    for step, (u, w) in enumerate(zip(got, want, strict=True)):
        for k in SHAPES:
            np.testing.assert_allclose(
                u[k], w[k], rtol=1e-9, atol=1e-12, err_msg=f"step {step} {k}"
            )
            assert u[k].sharding.is_equivalent_to(
                NamedSharding(mesh, SPECS[k]), u[k].ndim
            )
    _assert_each_device_holds_an_eighth(state)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            dict(params_partition_specs={"w": "x"}),
            TypeError,
            "Invalid params_partition_specs={'w': 'x'}: must be None or a pytree",
        ),
        (dict(mesh="x"), TypeError, "Invalid mesh='x': must be None or a jax"),
    ],
)
def test_bad_placement_arguments_are_refused_at_construction(kwargs, error, message):
    for make in (pj.distributed_shampoo, pj.scale_by_shampoo):
        args = (0.1, BLOCK) if make is pj.distributed_shampoo else (BLOCK,)
        with pytest.raises(error) as raised:
            make(*args, **kwargs)
        assert message in str(raised.value)


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ({"w": P("x")}, "must have the structure of the params"),
        ({**SPECS, "w": P("y")}, "names mesh axes ['y'] that are not in the mesh"),
        ({**SPECS, "b": P("x", None)}, "has 2 entries for an array with 1 dims"),
    ],
    ids=["structure", "axis", "rank"],
)
def test_params_partition_specs_that_do_not_fit_the_params_are_refused(specs, message):
    optimizer = pj.distributed_shampoo(
        0.1, BLOCK, params_partition_specs=specs, mesh=_mesh()
    )
    with pytest.raises(ValueError, match="Invalid params_partition_specs") as raised:
        jax.jit(optimizer.init)(_params())
    assert message in str(raised.value)


def test_params_partition_specs_without_a_mesh_is_a_clear_error():
    optimizer = pj.distributed_shampoo(0.1, BLOCK, params_partition_specs=SPECS)
    with pytest.raises(ValueError, match="needs a mesh"):
        optimizer.init(_params())
