"""precond.jax.distributed_shampoo as an optax optimizer: the conformance table
(DESIGN.md §7.3), sharded and data-parallel runs against one device, the int8/int16
memory mode against float32, failed inverse roots, checkpoints and bad input.

The numerics of one step against a float64 reference are in
test_shampoo_reference.py, the matrix functions in test_shampoo_math.py.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import shard_map
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import precond.jax as pj
from precond.jax.shampoo._config import ARGUMENT_CHECKS as SHAMPOO_ARGUMENT_CHECKS
from tests.jax.helpers import assert_skipped_once, float64, without_skip_counts
from tests.jax.test_optax_contract import (
    NOISY_STEPS,
    _adam_noisy_loss,
    _noisy_run,
    _quadratic,
    _train,
)

PARAMS = {"w": jnp.ones((6, 5)), "b": jnp.zeros(5), "conv": jnp.ones((3, 2, 2, 2))}
# With BLOCK = 16: uneven blocks (40 = 16 + 16 + 8), a 3-D tensor merged to (6, 8),
# a bias and a scalar.
BLOCK = 16
BLOCKED_PARAMS = {
    "w": jnp.full((40, 12), 0.1),
    "b": jnp.zeros(12),
    "c": jnp.ones((2, 3, 8)),
    "s": jnp.ones(()),
}


def _gradients(params, step):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(step), len(leaves))
    return treedef.unflatten(
        [jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves)]
    )


def _run(optimizer, params, steps, update=None, state=None):
    """Params and state after ``steps`` jitted steps on _gradients(·, step)."""
    state = optimizer.init(params) if state is None else state
    update = update or jax.jit(optimizer.update)
    for step in range(steps):
        updates, state = update(_gradients(params, step), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _assert_trees_close(got, want, **tolerance):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **tolerance), got, want)


# ------------------------------------------------------------- conformance table


def _shampoo(graft, learning_rate, **kwargs):
    return pj.distributed_shampoo(
        learning_rate, 128, graft_type=graft, start_preconditioning_step=1, **kwargs
    )


GRAFTS = [pj.GraftingType.SGD, pj.GraftingType.RMSPROP_NORMALIZED]


@pytest.mark.optimized_xla
@pytest.mark.parametrize("graft", GRAFTS, ids=lambda g: g.name)
def test_beats_adam_on_noisy_ill_conditioned_quadratic(graft):
    """½ tr(XᵀAXB) with rotated A, B (condition 1e3, 1e2) and curvature-shaped
    noise: Shampoo's best of 3 rates (cosine decay) beats Adam's best of 6."""
    loss, _, x0 = _quadratic("kronecker")
    run = _noisy_run(
        "shampoo",
        False,
        lambda lr: _shampoo(graft, optax.cosine_decay_schedule(lr, NOISY_STEPS)),
        "kronecker",
    )
    finals = {lr: float(run(lr)) for lr in (1.0, 0.1, 0.01)}
    adam = _adam_noisy_loss("kronecker")
    best = min(finals.values())
    assert best < float(loss(x0)) / 50, finals
    assert best < adam, (finals, adam)


@pytest.mark.optimized_xla
def test_converges_on_deterministic_ill_conditioned_quadratic_with_sgd_grafting():
    """1e-4 of the initial loss within 2000 steps. (RMSProp-normalized grafting at
    0.03, the same run, is the contract table's Shampoo row: test_optax_contract.)"""
    loss, _, x0 = _quadratic("kronecker")
    optimizer = _shampoo(pj.GraftingType.SGD, optax.cosine_decay_schedule(1.0, 2000))
    final = float(_train("shampoo", False, optimizer, loss, x0, 2000)[1][-1])
    assert final < 1e-4 * float(loss(x0)), final


def test_converges_on_rosenbrock():
    """Within 1e-3 of (1, 1) from (−1.5, 2) in 2000 steps, with RMSProp-normalized
    grafting. (SGD grafting takes SGD's step lengths, which blow up on the steep
    valley walls exactly as SGD does at any rate above 1e-3.)"""

    def rosenbrock(params):
        x, y = params["xy"][:, 0]
        return (1 - x) ** 2 + 100 * (y - x**2) ** 2

    params = {"xy": jnp.array([[-1.5], [2.0]])}
    optimizer = pj.distributed_shampoo(
        optax.cosine_decay_schedule(0.01, 2000),
        128,
        beta2=0.99,
        graft_type=pj.GraftingType.RMSPROP_NORMALIZED,
    )
    end, _ = _train("shampoo", False, optimizer, rosenbrock, params, 2000)
    np.testing.assert_allclose(end["xy"], 1.0, atol=1e-3)


CONFIGS = {
    "default": {},
    "adagrad-memory": dict(
        graft_type=pj.GraftingType.ADAGRAD,
        best_effort_memory_usage_reduction=True,
        quantize_statistics=True,
        weight_decay=1e-3,
    ),
    "sqrt_n-every-2": dict(
        graft_type=pj.GraftingType.SQRT_N,
        preconditioning_compute_steps=2,
        statistics_compute_steps=2,
        eigh=True,
    ),
}


@pytest.mark.parametrize("config", CONFIGS)
def test_one_compile_for_many_donated_steps(config):
    optimizer = pj.distributed_shampoo(0.01, 4, **CONFIGS[config])
    traces = []

    def update(grads, state):
        traces.append(1)
        return optimizer.update(grads, state, PARAMS)

    update = jax.jit(update, donate_argnums=1)
    state = optimizer.init(PARAMS)
    for step in range(3):
        _, state = update(_gradients(PARAMS, step), state)
    assert len(traces) == 1


def test_inject_hyperparams_gives_same_updates():
    """Hyperparameters as traced float32 arrays give the plain updates.

    The two programs differ (constants vs traced scalars), so where the CPU has
    FMA, XLA:CPU fuses different multiply-adds and the statistics differ by up to
    an ulp (bitwise equal under XLA_FLAGS=--xla_cpu_max_isa=AVX, which has no
    FMA). The comparison is made well-posed so that no CPU's rounding reaches it:

    - matrix_epsilon = 2⁻⁴: the relative ridge bounds the condition number of
      S + ε·λ_max·I by 1 + 1/ε = 17, so an ulp in S moves the roots by about
      17/p ulp. (At 2⁻¹⁷ the rank ≤ 4 statistics of the bias and of the 4×1
      block reached condition 1e5: the exact roots of two statistics an ulp
      apart differed by 3e-4, and the updates by 4.5e-5 with AVX2.)
    - per leaf, the error is measured against its largest entry: an entry that
      happens to be near 0 has no meaningful relative error.

    Powers of two keep the hyperparameters exact in float32 (1 − β2 of a float32
    β2 = 0.99 differs from Python's by 5e-6 relative)."""
    kwargs = dict(
        learning_rate=2.0**-8,
        block_size=4,
        beta1=0.5,
        beta2=0.75,
        weight_decay=2.0**-3,  # large enough that a 0.1% error in it shows
        matrix_epsilon=2.0**-4,
        start_preconditioning_step=2,
        graft_type=pj.GraftingType.RMSPROP,
    )
    injected = optax.inject_hyperparams(
        pj.distributed_shampoo, static_args=pj.SHAMPOO_STATIC_ARGS
    )(**kwargs)
    plain = pj.distributed_shampoo(**kwargs)
    states = [plain.init(PARAMS), injected.init(PARAMS)]
    updates = [jax.jit(plain.update), jax.jit(injected.update)]
    for step in range(4):
        grads = _gradients(PARAMS, step)
        want, states[0] = updates[0](grads, states[0], PARAMS)
        got, states[1] = updates[1](grads, states[1], PARAMS)
        # Measured max|got − want| / max|want|: <= 2.2e-7 (AVX2, AVX-512), 0
        # without FMA. Off by 1e-4 in lr, β1 or β2, or by 1e-3 in λ or ε: >= 7e-5.
        for name in want:
            scale = float(jnp.max(jnp.abs(want[name])))
            np.testing.assert_allclose(
                got[name], want[name], rtol=0, atol=1e-5 * scale, err_msg=name
            )


def test_multisteps_equals_one_step_on_the_mean_gradient():
    micro = [_gradients(PARAMS, 0), _gradients(PARAMS, 1)]
    optimizer = pj.distributed_shampoo(0.01, 4, start_preconditioning_step=0)
    accumulated = optax.MultiSteps(optimizer, every_k_schedule=2)
    state = accumulated.init(PARAMS)
    first, state = jax.jit(accumulated.update)(micro[0], state, PARAMS)
    for leaf in jax.tree.leaves(first):
        np.testing.assert_array_equal(leaf, 0.0)
    second, _ = jax.jit(accumulated.update)(micro[1], state, PARAMS)
    mean = jax.tree.map(lambda a, b: (a + b) / 2, *micro)
    want, _ = jax.jit(optimizer.update)(mean, optimizer.init(PARAMS), PARAMS)
    _assert_trees_close(second, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_update_and_state_dtypes_are_stable(config, dtype):
    params = {"w": jnp.ones((6, 5), dtype), "b": jnp.zeros(5, jnp.float32)}
    optimizer = pj.distributed_shampoo(0.01, 4, **CONFIGS[config])
    state = optimizer.init(params)
    before = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    update = jax.jit(optimizer.update)
    for step in range(3):
        grads = _gradients(params, step)
        updates, state = update(grads, state, params)
        assert jax.tree.map(lambda u: u.dtype, updates) == jax.tree.map(
            lambda g: g.dtype, grads
        )
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == before


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_non_finite_gradient_skips_the_step(bad):
    """Zero update and the whole state unchanged (count included), but for its
    count of skipped steps."""
    optimizer = pj.distributed_shampoo(0.01, 4, start_preconditioning_step=0)
    update = jax.jit(optimizer.update)
    _, state = update(_gradients(PARAMS, 0), optimizer.init(PARAMS), PARAMS)
    grads = _gradients(PARAMS, 1)
    grads["w"] = grads["w"].at[2, 3].set(bad)
    updates, new_state = update(grads, state, PARAMS)
    for leaf in jax.tree.leaves(updates):
        np.testing.assert_array_equal(leaf, 0.0)
    assert_skipped_once(new_state, state)


# --------------------------------------------------------------- distribution


def _mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


SHARDED_MODES = {
    "stored-and-computed": dict(
        shard_optimizer_states=True,
        preconditioner_partition_spec=P("data", None, None),
        sharded_init_fns=False,  # init returns the state, not the seed's triple
        precondition_with_previous_roots=False,  # the default follows the seed
    ),
    # The default of the sharded mode, as Google's: each step preconditions
    # with the roots of the step before; unsharded with the same option agrees.
    "stored-previous-roots": dict(
        shard_optimizer_states=True,
        preconditioner_partition_spec=P("data", None, None),
        sharded_init_fns=False,
    ),
    "computed-only": dict(preconditioner_partition_spec=P("data", None, None)),
}


@pytest.mark.parametrize("mode", SHARDED_MODES)
def test_sharded_equals_unsharded_on_8_devices(mode):
    """Stacks split over 8 devices (each computes the roots of its rows) give the
    same parameters as one device.

    float64: after 4 steps the statistics have rank <= 4 (condition ~1e6 with the
    ridge), so float32 rounding differences between batched and unbatched matmul
    kernels grow to 1e-3 in the roots; in float64 the same logic agrees to 1e-9.
    """
    kwargs = dict(start_preconditioning_step=1, **SHARDED_MODES[mode])
    with float64():
        params = jax.tree.map(lambda x: x.astype(jnp.float64), BLOCKED_PARAMS)
        previous = mode == "stored-previous-roots"
        unsharded = pj.distributed_shampoo(
            0.1,
            BLOCK,
            start_preconditioning_step=1,
            precondition_with_previous_roots=previous,
        )
        want, _ = _run(unsharded, params, 4)
        with jax.set_mesh(_mesh()):
            optimizer = pj.distributed_shampoo(0.1, BLOCK, **kwargs)
            got, state = _run(optimizer, params, 4)
    for stack in state.statistics:
        values = stack.values if hasattr(stack, "values") else stack
        assert values.shape[0] % 8 == 0
        if kwargs.get("shard_optimizer_states"):
            assert values.sharding.spec[0] == "data"
            assert values.addressable_shards[0].data.shape[0] == values.shape[0] // 8
    _assert_trees_close(got, want, rtol=1e-9, atol=1e-9)


def test_sharded_memory_mode_trains_like_unsharded_memory_mode():
    """int16 statistics and roots stored split over 8 devices train like the
    unsplit memory mode: per tensor, the two runs differ by < 1% of how far the
    parameters moved in 6 steps.

    Not bit for bit: quantization runs in float32, and a last-ulp difference
    between the batched and per-device matmul kernels (~1e-6 in float32 runs
    without quantization) can flip an int16 rounding, a relative change of 3e-5
    in a statistic that the roots amplify (measured: up to 2.4e-3 of the movement).
    """
    kwargs = dict(
        start_preconditioning_step=1,
        best_effort_memory_usage_reduction=True,
        quantize_statistics=True,  # int16 statistics outside pmap too
    )
    want, _ = _run(pj.distributed_shampoo(0.01, 128, **kwargs), PARAMS, 6)
    with jax.set_mesh(_mesh()):
        optimizer = pj.distributed_shampoo(
            0.01,
            128,
            shard_optimizer_states=True,
            sharded_init_fns=False,
            statistics_partition_spec=P("data", None, None),
            precondition_with_previous_roots=False,  # as unsharded
            **kwargs,
        )
        got, state = _run(optimizer, PARAMS, 6)
    assert state.statistics[0].values.sharding.spec[0] == "data"
    assert state.statistics[0].values.dtype == jnp.int16
    for name in PARAMS:
        moved = np.linalg.norm(want[name] - PARAMS[name])
        assert np.linalg.norm(got[name] - want[name]) < 0.01 * moved, name


def test_named_sharding_needs_no_ambient_mesh():
    """A NamedSharding carries its mesh: no jax.set_mesh around the calls."""
    spec = NamedSharding(_mesh(), P("data", None, None))
    optimizer = pj.distributed_shampoo(0.1, BLOCK, preconditioner_partition_spec=spec)
    got, _ = _run(optimizer, BLOCKED_PARAMS, 2)
    want, _ = _run(pj.distributed_shampoo(0.1, BLOCK), BLOCKED_PARAMS, 2)
    _assert_trees_close(got, want, rtol=1e-6, atol=1e-6)


def test_partition_specs_and_shapes_describe_the_state():
    """The spec helper gives one spec per state leaf, shaped like the state, and
    the shapes helper equals what init returns; jit with those out_shardings."""
    kwargs = dict(
        shard_optimizer_states=True,
        preconditioner_partition_spec=P("data", None, None),
        best_effort_memory_usage_reduction=True,
        quantize_statistics=True,
        graft_type=pj.GraftingType.ADAGRAD,
    )
    param_specs = {"w": P(), "b": P(), "c": P(None, None, "data"), "s": P()}
    with jax.set_mesh(_mesh()):
        shapes = pj.distributed_shampoo_state_shapes(
            BLOCKED_PARAMS, 0.1, BLOCK, **kwargs
        )
        specs = pj.distributed_shampoo_partition_specs(
            BLOCKED_PARAMS, param_specs, 0.1, BLOCK, **kwargs
        )
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        assert jax.tree.structure(specs, is_leaf=is_spec) == jax.tree.structure(shapes)
        jax.tree.map(
            lambda spec, shape: (
                len(spec) in (0, len(shape.shape)) or pytest.fail(f"{spec} for {shape}")
            ),
            specs,
            shapes,
            is_leaf=is_spec,
        )
        assert specs.momentum["c"] == pj.QuantizedArray(
            P(None, None, "data"), P(None, "data"), None
        )
        assert specs.statistics[0].values == P("data", None, None)
        optimizer = pj.distributed_shampoo(0.1, BLOCK, **kwargs)
        shardings = jax.tree.map(
            lambda s: NamedSharding(_mesh(), s), specs, is_leaf=is_spec
        )
        # The seed's pattern: init gives (init_fn, pspec_fn, shape_and_dtype_fn).
        init_fn = optimizer.init(None).init_fn
        state = jax.jit(init_fn, out_shardings=shardings)(BLOCKED_PARAMS)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == jax.tree.map(
        lambda x: (x.shape, x.dtype), shapes
    )
    assert state.momentum["c"].values.sharding.spec == P(None, None, "data")


def test_batch_axis_name_equals_one_device_on_the_concatenated_batch():
    """Data parallel under shard_map: each of 8 devices sees 1/8 of the batch,
    averages gradients with pmean and computes the roots of 1/8 of the rows;
    the parameters equal a single-device run on the whole batch. float64, so
    that the pmean's summation order (8 partial means, then their mean) stays
    at rounding level instead of being amplified by the roots of rank <= 5
    statistics."""
    rng = np.random.default_rng(0)
    inputs, targets = rng.normal(size=(64, 12)), rng.normal(size=(64, 3))
    params = {"w": rng.normal(size=(12, 3)), "b": np.zeros(3)}

    def loss(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    def train(optimizer, step, steps=5):
        state, p = optimizer.init(params), params
        for _ in range(steps):
            p, state = step(optimizer, p, state)
        return p, state

    def single(optimizer, p, state):
        updates, state = optimizer.update(jax.grad(loss)(p, inputs, targets), state, p)
        return optax.apply_updates(p, updates), state

    def parallel(optimizer, p, state):
        def local(p, state, x, y):
            grads = jax.lax.pmean(jax.grad(loss)(p, x, y), "batch")
            updates, state = optimizer.update(grads, state, p)
            return optax.apply_updates(p, updates), state

        mesh = jax.make_mesh((8,), ("batch",))
        x, y = (jax.device_put(a, NamedSharding(mesh, P("batch"))) for a in data)
        run = shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), P(), P("batch"), P("batch")),
            out_specs=(P(), P()),
            check_vma=False,
        )
        return jax.jit(run)(p, state, x, y)

    kwargs = dict(start_preconditioning_step=1, graft_type=pj.GraftingType.ADAGRAD)
    with float64():
        inputs, targets = jnp.asarray(inputs), jnp.asarray(targets)
        data = (inputs, targets)
        params = jax.tree.map(jnp.asarray, params)
        want, _ = train(pj.distributed_shampoo(0.1, 128, **kwargs), single)
        got, state = train(
            pj.distributed_shampoo(0.1, 128, batch_axis_name="batch", **kwargs),
            parallel,
        )
    _assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
    assert all(s.shape[0] < 8 for s in state.statistics), (
        "the state keeps unpadded stacks; only the computation is split"
    )


# --------------------------------------------------------------- memory mode


def _regression_losses(optimizer, steps=60):
    """Train losses of a 2-layer tanh network fitted to a fixed random teacher on
    256 examples (full batch): a problem where Shampoo's statistics fill in."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(256, 24)), jnp.float32)
    teacher = jnp.asarray(rng.normal(size=(24, 4)), jnp.float32)
    y = jnp.tanh(x @ teacher)
    params = {
        "w1": jnp.asarray(rng.normal(size=(24, 32)) / 5, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(32, 4)) / 6, jnp.float32),
        "b1": jnp.zeros(32),
    }

    def loss(p):
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

    @jax.jit
    def step(p, state):
        value, grads = jax.value_and_grad(loss)(p)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, value

    state, losses = optimizer.init(params), []
    for _ in range(steps):
        params, state, value = step(params, state)
        losses.append(float(value))
    return np.array(losses), state


def test_memory_mode_trains_close_to_float32():
    """int8 momenta and int16 statistics/roots: the loss curve stays within 2%
    of the float32 run's at every step of 60 (measured: 0.09%), and the state is
    less than 60% of the float32 state's bytes (measured: 52%).

    AdaGrad grafting at a stable rate: near the edge of stability (RMSProp
    grafting at 3e-3 here) any perturbation, quantization's included, changes
    the trajectory by 10-30% (float32 vs float32 with another summation order
    would too)."""
    kwargs = dict(start_preconditioning_step=1, graft_type=pj.GraftingType.ADAGRAD)
    want, full = _regression_losses(pj.distributed_shampoo(0.01, 128, **kwargs))
    got, small = _regression_losses(
        pj.distributed_shampoo(
            0.01,
            128,
            best_effort_memory_usage_reduction=True,
            quantize_statistics=True,
            **kwargs,
        )
    )
    assert want[-1] < 0.2 * want[0], "the float32 run should learn"
    np.testing.assert_allclose(got, want, rtol=0.02)

    def size(state):
        return sum(x.nbytes for x in jax.tree.leaves(state))

    assert size(small) < 0.6 * size(full)


# --------------------------------------------------------------- robustness


def _nan_in_first_stack(state):
    statistics = list(state.statistics)
    statistics[0] = statistics[0].at[0, 0, 0].set(jnp.nan)
    return state._replace(statistics=tuple(statistics))


@pytest.mark.parametrize("eigh", [False, True])
def test_nan_statistics_keep_the_previous_root_and_show_in_the_metrics(eigh):
    optimizer = pj.distributed_shampoo(
        0.1, BLOCK, start_preconditioning_step=0, eigh=eigh
    )
    update = jax.jit(optimizer.update)
    params, state = _run(optimizer, BLOCKED_PARAMS, 2, update=update)
    state = _nan_in_first_stack(state)
    before = state.preconditioners[0]
    for step in range(3):
        updates, state = update(_gradients(params, 10 + step), state, params)
        params = optax.apply_updates(params, updates)
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))
    np.testing.assert_array_equal(state.preconditioners[0][0], before[0])
    errors = state.training_metrics.inverse_pth_root_errors
    assert any(bool(jnp.any(jnp.isnan(e))) for e in jax.tree.leaves(errors))


def test_huge_condition_number_never_gives_non_finite_parameters():
    """A statistic with eigenvalues from 1e30 to 1e-30: whatever the root does,
    a rejected root is reported (error >= threshold) and the parameters stay
    finite."""
    optimizer = pj.distributed_shampoo(
        0.1, 128, start_preconditioning_step=0, matrix_epsilon=0.0
    )
    update = jax.jit(optimizer.update)
    params, state = _run(optimizer, PARAMS, 1, update=update)
    statistics = list(state.statistics)
    n = statistics[-1].shape[-1]
    basis, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(n, n)))
    bad = basis @ np.diag(np.logspace(30, -30, n)) @ basis.T
    statistics[-1] = statistics[-1].at[0].set(jnp.asarray(bad, jnp.float32))
    state = state._replace(statistics=tuple(statistics))
    updates, state = update(_gradients(params, 5), state, params)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))
    errors = np.concatenate(
        [np.asarray(e) for e in jax.tree.leaves(state.training_metrics)]
    )
    assert np.any(~(errors < 0.1)), errors


# One regression problem for the bad-gradient runs: Y = X·W* + noise, fitted by
# (w (8, 6), b (6,)) from zeros, full batch, BAD_RUN_STEPS steps.
BAD_RUN_STEPS = 51  # 50 normal steps and one bad one
BAD_AT = 20  # after preconditioning started (start_preconditioning_step=1)
_FLOAT32_MAX = float(np.finfo(np.float32).max)
# ‖G‖² not finite in float32: the step is skipped. None: the whole (8, 6) gradient
# of w is ±10^k for 48 k from -30 to 30 (alternating signs).
SKIPPED_GRADIENTS = {
    "1e20": 1e20,
    "1e30": 1e30,
    "float32_max": _FLOAT32_MAX,
    "mixed_1e-30_to_1e30": None,
    "nan": np.nan,
    "inf": np.inf,
    "-inf": -np.inf,
}
# ‖G‖² = 1e36 or 1e38, finite: a gradient like any other, applied. The statistic
# of its row becomes ~1e35 (unscaled, its Frobenius norm overflows float32).
APPLIED_GRADIENTS = {"1e18": 1e18, "1e19": 1e19}
# A rate per grafting type at which the clean run learns (loss / 100 or better).
GRAFT_RATES = {
    pj.GraftingType.SGD: 0.1,
    pj.GraftingType.ADAGRAD: 0.1,
    pj.GraftingType.RMSPROP: 0.01,
    pj.GraftingType.RMSPROP_NORMALIZED: 0.01,
    pj.GraftingType.SQRT_N: 0.01,
    pj.GraftingType.ADAGRAD_NORMALIZED: 0.1,
}


def _bad_gradient(value):
    """(mask, values) that replace w's gradient at the bad step."""
    if value is None:
        signs = (-1.0) ** np.arange(48)
        values = (signs * np.logspace(-30, 30, 48)).reshape(8, 6)
        return jnp.ones((8, 6), bool), jnp.asarray(values, jnp.float32)
    mask = jnp.zeros((8, 6), bool).at[2, 3].set(True)
    return mask, jnp.full((8, 6), value, jnp.float32)


def _bad_step_run(optimizer):
    """A jitted run(bad_at, mask, values) -> (final loss, (loss before each step,
    state and updates finite after each step, step skipped: zero update, the
    state unchanged but for its count of skipped steps, one higher), training
    metrics); ``bad_at = -1`` gives the clean run."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)
    y = x @ jnp.asarray(rng.normal(size=(8, 6)), jnp.float32)
    y = y + 0.1 * jnp.asarray(rng.normal(size=(32, 6)), jnp.float32)
    params = {"w": jnp.zeros((8, 6)), "b": jnp.zeros(6)}

    def loss(p):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    def all_true(flags):
        return jnp.all(jnp.stack(flags))

    @jax.jit
    def run(bad_at, mask, values):
        def step(carry, i):
            p, state = carry
            value, grads = jax.value_and_grad(loss)(p)
            grads["w"] = jnp.where((i == bad_at) & mask, values, grads["w"])
            updates, new = optimizer.update(grads, state, p)
            finite = all_true(
                [
                    jnp.all(jnp.isfinite(leaf))
                    for leaf in jax.tree.leaves((updates, new._replace(count=0)))
                ]
            )
            unchanged = all_true(
                [
                    jnp.array_equal(a, b, equal_nan=True)
                    for a, b in zip(
                        jax.tree.leaves(without_skip_counts(new)),
                        jax.tree.leaves(without_skip_counts(state)),
                    )
                ]
            )
            counted = new.skipped == state.skipped + 1
            zero = all_true([jnp.all(u == 0) for u in jax.tree.leaves(updates)])
            p = optax.apply_updates(p, updates)
            return (p, new), (value, finite, unchanged & counted & zero)

        carry = (params, optimizer.init(params))
        (p, state), trace = jax.lax.scan(step, carry, jnp.arange(BAD_RUN_STEPS))
        return loss(p), trace, state.training_metrics

    return run


@pytest.mark.parametrize("memory", [False, True], ids=["float32", "quantized"])
@pytest.mark.parametrize("graft", list(pj.GraftingType), ids=lambda g: g.name)
def test_one_bad_gradient_never_poisons_the_state(graft, memory):
    """One bad gradient among 50 normal steps, at step 20.

    Skipped (‖G‖² overflows float32: 1e20 ... float32 max, a tensor mixing
    1e-30 and 1e30, NaN, ±Inf): zero update and the whole state unchanged at
    that step, state and updates finite at every step, and the final loss within
    1% of the 50 normal steps alone (it is the same run: measured equal).
    Applied (1e18, 1e19: finite ‖G‖², a gradient like any other, whose step can
    wreck the parameters as any huge step would): state and updates stay finite
    at every step, and the roots of the ~1e35 statistics it leaves are still
    accepted at the last step (error < inverse_failure_threshold), so the
    preconditioners are not frozen. One compiled run serves every value.
    """
    optimizer = pj.distributed_shampoo(
        GRAFT_RATES[graft],
        128,
        start_preconditioning_step=1,
        graft_type=graft,
        best_effort_memory_usage_reduction=memory,
        quantize_statistics=memory,
    )
    run = _bad_step_run(optimizer)
    _, (losses, finite, skipped), _ = run(-1, *_bad_gradient(0.0))
    assert bool(jnp.all(finite))
    assert not bool(jnp.any(skipped))
    clean = float(losses[BAD_RUN_STEPS - 1])  # after the 50 normal steps
    assert clean < 0.01 * float(losses[0]), "the clean run should learn"
    for name, value in (SKIPPED_GRADIENTS | APPLIED_GRADIENTS).items():
        final, (_, finite, skipped), metrics = run(BAD_AT, *_bad_gradient(value))
        assert bool(jnp.all(finite)), name
        if name in SKIPPED_GRADIENTS:
            assert np.flatnonzero(skipped).tolist() == [BAD_AT], name
            assert abs(float(final) / clean - 1) < 0.01, (name, float(final), clean)
        else:
            assert not bool(jnp.any(skipped)), name
            errors = np.concatenate([np.asarray(e) for e in jax.tree.leaves(metrics)])
            assert np.all(errors < 0.1), (name, errors)


# Schedules whose step BAD_AT (state.count 20) recomputes the roots from the
# statistics it updates (every 4 steps), or keeps the stored roots while it
# updates the statistics (roots every 3, statistics every 2): the skipped step
# must leave both as they were either way.
SKIP_SCHEDULES = {
    "roots-every-4": dict(preconditioning_compute_steps=4),
    "roots-every-3-statistics-every-2": dict(
        preconditioning_compute_steps=3, statistics_compute_steps=2
    ),
}


@pytest.mark.parametrize("memory", [False, True], ids=["float32", "quantized"])
@pytest.mark.parametrize("schedule", SKIP_SCHEDULES.values(), ids=SKIP_SCHEDULES)
def test_a_skipped_step_leaves_the_state_as_it_was_on_any_schedule(schedule, memory):
    """A NaN gradient at a step that recomputes the roots, and at one that
    keeps them: zero update and the whole state unchanged at that step only."""
    optimizer = pj.distributed_shampoo(
        0.1,
        128,
        start_preconditioning_step=1,
        best_effort_memory_usage_reduction=memory,
        quantize_statistics=memory,
        **schedule,
    )
    run = _bad_step_run(optimizer)
    _, (_, finite, skipped), _ = run(BAD_AT, *_bad_gradient(np.nan))
    assert bool(jnp.all(finite))
    assert np.flatnonzero(skipped).tolist() == [BAD_AT]


def test_huge_finite_gradients_keep_the_grafted_norm_and_finite_statistics():
    """Gradients with one entry of 1.5e19 (‖G‖² = 2.25e38 is finite: applied).

    The root of a step of small gradients amplifies by ~1e3 (w is merged to
    (48,): P ≈ (1e-6)^{-1/2}; preconditioning every 2 steps), so ‖P(G)‖ ≈ 2e22
    overflows a plain float32 norm; the step still has SGD
    grafting's norm, ‖ΔW‖ = lr·‖G‖ (β1 = 0). With β2 = 1 the statistics are sums:
    the rows the huge entry feeds would overflow at the second such gradient and
    keep their previous values instead; all state stays finite."""
    params = {"w": jnp.zeros((8, 6)), "b": jnp.zeros(6)}
    small = jax.tree.map(lambda g: 1e-3 * g, _gradients(params, 0))
    huge = _gradients(params, 1)
    huge["w"] = huge["w"].at[2, 3].set(1.5e19)
    lr = 0.01

    optimizer = pj.distributed_shampoo(
        lr,
        128,
        beta1=0.0,
        nesterov=False,
        start_preconditioning_step=1,
        preconditioning_compute_steps=2,
    )
    update = jax.jit(optimizer.update)
    _, state = update(small, optimizer.init(params), params)
    updates, _ = update(huge, state, params)
    np.testing.assert_allclose(
        float(jnp.linalg.norm(updates["w"] / 1e19)),
        lr * float(jnp.linalg.norm(huge["w"] / 1e19)),
        rtol=1e-5,
    )

    optimizer = pj.distributed_shampoo(lr, 128, beta2=1.0, beta1=0.0)
    update = jax.jit(optimizer.update)
    _, state = update(huge, optimizer.init(params), params)
    first = [np.asarray(s) for s in state.statistics]
    for _ in range(3):
        _, state = update(huge, state, params)
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state))
    for before, after in zip(first, state.statistics, strict=True):
        for row in range(before.shape[0]):  # w's two rows: kept; b's: summed
            kept = np.array_equal(before[row], after[row])
            assert kept == (before[row].max() > 1e38), (row, before[row].max())


ODD_PARAMS = {
    "empty": jnp.ones((0, 5)),
    "empty_3d": jnp.ones((2, 0, 3)),
    "scalar": jnp.ones(()),
    "ones_dims": jnp.ones((1, 1, 7)),  # merged to (7,): like "vector"
    "vector": jnp.ones(7),
    "long": jnp.ones(5000),  # > skip_preconditioning_dim_size_gt = 4096
}


@pytest.mark.parametrize("memory", [False, True], ids=["float32", "quantized"])
def test_empty_scalar_size_one_and_long_parameters(memory):
    """Empty tensors get empty updates; a scalar and a vector longer than
    skip_preconditioning_dim_size_gt take the grafting step (with SGD grafting and
    β1 = 0: exactly −lr·G); a (1, 1, 7) tensor is preconditioned as its merged
    (7,) vector (same update as a (7,) parameter given the same gradients)."""
    lr = 0.5
    optimizer = pj.distributed_shampoo(
        lr,
        128,
        beta1=0.0,
        start_preconditioning_step=1,
        best_effort_memory_usage_reduction=memory,
        quantize_statistics=memory,
    )
    state = optimizer.init(ODD_PARAMS)
    update = jax.jit(optimizer.update)
    for step in range(3):
        grads = _gradients(ODD_PARAMS, step)
        grads["vector"] = grads["ones_dims"].reshape(7)
        updates, state = update(grads, state, ODD_PARAMS)
        for name in ("empty", "empty_3d"):
            assert updates[name].shape == ODD_PARAMS[name].shape
        for name in ("scalar", "long"):
            np.testing.assert_allclose(updates[name], -lr * grads[name], rtol=1e-6)
        np.testing.assert_allclose(
            updates["ones_dims"].reshape(7), updates["vector"], rtol=1e-6, atol=1e-7
        )
        if step >= 1:  # preconditioned: not the grafting step
            difference = updates["vector"] + lr * grads["vector"]
            assert float(jnp.linalg.norm(difference)) > 1e-3
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state))


@pytest.mark.parametrize(
    ("dtype", "message"),
    [
        (jnp.complex64, "does not support complex parameters"),
        (jnp.int32, "needs floating-point parameters"),
        (jnp.bool_, "needs floating-point parameters"),
    ],
    ids=["complex64", "int32", "bool"],
)
def test_complex_and_integer_parameters_are_refused_at_init(dtype, message):
    """The error names the leaf and its dtype (complex: and the PSGD optimizers,
    which support it); distributed_shampoo_state_shapes refuses the same."""
    params = {"layer": {"w": jnp.ones((4, 3), dtype), "b": jnp.ones(3)}}
    optimizer = pj.distributed_shampoo(0.1, 128)
    for init in (optimizer.init, jax.jit(optimizer.init)):
        with pytest.raises(TypeError, match=message) as raised:
            init(params)
        assert f"['layer']['w'] is {jnp.dtype(dtype)}" in str(raised.value)
    if dtype == jnp.complex64:
        assert "PSGD" in str(raised.value)
    with pytest.raises(TypeError, match=message):
        pj.distributed_shampoo_state_shapes(params, 0.1, 128)


MISMATCHED_STATES = {
    "other shapes": (
        {},
        dict(PARAMS, w=jnp.ones((4, 5))),
        ".momentum['w'] has shape (4, 5), expected (6, 5)",
    ),
    "other block size": (
        dict(block_size=2),
        PARAMS,
        ".statistics[1] has shape (3, 1, 1), expected (2, 1, 1)",
    ),
    "other grafting": (
        dict(graft_type=pj.GraftingType.SGD),
        PARAMS,
        "where .diagonal_statistics['b'] belongs",
    ),
    "quantized": (
        dict(best_effort_memory_usage_reduction=True, quantize_statistics=True),
        PARAMS,
        "it has .momentum['conv'].values where .momentum['conv'] belongs",
    ),
    "a parameter fewer": (
        {},
        {k: v for k, v in PARAMS.items() if k != "b"},
        "where .momentum['b'] belongs",
    ),
}


@pytest.mark.parametrize("case", MISMATCHED_STATES)
def test_state_of_another_model_is_refused_when_update_is_traced(case):
    """A state made by init for other params or other arguments is refused by
    ``update`` when it is traced (abstract values: nothing computed), naming the
    first leaf that differs (and both shapes where they differ)."""
    changes, other_params, message = MISMATCHED_STATES[case]
    kwargs = dict(learning_rate=0.1, block_size=4, graft_type=pj.GraftingType.ADAGRAD)
    optimizer = pj.distributed_shampoo(**kwargs)
    state = pj.distributed_shampoo(**(kwargs | changes)).init(other_params)
    with pytest.raises(ValueError, match="does not match these parameters") as raised:
        jax.eval_shape(optimizer.update, PARAMS, state, PARAMS)
    assert message in str(raised.value)


# --------------------------------------------------------------- checkpoints


def test_checkpoint_resume_is_bit_identical(tmp_path):
    """Save the state's arrays after 3 steps, restore them into a fresh init's
    structure, continue 3 steps: identical to 6 uninterrupted steps."""
    optimizer = pj.distributed_shampoo(
        0.1,
        4,
        start_preconditioning_step=1,
        preconditioning_compute_steps=2,
        best_effort_memory_usage_reduction=True,
        quantize_statistics=True,
        graft_type=pj.GraftingType.RMSPROP,
    )
    update = jax.jit(optimizer.update)
    want, _ = _run(optimizer, PARAMS, 6, update=update)

    params, state = _run(optimizer, PARAMS, 3, update=update)
    np.savez(tmp_path / "state.npz", *[np.asarray(x) for x in jax.tree.leaves(state)])
    saved = np.load(tmp_path / "state.npz")
    restored = jax.tree.unflatten(
        jax.tree.structure(optimizer.init(PARAMS)),
        [jnp.asarray(saved[f"arr_{i}"]) for i in range(len(saved.files))],
    )
    for step in range(3, 6):
        updates, restored = update(_gradients(PARAMS, step), restored, params)
        params = optax.apply_updates(params, updates)
    jax.tree.map(np.testing.assert_array_equal, params, want)


# --------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(learning_rate=-1.0), ValueError, "learning_rate=-1.0: must be >= 0"),
        (dict(block_size=-3), ValueError, "block_size=-3: must be >= 0"),
        (dict(block_size=2.5), TypeError, "block_size=2.5"),
        (dict(beta1=1.5), ValueError, "beta1=1.5: must be in [0.0, 1.0]"),
        (dict(beta2=-0.1), ValueError, "beta2=-0.1"),
        (dict(matrix_epsilon=-1e-6), ValueError, "matrix_epsilon=-1e-06"),
        (dict(preconditioning_compute_steps=0), ValueError, ">= 1"),
        (dict(statistics_compute_steps=0), ValueError, "statistics_compute_steps=0"),
        (dict(graft_type=7), ValueError, "graft_type=7: must be one of"),
        (dict(exponent_override=-2), ValueError, "exponent_override=-2"),
        (dict(inverse_failure_threshold=0.0), ValueError, "must be > 0.0"),
        (dict(skip_preconditioning_dim_size_gt=0), ValueError, ">= 1"),
        (dict(clip_by_scaled_gradient_norm=0.0), ValueError, "must be > 0.0"),
        (dict(num_devices_for_pjit=0), ValueError, "num_devices_for_pjit=0"),
        (dict(precision="fast"), ValueError, "precision='fast'"),
        (dict(nesterov="yes"), TypeError, "nesterov='yes': must be True or False"),
        (dict(best_effort_shape_interpretation="no"), TypeError, "True or False"),
        (dict(shard_optimizer_states="False"), TypeError, "True or False"),
        (dict(best_effort_memory_usage_reduction=1), TypeError, "reduction=1"),
        (dict(moving_average_for_momentum=None), TypeError, "momentum=None"),
        (dict(eigh=0), TypeError, "eigh=0: must be True or False"),
        (dict(learning_rate="0.1"), TypeError, "learning_rate='0.1'"),
        (dict(beta1=float("nan")), ValueError, "beta1=nan"),
        (dict(diagonal_epsilon=-1.0), ValueError, "diagonal_epsilon=-1.0"),
        (dict(weight_decay=-1e-4), ValueError, "weight_decay=-0.0001: must be"),
        (dict(start_preconditioning_step=-1), ValueError, "step=-1: must be >= 0"),
        (dict(start_preconditioning_step=jnp.asarray(5)), TypeError, "static_args"),
        (dict(exponent_override=2.0), TypeError, "exponent_override=2.0"),
        (dict(inverse_failure_threshold=float("inf")), ValueError, "finite"),
        (dict(skip_preconditioning_dim_size_gt=4096.0), TypeError, "a Python int"),
        (dict(clip_by_scaled_gradient_norm=-1.0), ValueError, "norm=-1.0"),
        (dict(num_devices_for_pjit=8.0), TypeError, "num_devices_for_pjit=8.0"),
        (dict(graft_type="SGD"), ValueError, "graft_type='SGD': must be one of"),
        (dict(batch_axis_name=3), TypeError, "batch_axis_name=3: must be None"),
        (dict(precision=3), ValueError, "precision=3"),
        (dict(statistics_partition_spec=("data",)), TypeError, "PartitionSpec"),
        (
            dict(shard_optimizer_states=True),
            ValueError,
            "preconditioner_partition_spec",
        ),
        (
            dict(
                batch_axis_name="batch",
                shard_optimizer_states=True,
                preconditioner_partition_spec=P("data"),
            ),
            ValueError,
            "batch_axis_name='batch'",
        ),
        (dict(no_such_argument=1), TypeError, "no_such_argument"),
    ],
)
def test_bad_arguments_are_named_with_their_value_and_range(kwargs, error, message):
    arguments = dict(learning_rate=0.1, block_size=128) | kwargs
    with pytest.raises(error, match=None) as raised:
        pj.distributed_shampoo(**arguments)
    assert message in str(raised.value)


def test_every_argument_is_validated():
    """The table of checks names every argument of distributed_shampoo."""
    assert list(SHAMPOO_ARGUMENT_CHECKS) == list(
        inspect.signature(pj.distributed_shampoo).parameters
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(graft_type=pj.GraftingType.ADAGRAD),
        dict(graft_type=2),  # the seed's enums are IntEnums: ints are accepted
        dict(learning_rate=optax.cosine_decay_schedule(0.1, 100)),
        dict(learning_rate=jnp.asarray(0.1), beta1=jnp.asarray(0.9)),
        dict(nesterov=np.bool_(False), eigh=True),
        dict(precision="high"),
        dict(precision=None),
        dict(batch_axis_name="batch"),
        dict(batch_axis_name=("replica", "data")),
        dict(clip_by_scaled_gradient_norm=1, num_devices_for_pjit=8),
        dict(inverse_failure_threshold=np.float32(0.5), beta2=1),
    ],
    # Names only: a value's repr may hold an address, which differs between
    # the xdist workers that must collect the same ids.
    ids=lambda kwargs: "-".join(kwargs),
)
def test_arguments_the_seed_accepts_are_accepted(kwargs):
    """No false refusals: enums or their ints, schedules, arrays (traced under
    inject_hyperparams), NumPy scalars and bools, precision names or None, axis
    name tuples. (The state that init gives does not depend on how an argument
    was spelled.)"""
    optimizer = pj.distributed_shampoo(
        **(dict(learning_rate=0.1, block_size=4) | kwargs)
    )
    shapes = jax.eval_shape(optimizer.init, PARAMS)
    assert isinstance(shapes, pj.ShampooState)
    if kwargs.get("graft_type") == 2:
        assert shapes.diagonal_statistics is not None  # AdaGrad's accumulator


def test_weight_decay_without_params_is_a_clear_error():
    optimizer = pj.distributed_shampoo(0.1, 128, weight_decay=1e-4)
    with pytest.raises(ValueError, match="needs the params"):
        optimizer.update(PARAMS, optimizer.init(PARAMS))
