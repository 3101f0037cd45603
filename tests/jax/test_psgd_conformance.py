"""The optax conformance table (DESIGN.md §7.3) for PSGD XMat, LRA, Affine and
Kron's generation-2 styles, each in whitening and in Hessian-vector-product mode.

Kron's 'EQ' whitening mode has its own table in test_kron_optimizer.py. Rows:
convergence on an ill-conditioned quadratic (beating optax.adam at equal steps,
both with the best of a learning-rate sweep) and on Rosenbrock, one compile for
many donated steps, ``inject_hyperparams``, ``MultiSteps``, update and state
dtypes, and the non-finite-gradient policy.
"""

from __future__ import annotations

import functools
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import precond.jax as pj


def _kron(style):
    return functools.partial(pj.kron, preconditioner_update_style=style)


# name ↦ optimizer factory (keyword arguments of the psgd-jax / kron signature).
OPTIMIZERS = {
    "xmat": pj.xmat,
    "lra": pj.low_rank_approximation,
    "affine": pj.affine,
    "kron-EQ": _kron("EQ"),
    "kron-QUAD": _kron("QUAD"),
    "kron-PRO": _kron("PRO"),
}
# Arguments that must stay Python values under optax.inject_hyperparams.
STATIC_ARGS = {
    "kron": pj.KRON_STATIC_ARGS,
    "lra": pj.LRA_STATIC_ARGS,
    "affine": pj.AFFINE_STATIC_ARGS,
}
# Every optimizer in both modes, except Kron 'EQ' whitening (test_kron_optimizer).
CASES = [
    pytest.param(name, newton, id=f"{name}-{'hvp' if newton else 'whitening'}")
    for name in OPTIMIZERS
    for newton in (False, True)
    if (name, newton) != ("kron-EQ", False)
]


def _make(name, newton, learning_rate, **kwargs):
    if name.startswith("kron") and not newton:
        kwargs.setdefault("preconditioner_update_probability", 1.0)
    return OPTIMIZERS[name](learning_rate=learning_rate, **kwargs)


def _step_fn(name, newton, optimizer, loss):
    """One training step (params, state, key) ↦ (params, state), in either mode."""

    def step(params, state, key):
        if newton:
            # Every step fits the preconditioner, as psgd-jax's default.
            _, grads, hvp, vector, flag = pj.hessian_helper(key, loss, params)
            updates, state = optimizer.update(
                grads,
                state,
                params,
                Hvp=hvp,
                vector=vector,
                update_preconditioner=flag,
            )
        else:
            updates, state = optimizer.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    return step


def _trainer(name, newton, make_optimizer, loss, steps, seed=0):
    """A jitted (params, learning rate) ↦ (params, losses) after ``steps`` steps of
    ``make_optimizer(learning rate)``: the rate is traced, so one compile serves a
    whole learning-rate sweep."""
    keys = jax.random.split(jax.random.PRNGKey(seed), steps)

    def run(params, learning_rate):
        optimizer = make_optimizer(learning_rate)
        step = _step_fn(name, newton, optimizer, loss)

        def body(carry, key):
            params, state = carry
            params, state = step(params, state, key)
            return (params, state), loss(params)

        (params, _), losses = jax.lax.scan(body, (params, optimizer.init(params)), keys)
        return params, losses

    return jax.jit(run)


def _train(name, newton, optimizer, loss, params, steps, seed=0):
    return _trainer(name, newton, lambda _: optimizer, loss, steps, seed)(params, 0.0)


def _cosine_trainer(name, newton, loss, steps):
    """``_trainer`` of the optimizer with a cosine decay from the rate over steps."""

    def make_optimizer(learning_rate):
        return _make(name, newton, optax.cosine_decay_schedule(learning_rate, steps))

    return _trainer(name, newton, make_optimizer, loss, steps)


def _spd(rng, d, condition):
    """A rotated SPD matrix with eigenvalues log-spaced from 1 to 1/condition."""
    basis, _ = np.linalg.qr(rng.normal(size=(d, d)))
    return basis @ np.diag(np.logspace(0, -np.log10(condition), d)) @ basis.T


def _quadratic(structure):
    """L(x) = ½ xᵀHx on x of shape (16, 8), with an ill-conditioned H that is not
    axis-aligned (so a diagonal method such as Adam cannot undo it) and that the
    optimizer's preconditioner can represent:

    * 'kronecker' (Kron, Affine): H = A ⊗ B, A 16×16 (condition 1e3) and B 8×8
      (1e2), both rotated: L = ½ tr(Xᵀ A X B).
    * 'x' (XMat): H = Q_HᵀQ_H with Q_H = diag(a) + antidiag(b) over the 128
      flattened entries, condition ≈ 1e4.
    * 'low-rank' (LRA): H = D + W·S·Wᵀ, D diagonal in [0.01, 0.1] and 5 random
      directions W with curvature 1 to 100.
    """
    rng = np.random.default_rng(0)
    n = 128
    if structure == "kronecker":
        H = np.kron(_spd(rng, 16, 1e3), _spd(rng, 8, 1e2))
    elif structure == "x":
        a = np.logspace(0, -2, n)[rng.permutation(n)]
        # Each pair (i, n−1−i) couples through b; det = a_i·a_j·(1 − 0.81·s_i·s_j).
        b = 0.9 * a[::-1] * rng.choice([-1, 1], n)
        Q = np.diag(a) + np.fliplr(np.diag(b[::-1]))
        H = Q.T @ Q
    else:
        assert structure == "low-rank"
        W, _ = np.linalg.qr(rng.normal(size=(n, 5)))
        H = np.diag(rng.uniform(0.01, 0.1, n)) + W @ np.diag(np.logspace(0, 2, 5)) @ W.T
    noise_root = jnp.asarray(np.linalg.cholesky(H), jnp.float32)
    H = jnp.asarray(H, jnp.float32)
    x0 = {"x": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)}

    def loss(params):
        x = params["x"].ravel()
        return 0.5 * x @ (H @ x)

    def noisy_loss(params, key):
        """A loss whose gradient is Hx + 0.1·Lz (z ~ N(0, I), LLᵀ = H): the noise
        has the curvature's covariance, as minibatch noise roughly does."""
        noise = 0.1 * noise_root @ jax.random.normal(key, (n,))
        return loss(params) + jnp.dot(jax.lax.stop_gradient(noise), params["x"].ravel())

    return loss, noisy_loss, x0


STRUCTURE = {"xmat": "x", "lra": "low-rank", "affine": "kronecker", "kron": "kronecker"}
LEARNING_RATES = (1.0, 0.3, 0.1, 0.03)
ADAM_LEARNING_RATES = (1.0, 0.3, 0.1, 0.03, 0.01, 0.003)
NOISY_STEPS, WINDOW = 300, 50


def _noisy_run(name, newton, make_optimizer, structure):
    """A jitted learning rate ↦ mean exact loss over the last 50 of 300 steps of
    ``make_optimizer(learning rate)`` on noisy gradients (one compile per sweep)."""
    loss, noisy_loss, x0 = _quadratic(structure)
    keys = jax.random.split(jax.random.PRNGKey(1), NOISY_STEPS)
    noise_keys = jax.random.split(jax.random.PRNGKey(2), NOISY_STEPS)

    def run(learning_rate):
        optimizer = make_optimizer(learning_rate)

        def body(carry, inputs):
            params, state = carry
            step_key, noise_key = inputs
            noisy = lambda p: noisy_loss(p, noise_key)  # noqa: E731
            step = _step_fn(name, newton, optimizer, noisy)
            params, state = step(params, state, step_key)
            return (params, state), loss(params)

        init = (x0, optimizer.init(x0))
        _, losses = jax.lax.scan(body, init, (keys, noise_keys))
        return jnp.mean(losses[-WINDOW:])

    return jax.jit(run)


@functools.cache
def _adam_noisy_loss(structure):
    run = _noisy_run("adam", False, optax.adam, structure)
    return min(float(run(lr)) for lr in ADAM_LEARNING_RATES)


@pytest.mark.parametrize(("name", "newton"), CASES)
def test_beats_adam_on_noisy_ill_conditioned_quadratic(name, newton):
    """Best of a learning-rate sweep (cosine decay) against Adam's best of a wider
    sweep, at equal steps: the preconditioner captures the rotated curvature that
    Adam's diagonal cannot."""
    structure = STRUCTURE[name.split("-")[0]]
    loss, _, x0 = _quadratic(structure)
    run = _noisy_run(
        name,
        newton,
        lambda lr: _make(name, newton, optax.cosine_decay_schedule(lr, NOISY_STEPS)),
        structure,
    )
    finals = {lr: float(run(lr)) for lr in LEARNING_RATES}
    best, adam = min(finals.values()), _adam_noisy_loss(structure)
    assert best < float(loss(x0)) / 50, finals
    assert best < adam, (finals, adam)


@pytest.mark.parametrize(("name", "newton"), CASES)
def test_converges_on_deterministic_ill_conditioned_quadratic(name, newton):
    """1e-4 of the initial loss within 2000 steps, for one rate of the sweep."""
    loss, _, x0 = _quadratic(STRUCTURE[name.split("-")[0]])
    train, finals = _cosine_trainer(name, newton, loss, 2000), {}
    for lr in LEARNING_RATES:
        finals[lr] = float(train(x0, lr)[1][-1])
        if finals[lr] < 1e-4 * float(loss(x0)):
            return
    pytest.fail(f"no learning rate reached 1e-4 of the initial loss: {finals}")


@pytest.mark.parametrize(("name", "newton"), CASES)
def test_converges_on_rosenbrock(name, newton):
    """Within 1e-3 of (1, 1) from (−1.5, 2) in 2000 steps, for one rate of a
    sweep: Newton-mode steps are unit-scale (P ≈ |H|⁻¹), whitening steps smaller.

    The point is a (2, 1) column, so that Kron fits a full 2×2 factor as the
    flattening optimizers do (a 1-D point gets a diagonal Kron factor: in
    Newton mode that crawls along the curved valley, about (0.8, 0.7) here).
    """

    def rosenbrock(params):
        x, y = params["xy"][:, 0]
        return (1 - x) ** 2 + 100 * (y - x**2) ** 2

    params = {"xy": jnp.array([[-1.5], [2.0]])}
    train, ends = _cosine_trainer(name, newton, rosenbrock, 2000), {}
    for lr in (1.0, 0.3, 0.1) if newton else (0.1, 0.03, 0.01):
        params_out, _ = train(params, lr)
        ends[lr] = params_out["xy"][:, 0].tolist()
        if np.allclose(params_out["xy"], 1.0, atol=1e-3):
            return
    pytest.fail(f"{name} did not reach (1, 1): {ends}")


PARAMS = {"w": jnp.ones((6, 5)), "b": jnp.zeros(5), "conv": jnp.ones((3, 2, 2, 2))}


def _gradients(params, step):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(step), len(leaves))
    return treedef.unflatten(
        [jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves)]
    )


def _newton_args(params, step, newton):
    """Hvp (of H = 2I + a ramp along the last axis), vector and flag; nothing in
    whitening mode."""
    if not newton:
        return {}
    vector = _gradients(params, 1000 + step)
    hvp = jax.tree.map(lambda v: 2 * v + 0.1 * jnp.cumsum(v, axis=-1), vector)
    return dict(Hvp=hvp, vector=vector, update_preconditioner=jnp.asarray(True))


@pytest.mark.parametrize(("name", "newton"), CASES)
def test_one_compile_for_many_donated_steps(name, newton):
    optimizer = _make(name, newton, 0.01)
    traces = []

    def update(grads, state, extra):
        traces.append(1)
        return optimizer.update(grads, state, PARAMS, **extra)

    update = jax.jit(update, donate_argnums=1)
    state = optimizer.init(PARAMS)
    for step in range(3):
        _, state = update(
            _gradients(PARAMS, step), state, _newton_args(PARAMS, step, newton)
        )
    assert len(traces) == 1


# Whitening mode under inject_hyperparams: test_optax_contract.py's table.
NEWTON_CASES = [case for case in CASES if case.values[1]]


@pytest.mark.parametrize(("name", "newton"), NEWTON_CASES)
def test_inject_hyperparams_gives_same_updates(name, newton):
    kwargs = dict(learning_rate=3e-3, b1=0.9, weight_decay=0.01)
    if name.startswith("kron"):
        kwargs["preconditioner_update_probability"] = 1.0
    factory = optax.inject_hyperparams(
        OPTIMIZERS[name], static_args=STATIC_ARGS.get(name.split("-")[0], ())
    )
    plain, injected = OPTIMIZERS[name](**kwargs), factory(**kwargs)
    states = [plain.init(PARAMS), injected.init(PARAMS)]
    updates = [jax.jit(plain.update), jax.jit(injected.update)]
    for step in range(4):
        grads, extra = _gradients(PARAMS, step), _newton_args(PARAMS, step, newton)
        want, states[0] = updates[0](grads, states[0], PARAMS, **extra)
        got, states[1] = updates[1](grads, states[1], PARAMS, **extra)
        # Hyperparameters arrive as float32 arrays instead of Python floats: an
        # ulp here and there, amplified by cancellation in small entries.
        jax.tree.map(
            lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-8),
            got,
            want,
        )


@pytest.mark.parametrize(("name", "newton"), CASES)
def test_multisteps_equals_one_step_on_the_mean_gradient(name, newton):
    """MultiSteps(k=2) emits, on its second call, the update of the mean gradient
    (with the Newton arguments of that call) and zeros on the first."""
    micro = [_gradients(PARAMS, 0), _gradients(PARAMS, 1)]
    extra = _newton_args(PARAMS, 1, newton)
    accumulated = optax.MultiSteps(_make(name, newton, 0.01), every_k_schedule=2)
    state = accumulated.init(PARAMS)
    update = jax.jit(accumulated.update)
    first, state = update(micro[0], state, PARAMS, **extra)
    for leaf in jax.tree.leaves(first):
        np.testing.assert_array_equal(leaf, 0.0)
    second, _ = update(micro[1], state, PARAMS, **extra)
    direct = _make(name, newton, 0.01)
    mean = jax.tree.map(lambda a, b: (a + b) / 2, *micro)
    want, _ = jax.jit(direct.update)(mean, direct.init(PARAMS), PARAMS, **extra)
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7),
        second,
        want,
    )


@pytest.mark.parametrize(("name", "newton"), CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_update_and_state_dtypes_are_stable(name, newton, dtype):
    params = {
        "w": jnp.ones((6, 5), dtype),
        "b": jnp.zeros(5, jnp.float32),  # mixed with the other dtype
    }
    optimizer = _make(name, newton, 0.01)
    state = optimizer.init(params)
    before = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    update = jax.jit(optimizer.update)
    for step in range(3):
        grads = _gradients(params, step)
        updates, state = update(
            grads, state, params, **_newton_args(params, step, newton)
        )
        assert jax.tree.map(lambda u: u.dtype, updates) == jax.tree.map(
            lambda g: g.dtype, grads
        )
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == before


@pytest.mark.parametrize(("name", "newton"), CASES)
def test_non_finite_gradient_skips_the_step(name, newton):
    """NaN, +Inf or -Inf in one entry: zero update, unchanged state; the next
    finite step proceeds normally. (One compiled update serves every value.)"""
    optimizer = _make(name, newton, 0.01)
    update = jax.jit(optimizer.update)
    _, state = update(
        _gradients(PARAMS, 0),
        optimizer.init(PARAMS),
        PARAMS,
        **_newton_args(PARAMS, 0, newton),
    )
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        grads = _gradients(PARAMS, 1)
        grads["w"] = grads["w"].at[2, 3].set(bad)
        updates, new_state = update(
            grads, state, PARAMS, **_newton_args(PARAMS, 1, newton)
        )
        for leaf in jax.tree.leaves(updates):
            np.testing.assert_array_equal(leaf, 0.0, err_msg=str(bad))
        jax.tree.map(np.testing.assert_array_equal, new_state, state)
        _, after = update(
            _gradients(PARAMS, 2), new_state, PARAMS, **_newton_args(PARAMS, 2, newton)
        )
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(after)), bad


# Arguments XMat, LRA and Affine share (psgd-jax's), each with a bad value, the
# error type and the start of its message.
SHARED_BAD_ARGUMENTS = [
    (dict(nesterov="no"), TypeError, "Invalid nesterov='no': must be True or False"),
    (dict(nesterov=1), TypeError, "Invalid nesterov=1: must be True or False"),
    (dict(seed="abc"), TypeError, "Invalid seed='abc': must be None, a PRNG key"),
    (dict(seed=1.5), TypeError, "Invalid seed=1.5"),
    (dict(seed=np.zeros(3, np.uint32)), TypeError, "Invalid seed=array"),
    (dict(mu_dtype=jnp.int32), ValueError, "must be a floating dtype"),
    (dict(mu_dtype="no dtype"), ValueError, "Invalid mu_dtype='no dtype'"),
    (dict(b1=1.0), ValueError, "Invalid b1=1.0: must be in [0.0, 1.0)"),
    (dict(precond_lr=0.0), ValueError, "Invalid precond_lr=0.0: must be > 0.0"),
    (dict(preconditioner_update_probability=1.5), ValueError, "Invalid prec"),
    (dict(update_global_norm_clip=-1.0), ValueError, "Invalid update_global_no"),
    (dict(precond_init_scale=0.0), ValueError, "Invalid precond_init_scale=0.0"),
    (dict(step_normalizer_order="3rd"), ValueError, "Invalid step_normalizer_o"),
    (dict(precision="fast"), ValueError, "Invalid precision='fast'"),
]


@pytest.mark.parametrize("name", ["xmat", "lra", "affine"])
def test_shared_arguments_are_checked_at_construction(name):
    for kwargs, error, message in SHARED_BAD_ARGUMENTS:
        with pytest.raises(error, match=re.escape(message)):
            OPTIMIZERS[name](**kwargs)


@pytest.mark.parametrize("name", ["xmat", "lra", "affine"])
def test_every_seed_form_psgd_jax_accepts_works(name):
    """None (psgd-jax's PRNGKey(36)), a raw or typed PRNG key, or an int n
    (PRNGKey(n)): the int and its raw key give the same state."""
    params = {"w": jnp.ones((3, 2))}
    states = {
        repr(seed): OPTIMIZERS[name](seed=seed).init(params)
        for seed in (None, 7, jax.random.PRNGKey(7), jax.random.key(7))
    }
    int_state, key_state = states["7"], states[repr(jax.random.PRNGKey(7))]
    jax.tree.map(np.testing.assert_array_equal, int_state, key_state)


def test_every_argument_has_a_check():
    """Each variant's scale_by_* arguments are exactly the shared table's plus
    its own table's: none goes unchecked."""
    from precond.jax._psgd_transform import PSGD_ARGUMENT_CHECKS
    from precond.jax.affine import AFFINE_ARGUMENT_CHECKS
    from precond.jax.lra import LRA_ARGUMENT_CHECKS

    own = {
        pj.scale_by_xmat: {},
        pj.scale_by_lra: LRA_ARGUMENT_CHECKS,
        pj.scale_by_affine: AFFINE_ARGUMENT_CHECKS,
    }
    for transform, checks in own.items():
        arguments = set(inspect.signature(transform).parameters)
        assert arguments == set(PSGD_ARGUMENT_CHECKS) | set(checks), transform
