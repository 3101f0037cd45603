"""precond.torch.Shampoo against precond.jax.distributed_shampoo in float64 (JAX
with x64, float64 torch parameters): the same gradient stream, 20 steps, the
parameters equal to ~1e-10 relative, over a table of settings that covers every
grafting type, both root kernels, blocking, merging, the step schedules,
Nesterov, both weight decays, a skipped large dim and 1-D, 3-D and scalar
parameters; and against the float64 NumPy reference
(tests/reference/shampoo_reference.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")

import optax  # noqa: E402

import precond.jax as pj  # noqa: E402
from precond.torch import GraftingType, PreconditionerType, Shampoo  # noqa: E402
from tests.reference import shampoo_reference as ref  # noqa: E402

STEPS = 20
TOLERANCE = 1e-10
SHAPES = {
    "matrix": (6, 10),
    "vector": (7,),
    "cube": (3, 4, 5),
    "scalar": (),
    "wide": (3, 50),
}
G = GraftingType

# name: distributed_shampoo's keyword arguments (besides learning_rate).
SETTINGS = {
    "sgd-newton": dict(block_size=4),
    "sgd-eigh": dict(block_size=4, eigh=True),
    "adagrad-newton": dict(block_size=4, graft_type=G.ADAGRAD),
    "adagrad-eigh": dict(block_size=8, graft_type=G.ADAGRAD, eigh=True),
    "rmsprop-clip": dict(
        block_size=4, graft_type=G.RMSPROP, clip_by_scaled_gradient_norm=0.5
    ),
    "rmsprop_normalized-eigh": dict(
        block_size=4, graft_type=G.RMSPROP_NORMALIZED, eigh=True
    ),
    "adagrad_normalized": dict(block_size=4, graft_type=G.ADAGRAD_NORMALIZED),
    "sqrt_n": dict(block_size=4, graft_type=G.SQRT_N),
    "sqrt_n-separate": dict(
        block_size=4, graft_type=G.SQRT_N, separate_grafting_momentum=True
    ),
    "merging-large-block": dict(block_size=16, graft_type=G.ADAGRAD),
    "no-merging-whole-axes": dict(block_size=0, best_effort_shape_interpretation=False),
    "schedules": dict(
        block_size=4,
        start_preconditioning_step=3,
        preconditioning_compute_steps=3,
        statistics_compute_steps=2,
    ),
    "heavy-ball-ema": dict(
        block_size=4, nesterov=False, moving_average_for_momentum=True
    ),
    "weight-decay": dict(block_size=4, weight_decay=0.05, graft_type=G.ADAGRAD),
    "decoupled-decay": dict(
        block_size=4, weight_decay=0.05, decoupled_weight_decay=True
    ),
    "coupled-lr": dict(
        block_size=4, weight_decay=0.05, decoupled_learning_rate=False, eigh=True
    ),
    "skip-large-dim": dict(block_size=4, skip_preconditioning_dim_size_gt=40),
    "skip-rank-lt-2": dict(block_size=4, skip_preconditioning_rank_lt=2),
    "exponent-absolute-ridge": dict(
        block_size=4, exponent_override=2, relative_matrix_epsilon=False
    ),
    "input-axes": dict(block_size=4, precondtioner_type=PreconditionerType.INPUT),
    "output-axes-eigh": dict(
        block_size=4, precondtioner_type=PreconditionerType.OUTPUT, eigh=True
    ),
    "previous-roots-beta2-one": dict(
        block_size=4, precondition_with_previous_roots=True, beta2=1.0, beta1=0.5
    ),
    "merge-limit": dict(block_size=4, merge_small_dims_block_size=20),
}


@pytest.fixture(scope="module", autouse=True)
def _float64():
    with jax.enable_x64(True):
        yield


def _stream(seed=0):
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
    grads = [
        {k: rng.standard_normal(s) * (1 + t % 3) for k, s in SHAPES.items()}
        for t in range(STEPS)
    ]
    return params, grads


def _jax_run(params, grads, lr, options):
    import jax.numpy as jnp

    options = dict(options)  # precond.jax's enums for precond.torch's
    if "graft_type" in options:
        options["graft_type"] = pj.GraftingType(int(options["graft_type"]))
    if "precondtioner_type" in options:
        kind = pj.PreconditionerType(int(options["precondtioner_type"]))
        options["precondtioner_type"] = kind
    opt = pj.distributed_shampoo(learning_rate=lr, **options)
    current = {k: jnp.asarray(v) for k, v in params.items()}
    state = opt.init(current)
    update = jax.jit(opt.update)
    trajectory = []
    for g in grads:
        updates, state = update(
            {k: jnp.asarray(v) for k, v in g.items()}, state, current
        )
        current = optax.apply_updates(current, updates)
        trajectory.append({k: np.asarray(v) for k, v in current.items()})
    return trajectory


def _torch_run(params, grads, lr, options):
    tensors = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()}
    optimizer = Shampoo(list(tensors.values()), lr=lr, **options)
    trajectory = []
    for g in grads:
        for k, p in tensors.items():
            p.grad = torch.tensor(g[k])
        optimizer.step()
        trajectory.append({k: p.detach().numpy().copy() for k, p in tensors.items()})
    return trajectory


def _assert_close(ours, theirs, tolerance=TOLERANCE):
    for t, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for k in b:
            scale = max(np.max(np.abs(b[k]), initial=0.0), 1e-30)
            error = np.max(np.abs(a[k] - b[k]), initial=0.0) / scale
            assert error <= tolerance, (t, k, error)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_torch_shampoo_equals_jax_distributed_shampoo(setting):
    options = SETTINGS[setting]
    params, grads = _stream()
    theirs = _jax_run(params, grads, 0.1, options)
    ours = _torch_run(params, grads, 0.1, options)
    _assert_close(ours, theirs)


REFERENCE_SETTINGS = {
    "adagrad-decay": dict(block_size=4, graft_type=ref.ADAGRAD, weight_decay=0.05),
    "rmsprop-clip-schedules": dict(
        block_size=8,
        graft_type=ref.RMSPROP,
        clip_by_scaled_gradient_norm=0.5,
        start_preconditioning_step=3,
        preconditioning_compute_steps=2,
    ),
}


@pytest.mark.parametrize("setting", list(REFERENCE_SETTINGS))
def test_torch_shampoo_equals_the_float64_reference(setting):
    """Against the NumPy reference (eigh roots with the exact λ_max)."""
    options = REFERENCE_SETTINGS[setting]
    params, grads = _stream(seed=3)
    updates, _ = ref.run_shampoo(params, grads, learning_rate=0.1, **options)
    theirs, current = [], {k: np.array(v) for k, v in params.items()}
    for u in updates:
        current = {k: current[k] + u[k] for k in current}
        theirs.append(current)
    ours = _torch_run(params, grads, 0.1, {**options, "eigh": True})
    _assert_close(ours, theirs, 1e-9)
