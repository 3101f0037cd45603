"""Bad arguments and inputs of every JAX optimizer get our own error, early.

DESIGN.md §9: an argument is refused at construction, or at ``init`` where the
parameters are first seen, with an error naming the argument, the offending
leaf's path or value, and what is allowed; never a bare JAX error from deep in
the first step. Here:

* masks (``weight_decay_mask``, ``mask``) whose tree does not fit the params',
  callable ones included, are refused at ``init``, naming the path;
* ``scanned_layers`` leaves must be bools (at construction, or at ``init`` for a
  callable);
* ``params_partition_specs`` must divide each parameter's shape, and Shampoo's
  stack specs may only name axes of the mesh (at ``init``);
* ``hessian_helper`` names ``loss_fn``, ``loss_fn_extra_args`` and ``has_aux``;
* a gradient whose shape differs from its parameter's is refused when
  ``update`` is traced, naming the parameter, both shapes;
* Python and NumPy scalars are parameters and gradients, as for optax's own
  optimizers.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import precond.jax as pj

# One row per optimizer family: keyword arguments ↦ optimizer, and the name of
# its mask argument.
FAMILIES = {
    "kron": (
        lambda **kw: pj.kron(1e-2, preconditioner_update_probability=1.0, **kw),
        "weight_decay_mask",
    ),
    "pro": (lambda **kw: pj.pro(1e-2, **kw), "weight_decay_mask"),
    "xmat": (lambda **kw: pj.xmat(1e-2, **kw), "mask"),
    "lra": (lambda **kw: pj.low_rank_approximation(1e-2, **kw), "mask"),
    "affine": (lambda **kw: pj.affine(1e-2, **kw), "mask"),
    "shampoo": (
        lambda **kw: pj.distributed_shampoo(
            1e-2, 4, start_preconditioning_step=1, **kw
        ),
        None,
    ),
    "soap": (
        lambda **kw: pj.soap(1e-2, precondition_frequency=1, **kw),
        "weight_decay_mask",
    ),
}
NAMES = list(FAMILIES)
MASKED = [name for name in NAMES if FAMILIES[name][1] is not None]

PARAMS = {"w": jnp.ones((3, 2)), "b": jnp.ones((2,))}
GRADS = {"w": jnp.full((3, 2), 0.5), "b": jnp.full((2,), -0.5)}


def _make(name, **kwargs):
    return FAMILIES[name][0](**kwargs)


# ------------------------------------------------------------------ masks

# mask ↦ (a regex of the error: the path where it stops fitting the params).
BAD_MASKS = {
    "a key missing": ({"w": True}, r"at the root: .*'b'"),
    "a key too many": ({"w": True, "b": False, "c": True}, r"at the root: .*'c'"),
    "deeper than the params": ({"w": True, "b": {"x": True}}, r"at \['b'\]"),
    "another container": ([True, False], r"at the root: .*list.*dict"),
    "callable, a key missing": (lambda p: {"w": True}, r"at the root: .*'b'"),
}


@pytest.mark.parametrize("case", list(BAD_MASKS))
@pytest.mark.parametrize("name", MASKED)
def test_a_mask_that_does_not_fit_the_params_is_refused_at_init(name, case):
    mask, where = BAD_MASKS[case]
    argument = FAMILIES[name][1]
    optimizer = _make(name, weight_decay=0.1, **{argument: mask})
    with pytest.raises(ValueError, match=rf"Invalid {argument}.*{where}"):
        optimizer.init(PARAMS)


@pytest.mark.parametrize("name", MASKED)
def test_a_callable_mask_returning_a_non_bool_is_refused_at_init(name):
    argument = FAMILIES[name][1]
    optimizer = _make(
        name, weight_decay=0.1, **{argument: lambda p: {"w": "yes", "b": True}}
    )
    with pytest.raises(TypeError, match=rf"Invalid {argument}\['w'\]='yes'"):
        optimizer.init(PARAMS)


NESTED = {"w": jnp.ones((3, 2)), "layer": {"k": jnp.ones(2), "b": jnp.ones(2)}}


@pytest.mark.parametrize(
    ("mask", "params"),
    [
        (True, PARAMS),
        ({"w": True, "b": False}, PARAMS),
        ({"layer": False, "w": True}, NESTED),
        (lambda p: {"layer": True, "w": False}, NESTED),
    ],
    ids=["one bool", "per leaf", "a prefix", "a callable prefix"],
)
def test_masks_that_are_prefixes_of_the_params_still_work(mask, params):
    """A mask is a prefix of the params' tree (optax.masked's rule): one bool
    stands for a whole subtree; the decay applies where it says True."""
    grads = jax.tree.map(jnp.zeros_like, params)
    optimizer = pj.kron(1.0, weight_decay=0.5, weight_decay_mask=mask)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    decayed = optax.masked(optax.add_decayed_weights(0.5), mask)
    want, _ = decayed.update(grads, decayed.init(params), params)
    for got, expected in zip(
        jax.tree.leaves(updates), jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(got, -expected)


# ------------------------------------------------------------------ scanned_layers


def test_scanned_layers_leaves_must_be_bools_at_construction():
    with pytest.raises(TypeError, match=r"Invalid scanned_layers\['b'\]='x'"):
        pj.kron(scanned_layers={"w": True, "b": "x"})


@pytest.mark.parametrize("name", ["kron", "pro"])
def test_a_callable_scanned_layers_returning_a_non_bool_is_refused_at_init(name):
    optimizer = _make(name, scanned_layers=lambda p: {"w": True, "b": "x"})
    with pytest.raises(TypeError, match=r"Invalid scanned_layers\['b'\]='x'"):
        optimizer.init(PARAMS)


@pytest.mark.parametrize(
    ("flags", "error", "message"),
    [
        ({"w": True}, ValueError, r"Invalid scanned_layers: .*at the root: .*'b'"),
        (
            {"w": True, "b": {"x": False}},
            TypeError,
            r"Invalid scanned_layers\['b'\]=\{'x': False\}: must be True or False",
        ),
    ],
    ids=["a key missing", "deeper than the params"],
)
@pytest.mark.parametrize("name", ["kron", "pro"])
def test_scanned_layers_that_do_not_fit_the_params_name_the_path(
    name, flags, error, message
):
    optimizer = _make(name, scanned_layers=flags)
    with pytest.raises(error, match=message):
        optimizer.init(PARAMS)


# ------------------------------------------------------------------ meshes


def _mesh():
    return jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)


SHARDED = ["kron", "pro", "xmat", "affine", "shampoo", "soap"]


@pytest.mark.parametrize("name", SHARDED)
def test_params_partition_specs_must_divide_the_shapes(name):
    """(6, 5) split 2 × 4 ways: 4 does not divide 5."""
    params = {"w": jnp.ones((6, 5)), "b": jnp.ones((5,))}
    specs = {"w": P("fsdp", "tp"), "b": P()}
    with jax.set_mesh(_mesh()):
        optimizer = _make(name, params_partition_specs=specs)
        with pytest.raises(
            ValueError,
            match=r"Invalid params_partition_specs\['w'\]=P\('fsdp', 'tp'\): "
            r".*dim 1 .*\(6, 5\).*'tp'.*4",
        ):
            optimizer.init(params)


def test_pro_params_partition_specs_name_missing_mesh_axes():
    with jax.set_mesh(_mesh()):
        optimizer = pj.pro(params_partition_specs={"w": P("x"), "b": P()})
        with pytest.raises(ValueError, match=r"params_partition_specs\['w'\].*'x'"):
            optimizer.init(PARAMS)


@pytest.mark.parametrize("seed_init", [False, True], ids=["init", "seed's init_fn"])
@pytest.mark.parametrize(
    "argument", ["preconditioner_partition_spec", "statistics_partition_spec"]
)
def test_shampoo_stack_specs_must_name_axes_of_the_mesh(argument, seed_init):
    """With sharded_init_fns (the seed's default), ``init`` returns the seed's
    InitFnState, whose ``init_fn`` makes the state: it checks the specs."""
    optimizer = pj.distributed_shampoo(
        1e-2,
        4,
        shard_optimizer_states=True,
        sharded_init_fns=seed_init,
        **{argument: P("x")},
    )
    with jax.set_mesh(_mesh()):
        init = optimizer.init(PARAMS).init_fn if seed_init else optimizer.init
        with pytest.raises(
            ValueError, match=rf"Invalid {argument}=P\('x',?\): .*'x'.*fsdp"
        ):
            init(PARAMS)


def test_shampoo_preconditioner_partition_spec_is_checked_without_sharded_states():
    optimizer = pj.distributed_shampoo(
        1e-2, 4, preconditioner_partition_spec=P("x", None, None)
    )
    with (
        jax.set_mesh(_mesh()),
        pytest.raises(ValueError, match=r"Invalid preconditioner_partition_spec"),
    ):
        optimizer.init(PARAMS)


# ------------------------------------------------------------------ hessian_helper

KEY = jax.random.PRNGKey(0)


def _loss_with_target(params, target):
    return jnp.sum((params["w"] - target) ** 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(loss_fn=3), TypeError, r"Invalid loss_fn=3: must be a callable"),
        (
            dict(loss_fn=_loss_with_target, loss_fn_extra_args=3.0),
            TypeError,
            r"Invalid loss_fn_extra_args=3.0: must be a tuple",
        ),
        (
            dict(loss_fn=_loss_with_target, loss_fn_extra_args={"target": 1.0}),
            TypeError,
            r"Invalid loss_fn_extra_args=\{'target': 1.0\}: must be a tuple",
        ),
        (
            dict(loss_fn=_loss_with_target),
            TypeError,
            r"Invalid loss_fn_extra_args=\(\): .*target",
        ),
        (
            dict(loss_fn=_loss_with_target, loss_fn_extra_args=(1.0, 2.0)),
            TypeError,
            r"Invalid loss_fn_extra_args=\(1.0, 2.0\): .*too many",
        ),
        (
            dict(loss_fn=_loss_with_target, loss_fn_extra_args=(1.0,), has_aux=True),
            TypeError,
            r"Invalid has_aux=True: .*\(loss, aux\)",
        ),
        (
            dict(loss_fn=lambda p: (jnp.sum(p["w"]), 1.0)),
            TypeError,
            r"Invalid has_aux=False: .*tuple",
        ),
        (
            dict(loss_fn=_loss_with_target, loss_fn_extra_args=(1.0,), has_aux="no"),
            TypeError,
            r"Invalid has_aux='no': must be True or False",
        ),
    ],
    ids=[
        "loss_fn not callable",
        "extra args not a tuple",
        "extra args a dict",
        "extra args missing",
        "extra args too many",
        "has_aux without aux",
        "aux without has_aux",
        "has_aux not a bool",
    ],
)
def test_hessian_helper_names_the_bad_argument(kwargs, error, message):
    params = {"w": jnp.ones(3)}
    with pytest.raises(error, match=message):
        pj.hessian_helper(KEY, params=params, **kwargs)


def test_hessian_helper_takes_a_list_of_extra_args():
    params = {"w": jnp.ones(3)}
    loss, *_ = pj.hessian_helper(KEY, 0, _loss_with_target, params, [0.5])
    np.testing.assert_allclose(loss, 0.75)


# ------------------------------------------------------------------ shapes


@pytest.mark.parametrize("with_params", [True, False], ids=["params", "no params"])
@pytest.mark.parametrize("shape", [(3, 3), (2, 3)], ids=["other", "transposed"])
@pytest.mark.parametrize("name", NAMES)
def test_a_gradient_of_another_shape_is_named(name, shape, with_params):
    optimizer = _make(name)
    state = optimizer.init(PARAMS)
    grads = {"w": jnp.ones(shape), "b": jnp.ones((2,))}
    params = PARAMS if with_params else None
    with pytest.raises(
        ValueError,
        match=rf"gradient of parameter \['w'\] has shape {re.escape(str(shape))}, "
        r"expected \(3, 2\)",
    ):
        jax.jit(optimizer.update)(grads, state, params)


def test_a_gradient_tree_of_another_structure_is_named():
    optimizer = _make("kron")
    state = optimizer.init(PARAMS)
    with pytest.raises(ValueError, match=r"gradients.*structure.*'c'"):
        optimizer.update({"w": GRADS["w"], "c": GRADS["b"]}, state, PARAMS)


# ------------------------------------------------------------------ scalars


@pytest.mark.parametrize("name", NAMES)
def test_python_and_numpy_scalars_are_parameters_and_gradients(name):
    """As for optax's own optimizers: {"w": 1.0} is a tree of one scalar
    parameter; the updates equal those of the same values as arrays."""
    optimizer = _make(name)
    scalars = {"w": 1.0, "v": np.float32(2.0), "m": jnp.ones((2, 2))}
    grads = {"w": 0.5, "v": np.float32(-0.25), "m": jnp.full((2, 2), 0.1)}
    as_arrays = jax.tree.map(jnp.asarray, scalars)
    want_state = optimizer.init(as_arrays)
    state = optimizer.init(scalars)
    want, want_state = optimizer.update(
        jax.tree.map(jnp.asarray, grads), want_state, as_arrays
    )
    got, state = optimizer.update(grads, state, scalars)
    for g, w in zip(jax.tree.leaves((got, state)), jax.tree.leaves((want, want_state))):
        np.testing.assert_array_equal(g, w)
    # optax's own optimizer on the same scalars, for the contract.
    adam = optax.adam(1e-2)
    adam_updates, _ = adam.update(grads, adam.init(scalars), scalars)
    assert jax.tree.structure(got) == jax.tree.structure(adam_updates)
