"""PSGD Affine as an optax transformation: ``affine`` and ``scale_by_affine``.

Drop-in for ``psgd_jax.affine``: the argument names and defaults of psgd-jax's
XMat/LRA/Affine family (``nesterov`` False, as for :func:`~precond.jax.xmat`).
Each parameter is viewed as a matrix G of shape (d₁, d₂) and preconditioned by
the Kronecker product P = (Q_rᵀQ_r) ⊗ (Q_lᵀQ_l), i.e. P·G = Q_lᵀQ_l·G·Q_rᵀQ_r,
with Q_l and Q_r upper triangular (or diagonal for small, huge or very skewed
sides). The Kronecker Q = Q_r ⊗ Q_l is an element of the affine group acting on
G from both sides (Li 2018, "Preconditioner on matrix Lie group for SGD",
arXiv:1809.10232).

The factor kernels are Kron's (:mod:`precond.jax._core.factor_kernels`): the fit is
``update_factors`` with the two factors of the matrix view, balancing is
``balance_factors`` and P·G is ``precondition``.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from precond._common.kron_constants import BALANCE_PROBABILITY
from precond._common.validation import check_bool, check_int
from precond.jax._core import factor_kernels as km
from precond.jax._core.guards import is_params_placeholder
from precond.jax._core.mesh_placement import typed_sharding
from precond.jax._core.pool_safe_linalg import triangular_solve
from precond.jax._core.precision import matmul_precision
from precond.jax.psgd._transform import (
    Preconditioner,
    auto_axes_preconditioner,
    check_arguments,
    first_fit_scale,
    psgd_alias,
    psgd_arguments,
    scale_by_psgd,
)

# Each fit rebalances the two factors of every parameter with probability
# BALANCE_PROBABILITY, Kron's rule (precond._common.kron_constants).
# Integer arguments that fix shapes: with optax.inject_hyperparams, list them in
# static_args.
AFFINE_STATIC_ARGS = ("max_size_triangular", "max_skew_triangular")


class AffineFactors(NamedTuple):
    """Q = Q_r ⊗ Q_l of one parameter viewed as a (d₁, d₂) matrix. In the state,
    one AffineFactors holds every parameter's: ``left`` and ``right`` are trees
    like the parameters of the arrays below."""

    left: jax.Array  # (d₁, d₁) upper triangular, or (d₁,) for a diagonal Q_l
    right: jax.Array  # (d₂, d₂) upper triangular, or (d₂,) for a diagonal Q_r


def matrix_view_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The (d₁, d₂) matrix view of a tensor, keeping its axis order.

    d₁ is the product of the first j dims and d₂ that of the rest, with j
    minimising d₁² + d₂² (the smallest such j on ties). A scalar is (1, 1) and a
    vector of n entries is (1, n); a matrix stays as it is unless a side is 1.
    Unlike psgd-jax, axes are never permuted, so the view is a free reshape
    (``permute_axes=True`` takes psgd-jax's view, :func:`permuted_matrix_view`).

    Example:
        >>> matrix_view_shape((2, 3, 8))
        (6, 8)
    """
    shape = tuple(int(d) for d in shape)
    best = (1, math.prod(shape))  # j = 0
    for j in range(1, len(shape) + 1):
        view = (math.prod(shape[:j]), math.prod(shape[j:]))
        if view[0] ** 2 + view[1] ** 2 < best[0] ** 2 + best[1] ** 2:
            best = view
    return best


def permuted_matrix_view(
    shape: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, int]]:
    """psgd-jax's matrix view: (axis permutation, (d₁, d₂)).

    A matrix keeps its shape and a scalar or vector becomes (1, n). A tensor of
    3 or more axes takes, over every permutation of its axes (in lexicographic
    order) and every split point j in 1..k−1, the first (permutation, j) with
    the least d₁² + d₂² (d₁ the product of the first j permuted dims).

    Example:
        >>> permuted_matrix_view((2, 8, 3))
        ((0, 2, 1), (6, 8))
    """
    shape = tuple(int(d) for d in shape)
    identity = tuple(range(len(shape)))
    if len(shape) == 2:
        return identity, shape
    if len(shape) < 2:
        return identity, (1, math.prod(shape))
    best, best_cost = None, math.inf
    for permutation in itertools.permutations(identity):
        dims = [shape[a] for a in permutation]
        for j in range(1, len(dims)):
            view = (math.prod(dims[:j]), math.prod(dims[j:]))
            if view[0] ** 2 + view[1] ** 2 < best_cost:
                best, best_cost = (permutation, view), view[0] ** 2 + view[1] ** 2
    assert best is not None  # every cost is finite, so the first one was taken
    return best


def matrix_view_plan(
    shape: Sequence[int], permute_axes: bool = False
) -> tuple[tuple[int, ...] | None, tuple[int, int]]:
    """(permutation or None, view): :func:`permuted_matrix_view` when
    ``permute_axes`` (and a permutation helps), else :func:`matrix_view_shape`."""
    if permute_axes:
        permutation, view = permuted_matrix_view(shape)
        if permutation != tuple(range(len(shape))):
            return permutation, view
        return None, view
    return None, matrix_view_shape(shape)


def to_matrix(x: jax.Array, plan) -> jax.Array:
    """``x`` as its (d₁, d₂) matrix view (permuted first if the plan says so)."""
    permutation, view = plan
    if permutation is not None:
        x = jnp.transpose(x, permutation)
    return x.reshape(view)


def from_matrix(X: jax.Array, plan, shape: Sequence[int]) -> jax.Array:
    """The inverse of :func:`to_matrix` for a tensor of ``shape``."""
    permutation, _ = plan
    if permutation is None:
        return X.reshape(shape)
    X = X.reshape([shape[a] for a in permutation])
    return jnp.transpose(X, tuple(int(i) for i in np.argsort(permutation)))


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
    return triangular_solve(Q, identity, left_side=True, lower=False)


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


def norm_lower_bound(S: jax.Array) -> jax.Array:
    """A cheap lower bound on ‖S‖₂ (as psgd-jax's): with s = max|S| and Ŝ = S/s,
    take the column x of Ŝ of largest norm if it beats every row (else the
    row), and return s·‖Ŝᴴ(Ŝx)‖/‖Ŝx‖ (two power-iteration steps on ŜŜᴴ or ŜᴴŜ);
    0 for S = 0. For a Hermitian S rows and columns tie and the row is used.
    """
    scale = jnp.max(jnp.abs(S))
    safe_scale = jnp.where(scale > 0, scale, 1)
    S_hat = S / safe_scale
    magnitude = km.squared_magnitude(S_hat)
    column_norms, row_norms = jnp.sum(magnitude, axis=0), jnp.sum(magnitude, axis=1)

    def from_column():
        x = jax.lax.dynamic_index_in_dim(
            S_hat, jnp.argmax(column_norms), axis=1, keepdims=False
        )
        y = km.conj(x) @ S_hat
        return jnp.linalg.norm((y / jnp.linalg.norm(y)) @ km.conj_transpose(S_hat))

    def from_row():
        x = jax.lax.dynamic_index_in_dim(
            S_hat, jnp.argmax(row_norms), axis=0, keepdims=False
        )
        y = S_hat @ km.conj(x)
        return jnp.linalg.norm(km.conj_transpose(S_hat) @ (y / jnp.linalg.norm(y)))

    bound = jax.lax.cond(
        jnp.max(column_norms) > jnp.max(row_norms), from_column, from_row
    )
    return jnp.where(scale > 0, safe_scale * bound, 0).astype(km.real_dtype(S.dtype))


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
    ('2nd'; max instead of lb for a diagonal factor) or η/(lb(∇) + tiny) ('1st'),
    lb being :func:`norm_lower_bound`. ``V=None`` integrates v ~ N(0, I) out:
    BBᵀ and BᵀB are replaced by their expectations
    (:func:`expected_noise_grams`).
    """
    Qs = [factors.left, factors.right]
    A = km.apply_along_axes(Qs, H)
    if V is None:
        noise_grams = expected_noise_grams(Qs)
    else:
        B = V
        for axis, Q in enumerate(Qs):
            B = km.solve_transposed_along_axis(Q, B, axis)
    first_order = step_normalizer_order == "1st"
    new = []
    for axis, Q in enumerate(Qs):
        diagonal = km.is_diagonal(Q)
        T1 = km.unfold_gram(A, axis, diagonal)
        T2 = noise_grams[axis] if V is None else km.unfold_gram(B, axis, diagonal)
        if diagonal:
            normalizer = jnp.abs(T1 - T2) if first_order else jnp.abs(T1 + T2)
            step = precond_lr / (jnp.max(normalizer) + km.TINY)
            new.append(Q - step * (T1 - T2) * Q)
        else:
            gradient = jnp.triu(T1 - T2)
            normalizer = gradient if first_order else T1 + T2
            step = precond_lr / (norm_lower_bound(normalizer) + km.TINY)
            new.append(Q - step * (gradient @ Q))
    return AffineFactors(*new)


def affine_precondition(factors: AffineFactors, G: jax.Array) -> jax.Array:
    """P·G = Q_lᵀQ_l·G·Q_rᵀQ_r for a (d₁, d₂) matrix G."""
    return km.precondition([factors.left, factors.right], G)


def integrates_noise_out(factors: AffineFactors) -> bool:
    """Whitening integrates v out (psgd-jax's rule) when both factors are
    diagonal, or one is diagonal and its side is at least as long as the other
    (then the triangular inverse is the small one); otherwise it samples
    v ~ N(0, I)."""
    left, right = factors
    if km.is_diagonal(left) and km.is_diagonal(right):
        return True
    if km.is_diagonal(left):
        return left.shape[0] >= right.shape[0]
    if km.is_diagonal(right):
        return right.shape[0] >= left.shape[0]
    return False


def affine_preconditioner(
    step_normalizer_order: str = "2nd",
    max_size_triangular: int = 4096,
    max_skew_triangular: int = 128,
    precision: str | None = "tensorfloat32",
    permute_axes: bool = False,
) -> Preconditioner:
    """Affine's :class:`~precond.jax.psgd._transform.Preconditioner`.

    The factors are one :class:`AffineFactors` whose ``left`` and ``right`` are
    trees like the parameters (each parameter's Q_l and Q_r), in
    promote(parameter dtype, float32). A fit on (v, h): per leaf,
    (1) at the first fit with automatic scaling, both factors are multiplied by
    (Σv²/Σh²)^{1/8}, so P by (Σv²/Σh²)^{1/2} (Σv² = numel in whitening mode);
    (2) :func:`affine_update`; (3) with probability 0.01 (a draw per leaf) the
    two factors are balanced. In whitening mode (``v`` None) v is integrated out
    by psgd-jax's rule (:func:`integrates_noise_out`), else drawn per leaf. Each
    leaf's draws come from its share of ``key`` in psgd-jax's order.
    """
    init = functools.partial(
        _init_all,
        permute_axes=permute_axes,
        max_size_triangular=max_size_triangular,
        max_skew_triangular=max_skew_triangular,
    )
    fit_all = functools.partial(
        _fit_all,
        step_normalizer_order=step_normalizer_order,
        precision=precision,
        permute_axes=permute_axes,
    )
    apply_all = functools.partial(
        _apply_all, precision=precision, permute_axes=permute_axes
    )
    return auto_axes_preconditioner(
        init, fit_all, apply_all, draws_vector=False, fit_uses_key=True, name="affine"
    )


def _init_all(
    params, scale, key, *, permute_axes, max_size_triangular, max_skew_triangular
):
    """Q = scale·I for every leaf (:func:`init_factors` of its matrix view); the
    key is returned unused."""
    if is_params_placeholder(params):
        # optax.tree.map_params: a leaf in place of the per-parameter factors
        # (a prefix of them), so that they are not taken for params.
        return jnp.zeros((0,), jnp.float32), key

    def leaf_factors(p):
        return init_factors(
            matrix_view_plan(p.shape, permute_axes)[1],
            scale,
            jnp.promote_types(p.dtype, jnp.float32),
            max_size_triangular,
            max_skew_triangular,
        )

    leaves, treedef = jax.tree.flatten(params)
    return _as_trees([leaf_factors(p) for p in leaves], treedef), key


def _as_trees(per_leaf: Sequence[AffineFactors], treedef) -> AffineFactors:
    """One :class:`AffineFactors` per parameter as the state keeps them: the
    Q_l's and the Q_r's, each a tree like the parameters (of arrays, which
    every tree library round-trips: flax's ``nnx.Optimizer`` turns a
    NamedTuple inside a parameter's entry into an ``nnx.State``)."""
    return AffineFactors(
        left=treedef.unflatten([f.left for f in per_leaf]),
        right=treedef.unflatten([f.right for f in per_leaf]),
    )


def _per_leaf(factors: AffineFactors, treedef) -> list[AffineFactors]:
    """The inverse of :func:`_as_trees`: (Q_l, Q_r) of each parameter."""
    return [
        AffineFactors(left, right)
        for left, right in zip(
            treedef.flatten_up_to(factors.left),
            treedef.flatten_up_to(factors.right),
            strict=True,
        )
    ]


def _fit_leaf(factors, h, v, balance, lr, first, newton, step_normalizer_order):
    """One leaf's fit on its matrix views h and v (Newton mode's, or the sampled
    v, or None to integrate v out): the first fit's scaling,
    :func:`affine_update`, then balancing where ``balance``."""
    if h.size == 0:
        return factors
    h = h.astype(factors.left.dtype)
    scale = first_fit_scale(h, v.astype(h.dtype) if newton else None, 0.125)
    factors = AffineFactors(*(jnp.where(first, Q * scale, Q) for Q in factors))
    if v is not None:
        v = v.astype(h.dtype)
    factors = affine_update(factors, h, v, lr, step_normalizer_order)
    # Balancing only rescales (O(d²) work): a select, not a branch.
    balanced = km.balance_factors(list(factors))
    return AffineFactors(
        *(jnp.where(balance, b, Q) for b, Q in zip(balanced, factors, strict=True))
    )


def _leaf_keys(keys: jax.Array, sampled: Sequence[bool]):
    """psgd-jax's use of each leaf's key k, derived for all leaves in one batched
    call per derivation (the bits of the per-leaf calls, at a fraction of their
    compile time):

    * a leaf that samples v: k₀, k_v = split(k), v drawn from k_v, then the
      balancing draw u = uniform(split(split(k₀)[1])[1]);
    * another: u = uniform(split(k)[1]).

    Returns (k_v or None per leaf, the (leaves,) draws u); a leaf balances
    where u < BALANCE_PROBABILITY.
    """
    split = jax.vmap(jax.random.split)
    halves = split(keys)
    after_v = split(halves[:, 0])[:, 1]
    decision_keys = jnp.stack(
        [after_v[i] if sample else keys[i] for i, sample in enumerate(sampled)]
    )
    draws = jax.vmap(lambda k: jax.random.uniform(jax.random.split(k)[1]))(
        decision_keys
    )
    v_keys = [halves[i, 1] if sample else None for i, sample in enumerate(sampled)]
    return v_keys, draws


def _sampled_vs(leaf_factors, hs, v_keys) -> list[jax.Array | None]:
    """v ~ N(0, I) like each h, in the fit's dtype, from its key (None without
    one): ``optax.tree.random_like``'s draw, one batched call per (shape, dtype);
    a leaf whose type carries a mesh sharding draws alone, with that sharding."""
    vs: list[jax.Array | None] = [None] * len(hs)
    batches: dict[tuple, list[int]] = {}
    for i, (factors, h, key) in enumerate(zip(leaf_factors, hs, v_keys, strict=True)):
        if key is None:
            continue
        like = h.astype(factors.left.dtype)
        if typed_sharding(like) is not None:
            # A tree of one array is that array.
            vs[i] = cast(
                jax.Array, optax.tree.random_like(key, like, jax.random.normal)
            )
        else:
            batches.setdefault((like.shape, like.dtype), []).append(i)
    for (shape, dtype), leaves in batches.items():
        keys = jnp.stack([v_keys[i] for i in leaves])
        for i, v in zip(leaves, _random_like_draws(keys, shape, dtype), strict=True):
            vs[i] = v
    return vs


def _random_like_draws(keys: jax.Array, shape, dtype) -> jax.Array:
    """``optax.tree.random_like(k, x, jax.random.normal)`` for every key k and an
    unsharded array x of ``shape`` and ``dtype``: normal(split(k, 1)[0])."""

    def draw(key):
        return jax.random.normal(jax.random.split(key, 1)[0], shape, dtype)

    return jax.vmap(draw)(keys)


def _matrix_views(tree, permute_axes):
    """The leaves of ``tree`` as their matrix views (:func:`to_matrix`)."""
    return [
        to_matrix(x, matrix_view_plan(x.shape, permute_axes))
        for x in jax.tree.leaves(tree)
    ]


def _fit_all(
    factors,
    h,
    v,
    lr,
    first,
    key,
    newton,
    *,
    step_normalizer_order,
    precision,
    permute_axes,
):
    """Every leaf's :func:`_fit_leaf`, each with the draws of its share of
    ``key`` (:func:`_leaf_keys`; in Newton mode only the balancing decision)."""
    treedef = jax.tree.structure(h)
    leaf_factors = _per_leaf(factors, treedef)
    keys = jax.random.split(key, max(len(leaf_factors), 1))[: len(leaf_factors)]
    hs = _matrix_views(h, permute_axes)
    # Whitening samples v ~ N(0, I) like h (in the fit's dtype) where it does
    # not integrate v out.
    sampled = [
        not newton and h_leaf.size > 0 and not integrates_noise_out(f)
        for f, h_leaf in zip(leaf_factors, hs, strict=True)
    ]
    with matmul_precision(precision), jax.named_scope("precond/affine/fit"):
        v_keys, draws = _leaf_keys(keys, sampled) if hs else ([], jnp.zeros(0))
        balances = list(draws < BALANCE_PROBABILITY)
        vs = (
            _matrix_views(v, permute_axes)
            if newton
            else _sampled_vs(leaf_factors, hs, v_keys)
        )
        new = [
            _fit_leaf(
                f, h_leaf, v_leaf, balance, lr, first, newton, step_normalizer_order
            )
            for f, h_leaf, v_leaf, balance in zip(
                leaf_factors, hs, vs, balances, strict=True
            )
        ]
    return _as_trees(new, treedef)


def _precondition_leaf(factors: AffineFactors, x: jax.Array, permute_axes: bool):
    """P·x for one leaf, through its matrix view."""
    plan = matrix_view_plan(x.shape, permute_axes)
    X = to_matrix(x, plan).astype(factors.left.dtype)
    return from_matrix(affine_precondition(factors, X), plan, x.shape)


def _apply_all(factors, m, *, precision, permute_axes):
    """P·m leaf by leaf."""
    leaves, treedef = jax.tree.flatten(m)
    leaf_factors = _per_leaf(factors, treedef)
    with (
        matmul_precision(precision),
        jax.named_scope("precond/affine/precondition"),
    ):
        out = [
            _precondition_leaf(f, x, permute_axes)
            for f, x in zip(leaf_factors, leaves, strict=True)
        ]
    return treedef.unflatten(out)


# Affine's own arguments (the shared ones: PSGD_ARGUMENT_CHECKS).
AFFINE_ARGUMENT_CHECKS = {
    "max_size_triangular": functools.partial(check_int, low=0),
    "max_skew_triangular": functools.partial(check_int, low=0),
    "permute_axes": check_bool,
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
    *,
    permute_axes: bool = False,
    params_partition_specs: Any | None = None,
    preconditioner_partition_spec: PartitionSpec | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Scales updates by the PSGD Affine preconditioner.

    Each parameter is viewed as a (d₁, d₂) matrix (:func:`matrix_view_shape`) and
    preconditioned by P·G = Q_lᵀQ_l·G·Q_rᵀQ_r. A side gets a diagonal factor when
    its size is < 2, > ``max_size_triangular`` or > ``max_skew_triangular`` times
    the other side's; else an upper-triangular one.

    Each step: (1) with probability p fit (Q_l, Q_r) to (v, h)
    (:func:`affine_update`): Newton mode with ``update(..., Hvp=h, vector=v,
    update_preconditioner=flag)``; else whitening with h = the raw gradient and v
    integrated out or v ~ N(0, I) (:func:`integrates_noise_out`; the first two
    steps always fit); at the first fit, when ``precond_init_scale`` is None,
    both factors are first scaled by (Σv²/Σh²)^{1/8} (whitening: Σv² = numel);
    after the fit, with probability 0.01 the factors are balanced; (2)
    m ← β₁m + (1−β₁)g, m̂ = m/(1−β₁ⁿ) (Nesterov: β₁m/(1−β₁ⁿ⁺¹) + (1−β₁)g/(1−β₁ⁿ));
    (3) U = P·m̂, clipped to global norm ``update_global_norm_clip``. A NaN/Inf
    gradient: zero update, the state unchanged but for its count ``skipped``.

    The state is a :class:`~precond.jax.PSGDState` whose ``preconditioner`` is an
    :class:`AffineFactors` of two trees like the parameters (the Q_l's, the Q_r's).

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
        permute_axes: view a tensor of 3 or more axes as psgd-jax does, over
            every permutation of its axes (:func:`permuted_matrix_view`; a
            transpose per step); False (default): the free reshape of
            :func:`matrix_view_shape`, axes in their order.
        params_partition_specs, preconditioner_partition_spec, mesh: keyword
            only, precond's: the state on a mesh (default: the context mesh).
            Momentum follows the params; the rows of every Q_l and Q_r are split
            over the spec's axes, zero-padded (the math is the unsharded one).

    Example:
        >>> optimizer = scale_by_affine()
    """
    check_arguments(AFFINE_ARGUMENT_CHECKS, locals())
    return scale_by_psgd(
        affine_preconditioner(
            step_normalizer_order,
            max_size_triangular,
            max_skew_triangular,
            precision,
            permute_axes,
        ),
        **psgd_arguments(locals()),
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
    *,
    permute_axes: bool = False,
    params_partition_specs: Any | None = None,
    preconditioner_partition_spec: PartitionSpec | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> optax.GradientTransformationExtraArgs:
    """PSGD Affine: ``chain(scale_by_affine, add_decayed_weights,
    scale_by_learning_rate)``.

    θ ← θ − lr·(U + λ·mask⊙θ) with U from :func:`scale_by_affine` (see it for the
    other arguments).

    The state is ``(core state, learning-rate state)`` whatever ``weight_decay``
    is (the decay keeps none), as ``optax.inject_hyperparams`` needs.

    Complex parameters: supported, mixed freely with real ones (factors are per
    parameter: complex for complex parameters). The preconditioner is Hermitian, P =
    (Q_rᴴQ_r) ⊗ (Q_lᴴQ_l), i.e. P·G = Q_lᴴQ_l·G·(Q_rᴴQ_r)ᵀ (Kron's mode-product
    convention), fitted with conjugate transposes; the integrated-out noise is
    circular complex normal. As for every optax optimizer, pass conjugated
    gradients, ``jax.tree.map(jnp.conj, jax.grad(loss)(params))`` (why:
    :func:`precond.jax.hessian_helper`, which returns them so).

    Example:
        >>> optimizer = affine(learning_rate=0.01)
    """
    return psgd_alias(scale_by_affine, locals())
