"""Kron's generation-2 update styles ('QUAD', 'PRO', 'QEQ') and bfloat16 factors.

Kernels against the float64 dense-matrix reference, the Procrustes rotation's
properties, the fitting property (Newton: P → H⁻¹; whitening: P → C^{-1/2}),
whole optimizer steps sharded == unsharded, cache layouts agreeing, and bf16
factor storage.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from jax.sharding import PartitionSpec as P

import precond.jax as pj
from precond.jax._core import factor_kernels as km
from tests.jax.core.test_factor_kernels import (
    _fit_problem,
    assert_close,
    random_spd,
    relative_identity_error,
    spd_sqrt,
)
from tests.jax.helpers import float64
from tests.reference import kron_reference as ref

STYLES = ["QUAD", "PRO", "QEQ"]
SHAPES = [(7,), (5, 4), (3, 4, 5)]
CASES = [
    pytest.param(shape, mask, id=f"{shape}-" + "".join("dt"[not m] for m in mask))
    for shape in SHAPES
    for mask in itertools.product([True, False], repeat=len(shape))
]


def random_factors(rng, shape, diagonal_mask, style):
    """Factors near s·I: symmetric for QUAD, a general Q for PRO and QEQ."""
    factors = []
    for d, diagonal in zip(shape, diagonal_mask, strict=True):
        if diagonal:
            factors.append(rng.uniform(0.5, 2.0, d))
            continue
        Q = np.eye(d) * rng.uniform(0.8, 1.5) + 0.2 * rng.standard_normal((d, d))
        factors.append((Q + Q.T) / 2 if style == "QUAD" else Q)
    return factors


def test_styles_are_validated():
    with pytest.raises(ValueError, match=r"Invalid preconditioner_update_style='EQ2'"):
        pj.kron(preconditioner_update_style="EQ2")


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("newton", [False, True], ids=["whitening", "newton"])
@pytest.mark.parametrize(("shape", "diagonal_mask"), CASES)
def test_update_equals_reference(style, newton, shape, diagonal_mask):
    rng = np.random.default_rng(len(shape) * 7 + sum(diagonal_mask))
    Qs = random_factors(rng, shape, diagonal_mask, style)
    G = rng.standard_normal(shape)
    if newton:
        V = rng.standard_normal(shape)
        targets = [
            np.diag(ref.unfold(V, i) @ ref.unfold(V, i).T)
            if diag
            else ref.unfold(V, i) @ ref.unfold(V, i).T
            for i, diag in enumerate(diagonal_mask)
        ]
    else:
        valid = [np.ones(d, bool) for d in shape]
        targets = km.whitening_targets(
            [jnp.asarray(v) for v in valid], list(diagonal_mask)
        )
        targets = [np.asarray(t, np.float64) for t in targets]
    # One L at 0 (the first update), one already large (smoothing keeps it).
    Ls = [0.0 if i % 2 == 0 else 1e3 for i in range(len(shape))]
    want_Qs, want_Ls = ref.update_factors_gen2(Qs, Ls, G, targets, 0.3, style)
    with float64():
        got_Qs, got_Ls = km.update_factors_gen2(
            [jnp.asarray(Q) for Q in Qs],
            [jnp.asarray(L, jnp.float64) for L in Ls],
            jnp.asarray(G),
            [jnp.asarray(t) for t in targets],
            0.3,
            style,
        )
        for got, want in zip(got_Qs, want_Qs, strict=True):
            assert_close(got, want, rtol=1e-12)
        np.testing.assert_allclose(np.asarray(got_Ls), want_Ls, rtol=1e-12)


def test_whitening_targets_are_noise_grams_of_the_real_entries():
    """E[V_(i)V_(i)ᵀ] for V ~ N(0, I) on the real entries: entries of V are
    independent with E[V²] = mask, so it is diagonal with the row sums of the
    unfolded 0/1 mask, i.e. the real entries of the other axes."""
    shape, extent = (4, 6, 3), (3, 5, 3)
    valid = [np.arange(d) < e for d, e in zip(shape, extent, strict=True)]
    mask = np.einsum("i,j,k->ijk", *[v.astype(float) for v in valid])
    for diagonal in ([True, False, True], [False, True, False]):
        targets = km.whitening_targets([jnp.asarray(v) for v in valid], diagonal)
        for i, (t, diag) in enumerate(zip(targets, diagonal, strict=True)):
            want = ref.unfold(mask, i).sum(axis=1)
            np.testing.assert_array_equal(t, want if diag else np.diag(want))


def _rotated_spd(rng, d, angle):
    """Q = O·S: an SPD S turned by a rotation O = exp(angle·K), K skew."""
    S = random_spd(rng, d, condition=5.0)
    K = rng.standard_normal((d, d))
    K = (K - K.T) / np.linalg.norm(K - K.T, 2)
    return scipy.linalg.expm(angle * K) @ S, S


def test_procrustes_step_is_a_second_order_rotation():
    """One step equals exp(aR̂)·Q to third order in a: Q's Gram moves by O(a³)."""
    rng = np.random.default_rng(0)
    Q, _ = _rotated_spd(rng, 6, 0.3)
    with float64():
        got = np.asarray(km.procrustes_step(jnp.asarray(Q)))
    assert_close(got, ref.procrustes_step(Q), rtol=1e-12)
    step = got - Q
    a_bound = 0.125
    # ‖QᵀQ − QₙᵀQₙ‖ ≤ O(a³)‖Q‖²: far below the O(a) change of Q itself.
    gram_change = np.linalg.norm(got.T @ got - Q.T @ Q) / np.linalg.norm(Q.T @ Q)
    assert np.linalg.norm(step) / np.linalg.norm(Q) > 0.01
    assert gram_change < a_bound**3


def test_repeated_procrustes_steps_reach_the_symmetric_polar_factor():
    """From Q = O·S, rotations alone lead to the SPD polar factor S of QᵀQ = S²."""
    rng = np.random.default_rng(1)
    Q, S = _rotated_spd(rng, 6, 0.5)
    with float64():
        step = jax.jit(km.procrustes_step)
        Q = jnp.asarray(Q)
        for _ in range(60):
            Q = step(Q)
        Q = np.asarray(Q)
    assert np.linalg.norm(Q - Q.T) / np.linalg.norm(Q) < 1e-8
    # Each truncated rotation changes QᵀQ by O(a³): a few per mille in all.
    np.testing.assert_allclose(Q, S, atol=2e-2 * np.linalg.norm(S, 2))
    assert np.all(np.linalg.eigvalsh((Q + Q.T) / 2) > 0)


def fit_factors_gen2(style, diagonal_mask, mixers, steps, *, whitening, seed=0):
    """``steps`` generation-2 updates from Q_i = I, η annealed from 0.5 to 0, no
    damping noise. Newton: G = V ×_i M_i with the sample Grams of V as targets;
    whitening: G from an independent draw, with the expected targets c_i·I."""
    shape = tuple(M.shape[0] for M in mixers)
    Ms = [
        jnp.asarray(np.diag(M) if diagonal else M)
        for M, diagonal in zip(mixers, diagonal_mask, strict=True)
    ]
    Qs = [
        jnp.ones(d) if diagonal else jnp.eye(d)
        for d, diagonal in zip(shape, diagonal_mask, strict=True)
    ]
    Ls = [jnp.zeros([], jnp.float64) for _ in shape]
    expected = km.whitening_targets([jnp.ones(d, bool) for d in shape], diagonal_mask)
    key = jax.random.key(seed)

    def step(carry, n):
        Qs, Ls = carry
        V = jax.random.normal(jax.random.fold_in(key, n), shape, jnp.float64)
        G = km.apply_along_axes(Ms, V)
        if whitening:
            targets = expected
        else:
            targets = [km.unfold_gram(V, i, d) for i, d in enumerate(diagonal_mask)]
        lr = 0.5 * (1.0 - n / steps)
        return km.update_factors_gen2(Qs, Ls, G, targets, lr, style), None

    run = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(steps))[0])
    Qs, _ = run((Qs, Ls))
    return [np.asarray(Q) for Q in Qs]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("name", ["6x5", "6x5x4", "6x5-diag"])
def test_fit_to_newton_pairs_converges_to_inverse_hessian(style, name):
    diagonal_mask, Hs = _fit_problem(name)
    H = ref.kron_all(Hs)
    with float64():
        Qs = fit_factors_gen2(style, diagonal_mask, Hs, 2000, whitening=False)
    # As for 'EQ': at P = H⁻¹ every pair gives T1 = T2 (Pg = V), so the fit has no
    # variance at its solution and converges to rounding (observed ~1e-15).
    assert relative_identity_error(ref.preconditioner_matrix(Qs), H) < 1e-10


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("name", ["6x5", "6x5x4", "6x5-diag"])
def test_fit_to_gradient_covariance_whitens(style, name):
    diagonal_mask, Cs = _fit_problem(name)
    C_sqrt = ref.kron_all([spd_sqrt(C) for C in Cs])
    with float64():
        Qs = fit_factors_gen2(
            style, diagonal_mask, [spd_sqrt(C) for C in Cs], 3000, whitening=True
        )
    # Only E[T1] = T2 at P = C^{-1/2}: sampling noise remains, as for 'EQ' (see
    # test_kron_math.test_fit_to_gradient_covariance_whitens; observed 0.04-0.06
    # here); P = I errs > 0.5.
    assert relative_identity_error(ref.preconditioner_matrix(Qs), C_sqrt) < 0.2


def _quadratic(seed=0):
    rng = np.random.default_rng(seed)
    left = random_spd(rng, 8, condition=100.0)
    right = random_spd(rng, 5, condition=10.0)
    target = {"w": rng.standard_normal((8, 5)), "b": rng.standard_normal(5)}
    scales = np.geomspace(1, 30, 5)

    def loss(p):
        d = p["w"] - target["w"]
        return 0.5 * jnp.sum(d * (left @ d @ right)) + 0.5 * jnp.sum(
            scales * (p["b"] - target["b"]) ** 2
        )

    params = {"w": jnp.zeros((8, 5)), "b": jnp.zeros(5)}
    return loss, params


@pytest.mark.parametrize("style", ["EQ", *STYLES])
def test_bfloat16_factors_train_and_stay_bfloat16(style):
    loss, params = _quadratic()
    optimizer = pj.kron(
        learning_rate=0.02,
        preconditioner_update_style=style,
        precond_dtype=jnp.bfloat16,
        preconditioner_update_probability=1.0,
    )
    state = optimizer.init(params)
    dtypes = jax.tree.map(lambda x: x.dtype, state)

    @jax.jit
    def step(params, state):
        grads = jax.grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return jax.tree.map(jnp.add, params, updates), state

    start = float(loss(params))
    for _ in range(300):
        params, state = step(params, state)
    assert jax.tree.map(lambda x: x.dtype, state) == dtypes
    factors = jax.tree.leaves(state[0].preconditioners)
    assert {f.dtype for f in factors} == {jnp.dtype(jnp.bfloat16)}
    if style != "EQ":
        assert {L.dtype for L in jax.tree.leaves(state[0].lipschitz)} == {
            jnp.dtype(jnp.float32)
        }
    assert float(loss(params)) < 1e-3 * start


@pytest.mark.parametrize("style", STYLES)
def test_cache_layouts_agree(style):
    """'packed' (a symmetric Q for QUAD; stored dense for PRO), 'dense' and None
    give the same updates in float64."""
    rng = np.random.default_rng(3)
    shapes = {"w": (6, 5), "x": (3, 4, 2), "b": (5,)}
    with float64():
        grads = [
            {k: jnp.asarray(rng.standard_normal(s)) for k, s in shapes.items()}
            for _ in range(4)
        ]
        results = []
        for cache in ("packed", "dense", None):
            optimizer = pj.scale_by_kron(
                preconditioner_update_style=style,
                preconditioner_cache=cache,
                precond_dtype=jnp.float64,
                preconditioner_update_probability=1.0,
            )
            state = optimizer.init(jax.tree.map(jnp.zeros_like, grads[0]))
            update = jax.jit(optimizer.update)
            for g in grads:
                updates, state = update(g, state)
            results.append(updates)
    for other in results[1:]:
        for k in shapes:
            np.testing.assert_allclose(other[k], results[0][k], rtol=1e-12)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("newton", [False, True], ids=["whitening", "newton"])
def test_sharded_equals_unsharded(style, newton):
    """(2, 4) mesh, FSDP × TP specs, blocks, a scanned parameter: the factors and
    Lipschitz estimates of each unit are fitted whole on one device."""
    from tests.jax.kron import test_kron_sharding as sharded

    mesh, specs = sharded._mesh("fsdp,tp"), sharded.PLACEMENTS["fsdp,tp"]
    kwargs = dict(
        **sharded.KWARGS,
        preconditioner_update_style=style,
        precond_dtype=jnp.float64,
    )
    with float64():
        grads = sharded._grads(4, jnp.float64)
        extra = {}
        if newton:
            rng = np.random.default_rng(5)
            extra = dict(
                Hvp=sharded._grads(1, jnp.float64, seed=6)[0],
                vector={
                    k: jnp.asarray(rng.standard_normal(s))
                    for k, s in sharded.SHAPES.items()
                },
                update_preconditioner=True,
            )

        def run(optimizer, put):
            params = put(jax.tree.map(jnp.zeros_like, grads[0]))
            state = optimizer.init(params)
            update = jax.jit(optimizer.update)
            outputs = []
            placed = {k: put(v) if isinstance(v, dict) else v for k, v in extra.items()}
            for g in grads:
                updates, state = update(put(g), state, **placed)
                outputs.append(updates)
            return outputs, state

        want, want_state = run(pj.scale_by_kron(**kwargs), lambda t: t)
        optimizer = pj.scale_by_kron(
            **kwargs,
            params_partition_specs=specs,
            preconditioner_partition_spec=P("fsdp", None),
        )
        with jax.set_mesh(mesh):
            got, state = run(optimizer, lambda t: sharded._put(t, mesh, specs))
    sharded._assert_close(got, want, rtol=1e-10, atol=1e-14)
    for got_L, want_L in zip(
        jax.tree.leaves(state.lipschitz),
        jax.tree.leaves(want_state.lipschitz),
        strict=True,
    ):
        np.testing.assert_allclose(got_L[: len(want_L)], want_L, rtol=1e-10)


def test_state_partition_specs_cover_the_lipschitz_estimates():
    params = {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32)}
    specs = pj.get_opt_state_partition_specs(
        params,
        preconditioner_update_style="PRO",
        params_partition_specs={"w": P("fsdp", None)},
        preconditioner_partition_spec=P("fsdp"),
        mesh=jax.make_mesh((8,), ("fsdp",)),
        partition_grads_into_blocks=True,
        block_size=16,
    )
    kron_state = specs[0]
    assert jax.tree.structure(kron_state.lipschitz) == jax.tree.structure(
        kron_state.preconditioners
    )
    assert set(jax.tree.leaves(kron_state.lipschitz)) == {P("fsdp")}
