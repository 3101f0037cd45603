"""Kron on a mesh of 8 simulated CPU devices equals Kron on one (DESIGN.md §7.4).

Float64 runs agree to 1e-10: sharding changes only the order of a few reductions
(the finiteness check and the per-parameter RMS), never the math of a unit, since
each unit is fitted whole on one device and the noise is keyed by unit identity.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import precond.jax as pj
from precond.bench.hlo import received_bytes
from tests.jax.helpers import float64

SHAPES = {
    "emb": (64, 32),
    "w1": (32, 48),
    "b1": (48,),
    "layers": (8, 16, 32),
    "w2": (48, 10),
}
SCANNED = {name: name == "layers" for name in SHAPES}
# Placements: replicated (b1 on the (8,) mesh), rows, columns, the scanned axis.
PLACEMENTS = {
    "fsdp": {
        "emb": P(None, "fsdp"),
        "w1": P("fsdp", None),
        "b1": P(),
        "layers": P("fsdp", None, None),
        "w2": P(None, None),
    },
    "fsdp,tp": {
        "emb": P(None, "tp"),
        "w1": P("fsdp", "tp"),
        "b1": P("tp"),
        "layers": P(None, "fsdp", "tp"),
        "w2": P("fsdp", None),
    },
}
MESHES = {"fsdp": ((8,), ("fsdp",)), "fsdp,tp": ((2, 4), ("fsdp", "tp"))}
KWARGS = dict(
    preconditioner_update_probability=1.0,
    scanned_layers=SCANNED,
    partition_grads_into_blocks=True,
    block_size=16,
)


def _mesh(name, axis_type=AxisType.Auto):
    shape, axes = MESHES[name]
    return jax.make_mesh(shape, axes, axis_types=(axis_type,) * len(axes))


def _grads(steps, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {k: jnp.asarray(rng.normal(size=s), dtype) for k, s in SHAPES.items()}
        for _ in range(steps)
    ]


def _put(tree, mesh, specs):
    return jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
    )


def _run(optimizer, grads, put=lambda t: t):
    params = put({k: jnp.zeros(s, grads[0][k].dtype) for k, s in SHAPES.items()})
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    outputs = []
    for g in grads:
        updates, state = update(put(g), state)
        outputs.append(updates)
    return outputs, state


def _unsharded(grads, **kwargs):
    return _run(pj.scale_by_kron(**KWARGS, **kwargs), grads)


@functools.cache
def _unsharded_float64(lax_map):
    """5 float64 steps on one device: the reference of every float64 sharded run
    (whatever the mesh and specs), computed once per worker."""
    with float64():
        grads = _grads(5, jnp.float64)
        kwargs = dict(precond_dtype=jnp.float64, lax_map_scanned_layers=lax_map)
        return grads, *_unsharded(grads, **kwargs)


def _assert_close(got, want, rtol, atol):
    for got_step, want_step in zip(got, want, strict=True):
        for k in SHAPES:
            np.testing.assert_allclose(got_step[k], want_step[k], rtol=rtol, atol=atol)


# Mesh × factor spec (inferred or given) × scanned layers (vmap or lax.map): the 4
# cases of a pairwise covering array, so every pair of choices meets once (the
# three choices act on separate parts of the update; the full product adds 4
# more compiles of an 8-device program and no new interaction).
PAIRWISE_CASES = [
    pytest.param("fsdp", None, False, id="fsdp-inferred-vmap"),
    pytest.param("fsdp", P("fsdp", None), True, id="fsdp-P-lax_map"),
    pytest.param("fsdp,tp", None, True, id="fsdp,tp-inferred-lax_map"),
    pytest.param("fsdp,tp", P("fsdp", None), False, id="fsdp,tp-P-vmap"),
]


@pytest.mark.parametrize(
    ("mesh_name", "preconditioner_partition_spec", "lax_map"), PAIRWISE_CASES
)
def test_sharded_equals_unsharded_float64(
    mesh_name, preconditioner_partition_spec, lax_map
):
    _assert_sharded_equals_unsharded(mesh_name, preconditioner_partition_spec, lax_map)


def test_sharded_fit_in_batches_equals_unsharded(monkeypatch):
    """A stack fitted in batches (as on a CPU for units smaller than their
    largest factor; here batches of 2 are forced on the 4 units per shard of the
    16×16 blocks) is fitted shard by shard, batch by batch, and equals the
    one-device run fitted in one vmap."""
    _unsharded_float64(False)  # the reference, computed before the patch
    step_module = importlib.import_module("precond.jax.kron._step")
    units_per_shard = []

    def in_pairs(units, G, factors):
        units_per_shard.append(units)
        return 2 if units == 4 else None

    monkeypatch.setattr(step_module, "_fit_batch_size", in_pairs)
    _assert_sharded_equals_unsharded("fsdp,tp", None, lax_map=False)
    assert 4 in units_per_shard


def _assert_sharded_equals_unsharded(mesh_name, preconditioner_partition_spec, lax_map):
    """5 float64 steps on ``mesh_name`` equal :func:`_unsharded_float64`'s."""
    mesh, specs = _mesh(mesh_name), PLACEMENTS[mesh_name]
    grads, want, want_state = _unsharded_float64(lax_map)
    with float64():
        optimizer = pj.scale_by_kron(
            **KWARGS,
            precond_dtype=jnp.float64,
            lax_map_scanned_layers=lax_map,
            params_partition_specs=specs,
            preconditioner_partition_spec=preconditioner_partition_spec,
        )
        with jax.set_mesh(mesh):
            got, state = _run(optimizer, grads, lambda t: _put(t, mesh, specs))
    _assert_close(got, want, rtol=1e-10, atol=1e-14)
    for k in SHAPES:
        np.testing.assert_allclose(state.mu[k], want_state.mu[k], rtol=1e-12)
    # The factors of the real units agree too (the sharded stacks add empty ones).
    for got_f, want_f in zip(
        jax.tree.leaves(state.preconditioners),
        jax.tree.leaves(want_state.preconditioners),
        strict=True,
    ):
        np.testing.assert_allclose(got_f[: len(want_f)], want_f, rtol=1e-9, atol=1e-12)


def test_sharded_equals_unsharded_float32():
    """Float32: 1e-4 relative. The factor fit divides by a norm lower bound and
    compounds rounding over 5 steps; reordered float32 reductions (RMS, the
    damping mean) move results by a few ulps per step, and the fit amplifies that."""
    mesh, specs = _mesh("fsdp,tp"), PLACEMENTS["fsdp,tp"]
    grads = _grads(5, jnp.float32)
    want, _ = _unsharded(grads)
    optimizer = pj.scale_by_kron(**KWARGS, params_partition_specs=specs)
    with jax.set_mesh(mesh):
        got, _ = _run(optimizer, grads, lambda t: _put(t, mesh, specs))
    _assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_explicit_mesh_needs_no_spec_arguments():
    """On an explicit mesh the shardings come from the params' types."""
    mesh, specs = _mesh("fsdp,tp", AxisType.Explicit), PLACEMENTS["fsdp,tp"]
    grads, want, _ = _unsharded_float64(False)  # lax_map_scanned_layers: default
    grads, want = grads[:3], want[:3]
    with float64():
        optimizer = pj.scale_by_kron(**KWARGS, precond_dtype=jnp.float64)
        with jax.set_mesh(mesh):
            put = lambda t: _put(t, mesh, specs)  # noqa: E731
            abstract = jax.eval_shape(optimizer.init, put(_zeros(jnp.float64)))
            got, state = _run(optimizer, grads, put)
    _assert_close(got, want, rtol=1e-10, atol=1e-14)
    for k, spec in specs.items():
        assert got[-1][k].sharding.spec == spec
        assert state.mu[k].sharding.spec == spec
    # eval_shape of init carries the state's shardings, equal to the real ones.
    for shape, leaf in zip(
        jax.tree.leaves(abstract), jax.tree.leaves(state), strict=True
    ):
        assert shape.sharding.spec == leaf.sharding.spec
    # Unit axes inferred in the order the specs first name them (b1: tp).
    for factor in jax.tree.leaves(state.preconditioners):
        assert factor.sharding.spec[0] == ("tp", "fsdp")
        assert set(factor.sharding.spec[1:]) <= {None}


def _zeros(dtype=jnp.float32):
    return {k: jnp.zeros(s, dtype) for k, s in SHAPES.items()}


def test_state_shardings_are_as_intended_and_stable():
    """After init and after every update: momentum like its parameter, factor stacks
    split along their unit axis, counters replicated; the step compiles once."""
    mesh, specs = _mesh("fsdp,tp"), PLACEMENTS["fsdp,tp"]
    optimizer = pj.kron(**KWARGS, params_partition_specs=specs)
    with jax.set_mesh(mesh):
        params = _put(_zeros(), mesh, specs)
        state = optimizer.init(params)
        want = pj.get_opt_state_partition_specs(
            params, **KWARGS, params_partition_specs=specs
        )
        update = jax.jit(optimizer.update)
        for step, grads in enumerate(_grads(3, jnp.float32)):
            is_spec = lambda x: isinstance(x, P)  # noqa: E731
            for spec, leaf in zip(
                jax.tree.leaves(want, is_leaf=is_spec),
                jax.tree.leaves(state),
                strict=True,
            ):
                assert leaf.sharding.is_equivalent_to(
                    NamedSharding(mesh, spec), leaf.ndim
                ), (step, spec, leaf.sharding)
            updates, state = update(_put(grads, mesh, specs), state)
            for k, spec in specs.items():
                assert updates[k].sharding.is_equivalent_to(
                    NamedSharding(mesh, spec), len(SHAPES[k])
                ), (k, updates[k].sharding)
    assert update._cache_size() == 1
    kron_state = state[0]
    assert kron_state.mu["w1"].sharding.spec == P("fsdp", "tp")
    for factor in jax.tree.leaves(kron_state.preconditioners):
        assert factor.sharding.spec[0] == ("tp", "fsdp")
        assert set(factor.sharding.spec[1:]) <= {None}


def _bytes_per_device(tree):
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def test_factor_memory_per_device_shrinks_with_devices():
    """4 layers of 256×256 in 64-blocks: 64 units of two 64×64 factors. Over 8
    devices each holds 8 units, an eighth of the one-device state."""
    params = {"w": jnp.zeros((4, 256, 256))}
    kwargs = dict(
        scanned_layers={"w": True}, partition_grads_into_blocks=True, block_size=64
    )
    alone = pj.scale_by_kron(**kwargs).init(params)
    mesh = _mesh("fsdp,tp")
    specs = {"w": P(None, "fsdp", "tp")}
    with jax.set_mesh(mesh):
        shared = pj.scale_by_kron(**kwargs, params_partition_specs=specs).init(
            _put(params, mesh, specs)
        )
    one = _bytes_per_device(alone.preconditioners)
    eight = _bytes_per_device(shared.preconditioners)
    assert one / eight == pytest.approx(8.0)


def test_update_step_communicates_at_most_three_times_the_gradient():
    """No hidden all-gather of the factors: one device receives at most ~3× the
    gradient bytes per step (at update probability 1). The design moves the
    gradient into units once (1×) and the update back once (1× plus padding units;
    plus small all-to-alls assembling stacks); gathering the factors would add
    their size, about 2× the gradient here (two 16×16 factors per 16×16 block)."""
    mesh, specs = _mesh("fsdp,tp"), PLACEMENTS["fsdp,tp"]
    optimizer = pj.scale_by_kron(**KWARGS, params_partition_specs=specs)
    with jax.set_mesh(mesh):
        params = _put(_zeros(), mesh, specs)
        state = optimizer.init(params)
        hlo = jax.jit(optimizer.update).lower(params, state).compile().as_text()
        factor_bytes = sum(x.nbytes for x in jax.tree.leaves(state.preconditioners))
    grad_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert factor_bytes > 2 * grad_bytes
    assert received_bytes(hlo, 8) <= 3 * grad_bytes


def test_get_opt_state_partition_specs_without_mesh():
    """The helper needs no mesh (it only names axes) and follows the seed's call."""
    specs = PLACEMENTS["fsdp,tp"]
    shapes = jax.eval_shape(_zeros)
    got = pj.get_opt_state_partition_specs(
        shapes,
        learning_rate=0.1,
        weight_decay=0.01,
        params_partition_specs=specs,
        preconditioner_partition_spec=P("fsdp", None),
        **KWARGS,
    )
    kron_specs = got[0]
    # Specs come back as jit spells them: without trailing Nones.
    assert kron_specs.mu == {**specs, "w2": P("fsdp")}
    assert kron_specs.count == P()
    assert set(jax.tree.leaves(kron_specs.preconditioners)) == {P("fsdp")}
    only = pj.get_opt_state_partition_specs(
        shapes,
        scale_by_kron_only=True,
        learning_rate=0.1,
        params_partition_specs=specs,
        **KWARGS,
    )
    assert isinstance(only, pj.KronState)
    assert set(jax.tree.leaves(only.preconditioners)) == {P(("tp", "fsdp"))}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(params_partition_specs={"w": P("fsdp")}),
            r"Invalid params_partition_specs: must have the structure of the params",
        ),
        (
            dict(params_partition_specs={"w": P("data"), "b": P()}),
            r"Invalid params_partition_specs\['w'\]=P\('data',\): names "
            r"mesh axes \['data'\] that are not in the mesh",
        ),
        (
            dict(params_partition_specs={"w": P("fsdp", None, None), "b": P()}),
            r"has 3 entries for an array with 2 dims",
        ),
        (
            dict(preconditioner_partition_spec=P("model")),
            r"Invalid preconditioner_partition_spec=P\('model',\): names mesh axes "
            r"\['model'\] that are not in the mesh, whose axes are \('fsdp',\)",
        ),
        (
            dict(params_partition_specs={"w": "fsdp", "b": P()}),
            r"Invalid params_partition_specs\['w'\]='fsdp': must be a PartitionSpec",
        ),
        (
            dict(scanned_layers={"w": True}),
            r"Invalid scanned_layers: must have the structure of the params",
        ),
    ],
)
def test_bad_sharding_arguments(kwargs, message):
    params = {"w": jnp.zeros((8, 8)), "b": jnp.zeros(8)}
    with jax.set_mesh(_mesh("fsdp")), pytest.raises(ValueError, match=message):
        pj.kron(**kwargs).init(params)


def test_specs_without_a_mesh_are_an_error():
    optimizer = pj.kron(params_partition_specs={"w": P("fsdp")})
    with pytest.raises(ValueError, match="need a mesh"):
        optimizer.init({"w": jnp.zeros(8)})


def test_preconditioner_partition_spec_must_be_a_partition_spec():
    with pytest.raises(ValueError, match="Invalid preconditioner_partition_spec"):
        pj.kron(preconditioner_partition_spec=("fsdp", None))


def test_state_from_another_mesh_is_an_error():
    params = {"w": jnp.zeros((4, 16, 16))}
    kwargs = dict(
        scanned_layers={"w": True}, params_partition_specs={"w": P(None, "fsdp")}
    )
    with jax.set_mesh(_mesh("fsdp")):
        state = pj.kron(**kwargs).init(params)  # 4 units padded to 8
    with (
        jax.set_mesh(jax.make_mesh((2,), ("fsdp",), devices=jax.devices()[:2])),
        pytest.raises(ValueError, match="does not match these parameters"),
    ):
        pj.kron(**kwargs).update(params, state)


def test_sharded_newton_mode_equals_unsharded():
    """Kron fitted to (H·v, v) pairs: the vectors are stacked and split like the
    gradients (float64, 1e-10)."""
    mesh, specs = _mesh("fsdp,tp"), PLACEMENTS["fsdp,tp"]
    with float64():
        grads, hvps, vectors = (_grads(3, jnp.float64, seed=s) for s in (0, 1, 2))

        def run(optimizer, put):
            params = put(_zeros(jnp.float64))
            state = optimizer.init(params)
            update = jax.jit(optimizer.update)
            outputs = []
            for g, h, v in zip(grads, hvps, vectors, strict=True):
                updates, state = update(
                    put(g), state, Hvp=put(h), vector=put(v), update_preconditioner=True
                )
                outputs.append(updates)
            return outputs

        kwargs = dict(precond_dtype=jnp.float64, **KWARGS)
        want = run(pj.scale_by_kron(**kwargs), lambda t: t)
        with jax.set_mesh(mesh):
            got = run(
                pj.scale_by_kron(**kwargs, params_partition_specs=specs),
                lambda t: _put(t, mesh, specs),
            )
    _assert_close(got, want, rtol=1e-10, atol=1e-14)
