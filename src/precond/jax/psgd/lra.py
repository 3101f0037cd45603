"""PSGD LRA as an optax transformation: ``low_rank_approximation`` (``lra``) and
``scale_by_lra``.

Drop-in for ``psgd_jax.low_rank_approximation``: same argument names and
defaults. All parameters are flattened into one vector of n entries,
preconditioned by P = QᵀQ with the "UVd" factor Q = (I + UVᵀ)·diag(d), U, V ∈
R^{n×r} (Li 2022, arXiv:2211.04422): n(2r + 1) numbers of state (+ n momentum),
O(nr) work per step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from precond._common.kron_constants import BALANCE_PROBABILITY
from precond._common.validation import check_choice, check_int
from precond.jax._core.factor_kernels import conj, conj_transpose, squared_magnitude
from precond.jax.psgd._transform import (
    Preconditioner,
    check_arguments,
    flattened_preconditioner,
    psgd_alias,
    psgd_arguments,
    scale_by_psgd,
)

# Integer arguments that fix shapes or seeds: they must stay Python ints, so pass
# them as ``static_args`` to ``optax.inject_hyperparams``.
LRA_STATIC_ARGS = ("uvd_rank_of_approximation", "seed")
# LRA's own arguments (the shared ones: PSGD_ARGUMENT_CHECKS).
LRA_BALANCE_METHODS = ("gauge", "norm")
LRA_ARGUMENT_CHECKS = {
    "uvd_rank_of_approximation": functools.partial(check_int, low=1),
    "balance_method": functools.partial(check_choice, choices=LRA_BALANCE_METHODS),
}
# Each fit rebalances ‖U‖ and ‖V‖ with probability BALANCE_PROBABILITY: PSGD's
# rule for scale-redundant factors, Kron's (precond._common.kron_constants).
UPDATE_U_PROBABILITY = 0.5  # chance per fit of stepping U (else V)


class LRAFactors(NamedTuple):
    """Q = (I + UVᵀ)·diag(d) over all parameters flattened (n entries)."""

    U: jax.Array  # (n, r): left low-rank factor
    V: jax.Array  # (n, r): right low-rank factor
    d: jax.Array  # (n,): diagonal factor


def _branch(pred, true_fn, false_fn, *operands):
    """``true_fn(*operands)`` if pred else ``false_fn(*operands)``: a Python
    branch for a Python bool, else ``lax.cond`` (only the taken side runs)."""
    if isinstance(pred, bool):
        return true_fn(*operands) if pred else false_fn(*operands)
    return jax.lax.cond(pred, true_fn, false_fn, *operands)


def lra_precondition(
    U: jax.Array, V: jax.Array, d: jax.Array, g: jax.Array
) -> jax.Array:
    """P·g = QᵀQ·g = d⊙(I + VUᵀ)(I + UVᵀ)(d⊙g), in O(nr) (complex: P = QᴴQ,
    d̄⊙(I + VUᴴ)(I + UVᴴ)(d⊙g))."""
    x = d * g
    y = x + U @ (conj_transpose(V) @ x)
    return conj(d) * (y + V @ (conj_transpose(U) @ y))


def _rank2_frobenius_norm(a, c, b, e):
    """‖a cᵀ − b eᵀ‖_F (‖a cᴴ − b eᴴ‖_F if complex) from inner products:
    ‖a‖²‖c‖² + ‖b‖²‖e‖² − 2·Re((aᴴb)(eᴴc))."""
    squared = (
        jnp.real(conj(a) @ a) * jnp.real(conj(c) @ c)
        + jnp.real(conj(b) @ b) * jnp.real(conj(e) @ e)
        - 2 * jnp.real((conj(a) @ b) * (conj(e) @ c))
    )
    return jnp.sqrt(jnp.abs(squared))


def lra_scale_balance(U: jax.Array, V: jax.Array) -> tuple[jax.Array, jax.Array]:
    """psgd-jax's balancing: U/ρ, V·ρ with ρ = sqrt(‖U‖_F/‖V‖_F) (UVᵀ unchanged,
    ‖U‖_F = ‖V‖_F afterwards; the r×r gauge is left free, see
    :func:`lra_balance`)."""
    rho = jnp.sqrt(jnp.linalg.norm(U) / jnp.linalg.norm(V))
    return U / rho, V * rho


def lra_balance(U: jax.Array, V: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The balanced factors of UVᵀ: (U·R, V·R⁻ᵀ) with UᵀU = VᵀV, the pair of
    least ‖U‖²_F + ‖V‖²_F among all U·R, V·R⁻ᵀ (R ∈ GL(r)), which all give the
    same UVᵀ, so the same Q.

    With U = Q_u R_u, V = Q_v R_v (thin QR) and R_u R_vᵀ = XΣYᵀ (SVD, r×r):
    U ← Q_u X Σ^{1/2}, V ← Q_v Y Σ^{1/2} (then UᵀU = VᵀV = Σ, ‖U‖²_F = ‖V‖²_F =
    ‖UVᵀ‖_*). Only the r×r gauge R moves. The fit's U and V steps leave that gauge
    free to drift: it walks off, ‖U‖ and ‖V‖ grow while UVᵀ stays, until
    I + VᵀU is too ill-conditioned for the float32 r×r solves; scaling U and V by
    one number ρ (psgd-jax) only fixes ‖U‖ = ‖V‖, not that drift.

    Singular values of UVᵀ below τ = r·ε·Σ_11 (rounding level) are raised to τ:
    a zero column in both U and V would never move again (each factor's step is
    proportional to the other factor), while the drift lives in exactly those
    near-null directions. If UVᵀ = 0 there is no scale: U and V are left as they
    are.
    """
    q_u, r_u = jnp.linalg.qr(U)
    q_v, r_v = jnp.linalg.qr(V)
    # Complex: R_u R_vᴴ = XΣYᴴ, V ← Q_v Y Σ^{1/2} (U·R, V·R⁻ᴴ keep UVᴴ).
    x, sigma, y_t = jnp.linalg.svd(r_u @ conj_transpose(r_v))
    floor = U.shape[1] * jnp.finfo(U.dtype).eps * sigma[0]
    root = jnp.sqrt(jnp.maximum(sigma, floor))
    nonzero = sigma[0] > 0
    return (
        jnp.where(nonzero, q_u @ (x * root), U),
        jnp.where(nonzero, q_v @ (conj_transpose(y_t) * root), V),
    )


def lra_update(
    U: jax.Array,
    V: jax.Array,
    d: jax.Array,
    v: jax.Array,
    h: jax.Array,
    precond_lr: jax.Array | float,
    step_normalizer_order: str = "2nd",
    *,
    update_u: bool | jax.Array,
    balance: bool | jax.Array,
    balance_method: str = "gauge",
) -> LRAFactors:
    """One PSGD step of Q = (I + UVᵀ)·diag(d) on the pair (v, h) (h ≈ H·v).

    If ``balance``: U, V ← :func:`lra_balance` (U, V) (Q unchanged; psgd-jax
    only scaled them by one number, :func:`lra_scale_balance`, chosen by
    ``balance_method="norm"``, which lets the r×r gauge of U, V drift until
    float32 solves fail, after ~10⁵ steps). With
    a = Qh, b = Q⁻ᵀv = (I + VUᵀ)⁻¹(v/d) and P⁻¹v = diag(1/d)(I + UVᵀ)⁻¹b (Woodbury,
    r×r solves), and Ph = d⊙(I + VUᵀ)a:

    - d ← d − μ·d⊙∇d, ∇d = Ph⊙h − v⊙P⁻¹v, μ = η·min(rsqrt(Ph² + v²)·rsqrt(h² +
      (P⁻¹v)²)) ('2nd') or η/max|∇d| ('1st');
    - with E = aaᵀ − bbᵀ (a, b from before the d step), either (``update_u``)
      Q ← (I − μ·EVVᵀ)Q, i.e. U ← U − μ(a(aᵀV) − b(bᵀV))(I + VᵀU), or
      Q ← (I − μ·UUᵀE)Q, i.e. V ← V − μ[(a + VUᵀa)(aᵀU) − (b + VUᵀb)(bᵀU)]; with
      the rank-2 gradient G = EVVᵀ (or UUᵀE), μ = η/(‖a‖‖VVᵀa‖ + ‖b‖‖VVᵀb‖)
      (or UUᵀ; '2nd', a bound of ‖G‖₂ by its two terms) or η/‖G‖_F ('1st',
      as psgd-jax).

    Complex (P = QᴴQ, Q = (I + UVᴴ)·diag(d)): every ᵀ above is ᴴ, b = Q⁻ᴴv,
    ∇d = Ph⊙h̄ − v⊙conj(P⁻¹v), E = aaᴴ − bbᴴ and squares are |·|².
    """
    balancer = lra_balance if balance_method == "gauge" else lra_scale_balance
    U, V = _branch(balance, balancer, lambda U, V: (U, V), U, V)
    a, Ph, b, iPv = _fit_terms(U, V, d, v, h)
    d = _diagonal_step(d, v, h, Ph, iPv, precond_lr, step_normalizer_order)
    U, V = _low_rank_step(U, V, a, b, precond_lr, step_normalizer_order, update_u)
    return LRAFactors(U, V, d)


def _fit_terms(U, V, d, v, h):
    """(a, Ph, b, P⁻¹v) of :func:`lra_update`: a = Qh, Ph = QᴴQh, b = Q⁻ᴴv
    (Woodbury: (I + VUᴴ)⁻¹(v/d̄), an r×r solve) and P⁻¹v = Q⁻¹b."""
    eye = jnp.eye(U.shape[1], dtype=d.dtype)
    UtV = conj_transpose(U) @ V
    a = d * h
    a = a + U @ (conj_transpose(V) @ a)  # Qh
    Ph = conj(d) * (a + V @ (conj_transpose(U) @ a))
    w = v / conj(d)
    b = w - V @ jnp.linalg.solve(eye + UtV, conj_transpose(U) @ w)  # Q⁻ᵀv
    # P⁻¹v = Q⁻¹Q⁻ᵀv
    iPv = (
        b - U @ jnp.linalg.solve(eye + conj_transpose(UtV), conj_transpose(V) @ b)
    ) / d
    return a, Ph, b, iPv


def _diagonal_step(d, v, h, Ph, iPv, precond_lr, step_normalizer_order):
    """d − μ·d⊙∇d with ∇d = Ph⊙h̄ − v⊙conj(P⁻¹v) and μ of
    :func:`lra_update`."""
    tiny = jnp.finfo(d.dtype).tiny
    grad_d = Ph * conj(h) - v * conj(iPv)
    if step_normalizer_order == "2nd":
        mu = precond_lr * jnp.min(
            jax.lax.rsqrt(squared_magnitude(Ph) + squared_magnitude(v) + tiny)
            * jax.lax.rsqrt(squared_magnitude(h) + squared_magnitude(iPv) + tiny)
        )
    else:
        mu = precond_lr / (jnp.max(jnp.abs(grad_d)) + tiny)
    return d - mu * d * grad_d


def _low_rank_step(U, V, a, b, precond_lr, step_normalizer_order, update_u):
    """The U step (``update_u``) or the V step of :func:`lra_update` on
    E = aaᴴ − bbᴴ."""
    tiny = jnp.finfo(a.dtype).tiny
    eye = jnp.eye(U.shape[1], dtype=a.dtype)
    UtV = conj_transpose(U) @ V

    def step_size(c, e):
        """η over ‖a cᵀ − b eᵀ‖: bounded by its two terms ('2nd') or its
        Frobenius norm ('1st')."""
        if step_normalizer_order == "2nd":
            norm = jnp.linalg.norm(a) * jnp.linalg.norm(c)
            norm += jnp.linalg.norm(b) * jnp.linalg.norm(e)
        else:
            norm = _rank2_frobenius_norm(a, c, b, e)
        return precond_lr / (norm + tiny)

    def step_u(U, V):
        aV, bV = conj(a) @ V, conj(b) @ V  # aᴴV, bᴴV
        mu = step_size(V @ conj(aV), V @ conj(bV))  # VVᴴa, VVᴴb
        right = eye + conj_transpose(UtV)  # I + VᴴU
        step = jnp.outer(a, aV @ right) - jnp.outer(b, bV @ right)
        return U - mu * step, V

    def step_v(U, V):
        aU, bU = conj(a) @ U, conj(b) @ U  # aᴴU, bᴴU
        mu = step_size(U @ conj(aU), U @ conj(bU))  # UUᴴa, UUᴴb
        step = jnp.outer(a + V @ conj(aU), aU) - jnp.outer(b + V @ conj(bU), bU)
        return U, V - mu * step

    return _branch(update_u, step_u, step_v, U, V)


def fit_randomness(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The random decisions of one fit from its key, in psgd-jax's order:
    (balance, update_u) with P(balance) = 0.01 and P(update_u) = 0.5."""
    u_key, balance_key = jax.random.split(key)
    balance = jax.random.uniform(balance_key) < BALANCE_PROBABILITY
    return balance, jax.random.uniform(u_key) < UPDATE_U_PROBABILITY


def lra_preconditioner(
    rank: int = 10,
    step_normalizer_order: str = "2nd",
    precision: str | None = "tensorfloat32",
    balance_method: str = "gauge",
) -> Preconditioner:
    """LRA's :class:`~precond.jax.psgd._transform.Preconditioner`: all parameters
    flattened into one vector of n entries; r = min(rank, n) (r = n columns can
    already hold any n×n UVᵀ, more only cost memory and bigger solves);
    U, V ~ N(0, 1)/sqrt(n(r + 10)) (drawn from two keys split off the seed, as
    psgd-jax), d = scale; at the first fit with automatic scaling, d is first
    multiplied by (Σv²/Σh²)^{1/4} (whitening: (n/Σh²)^{1/4})."""

    def init_vector(n, dtype, scale, key):
        r = min(rank, n)
        norm = (n * (r + 10)) ** 0.5 if n else 1.0
        key, u_key = jax.random.split(key)
        U = jax.random.normal(u_key, (n, r), dtype) / norm
        key, v_key = jax.random.split(key)
        V = jax.random.normal(v_key, (n, r), dtype) / norm
        return LRAFactors(U=U, V=V, d=jnp.full((n,), scale, dtype)), key

    def fit_vector(factors, h, v, lr, rescale, key):
        balance, update_u = fit_randomness(key)
        U, V, d = factors
        return lra_update(
            U,
            V,
            rescale(d),
            v,
            h,
            lr,
            step_normalizer_order,
            update_u=update_u,
            balance=balance,
            balance_method=balance_method,
        )

    return flattened_preconditioner(
        init_vector,
        fit_vector,
        lra_precondition,
        precision=precision,
        name="lra",
        fit_uses_key=True,
    )


def scale_by_lra(
    preconditioner_update_probability: float = 1.0,
    b1: float = 0.9,
    nesterov: bool = False,
    uvd_rank_of_approximation: int = 10,
    precond_lr: float | Callable = 0.1,
    precond_init_scale: float | None = None,
    update_global_norm_clip: float | None = None,
    step_normalizer_order: str = "2nd",
    seed: jax.Array | int | None = None,
    mu_dtype: Any | None = None,
    precision: str | None = "tensorfloat32",
    *,
    balance_method: str = "gauge",
    params_partition_specs: Any | None = None,
    preconditioner_partition_spec: PartitionSpec | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Scales updates by the PSGD LRA preconditioner P = QᵀQ, Q = (I + UVᵀ)diag(d).

    Each step: (1) with probability p fit Q to (v, h) (:func:`lra_update`):
    Newton mode with ``update(..., Hvp=h, vector=v, update_preconditioner=flag)``,
    else whitening with h = the raw gradient and v ~ N(0, I) (the first two
    steps always fit); at the first fit, when ``precond_init_scale`` is None, d
    is first scaled by (Σv²/Σh²)^{1/4} (whitening: (n/Σh²)^{1/4}); (2) m ←
    β₁m + (1−β₁)g, m̂ = m/(1−β₁ⁿ) (Nesterov: β₁m/(1−β₁ⁿ⁺¹) + (1−β₁)g/(1−β₁ⁿ));
    (3) U = P·m̂ = d⊙(I + VUᵀ)(I + UVᵀ)(d⊙m̂), clipped to global norm
    ``update_global_norm_clip``. A NaN/Inf gradient: zero update, the state
    unchanged but for its count ``skipped``. Memory: n(2r + 1) for Q, + n momentum.

    The state is a :class:`~precond.jax.PSGDState` whose ``preconditioner`` is
    :class:`LRAFactors`.

    Args:
        preconditioner_update_probability: probability of fitting Q each step.
        b1: momentum decay in [0, 1); 0 keeps no momentum.
        nesterov: Nesterov momentum.
        uvd_rank_of_approximation: rank r of U and V (at most n is used).
        precond_lr: step size η of the fit (float or schedule of the step).
        precond_init_scale: initial d = s (Q ≈ s·I); None: scaled from the first fit.
        update_global_norm_clip: clip U to this global norm (None: no clip).
        step_normalizer_order: '2nd' or '1st' (see :func:`lra_update`).
        seed: PRNG key or int (default psgd-jax's PRNGKey(36)), kept in the state.
        mu_dtype: momentum dtype (default the gradients').
        precision: matmul precision of the fit and of P·m̂ (a
            ``jax.default_matmul_precision`` name; None: JAX's default).
        balance_method: how a fit (with probability 0.01) rebalances U and V without
            changing Q: 'gauge' (:func:`lra_balance`, UᵀU = VᵀV) or 'norm' (psgd-jax's
            U/ρ, V·ρ, :func:`lra_scale_balance`).
        params_partition_specs: keyword only, precond's: the state on a mesh (default:
            the context mesh). Momentum follows the params; U, V (n × r) and d (n) are
            split over the spec's axes, zero-padded (the math is the unsharded one).
        preconditioner_partition_spec: keyword only, precond's: the state on a mesh
            (default: the context mesh). Momentum follows the params; U, V (n × r) and d
            (n) are split over the spec's axes, zero-padded (the math is the unsharded
            one).
        mesh: keyword only, precond's: the state on a mesh (default: the context mesh).
            Momentum follows the params; U, V (n × r) and d (n) are split over the
            spec's axes, zero-padded (the math is the unsharded one).

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state is a
        :class:`~precond.jax.PSGDState`.

    References:
        Li, "Black box Lie group preconditioners for SGD", arXiv:2211.04422.

    Example, chained with a schedule of one's own:
        >>> import optax
        >>> schedule = optax.linear_schedule(0.01, 0.0, transition_steps=100)
        >>> opt = optax.chain(scale_by_lra(), optax.scale_by_learning_rate(schedule))
        >>> params = {"w": jnp.zeros((4, 3))}
        >>> updates, state = opt.update({"w": jnp.ones((4, 3))}, opt.init(params))
    """
    check_arguments(LRA_ARGUMENT_CHECKS, locals())
    return scale_by_psgd(
        lra_preconditioner(
            uvd_rank_of_approximation, step_normalizer_order, precision, balance_method
        ),
        **psgd_arguments(locals()),
    )


def low_rank_approximation(
    learning_rate: float | Callable = 0.01,
    preconditioner_update_probability: float = 1.0,
    b1: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    mask: Any | Callable | None = None,
    uvd_rank_of_approximation: int = 10,
    precond_lr: float | Callable = 0.1,
    precond_init_scale: float | None = None,
    update_global_norm_clip: float | None = None,
    step_normalizer_order: str = "2nd",
    seed: jax.Array | int | None = None,
    mu_dtype: Any | None = None,
    precision: str | None = "tensorfloat32",
    *,
    balance_method: str = "gauge",
    params_partition_specs: Any | None = None,
    preconditioner_partition_spec: PartitionSpec | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> optax.GradientTransformationExtraArgs:
    """PSGD LRA: ``chain(scale_by_lra, add_decayed_weights, scale_by_learning_rate)``.

    θ ← θ − lr·(U + λ·mask⊙θ) with U from :func:`scale_by_lra`.

    The state is ``(core state, learning-rate state)`` whatever ``weight_decay``
    is (the decay keeps none), as ``optax.inject_hyperparams`` needs.

    Complex parameters: supported. P = QᴴQ is Hermitian, Q = (I + UVᴴ)·diag(d) with
    complex U, V, d, fitted with conjugate transposes and circular complex noise
    (:func:`lra_update`). All parameters are flattened into one vector, so a tree
    with any complex leaf is fitted in complex arithmetic (real leaves get the real
    part of P·g, a descent direction for them). As for every optax optimizer, pass
    conjugated gradients, ``jax.tree.map(jnp.conj, jax.grad(loss)(params))`` (why:
    :func:`precond.jax.hessian_helper`, which returns them so).

    Args:
        learning_rate: the step size lr > 0, or a schedule of the step count.
        preconditioner_update_probability: probability of fitting Q each step.
        b1: momentum decay in [0, 1); 0 keeps no momentum.
        nesterov: Nesterov momentum.
        weight_decay: decoupled weight decay λ >= 0, added as λ·θ before the learning
            rate.
        mask: a pytree of bools like the params (or a callable of the params returning
            one) selecting the parameters that decay; None decays all.
        uvd_rank_of_approximation: rank r of U and V (at most n is used).
        precond_lr: step size η of the fit (float or schedule of the step).
        precond_init_scale: initial d = s (Q ≈ s·I); None: scaled from the first fit.
        update_global_norm_clip: clip U to this global norm (None: no clip).
        step_normalizer_order: '2nd' or '1st' (see :func:`lra_update`).
        seed: PRNG key or int (default psgd-jax's PRNGKey(36)), kept in the state.
        mu_dtype: momentum dtype (default the gradients').
        precision: matmul precision of the fit and of P·m̂ (a
            ``jax.default_matmul_precision`` name; None: JAX's default).
        balance_method: how a fit (with probability 0.01) rebalances U and V without
            changing Q: 'gauge' (:func:`lra_balance`, UᵀU = VᵀV) or 'norm' (psgd-jax's
            U/ρ, V·ρ, :func:`lra_scale_balance`).
        params_partition_specs: keyword only, precond's: a PartitionSpec (or None) per
            parameter, a pytree like the params; the momentum follows it. None: read
            from the params' types on a mesh with Explicit axes, else replicated.
        preconditioner_partition_spec: keyword only, precond's: the mesh axes that split
            U, V (n × r) and d (n), zero-padded to a multiple of their size (the math is
            the unsharded one); None replicates them.
        mesh: keyword only, precond's: the mesh the specs name; None: the context mesh
            (``jax.set_mesh``).

    Returns:
        An ``optax.GradientTransformationExtraArgs``: the chain of :func:`scale_by_lra`,
        the decay and the learning rate; its state is ``(core state, learning-rate
        state)``.

    Example:
        >>> optimizer = low_rank_approximation(learning_rate=0.01)
    """
    return psgd_alias(scale_by_lra, locals())


lra = low_rank_approximation
