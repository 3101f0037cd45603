"""distributed_shampoo steps against the float64 NumPy reference.

Everything runs with x64 enabled, so parameters, statistics and roots are float64.
With ``eigh=True`` the optimizer's roots are exact up to rounding and the updates
match the reference (also eigh-based) to ~1e-9 relative. The default coupled-Newton
root stops at max|H^p·A − I| ≤ 1e-6, i.e. a root error up to ~1e-6/p, so it is
compared at 1e-5 relative instead.

Updates are compared leaf by leaf with atol = rtol·max|expected| (a norm-wise
check: entries that are nearly zero carry no relative precision).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.linalg

from precond.jax import GraftingType, distributed_shampoo
from tests.jax.helpers import float64
from tests.reference import shampoo_reference as ref

# Block size 16 leaves these shapes alone: no dims merge (5·6 > 16, 10·12 > 16) and
# no dim is cut (all ≤ 16). The 3-D parameter gets p = 6, the 2-D one p = 4, the
# bias p = 2.
SHAPES = {"b": (12,), "w2": (10, 12), "w3": (5, 6, 7)}
BLOCK = 16
# With a scalar too (rank 0: always skipped, follows the grafting direction).
REDUCTION_SHAPES = {**SHAPES, "s": ()}
EIGH_RTOL = 1e-9
# Coupled Newton stops at max|M − I| ≤ 1e-6: roots carry a relative error ~1e-6/p.
NEWTON_RTOL = 1e-5


@pytest.fixture(autouse=True)
def _float64():
    with float64():
        yield


def _params(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=s) for k, s in shapes.items()}


def _grads(shapes, steps, seed=1):
    """Gradients with a different overall scale per step and leaf."""
    rng = np.random.default_rng(seed)
    return [
        {k: rng.normal(size=s) * 10.0 ** rng.uniform(-1, 1) for k, s in shapes.items()}
        for _ in range(steps)
    ]


def _optimizer(eigh=True, **options):
    options = dict(options)
    if "graft_type" in options:
        options["graft_type"] = GraftingType(int(options["graft_type"]))
    return distributed_shampoo(eigh=eigh, **options)


def _run_optimizer(optimizer, params, grads_per_step):
    """Jitted updates per step (parameters advance by them) and the final state."""
    params = jax.tree.map(jnp.asarray, params)
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    outputs = []
    for grads in grads_per_step:
        updates, state = update(jax.tree.map(jnp.asarray, grads), state, params)
        params = optax.apply_updates(params, updates)
        outputs.append({k: np.asarray(v) for k, v in updates.items()})
    return outputs, state


def _assert_close(got, want, rtol, what=""):
    for k in want:
        assert got[k].dtype == np.float64, (what, k, got[k].dtype)
        scale = float(np.max(np.abs(want[k]))) if np.size(want[k]) else 0.0
        np.testing.assert_allclose(
            got[k], want[k], rtol=rtol, atol=rtol * scale, err_msg=f"{what} {k}"
        )


def _compare(shapes, steps, rtol=EIGH_RTOL, eigh=True, **options):
    params, grads = _params(shapes), _grads(shapes, steps)
    expected, reference = ref.run_shampoo(params, grads, **options)
    got, state = _run_optimizer(_optimizer(eigh=eigh, **options), params, grads)
    for n, (g, e) in enumerate(zip(got, expected)):
        _assert_close(g, e, rtol, what=f"step {n}")
    return got, state, reference


# --------------------------------------------------------------------------------
# The reference on its own (no precond code).


def test_reference_merge_small_dims_examples():
    assert ref.merge_small_dims([1, 2, 512, 1, 2048, 1, 3, 4], 1024) == [
        1024,
        2048,
        12,
    ]
    assert ref.merge_small_dims([1, 2, 768, 1, 2048], 1024) == [2, 768, 2048]
    assert ref.merge_small_dims([1, 1, 1], 8) == [1]
    assert ref.merge_small_dims([2, 3, 64], 128) == [6, 64]
    assert ref.merge_small_dims([4, 4, 4], 128) == [64]
    assert ref.merge_small_dims([300, 70], 128) == [300, 70]
    assert ref.merge_small_dims([5, 6, 7], 16) == [5, 6, 7]


def test_precond_merge_small_dims_examples():
    from precond._common import factor_plan

    merge = getattr(factor_plan, "merge_small_dims", None)
    if merge is None:
        pytest.skip("precond._common.factor_plan.merge_small_dims not exported")
    cases = [
        ([1, 2, 512, 1, 2048, 1, 3, 4], 1024),
        ([1, 2, 768, 1, 2048], 1024),
        ([1, 1, 1], 8),
        ([2, 3, 64], 128),
        ([4, 4, 4], 128),
        ([300, 70], 128),
        ([5, 6, 7], 16),
        ([3, 1, 5, 1, 2], 30),
    ]
    for shape, max_dim in cases:
        assert list(merge(shape, max_dim)) == ref.merge_small_dims(shape, max_dim), (
            shape,
            max_dim,
        )


@pytest.mark.parametrize(
    ("shape", "block", "chunks"),
    [
        ((300, 70), 128, [[128, 128, 44], [70]]),
        ((20, 9, 6), 8, [[8, 8, 4], [8, 1], [6]]),
        ((7, 5), 7, [[7], [5]]),
        ((7,), 3, [[3, 3, 1]]),
    ],
)
def test_reference_partition_round_trip(shape, block, chunks):
    X = np.random.default_rng(0).normal(size=shape)
    blocks = ref.partition(X, block)
    # Lexicographic: the Cartesian product of the chunks, axis 0 outermost.
    expected_shapes = [tuple(c) for c in np.ndindex(*[len(c) for c in chunks])]
    expected_shapes = [
        tuple(chunks[a][i] for a, i in enumerate(idx)) for idx in expected_shapes
    ]
    assert [b.shape for b in blocks] == expected_shapes
    np.testing.assert_array_equal(ref.merge_blocks(blocks, shape, block), X)


def test_reference_statistics_and_root_oracle():
    """β2 = 1, one step on a matrix G: S_0 = εI + GGᵀ, S_1 = εI + GᵀG, and the
    roots satisfy (S + ε'I)·P^p = I."""
    rng = np.random.default_rng(0)
    G, eps = rng.normal(size=(4, 6)), 1e-6
    reference = ref.ShampooReference(
        {"w": np.zeros((4, 6))},
        learning_rate=1.0,
        block_size=128,
        beta2=1.0,
        matrix_epsilon=eps,
        best_effort_shape_interpretation=False,
    )
    reference.step({"w": G}, {"w": np.zeros((4, 6))})
    (S0, S1), (P0, P1) = (
        reference.params["w"].statistics[0],
        reference.params["w"].preconditioners[0],
    )
    np.testing.assert_allclose(S0, eps * np.eye(4) + G @ G.T, rtol=1e-14)
    np.testing.assert_allclose(S1, eps * np.eye(6) + G.T @ G, rtol=1e-14)
    for S, P in ((S0, P0), (S1, P1)):
        ridge = eps * np.linalg.norm(S, 2)
        A = S + ridge * np.eye(len(S))
        np.testing.assert_allclose(
            np.linalg.matrix_power(P, 4) @ A, np.eye(len(S)), atol=1e-8
        )


def _dense_oracle_update(G, eps, lr):
    """algorithms.md's exactness check: SGD grafting, β1 = 0, β2 = 1, start = 0,
    a 2-D parameter: the update is -lr·‖G‖/‖X‖·X with X = L^{-1/4} G R^{-1/4},
    L = εI + GGᵀ and R = εI + GᵀG each plus its relative ridge ε·λmax (scipy's
    fractional power, independent of the reference's eigh)."""
    m, n = G.shape
    L = eps * np.eye(m) + G @ G.T
    R = eps * np.eye(n) + G.T @ G
    L = L + eps * np.linalg.norm(L, 2) * np.eye(m)
    R = R + eps * np.linalg.norm(R, 2) * np.eye(n)
    X = (
        np.real(scipy.linalg.fractional_matrix_power(L, -0.25))
        @ G
        @ np.real(scipy.linalg.fractional_matrix_power(R, -0.25))
    )
    return -lr * np.linalg.norm(G) / np.linalg.norm(X) * X


DENSE_ORACLE_OPTIONS = dict(
    learning_rate=0.3,
    block_size=128,
    beta1=0.0,
    beta2=1.0,
    matrix_epsilon=1e-6,
    start_preconditioning_step=0,
    best_effort_shape_interpretation=False,
    graft_type=ref.SGD,
)


def test_reference_dense_oracle_and_reductions():
    """The reference against algorithms.md's one-step dense oracle, and its
    grafting-only runs against the independent AdaGrad / RMSProp references."""
    G = np.random.default_rng(3).normal(size=(6, 9))
    (got,), _ = ref.run_shampoo(
        {"w": np.zeros((6, 9))}, [{"w": G}], **DENSE_ORACLE_OPTIONS
    )
    np.testing.assert_allclose(
        got["w"], _dense_oracle_update(G, 1e-6, 0.3), rtol=1e-8, atol=1e-9
    )
    params, grads = _params(REDUCTION_SHAPES), _grads(REDUCTION_SHAPES, 6)
    common = dict(learning_rate=0.05, weight_decay=1e-2, nesterov=False)
    shampoo = dict(block_size=BLOCK, start_preconditioning_step=100, **common)
    expected = ref.adagrad_updates(params, grads, **common)
    got, _ = ref.run_shampoo(params, grads, graft_type=ref.ADAGRAD, **shampoo)
    for g, e in zip(got, expected):
        _assert_close(g, e, 1e-14)
    clip = dict(beta2=0.9, clip_by_scaled_gradient_norm=0.5)
    expected = ref.rmsprop_updates(params, grads, **common, **clip)
    got, _ = ref.run_shampoo(params, grads, graft_type=ref.RMSPROP, **shampoo, **clip)
    for g, e in zip(got, expected):
        _assert_close(g, e, 1e-14)


# --------------------------------------------------------------------------------
# The optimizer against the reference.


def test_one_step_dense_oracle():
    """One step of the optimizer against algorithms.md's dense exactness check
    (statistics updated before roots, roots before the direction)."""
    G = np.random.default_rng(3).normal(size=(6, 9))
    optimizer = _optimizer(**DENSE_ORACLE_OPTIONS)
    (got,), _ = _run_optimizer(optimizer, {"w": np.zeros((6, 9))}, [{"w": G}])
    np.testing.assert_allclose(
        got["w"], _dense_oracle_update(G, 1e-6, 0.3), rtol=1e-8, atol=1e-9
    )


@pytest.mark.parametrize(
    "graft_type",
    [
        ref.SGD,
        ref.ADAGRAD,
        ref.RMSPROP,
        ref.RMSPROP_NORMALIZED,
        ref.SQRT_N,
        ref.ADAGRAD_NORMALIZED,
    ],
)
def test_steps_match_reference(graft_type):
    """2-D, 3-D and 1-D parameters, 4 steps: step 0 grafting only (start = 1),
    then grafted Shampoo with heavy-ball momentum and Nesterov."""
    _compare(
        SHAPES,
        steps=4,
        learning_rate=0.1,
        block_size=BLOCK,
        beta1=0.9,
        beta2=0.99,
        start_preconditioning_step=1,
        graft_type=graft_type,
    )


OPTION_SETS = {
    # EMA momentum, no Nesterov, coupled weight decay, β2 = 1 (c = 1).
    "ema_momentum_weight_decay_beta2_one": dict(
        graft_type=ref.ADAGRAD,
        beta2=1.0,
        nesterov=False,
        moving_average_for_momentum=True,
        weight_decay=1e-2,
        start_preconditioning_step=0,
    ),
    # Odd exponent override and a learning-rate schedule of t.
    "exponent_override_schedule": dict(
        graft_type=ref.SGD,
        exponent_override=3,
        learning_rate=lambda t: 0.1 / (1.0 + t),
        start_preconditioning_step=0,
    ),
    # RMSProp grafting with an active scaled-norm clip (RMS(u_g) ≈ 10 ≫ 0.5).
    "rmsprop_clip": dict(
        graft_type=ref.RMSPROP,
        beta2=0.99,
        clip_by_scaled_gradient_norm=0.5,
        start_preconditioning_step=2,
    ),
    # ... and normalized, with EMA momentum under Nesterov (v = (1-β1)·u + β1·m).
    "rmsprop_normalized_clip_ema_nesterov": dict(
        graft_type=ref.RMSPROP_NORMALIZED,
        beta2=0.99,
        clip_by_scaled_gradient_norm=0.5,
        moving_average_for_momentum=True,
        start_preconditioning_step=0,
    ),
    # Sign grafting: the single momentum buffer crosses the graft → Shampoo switch.
    "sqrt_n_ema_weight_decay_start_2": dict(
        graft_type=ref.SQRT_N,
        nesterov=False,
        moving_average_for_momentum=True,
        weight_decay=1e-3,
        start_preconditioning_step=2,
    ),
}


@pytest.mark.parametrize("name", sorted(OPTION_SETS))
def test_options_match_reference(name):
    options = {"learning_rate": 0.1, "block_size": BLOCK, **OPTION_SETS[name]}
    options.setdefault("start_preconditioning_step", 1)
    _compare(SHAPES, steps=5, **options)


def test_newton_root_matches_reference_loosely():
    """The default coupled-Newton root (eigh=False) against the eigh reference:
    Newton stops at max|H^p·A − I| ≤ 1e-6, so only ~1e-5 relative agreement."""
    _compare(
        SHAPES,
        steps=4,
        rtol=NEWTON_RTOL,
        eigh=False,
        learning_rate=0.1,
        block_size=BLOCK,
        beta2=0.99,
        graft_type=ref.RMSPROP,
        start_preconditioning_step=1,
    )


# --------------------------------------------------------------------------------
# Reductions: grafting only.


@pytest.mark.parametrize(
    ("graft_type", "options"),
    [
        (ref.ADAGRAD, {}),
        (ref.RMSPROP, {"beta2": 0.99}),
        (
            ref.RMSPROP,
            {
                "beta2": 0.9,
                "nesterov": False,
                "moving_average_for_momentum": True,
                "weight_decay": 1e-2,
                "clip_by_scaled_gradient_norm": 0.5,
            },
        ),
    ],
    ids=["adagrad", "rmsprop", "rmsprop_ema_wd_clip"],
)
def test_grafting_only_equals_diagonal_optimizer(graft_type, options):
    """start_preconditioning_step beyond the run: 10 steps of plain AdaGrad /
    RMSProp with the same momentum (Shampoo's statistics and roots are still
    computed but never used)."""
    params, grads = _params(REDUCTION_SHAPES), _grads(REDUCTION_SHAPES, 10)
    common = dict(learning_rate=0.05, beta1=0.9, epsilon=1e-10, **options)
    if graft_type == ref.ADAGRAD:
        expected = ref.adagrad_updates(params, grads, **common)
    else:
        expected = ref.rmsprop_updates(params, grads, **common)
    optimizer_options = dict(common)
    optimizer_options["diagonal_epsilon"] = optimizer_options.pop("epsilon")
    optimizer = _optimizer(
        block_size=BLOCK,
        graft_type=graft_type,
        start_preconditioning_step=100,
        **optimizer_options,
    )
    got, _ = _run_optimizer(optimizer, params, grads)
    for n, (g, e) in enumerate(zip(got, expected)):
        _assert_close(g, e, EIGH_RTOL, what=f"step {n}")


# --------------------------------------------------------------------------------
# Blocking and merging.


def test_block_size_covering_every_dim_changes_nothing():
    """Blocks no smaller than every dim (no merging): the same updates as an
    effectively infinite block size, and as the reference."""
    options = dict(
        learning_rate=0.1,
        beta2=0.99,
        start_preconditioning_step=0,
        graft_type=ref.ADAGRAD,
        best_effort_shape_interpretation=False,
    )
    params, grads = _params(SHAPES), _grads(SHAPES, 3)
    exact, _ = _run_optimizer(_optimizer(block_size=12, **options), params, grads)
    huge, _ = _run_optimizer(_optimizer(block_size=10**6, **options), params, grads)
    expected, _ = ref.run_shampoo(params, grads, block_size=12, **options)
    for n in range(3):
        _assert_close(exact[n], huge[n], 1e-12, what=f"step {n}")
        _assert_close(exact[n], expected[n], EIGH_RTOL, what=f"step {n}")


@pytest.mark.parametrize(
    ("shape", "block", "num_statistics"),
    [((300, 70), 128, 3 * 2), ((20, 9, 6), 8, 6 * 3)],
    ids=["300x70_block128", "20x9x6_block8"],
)
def test_uneven_blocks_match_reference(shape, block, num_statistics):
    """(300, 70) in 128-blocks: row chunks 128, 128, 44. (20, 9, 6) in 8-blocks:
    chunks (8, 8, 4) × (8, 1) × (6), so 1×1 statistics too. Every block is
    preconditioned separately; grafting and the norm ratio are over the whole
    parameter."""
    shapes = {"t": shape, "b": (12,)}
    _, state, reference = _compare(
        shapes,
        steps=3,
        learning_rate=0.1,
        block_size=block,
        beta2=0.99,
        start_preconditioning_step=1,
        graft_type=ref.RMSPROP,
    )
    assert reference.params["t"].num_statistics == num_statistics
    errors = state.training_metrics.inverse_pth_root_errors
    assert np.shape(errors["t"]) == (num_statistics,)
    # The bias is cut too when block < 12: one statistic per block.
    assert np.shape(errors["b"]) == (reference.params["b"].num_statistics,)


@pytest.mark.parametrize("merge", [True, False])
def test_shape_interpretation(merge):
    """(2, 3, 64) with block 128 merges to (6, 64) (p = 4): with merging on the
    updates equal the reference run on a (6, 64) parameter; with it off they equal
    the reference on the 3-D shape (p = 6), and the two differ."""
    shape = (2, 3, 64)
    options = dict(
        learning_rate=0.1,
        block_size=128,
        beta2=0.99,
        start_preconditioning_step=0,
        graft_type=ref.ADAGRAD,
    )
    params, grads = _params({"w": shape}), _grads({"w": shape}, 3)
    got, _ = _run_optimizer(
        _optimizer(best_effort_shape_interpretation=merge, **options), params, grads
    )
    merged = {"w": (6, 64)}
    as_merged, _ = ref.run_shampoo(
        {"w": params["w"].reshape(6, 64)},
        [{"w": g["w"].reshape(6, 64)} for g in grads],
        best_effort_shape_interpretation=False,
        **options,
    )
    as_merged = [{"w": u["w"].reshape(shape)} for u in as_merged]
    unmerged, _ = ref.run_shampoo(
        params, grads, best_effort_shape_interpretation=False, **options
    )
    internal, reference = ref.run_shampoo(
        params, grads, best_effort_shape_interpretation=merge, **options
    )
    assert reference.params["w"].merged_shape == (merged["w"] if merge else shape)
    expected = as_merged if merge else unmerged
    for n in range(3):
        _assert_close(got[n], expected[n], EIGH_RTOL, what=f"step {n}")
        _assert_close(internal[n], expected[n], 1e-12, what=f"reference step {n}")
    assert not np.allclose(as_merged[-1]["w"], unmerged[-1]["w"], rtol=1e-3)


# --------------------------------------------------------------------------------
# Schedules of work, skipping, non-finite gradients.


def test_statistics_and_root_intervals():
    """statistics_compute_steps = 2, preconditioning_compute_steps = 3, 7 steps:
    statistics at t = 0, 2, 4, 6, roots at t = 0, 3, 6 (stale roots in between)."""
    _compare(
        SHAPES,
        steps=7,
        learning_rate=0.1,
        block_size=BLOCK,
        beta2=0.99,
        start_preconditioning_step=0,
        graft_type=ref.RMSPROP,
        statistics_compute_steps=2,
        preconditioning_compute_steps=3,
    )


def test_skipped_parameters_follow_grafting():
    """skip_preconditioning_dim_size_gt = 16: (4, 20) and the scalar are skipped
    and follow plain AdaGrad (u_s = u_g up to the 1e-16 guard); (4, 4, 4) merges to
    (64,) but its ORIGINAL dims are ≤ 16, so it stays preconditioned."""
    shapes = {"cube": (4, 4, 4), "s": (), "w": (10, 12), "wide": (4, 20)}
    options = dict(
        learning_rate=0.1,
        block_size=128,
        beta2=0.99,
        start_preconditioning_step=0,
        graft_type=ref.ADAGRAD,
        skip_preconditioning_dim_size_gt=16,
    )
    got, _, reference = _compare(shapes, steps=4, **options)
    assert [k for k, st in reference.params.items() if st.skipped] == ["s", "wide"]
    params, grads = _params(shapes), _grads(shapes, 4)
    adagrad = ref.adagrad_updates(params, grads, learning_rate=0.1)
    for n in range(4):
        for k in ("s", "wide"):
            _assert_close({k: got[n][k]}, {k: adagrad[n][k]}, EIGH_RTOL, f"step {n}")
    assert not np.allclose(got[-1]["cube"], adagrad[-1]["cube"], rtol=1e-3)


def test_nonfinite_gradient_skips_the_step():
    """A NaN anywhere in the gradient tree: zero updates, count and state kept; the
    following steps continue as if that step never happened."""
    options = dict(
        learning_rate=0.1,
        block_size=BLOCK,
        beta2=0.99,
        start_preconditioning_step=1,
        graft_type=ref.RMSPROP,
    )
    params, grads = _params(SHAPES), _grads(SHAPES, 4)
    bad = {k: v.copy() for k, v in grads[1].items()}
    bad["w3"][1, 2, 3] = np.nan
    sequence = [grads[0], bad, grads[1], grads[2], grads[3]]
    expected, _ = ref.run_shampoo(params, sequence, **options)
    got, state = _run_optimizer(_optimizer(**options), params, sequence)
    assert int(state.count) == 4
    for k in SHAPES:
        np.testing.assert_array_equal(got[1][k], np.zeros(SHAPES[k]))
    for n, (g, e) in enumerate(zip(got, expected)):
        _assert_close(g, e, EIGH_RTOL, what=f"step {n}")


def test_failed_roots_keep_the_previous_preconditioner():
    """inverse_failure_threshold = 1e-30 (it must be > 0): every float64 eigh root
    has an error ~1e-15 ≥ 1e-30 and counts as failed, so P stays I and the update
    is -lr·G·‖u_g‖/‖G‖."""
    options = dict(
        learning_rate=0.1,
        block_size=BLOCK,
        beta1=0.0,
        beta2=0.99,
        start_preconditioning_step=0,
        graft_type=ref.ADAGRAD,
        inverse_failure_threshold=1e-30,
    )
    got, _, _ = _compare(SHAPES, steps=3, **options)
    params, grads = _params(SHAPES), _grads(SHAPES, 3)
    adagrad = ref.adagrad_updates(params, grads, learning_rate=0.1, beta1=0.0)
    for n in range(3):
        for k in SHAPES:
            G = grads[n][k]
            want = -G * np.linalg.norm(adagrad[n][k]) / np.linalg.norm(G)
            _assert_close({k: got[n][k]}, {k: want}, EIGH_RTOL, f"step {n}")
