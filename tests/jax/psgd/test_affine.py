"""PSGD Affine against a float64 explicit-matrix reference, its fitting
properties, sharded == unsharded, and bad input."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from precond.jax import affine, scale_by_affine
from precond.jax.psgd import _affine_kernels as kernels
from precond.jax.psgd._affine_kernels import AffineFactors
from tests.jax.helpers import float64
from tests.reference import affine_reference as ref

# The module, not the ``affine`` function that precond.jax re-exports under its name.
affine_module = importlib.import_module("precond.jax.psgd.affine")

# One pair of limits for every case, so one optimizer covers them all: sides
# above 16, or more than 6 times the other side, get a diagonal factor.
LIMITS = dict(max_size_triangular=16, max_skew_triangular=6)
# name: (tensor shape, expected view, expected (left diagonal, right diagonal))
CASES = {
    "matrix": ((5, 7), (5, 7), (False, False)),
    "tensor": ((2, 3, 8), (6, 8), (False, False)),
    "skew": ((2, 13), (2, 13), (False, True)),
    "max_size": ((5, 17), (5, 17), (False, True)),
    "vector": ((6,), (1, 6), (True, False)),
    "scalar": ((), (1, 1), (True, True)),
}


@pytest.fixture(autouse=True)
def _float64():
    with float64():
        yield


def _random_factor(rng, size, diagonal):
    if diagonal:
        return rng.uniform(0.5, 1.5, size)
    return np.triu(0.3 * rng.normal(size=(size, size))) + np.diag(
        rng.uniform(0.8, 1.2, size)
    )


def _random_factors(rng, view, diagonal):
    return [
        _random_factor(rng, d, diag) for d, diag in zip(view, diagonal, strict=True)
    ]


def _jax_factors(factors):
    return AffineFactors(*(jnp.asarray(Q) for Q in factors))


def _factors_of(state, name):
    """Parameter ``name``'s (Q_l, Q_r): the state keeps every Q_l in one tree
    like the params and every Q_r in another."""
    return AffineFactors(*(tree[name] for tree in state.preconditioner))


@pytest.mark.parametrize("name", list(CASES))
def test_view_and_factor_types(name):
    shape, view, diagonal = CASES[name]
    assert kernels.matrix_view_shape(shape) == view == ref.matrix_view_shape(shape)
    params = {"x": jnp.zeros(shape)}
    state = scale_by_affine(**LIMITS).init(params)
    factors = _factors_of(state, "x")
    assert isinstance(factors, AffineFactors)
    assert (factors.left.ndim == 1, factors.right.ndim == 1) == diagonal
    assert (factors.left.shape[0], factors.right.shape[0]) == view
    # Unlike psgd-jax, no permutation: (3, 64, 3) is (3, 192), not (9, 64); ties
    # take the smaller first side.
    assert kernels.matrix_view_shape((3, 64, 3)) == (3, 192)
    assert kernels.matrix_view_shape((3, 4, 3)) == (3, 12)


@pytest.mark.parametrize("order", ["2nd", "1st"])
@pytest.mark.parametrize("newton", [True, False], ids=["newton", "dropv"])
@pytest.mark.parametrize("name", list(CASES))
def test_one_fit_and_preconditioning_match_reference(name, newton, order):
    """Kernels: one fit on (V, H) (V integrated out for 'dropv') and P·G after it
    equal the explicit-matrix float64 reference."""
    _, view, diagonal = CASES[name]
    rng = np.random.default_rng(len(name))
    factors = _random_factors(rng, view, diagonal)
    H, V, G = (rng.normal(size=view) for _ in range(3))
    V = V if newton else None
    got = kernels.affine_update(
        _jax_factors(factors),
        jnp.asarray(H),
        None if V is None else jnp.asarray(V),
        0.1,
        order,
    )
    want = ref.update(*factors, H, V, 0.1, order)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(
        kernels.affine_precondition(got, jnp.asarray(G)),
        ref.precondition(*want, G),
        rtol=1e-12,
        atol=1e-14,
    )


@pytest.mark.parametrize("name", ["matrix", "skew", "vector", "scalar"])
def test_expected_noise_grams(name):
    """E[BBᵀ], E[BᵀB] by the trace formula equal the exact sum over the unit
    matrices (1e-12) and a Monte Carlo average (20 000 draws, within 5%)."""
    _, view, diagonal = CASES[name]
    rng = np.random.default_rng(3)
    factors = _random_factors(rng, view, diagonal)
    got = kernels.expected_noise_grams([jnp.asarray(Q) for Q in factors])
    exact = ref.noise_grams_by_basis(*factors)
    for g, w, Q in zip(got, exact, factors, strict=True):
        np.testing.assert_allclose(g, np.diag(w) if Q.ndim == 1 else w, rtol=1e-12)
    L_inv, R_inv = (np.linalg.inv(ref.dense(Q)) for Q in factors)
    B = L_inv.T @ rng.normal(size=(20000, *view)) @ R_inv
    monte_carlo = (
        np.mean(B @ B.transpose(0, 2, 1), axis=0),
        np.mean(B.transpose(0, 2, 1) @ B, axis=0),
    )
    for m, w in zip(monte_carlo, exact, strict=True):
        assert np.linalg.norm(m - w) < 0.05 * np.linalg.norm(w)


@pytest.mark.parametrize("make_key", [jax.random.PRNGKey, jax.random.key])
def test_leaf_keys_are_psgd_jax_s_per_leaf_draws(make_key):
    """The keys and balancing draws derived for all leaves at once are those of
    psgd-jax's per-leaf chain: k₀, k_v = split(k) and u from
    split(split(k₀)[1])[1] where v is sampled, u from split(k)[1] elsewhere."""
    keys = jax.random.split(make_key(7), 5)
    sampled = (True, False, True, False, True)
    v_keys, draws = jax.jit(affine_module._leaf_keys, static_argnums=1)(keys, sampled)
    data = jax.random.key_data
    for k, sample, v_key, u in zip(keys, sampled, v_keys, draws, strict=True):
        if sample:
            k, want_v_key = jax.random.split(k)
            np.testing.assert_array_equal(data(v_key), data(want_v_key))
            k = jax.random.split(k)[1]
        else:
            assert v_key is None
        assert u == jax.random.uniform(jax.random.split(k)[1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.complex64])
def test_batched_draws_of_v_are_optax_random_like_s(dtype):
    """One batched draw per shape gives each leaf the v that
    ``optax.tree.random_like`` draws from its key alone."""
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    got = jax.jit(affine_module._random_like_draws, static_argnums=(1, 2))(
        keys, (6, 4), dtype
    )
    like = jnp.zeros((6, 4), dtype)
    for k, v in zip(keys, got, strict=True):
        want = optax.tree.random_like(k, like, jax.random.normal)
        np.testing.assert_array_equal(v, want)


def _integrates_noise_out(view, diagonal):
    """psgd-jax's rule: whitening integrates v out when both sides are diagonal,
    or one is and its side is at least as long as the other."""
    if all(diagonal):
        return True
    if diagonal[0]:
        return view[0] >= view[1]
    if diagonal[1]:
        return view[1] >= view[0]
    return False


def _reference_step(factors, h, v, g, lr, order, first, view):
    """First-fit scaling then one fit, then P·g (b1 = 0), all in float64."""
    factors = [np.asarray(Q) for Q in factors]
    h, g = h.reshape(view), g.reshape(view)
    v = None if v is None else v.reshape(view)
    if first:
        factors = [ref.first_scale(h, v) * Q for Q in factors]
    factors = ref.update(*factors, h, v, lr, order)
    return factors, ref.precondition(*factors, g)


@pytest.mark.parametrize(
    ("newton", "order"),
    [(True, "2nd"), (False, "2nd"), (True, "1st")],
    ids=["newton-2nd", "whitening-2nd", "newton-1st"],
)
def test_optimizer_steps_match_reference(newton, order):
    """Three steps of scale_by_affine (b1 = 0) on a tree of every case: updates
    and P equal the reference per leaf. Whitening leaves out the leaves whose v
    is drawn inside (psgd-jax's rule; checked statistically below).

    '2nd' starts with the automatic scaling. '1st' starts from Q = I: right after
    the automatic scaling, tr(T1 − T2) = 0 on each side, so a side of size 1 has
    a zero gradient up to rounding, and '1st' (μ = η/max|∇|) turns that rounding
    into a step of size η and arbitrary sign, which no reference reproduces."""
    names = [n for n, c in CASES.items() if newton or _integrates_noise_out(*c[1:])]
    params = {n: jnp.zeros(CASES[n][0]) for n in names}
    auto_scale = order == "2nd"
    optimizer = scale_by_affine(
        b1=0.0,
        step_normalizer_order=order,
        precond_init_scale=None if auto_scale else 1.0,
        **LIMITS,
    )
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    rng = np.random.default_rng(0)
    want = {n: _factors_of(state, n) for n in names}
    for step in range(3):
        g, h, v = ({n: rng.normal(size=CASES[n][0]) for n in names} for _ in range(3))
        if newton:
            updates, state = update(
                g, state, Hvp=h, vector=v, update_preconditioner=True
            )
        else:
            updates, state = update(g, state)
            h, v = g, {n: None for n in names}
        for n in names:
            want[n], expected = _reference_step(
                want[n],
                h[n],
                v[n],
                g[n],
                0.1,
                order,
                auto_scale and step == 0,
                CASES[n][1],
            )
            np.testing.assert_allclose(
                updates[n], expected.reshape(CASES[n][0]), rtol=1e-11, atol=1e-13
            )
            # P is compared (balancing may move a scalar between Q_l and Q_r).
            got_P = ref.preconditioner_matrix(*_factors_of(state, n))
            np.testing.assert_allclose(
                got_P, ref.preconditioner_matrix(*want[n]), rtol=1e-11, atol=1e-13
            )


def test_newton_fit_recovers_kronecker_hessian():
    """H·X = H_l X H_r (H = H_r ⊗ H_l, SPD, condition ~100): exact pairs (v, H·v)
    have a noise-free fixed point P = H⁻¹ (there A = B for every v), so fixed-η
    fitting converges to it geometrically: max|P·H − I| < 1e-10 after 600 steps
    (observed 3e-14; 8e-5 after 200)."""
    rng = np.random.default_rng(0)
    view = (4, 5)

    def spd(d):
        U = np.linalg.qr(rng.normal(size=(d, d)))[0]
        return U @ np.diag(np.geomspace(1, 10, d)) @ U.T

    H_l, H_r = spd(view[0]), spd(view[1])
    optimizer = scale_by_affine(b1=0.0, precond_lr=0.5)
    params = {"w": jnp.zeros(view)}
    state = optimizer.init(params)

    @jax.jit
    def fit(state, vs):
        def body(state, v):
            h = jnp.asarray(H_l) @ v @ jnp.asarray(H_r)
            _, state = optimizer.update(
                params, state, Hvp={"w": h}, vector={"w": v}, update_preconditioner=True
            )
            return state, None

        return jax.lax.scan(body, state, vs)[0]

    state = fit(state, jnp.asarray(rng.normal(size=(600, *view))))
    P = ref.preconditioner_matrix(*_factors_of(state, "w"))
    H = np.kron(H_r, H_l)
    np.testing.assert_allclose(P @ H, np.eye(H.shape[0]), atol=1e-10)


@pytest.mark.parametrize("dropv", [True, False], ids=["dropv", "sampled_v"])
def test_whitening_fit_recovers_inverse_root(dropv):
    """Gradients G = C_l^{1/2} Z C_r^{1/2}, Z ~ N(0, I) (E[vec G vec Gᵀ] = C_r ⊗
    C_l): E[T1] = E[T2] holds at P = C^{-1/2} = C_r^{-1/2} ⊗ C_l^{-1/2}. The fit
    gets there only approximately: the step size η/lb(T1 + T2) depends on the
    sample, so the stochastic fixed point is E[(T1 − T2)/lb(T1 + T2)] = 0, a few
    percent off, and fresh G (and v) keep P fluctuating at a size set by η
    (annealed 0.1 → 0.0005 over 10 000 steps). Relative Frobenius error < 10%
    (observed 6% dropv, 5% sampled v). dropv: C_r diagonal and the right factor
    diagonal (max_skew_triangular=1)."""
    rng = np.random.default_rng(1)
    view = (4, 6)

    def root(C):
        w, U = np.linalg.eigh(C)
        return U @ np.diag(np.sqrt(w)) @ U.T

    U = np.linalg.qr(rng.normal(size=(4, 4)))[0]
    C_l = U @ np.diag(np.geomspace(0.1, 10, 4)) @ U.T
    if dropv:
        C_r = np.diag(np.geomspace(0.2, 5, 6))
        kwargs = dict(max_skew_triangular=1)
    else:
        V = np.linalg.qr(rng.normal(size=(6, 6)))[0]
        C_r = V @ np.diag(np.geomspace(0.2, 5, 6)) @ V.T
        kwargs = {}
    steps = 10000
    optimizer = scale_by_affine(
        b1=0.0, precond_lr=optax.linear_schedule(0.1, 0.0005, steps), **kwargs
    )
    params = {"w": jnp.zeros(view)}
    state = optimizer.init(params)
    assert kernels.integrates_noise_out(_factors_of(state, "w")) == dropv
    L, R = jnp.asarray(root(C_l)), jnp.asarray(root(C_r))

    @jax.jit
    def fit(state, zs):
        def body(state, z):
            _, state = optimizer.update({"w": L @ z @ R}, state)
            return state, None

        return jax.lax.scan(body, state, zs)[0]

    state = fit(state, jnp.asarray(rng.normal(size=(steps, *view))))
    P = ref.preconditioner_matrix(*_factors_of(state, "w"))
    target = np.kron(np.linalg.inv(root(C_r)), np.linalg.inv(root(C_l)))
    assert np.linalg.norm(P - target) < 0.1 * np.linalg.norm(target)


def test_whitening_trains_an_ill_conditioned_quadratic():
    """L(X) = ½ tr((X − T)ᵀ H_l (X − T) H_r), Hessian H_r ⊗ H_l of condition 1e4,
    plus a vector and a 3-D leaf with diagonal curvature of condition 1e4: 300
    whitening steps (float32, default arguments, lr 0.1 decayed linearly to 0)
    cut the loss by 1e5 (observed 1e7; with a constant lr 0.1 it stalls near
    4e-5). Gradient descent at its largest stable step shrinks the flattest
    direction by only 1 − 2e-4 per step."""
    with jax.enable_x64(False):
        rng = np.random.default_rng(2)
        H_l = jnp.asarray(np.diag(np.geomspace(1, 100, 6)), jnp.float32)
        H_r = jnp.asarray(np.diag(np.geomspace(1, 100, 5)), jnp.float32)
        targets = {
            "w": jnp.asarray(rng.normal(size=(6, 5)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=8), jnp.float32),
            "t": jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32),
        }
        b_scale = jnp.asarray(np.geomspace(1, 1e4, 8), jnp.float32)
        t_scale = jnp.asarray(np.geomspace(1, 1e4, 24).reshape(2, 3, 4), jnp.float32)

        def loss(p):
            E = p["w"] - targets["w"]
            return (
                0.5 * jnp.trace(E.T @ H_l @ E @ H_r)
                + 0.5 * jnp.sum(b_scale * (p["b"] - targets["b"]) ** 2)
                + 0.5 * jnp.sum(t_scale * (p["t"] - targets["t"]) ** 2)
            )

        optimizer = affine(learning_rate=optax.linear_schedule(0.1, 0.0, 300))
        params = jax.tree.map(jnp.zeros_like, targets)

        def step(carry, _):
            params, state = carry
            updates, state = optimizer.update(jax.grad(loss)(params), state, params)
            return (optax.apply_updates(params, updates), state), None

        run = jax.jit(lambda c: jax.lax.scan(step, c, None, 300)[0])
        params, _ = run((params, optimizer.init(params)))
        assert loss(params) < 1e-5 * loss(jax.tree.map(jnp.zeros_like, targets))


# Sharded == unsharded: two meshes, parameters split along one or two axes. w is
# viewed as (16, 24) with two triangular factors (whitening samples v); t as
# (2, 256) with a diagonal right factor (256 > 128·2: v integrated out).
SHARD_SHAPES = {"w": (16, 24), "t": (2, 4, 64)}
MESHES = {"fsdp": ((8,), ("fsdp",)), "fsdp,tp": ((2, 4), ("fsdp", "tp"))}
PLACEMENTS = {
    "fsdp": {"w": P("fsdp", None), "t": P(None, None, "fsdp")},
    "fsdp,tp": {"w": P("fsdp", "tp"), "t": P("fsdp", "tp", None)},
}
# Whitening and Newton steps alternate in one run (the fits chain).
SHARD_STEPS = ("whitening", "newton", "whitening", "newton")


def _sharding_inputs():
    rng = np.random.default_rng(0)
    return [
        tuple(
            {
                k: jnp.asarray(rng.normal(size=s), jnp.float32)
                for k, s in SHARD_SHAPES.items()
            }
            for _ in range(3)
        )
        for _ in SHARD_STEPS
    ]


def _run_sharding_steps(place=lambda t: t):
    optimizer = scale_by_affine()
    state = optimizer.init(place({k: jnp.ones(s) for k, s in SHARD_SHAPES.items()}))
    update = jax.jit(optimizer.update)
    outputs = []
    for mode, (g, h, v) in zip(SHARD_STEPS, _sharding_inputs(), strict=True):
        extra = {}
        if mode == "newton":
            extra = dict(Hvp=place(h), vector=place(v), update_preconditioner=True)
        updates, state = update(place(g), state, **extra)
        outputs.append(updates)
    return outputs, state


@functools.cache
def _unsharded_run():
    with jax.enable_x64(False):
        return _run_sharding_steps()


@pytest.mark.parametrize(
    ("mesh_name", "axis_type"),
    [("fsdp", AxisType.Auto), ("fsdp,tp", AxisType.Explicit)],
    ids=["fsdp-auto", "fsdp,tp-explicit"],
)
def test_sharded_equals_unsharded(mesh_name, axis_type):
    """Whitening and Newton steps in float32, jitted, with params, gradients,
    Hvp and vector placed on a mesh, equal the one-device run: relative
    Frobenius error < 2e-6 per leaf for updates and factors (observed ≤ 2e-7
    and ≤ 4e-8 on all four mesh × axis-type pairs: float32 rounding, the same
    math with a few reductions in another order). Updates keep the gradients'
    shardings."""
    with jax.enable_x64(False):
        shape, axes = MESHES[mesh_name]
        mesh = jax.make_mesh(shape, axes, axis_types=(axis_type,) * len(axes))
        specs = PLACEMENTS[mesh_name]

        def put(tree):
            return jax.tree.map(
                lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
            )

        want, want_state = _unsharded_run()
        with jax.set_mesh(mesh):
            got, state = _run_sharding_steps(put)
    for got_step, want_step in zip(got, want, strict=True):
        for k in SHARD_SHAPES:
            _assert_relative_error(got_step[k], want_step[k], 2e-6)
            assert got_step[k].sharding.is_equivalent_to(
                NamedSharding(mesh, specs[k]), got_step[k].ndim
            )
    for g, w in zip(
        jax.tree.leaves(state.preconditioner),
        jax.tree.leaves(want_state.preconditioner),
        strict=True,
    ):
        _assert_relative_error(g, w, 2e-6)


def _assert_relative_error(got, want, bound):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.linalg.norm(got - want) <= bound * np.linalg.norm(want)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            dict(max_size_triangular=-1),
            ValueError,
            "Invalid max_size_triangular=-1: must be >= 0",
        ),
        (
            dict(max_skew_triangular=-2),
            ValueError,
            "Invalid max_skew_triangular=-2: must be >= 0",
        ),
        (
            dict(max_size_triangular=1.5),
            TypeError,
            "Invalid max_size_triangular=1.5: must be a Python int",
        ),
        (
            dict(step_normalizer_order="3rd"),
            ValueError,
            "Invalid step_normalizer_order='3rd'",
        ),
        (dict(precision="fast"), ValueError, "Invalid precision='fast'"),
        (dict(precond_lr=0.0), ValueError, "Invalid precond_lr=0.0"),
        (dict(learning_rate=-1.0), ValueError, "Invalid learning_rate=-1.0"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        affine(**kwargs)


def test_partial_newton_arguments_are_an_error():
    optimizer = affine()
    params = {"w": jnp.zeros((3, 2))}
    with pytest.raises(ValueError, match="missing vector, update_preconditioner"):
        optimizer.update(params, optimizer.init(params), params, Hvp=params)


def test_zero_max_sizes_make_every_factor_diagonal():
    params = {"w": jnp.zeros((4, 5)), "t": jnp.zeros((2, 3, 4))}
    for kwargs in (dict(max_size_triangular=0), dict(max_skew_triangular=0)):
        state = scale_by_affine(**kwargs).init(params)
        assert all(f.ndim == 1 for f in jax.tree.leaves(state.preconditioner))
