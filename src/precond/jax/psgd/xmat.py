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
from jax.sharding import PartitionSpec

from precond.jax._core.factor_kernels import conj, squared_magnitude
from precond.jax.psgd._transform import (
    Preconditioner,
    flattened_preconditioner,
    psgd_alias,
    psgd_arguments,
    scale_by_psgd,
)


class XMatFactors(NamedTuple):
    """Q = diag(a) + antidiag(b) over all parameters flattened (n entries)."""

    a: jax.Array  # (n,): diagonal of Q
    b: jax.Array  # (n,): anti-diagonal of Q (its middle entry stays 0 for odd n)


def flip(x: jax.Array) -> jax.Array:
    """x reversed: x[n-1-i] (the anti-diagonal's partner of entry i)."""
    return x[::-1]


def xmat_precondition(a: jax.Array, b: jax.Array, g: jax.Array) -> jax.Array:
    """P·g with P = QᵀQ, Q = diag(a) + antidiag(b):
    (a² + flip(b²))⊙g + (a⊙b + flip(a⊙b))⊙flip(g); complex (P = QᴴQ):
    (|a|² + flip(|b|²))⊙g + (ā⊙b + flip(a⊙b̄))⊙flip(g)."""
    return (conj(a) * a + flip(conj(b) * b)) * g + (
        conj(a) * b + flip(a * conj(b))
    ) * flip(g)


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

    Complex (P = QᴴQ, the relative gradient AAᴴ − BBᴴ on the X pattern):
    Q⁻ᴴv = (flip(ā)⊙v − flip(b̄)⊙flip(v)) / conj(a⊙flip(a) − b⊙flip(b)),
    ∇a = |Qh|² − |Q⁻ᴴv|², ∇b = Qh⊙conj(flip(Qh)) − Q⁻ᴴv⊙conj(flip(Q⁻ᴴv)), and
    squares are |·|² in μ; the a and b steps are the same.
    """
    Qh = a * h + b * flip(h)
    iQv = (flip(conj(a)) * v - flip(conj(b)) * flip(v)) / conj(
        a * flip(a) - b * flip(b)
    )
    grad_a = squared_magnitude(Qh) - squared_magnitude(iQv)
    grad_b = Qh * conj(flip(Qh)) - iQv * conj(flip(iQv))
    n = a.shape[0]
    if n % 2:
        grad_b = grad_b.at[n // 2].set(0)
    tiny = jnp.finfo(a.dtype).tiny
    if step_normalizer_order == "2nd":
        mu = precond_lr / (
            jnp.max(squared_magnitude(Qh) + squared_magnitude(iQv)) + tiny
        )
    else:
        mu = precond_lr / (
            jnp.maximum(jnp.max(jnp.abs(grad_a)), jnp.max(jnp.abs(grad_b))) + tiny
        )
    new_a = a - mu * (grad_a * a + grad_b * flip(b))
    new_b = b - mu * (grad_a * b + grad_b * flip(a))
    return new_a, new_b


def xmat_preconditioner(
    step_normalizer_order: str = "2nd",
    precision: str | None = None,
) -> Preconditioner:
    """XMat's :class:`~precond.jax.psgd._transform.Preconditioner`: all
    parameters flattened into one vector; at the first fit with automatic
    scaling, a is first multiplied by (Σv²/Σh²)^{1/4} (Newton) or (n/Σh²)^{1/4}
    (whitening, v drawn by the transform)."""

    def init_vector(n, dtype, scale, key):
        factors = XMatFactors(a=jnp.full((n,), scale, dtype), b=jnp.zeros((n,), dtype))
        return factors, key

    def fit_vector(factors, h, v, lr, rescale, key):
        del key
        a = rescale(factors.a)
        return XMatFactors(*xmat_update(a, factors.b, v, h, lr, step_normalizer_order))

    return flattened_preconditioner(
        init_vector, fit_vector, xmat_precondition, precision=precision, name="xmat"
    )


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
    *,
    params_partition_specs: Any | None = None,
    preconditioner_partition_spec: PartitionSpec | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Scales updates by the PSGD XMat preconditioner.

    Each step: (1) with probability p fit Q to (v, h): Newton mode with
    ``update(..., Hvp=h, vector=v, update_preconditioner=flag)``, else whitening
    with h = the raw gradient and v ~ N(0, I) (the first two steps always
    fit); at the first fit, when ``precond_init_scale`` is None, a is first
    scaled by (Σv²/Σh²)^{1/4} (whitening: (n/Σh²)^{1/4}); (2) m ← β₁m +
    (1−β₁)g, m̂ = m/(1−β₁ⁿ) (Nesterov: β₁m/(1−β₁ⁿ⁺¹) + (1−β₁)g/(1−β₁ⁿ));
    (3) U = P·m̂, clipped to global norm ``update_global_norm_clip``. A NaN/Inf
    gradient: zero update, the state unchanged but for its count ``skipped``.

    The state is a :class:`~precond.jax.PSGDState` whose ``preconditioner`` is
    :class:`XMatFactors`.

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
        precision: matmul precision (accepted for psgd-jax compatibility; XMat has only
            elementwise work).
        params_partition_specs: keyword only, precond's: the state on a mesh (default:
            the context mesh). Momentum follows the params; a and b (n entries each) are
            split over the spec's axes, zero-padded (the math is the unsharded one).
        preconditioner_partition_spec: keyword only, precond's: the state on a mesh
            (default: the context mesh). Momentum follows the params; a and b (n entries
            each) are split over the spec's axes, zero-padded (the math is the unsharded
            one).
        mesh: keyword only, precond's: the state on a mesh (default: the context mesh).
            Momentum follows the params; a and b (n entries each) are split over the
            spec's axes, zero-padded (the math is the unsharded one).

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state is a
        :class:`~precond.jax.PSGDState`.

    Example, after gradient clipping, with a fixed rate:
        >>> import optax
        >>> clip = optax.clip_by_global_norm(1.0)
        >>> opt = optax.chain(clip, scale_by_xmat(), optax.scale_by_learning_rate(0.01))
        >>> state = opt.init({"w": jnp.zeros((4, 3))})
        >>> updates, state = opt.update({"w": jnp.full((4, 3), 9.0)}, state)
    """
    return scale_by_psgd(
        xmat_preconditioner(step_normalizer_order, precision),
        **psgd_arguments(locals()),
    )


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
    *,
    params_partition_specs: Any | None = None,
    preconditioner_partition_spec: PartitionSpec | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> optax.GradientTransformationExtraArgs:
    """PSGD XMat: ``chain(scale_by_xmat, add_decayed_weights, scale_by_learning_rate)``.

    θ ← θ − lr·(U + λ·mask⊙θ) with U from :func:`scale_by_xmat`.

    The state is ``(core state, learning-rate state)`` whatever ``weight_decay``
    is (the decay keeps none), as ``optax.inject_hyperparams`` needs.

    Complex parameters: supported. P = QᴴQ is Hermitian, Q = diag(a) + antidiag(b)
    with complex a, b, fitted with conjugate transposes and circular complex noise
    (:func:`xmat_update`). All parameters are flattened into one vector, so a tree
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
        precond_lr: step size η of the fit (float or schedule of the step).
        precond_init_scale: initial Q = s·I; None: scaled from the first fit.
        update_global_norm_clip: clip U to this global norm (None: no clip).
        step_normalizer_order: '2nd' or '1st' (see :func:`xmat_update`).
        seed: PRNG key or int (default psgd-jax's PRNGKey(36)), kept in the state.
        mu_dtype: momentum dtype (default the gradients').
        precision: matmul precision (accepted for psgd-jax compatibility; XMat has only
            elementwise work).
        params_partition_specs: keyword only, precond's: a PartitionSpec (or None) per
            parameter, a pytree like the params; the momentum follows it. None: read
            from the params' types on a mesh with Explicit axes, else replicated.
        preconditioner_partition_spec: keyword only, precond's: the mesh axes that split
            a and b (n entries each), zero-padded to a multiple of their size (the math
            is the unsharded one); None replicates them.
        mesh: keyword only, precond's: the mesh the specs name; None: the context mesh
            (``jax.set_mesh``).

    Returns:
        An ``optax.GradientTransformationExtraArgs``: the chain of
        :func:`scale_by_xmat`, the decay and the learning rate; its state is ``(core
        state, learning-rate state)``.

    Example:
        >>> optimizer = xmat(learning_rate=0.01)
    """
    return psgd_alias(scale_by_xmat, locals())
