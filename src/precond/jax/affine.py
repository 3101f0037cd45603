"""PSGD Affine as an optax transformation: ``affine`` and ``scale_by_affine``.

Drop-in for ``psgd_jax.affine``: the argument names and defaults of psgd-jax's
XMat/LRA/Affine family (``nesterov`` False, as for :func:`~precond.jax.xmat`).
Each parameter is viewed as a matrix G of shape (d₁, d₂) and preconditioned by
the Kronecker product P = (Q_rᵀQ_r) ⊗ (Q_lᵀQ_l), i.e. P·G = Q_lᵀQ_l·G·Q_rᵀQ_r,
with Q_l and Q_r upper triangular (or diagonal for small, huge or very skewed
sides). The Kronecker Q = Q_r ⊗ Q_l is an element of the affine group acting on
G from both sides (Li 2018, "Preconditioner on matrix Lie group for SGD",
arXiv:1809.10232).

The factor kernels are Kron's (:mod:`precond.jax._kron_math`): the fit is
``update_factors`` with the two factors of the matrix view, balancing is
``balance_factors`` and P·G is ``precondition``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from precond._common.validation import check_int
from precond.jax import _kron_math as km
from precond.jax._alias import with_decay_and_learning_rate
from precond.jax._kron_sharding import explicit_specs
from precond.jax._precision import matmul_precision
from precond.jax._psgd_transform import (
    Preconditioner,
    scale_by_psgd,
)

# Each fit rebalances the two factors of every parameter with this probability.
BALANCE_PROBABILITY = 0.01
# Integer arguments that fix shapes: with optax.inject_hyperparams, list them in
# static_args.
AFFINE_STATIC_ARGS = ("max_size_triangular", "max_skew_triangular")


class AffineFactors(NamedTuple):
    """Q = Q_r ⊗ Q_l of one parameter viewed as a (d₁, d₂) matrix."""

    left: jax.Array  # (d₁, d₁) upper triangular, or (d₁,) for a diagonal Q_l
    right: jax.Array  # (d₂, d₂) upper triangular, or (d₂,) for a diagonal Q_r


def matrix_view_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The (d₁, d₂) matrix view of a tensor, keeping its axis order.

    d₁ is the product of the first j dims and d₂ that of the rest, with j
    minimising d₁² + d₂² (the smallest such j on ties). A scalar is (1, 1) and a
    vector of n entries is (1, n); a matrix stays as it is unless a side is 1.
    Unlike psgd-jax, axes are never permuted, so the view is a free reshape.

    Example:
        >>> matrix_view_shape((2, 3, 8))
        (6, 8)
    """
    shape = tuple(int(d) for d in shape)
    best = None
    for j in range(len(shape) + 1):
        view = (math.prod(shape[:j]), math.prod(shape[j:]))
        if best is None or view[0] ** 2 + view[1] ** 2 < best[0] ** 2 + best[1] ** 2:
            best = view
    return best


def is_diagonal_side(
    size: int, other: int, max_size_triangular: int, max_skew_triangular: int
) -> bool:
    """A side of ``size`` (the other side ``other``) gets a diagonal factor when
    size < 2, size > max_size_triangular or size > max_skew_triangular·other."""
    return size < 2 or size > max_size_triangular or size > max_skew_triangular * other


def init_factors(
    view: tuple[int, int],
    scale: float,
    dtype: Any,
    max_size_triangular: int,
    max_skew_triangular: int,
) -> AffineFactors:
    """Q_l = √s·I and Q_r = √s·I (vectors of √s for diagonal sides): Q = s·I."""
    d1, d2 = view
    root = math.sqrt(scale)

    def factor(size, other):
        if is_diagonal_side(size, other, max_size_triangular, max_skew_triangular):
            return jnp.full((size,), root, dtype)
        return root * jnp.eye(size, dtype=dtype)

    return AffineFactors(left=factor(d1, d2), right=factor(d2, d1))


def _inverse(Q: jax.Array) -> jax.Array:
    """Q⁻¹ of an upper-triangular Q (1/q for a diagonal factor)."""
    if km.is_diagonal(Q):
        return 1 / Q
    identity = jnp.eye(Q.shape[0], dtype=Q.dtype)
    return jax.lax.linalg.triangular_solve(Q, identity, left_side=True, lower=False)


def expected_noise_grams(Qs: Sequence[jax.Array]) -> list[jax.Array]:
    """E[B_(i)B_(i)ᵀ] for B = V ×_1 Q_1^{-T} … ×_k Q_k^{-T}, V ~ N(0, I).

    B_(i) = Q_i^{-T}·V_(i)·M with M = ⊗_{j≠i} Q_j^{-1} (in the unfolding's order),
    and E[V_(i) S V_(i)ᵀ] = tr(S)·I for iid standard normal V, so

        E[B_(i)B_(i)ᵀ] = (∏_{j≠i} tr(Q_j^{-1}Q_j^{-T}))·Q_i^{-T}Q_i^{-1},

    with tr(Q^{-1}Q^{-T}) = ‖Q^{-1}‖_F². For the matrix view: E[BBᵀ] =
    tr(Q_r⁻¹Q_r⁻ᵀ)·Q_l⁻ᵀQ_l⁻¹ and E[BᵀB] = tr(Q_l⁻¹Q_l⁻ᵀ)·Q_r⁻ᵀQ_r⁻¹. Only the
    diagonal (a vector) for a diagonal factor.

    Complex factors: B = V ×_i Q_i^{-H} with circular V (E[v v̄] = 1, E[v v] =
    0), E[B_(i)B_(i)ᴴ] = (∏_{j≠i} ‖Q_j^{-1}‖_F²)·Q_i^{-H}Q_i^{-1}.
    """
    inverses = [_inverse(Q) for Q in Qs]
    traces = [jnp.sum(km.squared_magnitude(inverse)) for inverse in inverses]
    grams = []
    for i, inverse in enumerate(inverses):
        others = math.prod(traces[:i] + traces[i + 1 :])
        if inverse.ndim == 1:
            gram = km.squared_magnitude(inverse)
        else:
            gram = km.hermitian_part(km.conj_transpose(inverse) @ inverse)
        grams.append(others * gram)
    return grams


def affine_update(
    factors: AffineFactors,
    H: jax.Array,
    V: jax.Array | None,
    precond_lr: jax.Array | float,
    step_normalizer_order: str = "2nd",
) -> AffineFactors:
    """One PSGD step of (Q_l, Q_r) on the pair (V, H) of (d₁, d₂) matrices.

    A = Q_l·H·Q_rᵀ and B = Q_l⁻ᵀ·V·Q_r⁻¹; the relative gradients are
    triu(AAᵀ − BBᵀ) for Q_l and triu(AᵀA − BᵀB) for Q_r (only the diagonals for
    a diagonal factor), and Q ← Q − μ·∇·Q with μ = η/(lb(AAᵀ + BBᵀ) + tiny)
    ('2nd'; max instead of lb for a diagonal factor) or η/(lb(∇) + tiny) ('1st').
    ``V=None`` integrates v ~ N(0, I) out: BBᵀ and BᵀB are replaced by their
    expectations (:func:`expected_noise_grams`). This is
    :func:`precond.jax._kron_math.update_factors` with the two factors.
    """
    Qs = [factors.left, factors.right]
    noise_grams = None if V is not None else expected_noise_grams(Qs)
    left, right = km.update_factors(
        Qs,
        H,
        V,
        precond_lr,
        step_normalizer_order=step_normalizer_order,
        noise_grams=noise_grams,
    )
    return AffineFactors(left, right)


def affine_precondition(factors: AffineFactors, G: jax.Array) -> jax.Array:
    """P·G = Q_lᵀQ_l·G·Q_rᵀQ_r for a (d₁, d₂) matrix G."""
    return km.precondition([factors.left, factors.right], G)


def integrates_noise_out(factors: AffineFactors) -> bool:
    """Whitening integrates v out when at least one factor is diagonal (then the
    inverses are cheap); with two triangular factors it samples v ~ N(0, I)."""
    return km.is_diagonal(factors.left) or km.is_diagonal(factors.right)


def _with_auto_axes(body: Callable, out_like: Any, *args) -> Any:
    """``body(*args)``; on an explicit mesh under ``auto_axes`` (the compiler
    places the per-leaf matrix work, as on an auto mesh), with outputs sharded
    like ``out_like`` (a tree with the outputs' structure)."""
    specs = explicit_specs(args)
    if specs is None:
        return body(*args)
    out_specs = explicit_specs(out_like)
    if out_specs is None:
        out_specs = jax.tree.map(lambda _: PartitionSpec(), out_like)
    return jax.sharding.auto_axes(body, out_sharding=out_specs)(*args)


def affine_preconditioner(
    step_normalizer_order: str = "2nd",
    max_size_triangular: int = 4096,
    max_skew_triangular: int = 128,
    precision: str | None = "tensorfloat32",
) -> Preconditioner:
    """Affine's :class:`~precond.jax._psgd_transform.Preconditioner`.

    The factors are a tree like the parameters with one :class:`AffineFactors`
    per leaf, in promote(parameter dtype, float32). A fit on (v, h): per leaf,
    (1) at the first fit with automatic scaling, both factors are multiplied by
    (Σv²/Σh²)^{1/8}, so P by (Σv²/Σh²)^{1/2} (Σv² = numel when v is integrated
    out); (2) with probability 0.01 (one draw for all leaves) the two factors are
    balanced; (3) :func:`affine_update`. In whitening mode (``v`` None) v is
    integrated out when a factor is diagonal, else drawn from ``key`` per leaf.
    """

    def views(tree):
        return [x.reshape(matrix_view_shape(x.shape)) for x in jax.tree.leaves(tree)]

    def init(params, scale, key):
        del key

        def leaf_factors(p):
            dtype = jnp.promote_types(p.dtype, jnp.float32)
            return init_factors(
                matrix_view_shape(p.shape),
                scale,
                dtype,
                max_size_triangular,
                max_skew_triangular,
            )

        return jax.tree.map(leaf_factors, params)

    def fit_leaf(factors, h, v, lr, first, key, balance):
        if h.size == 0:
            return factors
        dtype = factors.left.dtype
        h = h.astype(dtype)
        if v is not None:
            v = v.astype(dtype)
            v_energy = jnp.sum(km.squared_magnitude(v))
        elif integrates_noise_out(factors):
            v_energy = jnp.asarray(h.size, km.real_dtype(dtype))
        else:
            v = jax.random.normal(key, h.shape, dtype)
            v_energy = jnp.sum(km.squared_magnitude(v))
        tiny = jnp.finfo(dtype).tiny
        scale = (v_energy / (jnp.sum(km.squared_magnitude(h)) + tiny)) ** 0.125
        factors = [jnp.where(first, Q * scale, Q) for Q in factors]
        # Balancing only rescales (O(d²) work): a select, not a branch.
        balanced = km.balance_factors(factors)
        factors = AffineFactors(
            *(jnp.where(balance, b, Q) for b, Q in zip(balanced, factors, strict=True))
        )
        return affine_update(factors, h, v, lr, step_normalizer_order)

    def fit(factors, h, v, lr, first, key):
        return _with_auto_axes(fit_all, factors, factors, h, v, lr, first, key)

    def fit_all(factors, h, v, lr, first, key):
        treedef = jax.tree.structure(h)
        leaf_factors = treedef.flatten_up_to(factors)
        balance_key, noise_key = jax.random.split(key)
        balance = jax.random.uniform(balance_key) < BALANCE_PROBABILITY
        keys = jax.random.split(noise_key, max(len(leaf_factors), 1))
        vs = [None] * len(leaf_factors) if v is None else views(v)
        with matmul_precision(precision), jax.named_scope("precond/affine/fit"):
            new = [
                fit_leaf(f, h_leaf, v_leaf, lr, first, k, balance)
                for f, h_leaf, v_leaf, k in zip(
                    leaf_factors, views(h), vs, keys[: len(leaf_factors)], strict=True
                )
            ]
        return treedef.unflatten(new)

    def apply(factors, m):
        return _with_auto_axes(apply_all, m, factors, m)

    def apply_all(factors, m):
        leaves, treedef = jax.tree.flatten(m)
        leaf_factors = treedef.flatten_up_to(factors)
        with (
            matmul_precision(precision),
            jax.named_scope("precond/affine/precondition"),
        ):
            out = [
                affine_precondition(
                    f, x.reshape(matrix_view_shape(x.shape)).astype(f.left.dtype)
                ).reshape(x.shape)
                for f, x in zip(leaf_factors, leaves, strict=True)
            ]
        return treedef.unflatten(out)

    return Preconditioner(init, fit, apply)


# Affine's own arguments (the shared ones: PSGD_ARGUMENT_CHECKS).
AFFINE_ARGUMENT_CHECKS = {
    "max_size_triangular": functools.partial(check_int, low=0),
    "max_skew_triangular": functools.partial(check_int, low=0),
}


def scale_by_affine(
    preconditioner_update_probability: float = 1.0,
    b1: float = 0.9,
    nesterov: bool = False,
    max_size_triangular: int = 4096,
    max_skew_triangular: int = 128,
    precond_lr: float | Callable = 0.1,
    precond_init_scale: float | None = None,
    update_global_norm_clip: float | None = None,
    step_normalizer_order: str = "2nd",
    seed: jax.Array | int | None = None,
    mu_dtype: Any | None = None,
    precision: str | None = "tensorfloat32",
) -> optax.GradientTransformationExtraArgs:
    """Scales updates by the PSGD Affine preconditioner.

    Each parameter is viewed as a (d₁, d₂) matrix (:func:`matrix_view_shape`) and
    preconditioned by P·G = Q_lᵀQ_l·G·Q_rᵀQ_r. A side gets a diagonal factor when
    its size is < 2, > ``max_size_triangular`` or > ``max_skew_triangular`` times
    the other side's; else an upper-triangular one.

    Each step: (1) with probability p fit (Q_l, Q_r) to (v, h)
    (:func:`affine_update`): Newton mode with ``update(..., Hvp=h, vector=v,
    update_preconditioner=flag)``; else whitening with h = the raw gradient and v
    integrated out (a side diagonal) or v ~ N(0, I) (both triangular); at the
    first fit, when ``precond_init_scale`` is None, both factors are first scaled
    by (Σv²/Σh²)^{1/8}; with probability 0.01 the factors are balanced; (2)
    m ← β₁m + (1−β₁)g, m̂ = m/(1−β₁ⁿ) (Nesterov: β₁m̂ + (1−β₁)g/(1−β₁ⁿ));
    (3) U = P·m̂, clipped to global norm ``update_global_norm_clip``. A NaN/Inf
    gradient gives a zero update and leaves the state unchanged.

    The state is a :class:`~precond.jax.PSGDState` whose ``preconditioner`` is a
    tree like the parameters of :class:`AffineFactors`.

    Args:
        preconditioner_update_probability: probability of fitting Q each step.
        b1: momentum decay in [0, 1); 0 keeps no momentum.
        nesterov: Nesterov momentum.
        precond_lr: step size η of the fit (float or schedule of the step).
        precond_init_scale: initial Q = Q_r ⊗ Q_l = s·I (each factor √s·I);
            None: scaled from the first fit.
        update_global_norm_clip: clip U to this global norm (None: no clip).
        step_normalizer_order: '2nd' or '1st' (see :func:`affine_update`).
        seed: PRNG key or int (default psgd-jax's PRNGKey(36)), kept in the state.
        mu_dtype: momentum dtype (default the gradients').
        precision: matmul precision of the fit and of P·m̂ (a name for
            ``jax.default_matmul_precision``; None: the backend default).
        max_size_triangular: sides larger than this get a diagonal factor
            (>= 0; 0 makes every factor diagonal).
        max_skew_triangular: a side more than this many times the other one
            gets a diagonal factor (>= 0; 0 makes every factor diagonal).

    Example:
        >>> optimizer = scale_by_affine()  # doctest: +SKIP
    """
    for name, value in (
        ("max_size_triangular", max_size_triangular),
        ("max_skew_triangular", max_skew_triangular),
    ):
        AFFINE_ARGUMENT_CHECKS[name](name, value)
    return scale_by_psgd(
        affine_preconditioner(
            step_normalizer_order, max_size_triangular, max_skew_triangular, precision
        ),
        preconditioner_update_probability=preconditioner_update_probability,
        b1=b1,
        nesterov=nesterov,
        precond_lr=precond_lr,
        precond_init_scale=precond_init_scale,
        update_global_norm_clip=update_global_norm_clip,
        seed=seed,
        mu_dtype=mu_dtype,
        step_normalizer_order=step_normalizer_order,
        precision=precision,
    )


def affine(
    learning_rate: float | Callable = 0.01,
    preconditioner_update_probability: float = 1.0,
    b1: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    mask: Any | Callable | None = None,
    max_size_triangular: int = 4096,
    max_skew_triangular: int = 128,
    precond_lr: float | Callable = 0.1,
    precond_init_scale: float | None = None,
    update_global_norm_clip: float | None = None,
    step_normalizer_order: str = "2nd",
    seed: jax.Array | int | None = None,
    mu_dtype: Any | None = None,
    precision: str | None = "tensorfloat32",
) -> optax.GradientTransformationExtraArgs:
    """PSGD Affine: ``chain(scale_by_affine, add_decayed_weights,
    scale_by_learning_rate)``.

    θ ← θ − lr·(U + λ·mask⊙θ) with U from :func:`scale_by_affine` (see it for the
    other arguments).

    Complex parameters: supported, mixed freely with real ones (factors are per
    parameter: complex for complex parameters). The preconditioner is Hermitian, P =
    (Q_rᴴQ_r) ⊗ (Q_lᴴQ_l), i.e. P·G = Q_lᴴQ_l·G·(Q_rᴴQ_r)ᵀ (Kron's mode-product
    convention), fitted with conjugate transposes; the integrated-out noise is
    circular complex normal. As for every optax optimizer on complex parameters,
    pass the conjugate of ``jax.grad`` (which returns conj(2∂L/∂z̄) for a real loss,
    the conjugate of the descent direction): ``grads = jax.tree.map(jnp.conj,
    jax.grad(loss)(params))`` (:func:`precond.jax.hessian_helper` returns it so).

    Example:
        >>> optimizer = affine(learning_rate=0.01)  # doctest: +SKIP
    """
    core = scale_by_affine(
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
        max_size_triangular=max_size_triangular,
        max_skew_triangular=max_skew_triangular,
    )
    return with_decay_and_learning_rate(core, learning_rate, weight_decay, mask)
