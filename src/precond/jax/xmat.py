"""PSGD XMat as an optax transformation: ``xmat`` and ``scale_by_xmat``.

Drop-in for ``psgd_jax.xmat``: same argument names and defaults. All parameters
are flattened into one vector of n entries, preconditioned by P = QᵀQ with the
"X-shaped" Q = diag(a) + antidiag(b) (Li 2018, arXiv:1809.10232): 3n numbers of
state with the momentum, O(n) work per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from precond._common.validation import check_choice, check_real, is_concrete_number
from precond.jax._alias import with_decay_and_learning_rate
from precond.jax.hessian import newton_arguments

STEP_NORMALIZER_ORDERS = ("1st", "2nd")
DEFAULT_SEED = 36  # psgd-jax's PRNGKey(36)


class XMatState(NamedTuple):
    """State of :func:`scale_by_xmat`: arrays only."""

    count: jax.Array  # shape=(), int32: steps taken
    key: jax.Array  # PRNG key (uint32[2]): the update decisions and noise
    mu: optax.Updates | None  # like params; None when b1 == 0
    a: jax.Array  # (n,): diagonal of Q
    b: jax.Array  # (n,): anti-diagonal of Q (its middle entry stays 0 for odd n)
    updates: jax.Array  # shape=(), int32: preconditioner updates so far


def flip(x: jax.Array) -> jax.Array:
    """x reversed: x[n-1-i] (the anti-diagonal's partner of entry i)."""
    return x[::-1]


def xmat_precondition(a: jax.Array, b: jax.Array, g: jax.Array) -> jax.Array:
    """P·g with P = QᵀQ, Q = diag(a) + antidiag(b):
    (a² + flip(b²))⊙g + (a⊙b + flip(a⊙b))⊙flip(g)."""
    return (a * a + flip(b * b)) * g + (a * b + flip(a * b)) * flip(g)


def xmat_update(
    a: jax.Array,
    b: jax.Array,
    v: jax.Array,
    h: jax.Array,
    precond_lr: jax.Array | float,
    step_normalizer_order: str = "2nd",
) -> tuple[jax.Array, jax.Array]:
    """One PSGD step of Q = diag(a) + antidiag(b) on the pair (v, h) (h ≈ H·v).

    Qh = a⊙h + b⊙flip(h), Q⁻ᵀv = (flip(a)⊙v − flip(b)⊙flip(v)) /
    (a⊙flip(a) − b⊙flip(b)); ∇a = (Qh)² − (Q⁻ᵀv)², ∇b = Qh⊙flip(Qh) −
    Q⁻ᵀv⊙flip(Q⁻ᵀv) (middle entry 0 for odd n); then with μ = η/max((Qh)² +
    (Q⁻ᵀv)²) ('2nd') or η/max(|∇a|, |∇b|) ('1st'):
    a ← a − μ(∇a⊙a + ∇b⊙flip(b)), b ← b − μ(∇a⊙b + ∇b⊙flip(a)).
    """
    Qh = a * h + b * flip(h)
    iQv = (flip(a) * v - flip(b) * flip(v)) / (a * flip(a) - b * flip(b))
    grad_a = Qh * Qh - iQv * iQv
    grad_b = Qh * flip(Qh) - iQv * flip(iQv)
    n = a.shape[0]
    if n % 2:
        grad_b = grad_b.at[n // 2].set(0)
    tiny = jnp.finfo(a.dtype).tiny
    if step_normalizer_order == "2nd":
        mu = precond_lr / (jnp.max(Qh * Qh + iQv * iQv) + tiny)
    else:
        mu = precond_lr / (
            jnp.maximum(jnp.max(jnp.abs(grad_a)), jnp.max(jnp.abs(grad_b))) + tiny
        )
    new_a = a - mu * (grad_a * a + grad_b * flip(b))
    new_b = b - mu * (grad_a * b + grad_b * flip(a))
    return new_a, new_b


def scale_by_xmat(
    preconditioner_update_probability: float = 1.0,
    b1: float = 0.9,
    nesterov: bool = False,
    precond_lr: float | Callable = 0.1,
    precond_init_scale: float | None = None,
    update_global_norm_clip: float | None = None,
    step_normalizer_order: str = "2nd",
    seed: jax.Array | int | None = None,
    mu_dtype: Any | None = None,
    precision: str | None = "tensorfloat32",
) -> optax.GradientTransformationExtraArgs:
    """Scales updates by the PSGD XMat preconditioner.

    Each step: (1) with probability p fit Q to (v, h): Newton mode with
    ``update(..., Hvp=h, vector=v, update_preconditioner=flag)``, else whitening
    with h = the raw gradient and v ~ N(0, I); at the first fit, when
    ``precond_init_scale`` is None, a is first scaled by (Σv²/Σh²)^{1/4}; (2)
    m ← β₁m + (1−β₁)g, m̂ = m/(1−β₁ⁿ) (Nesterov: β₁m̂ + (1−β₁)g/(1−β₁ⁿ));
    (3) U = P·m̂, clipped to global norm ``update_global_norm_clip``.

    Args:
        preconditioner_update_probability: probability of fitting Q each step.
        b1: momentum decay in [0, 1); 0 keeps no momentum.
        nesterov: Nesterov momentum.
        precond_lr: step size η of the fit (float or schedule of the step).
        precond_init_scale: initial Q = s·I; None: scaled from the first fit.
        update_global_norm_clip: clip U to this global norm (None: no clip).
        step_normalizer_order: '2nd' or '1st' (see :func:`xmat_update`).
        seed: PRNG key or int (default psgd-jax's PRNGKey(36)), kept in the state.
        mu_dtype: momentum dtype (default the gradients').
        precision: matmul precision (accepted for psgd-jax compatibility; XMat
            has only elementwise work).
    """
    check_real(
        "preconditioner_update_probability",
        preconditioner_update_probability,
        low=0.0,
        high=1.0,
    )
    check_real("b1", b1, low=0.0, high=1.0, high_inclusive=False)
    check_real(
        "precond_lr", precond_lr, low=0.0, low_inclusive=False, allow_schedule=True
    )
    if precond_init_scale is not None:
        check_real(
            "precond_init_scale", precond_init_scale, low=0.0, low_inclusive=False
        )
    if update_global_norm_clip is not None:
        check_real(
            "update_global_norm_clip",
            update_global_norm_clip,
            low=0.0,
            low_inclusive=False,
        )
    check_choice("step_normalizer_order", step_normalizer_order, STEP_NORMALIZER_ORDERS)
    del precision
    keep_momentum = not (is_concrete_number(b1) and b1 == 0)

    def init_fn(params):
        flat, _ = ravel_pytree(params)
        n = flat.shape[0]
        dtype = jnp.promote_types(flat.dtype, jnp.float32) if n else jnp.float32
        scale = 1.0 if precond_init_scale is None else precond_init_scale
        if seed is None:
            key = jax.random.PRNGKey(DEFAULT_SEED)
        elif isinstance(seed, int):
            key = jax.random.PRNGKey(seed)
        else:
            key = seed
        mu = None
        if keep_momentum:
            mu = jax.tree.map(
                lambda p: jnp.zeros_like(p, dtype=mu_dtype or p.dtype), params
            )
        return XMatState(
            count=jnp.zeros([], jnp.int32),
            key=key,
            mu=mu,
            a=jnp.full((n,), scale, dtype),
            b=jnp.zeros((n,), dtype),
            updates=jnp.zeros([], jnp.int32),
        )

    def update_fn(updates, state: XMatState, params=None, **extra_args):
        del params
        newton = newton_arguments(updates, extra_args)
        g, unravel = ravel_pytree(updates)
        g = g.astype(state.a.dtype)
        key, decision_key, noise_key = jax.random.split(state.key, 3)
        if newton is not None:
            h = ravel_pytree(newton["Hvp"])[0].astype(g.dtype)
            v = ravel_pytree(newton["vector"])[0].astype(g.dtype)
            do_update = jnp.asarray(newton["update_preconditioner"], bool)
        else:
            h, v = g, jax.random.normal(noise_key, g.shape, g.dtype)
            do_update = (
                jax.random.uniform(decision_key) < preconditioner_update_probability
            )
        lr = precond_lr(state.count) if callable(precond_lr) else precond_lr

        def fit(ab):
            a, b = ab
            if precond_init_scale is None:
                first = state.updates == 0
                scale = (
                    jnp.sum(v * v) / (jnp.sum(h * h) + jnp.finfo(g.dtype).tiny)
                ) ** 0.25
                a = jnp.where(first, a * scale, a)
            return xmat_update(a, b, v, h, lr, step_normalizer_order)

        a, b = jax.lax.cond(do_update, fit, lambda ab: ab, (state.a, state.b))
        count = state.count + 1
        if keep_momentum:
            mu = jax.tree.map(
                lambda m, u: (b1 * m + (1 - b1) * u).astype(m.dtype), state.mu, updates
            )
            correction = 1 - b1 ** count.astype(jnp.float32)
            if nesterov:
                m_hat = jax.tree.map(
                    lambda m, u: b1 * m / correction + (1 - b1) * u / correction,
                    mu,
                    updates,
                )
            else:
                m_hat = jax.tree.map(lambda m: m / correction, mu)
            m_flat = ravel_pytree(m_hat)[0].astype(a.dtype)
        else:
            mu, m_flat = None, g
        U = xmat_precondition(a, b, m_flat)
        if update_global_norm_clip is not None:
            norm = jnp.linalg.norm(U)
            U = U * jnp.minimum(1.0, update_global_norm_clip / (norm + 1e-30))
        new_updates = jax.tree.map(lambda u, x: u.astype(x.dtype), unravel(U), updates)
        new_state = XMatState(
            count=count,
            key=key,
            mu=mu,
            a=a,
            b=b,
            updates=state.updates + do_update.astype(jnp.int32),
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def xmat(
    learning_rate: float | Callable = 0.01,
    preconditioner_update_probability: float = 1.0,
    b1: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    mask: Any | Callable | None = None,
    precond_lr: float | Callable = 0.1,
    precond_init_scale: float | None = None,
    update_global_norm_clip: float | None = None,
    step_normalizer_order: str = "2nd",
    seed: jax.Array | int | None = None,
    mu_dtype: Any | None = None,
    precision: str | None = "tensorfloat32",
) -> optax.GradientTransformationExtraArgs:
    """PSGD XMat: ``chain(scale_by_xmat, add_decayed_weights, scale_by_learning_rate)``.

    θ ← θ − lr·(U + λ·mask⊙θ) with U from :func:`scale_by_xmat` (see it for the
    other arguments).

    Example:
        >>> optimizer = xmat(learning_rate=0.01)  # doctest: +SKIP
    """
    core = scale_by_xmat(
        preconditioner_update_probability=preconditioner_update_probability,
        b1=b1,
        nesterov=nesterov,
        precond_lr=precond_lr,
        precond_init_scale=precond_init_scale,
        update_global_norm_clip=update_global_norm_clip,
        step_normalizer_order=step_normalizer_order,
        seed=seed,
        mu_dtype=mu_dtype,
        precision=precision,
    )
    return with_decay_and_learning_rate(core, learning_rate, weight_decay, mask)
