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
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from precond._common.kron_constants import BALANCE_PROBABILITY
from precond._common.validation import check_bool, check_int
from precond.jax._core import factor_kernels as km
from precond.jax._core.guards import is_params_placeholder
from precond.jax._core.mesh_placement import typed_sharding
from precond.jax._core.precision import matmul_precision
from precond.jax.psgd._affine_kernels import (
    AffineFactors,
    affine_precondition,
    affine_update,
    from_matrix,
    init_factors,
    integrates_noise_out,
    matrix_view_plan,
    to_matrix,
)
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
        max_size_triangular: sides larger than this get a diagonal factor (>= 0; 0 makes
            every factor diagonal).
        max_skew_triangular: a side more than this many times the other one gets a
            diagonal factor (>= 0; 0 makes every factor diagonal).
        precond_lr: step size η of the fit (float or schedule of the step).
        precond_init_scale: initial Q = Q_r ⊗ Q_l = s·I (each factor √s·I); None: scaled
            from the first fit.
        update_global_norm_clip: clip U to this global norm (None: no clip).
        step_normalizer_order: '2nd' or '1st' (see :func:`affine_update`).
        seed: PRNG key or int (default psgd-jax's PRNGKey(36)), kept in the state.
        mu_dtype: momentum dtype (default the gradients').
        precision: matmul precision of the fit and of P·m̂ (a name for
            ``jax.default_matmul_precision``; None: the backend default).
        permute_axes: view a tensor of 3 or more axes as psgd-jax does, over every
            permutation of its axes (:func:`permuted_matrix_view`; a transpose per
            step); False (default): the free reshape of :func:`matrix_view_shape`, axes
            in their order.
        params_partition_specs: keyword only, precond's: the state on a mesh (default:
            the context mesh). Momentum follows the params; the rows of every Q_l and
            Q_r are split over the spec's axes, zero-padded (the math is the unsharded
            one).
        preconditioner_partition_spec: keyword only, precond's: the state on a mesh
            (default: the context mesh). Momentum follows the params; the rows of every
            Q_l and Q_r are split over the spec's axes, zero-padded (the math is the
            unsharded one).
        mesh: keyword only, precond's: the state on a mesh (default: the context mesh).
            Momentum follows the params; the rows of every Q_l and Q_r are split over
            the spec's axes, zero-padded (the math is the unsharded one).

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state is a
        :class:`~precond.jax.PSGDState`.

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

    θ ← θ − lr·(U + λ·mask⊙θ) with U from :func:`scale_by_affine`.

    The state is ``(core state, learning-rate state)`` whatever ``weight_decay``
    is (the decay keeps none), as ``optax.inject_hyperparams`` needs.

    Complex parameters: supported, mixed freely with real ones (factors are per
    parameter: complex for complex parameters). The preconditioner is Hermitian, P =
    (Q_rᴴQ_r) ⊗ (Q_lᴴQ_l), i.e. P·G = Q_lᴴQ_l·G·(Q_rᴴQ_r)ᵀ (Kron's mode-product
    convention), fitted with conjugate transposes; the integrated-out noise is
    circular complex normal. As for every optax optimizer, pass conjugated
    gradients, ``jax.tree.map(jnp.conj, jax.grad(loss)(params))`` (why:
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
        max_size_triangular: sides larger than this get a diagonal factor (>= 0; 0 makes
            every factor diagonal).
        max_skew_triangular: a side more than this many times the other one gets a
            diagonal factor (>= 0; 0 makes every factor diagonal).
        precond_lr: step size η of the fit (float or schedule of the step).
        precond_init_scale: initial Q = Q_r ⊗ Q_l = s·I (each factor √s·I); None: scaled
            from the first fit.
        update_global_norm_clip: clip U to this global norm (None: no clip).
        step_normalizer_order: '2nd' or '1st' (see :func:`affine_update`).
        seed: PRNG key or int (default psgd-jax's PRNGKey(36)), kept in the state.
        mu_dtype: momentum dtype (default the gradients').
        precision: matmul precision of the fit and of P·m̂ (a name for
            ``jax.default_matmul_precision``; None: the backend default).
        permute_axes: view a tensor of 3 or more axes as psgd-jax does, over every
            permutation of its axes (:func:`permuted_matrix_view`; a transpose per
            step); False (default): the free reshape of :func:`matrix_view_shape`, axes
            in their order.
        params_partition_specs: keyword only, precond's: a PartitionSpec (or None) per
            parameter, a pytree like the params; the momentum follows it. None: read
            from the params' types on a mesh with Explicit axes, else replicated.
        preconditioner_partition_spec: keyword only, precond's: the mesh axes that split
            the rows of every Q_l and Q_r, zero-padded to a multiple of their size (the
            math is the unsharded one); None replicates them.
        mesh: keyword only, precond's: the mesh the specs name; None: the context mesh
            (``jax.set_mesh``).

    Returns:
        An ``optax.GradientTransformationExtraArgs``: the chain of
        :func:`scale_by_affine`, the decay and the learning rate; its state is ``(core
        state, learning-rate state)``.

    Example:
        >>> optimizer = affine(learning_rate=0.01)
    """
    return psgd_alias(scale_by_affine, locals())
