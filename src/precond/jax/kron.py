"""PSGD Kron as an optax transformation: ``kron``, ``scale_by_kron`` and its schedule.

Drop-in for ``distributed_kron.kron`` on one device: same argument names and
defaults. The preconditioner of each parameter is P = ⊗_i Q_iᵀQ_i with one
triangular or diagonal factor Q_i per axis, fitted online so that P·m̂ is whitened
(Li 2018, arXiv:1809.10232; Li 2024, arXiv:2402.11858).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from precond._common.validation import is_concrete_number
from precond._common.xla_workarounds import warn_if_xla_cpu_deadlock_possible
from precond.jax import _kron_layout as layout
from precond.jax import _kron_math as km
from precond.jax._alias import with_decay_and_learning_rate
from precond.jax._guards import (
    all_finite,
    check_parameter_dtypes,
    check_state_matches,
    gradients_are_usable,
)
from precond.jax._kron_arguments import (
    KRON_STATIC_ARGS,
    precond_update_prob_schedule,
    validate_kron_arguments,
)
from precond.jax._kron_layout import StackPlan, TensorPlan
from precond.jax._kron_randomness import (
    BALANCE_PROBABILITY,
    fit_randomness,
    unit_noise,
)
from precond.jax._kron_sharding import (
    ShardingPlan,
    partition_specs_only,
    per_parameter,
    plan_sharding,
)
from precond.jax._precision import matmul_precision
from precond.jax.hessian import newton_arguments

__all__ = [
    "KRON_STATIC_ARGS",
    "KronState",
    "get_opt_state_partition_specs",
    "kron",
    "kron_state_from_distributed_kron",
    "kron_state_to_distributed_kron",
    "precond_update_prob_schedule",
    "scale_by_kron",
]

# kron's own arguments, which scale_by_kron accepts and ignores (as
# distributed-kron's does), so that one dict of kron arguments serves both.
KRON_ALIAS_ARGS = ("learning_rate", "weight_decay", "weight_decay_mask")

# Updates are scaled down so their per-tensor RMS is at most this.
MAX_UPDATE_RMS = 1.1


class KronState(NamedTuple):
    """State of :func:`scale_by_kron`: arrays only, so any checkpointer saves it."""

    count: jax.Array  # shape=(), dtype=int32: steps taken (skipped steps not counted)
    mu: optax.Updates | None  # like params, dtype=mu_dtype; None when b1 == 0
    preconditioners: tuple  # per stack of equal-shaped units (see _kron_layout), a
    # tuple of factors per axis, each with a leading unit axis: (units, b) diagonal;
    # triangular by preconditioner_cache: None (units, b, b) Q, 'packed'
    # (units, b + 1, b) Q with QᵀQ in its lower triangle, 'dense' (units, 2, b, b);
    # dtype precond_dtype, its complex counterpart in stacks of complex parameters
    update_counter: jax.Array  # shape=(), dtype=int32: steps since the last update
    # Generation-2 styles only (None for 'EQ'): per stack, per axis, the (units,)
    # float32 Lipschitz estimates L_i of the factor updates.
    lipschitz: tuple | None = None


def _fit_key(seed: int, count: jax.Array) -> jax.Array:
    """The key of the random draws of a factor update at step ``count``."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), count)


class _StateLayout(NamedTuple):
    """How a scale_by_kron keeps its factors: its planner and the conversions
    between a factor Q and its stored array."""

    plan_tree: Callable  # params -> (treedef, plans, stacks, sharding)
    stored: Callable  # Q (units, d, d) -> stored array
    factor_of: Callable  # one unit's stored array -> Q


def _leafless_state(
    params: Any, keep_momentum: bool, generation_2: bool, precond_dtype: Any
) -> KronState:
    """The state of a tree with no arrays, e.g. optax.tree.map_params's
    placeholder: momentum is that tree, and the factors (and Lipschitz estimates)
    one empty array each, a leaf that stands for the factors of any parameters, so
    that this state is a prefix of every real one."""
    return KronState(
        count=jnp.zeros([], jnp.int32),
        mu=jax.tree.map(lambda x: x, params) if keep_momentum else None,
        preconditioners=jnp.zeros((0,), precond_dtype),
        update_counter=jnp.zeros([], jnp.int32),
        lipschitz=jnp.zeros((0,), jnp.float32) if generation_2 else None,
    )


def _momentum_dtype(mu_dtype: Any | None, param: Any) -> jnp.dtype:
    """``mu_dtype`` (default the parameter's), complex for a complex parameter."""
    dtype = jnp.dtype(mu_dtype or param.dtype)
    return km.complex_dtype(dtype) if km.is_complex(param) else dtype


def _saturating_increment(count: jax.Array) -> jax.Array:
    return jnp.where(count < jnp.iinfo(jnp.int32).max, count + 1, count)


def _factor_structure(stacks: list[StackPlan]) -> tuple:
    """A pytree shaped like ``KronState.preconditioners`` (one leaf per factor)."""
    return tuple(tuple(0 for _ in stack.block_shape) for stack in stacks)


def _state_specs(
    sharding: ShardingPlan,
    treedef: Any,
    factors: Any,
    keep_momentum: bool,
    lipschitz: bool,
) -> KronState:
    """The PartitionSpec of every leaf of a KronState: momentum like its parameter,
    factor stacks (and their Lipschitz estimates, if ``lipschitz``) split along
    their unit axis, counters replicated. ``factors`` is any pytree shaped like the
    state's preconditioners."""
    param_specs = sharding.param_specs
    if param_specs is None:
        param_specs = [PartitionSpec()] * treedef.num_leaves
    return KronState(
        count=PartitionSpec(),
        mu=treedef.unflatten(param_specs) if keep_momentum else None,
        preconditioners=jax.tree.map(lambda _: sharding.stack_spec, factors),
        update_counter=PartitionSpec(),
        lipschitz=(
            jax.tree.map(lambda _: sharding.stack_spec, factors) if lipschitz else None
        ),
    )


def scale_by_kron(
    b1: float = 0.9,
    # A pure function, as in distributed-kron's signature: safe as a default.
    preconditioner_update_probability: float | Callable = (
        precond_update_prob_schedule()  # noqa: B008
    ),
    max_size_triangular: int = 8192,
    min_ndim_triangular: int = 2,
    memory_save_mode: str | None = None,
    preconditioner_lr: float = 0.1,
    preconditioner_init_scale: float = 1.0,
    mu_dtype: Any | None = None,
    precond_dtype: Any | None = None,
    precond_update_precision: str | None = "tensorfloat32",
    precond_grads_precision: str | None = None,
    scanned_layers: Any | Callable | None = None,
    lax_map_scanned_layers: bool = False,
    lax_map_batch_size: int = 8,
    merge_small_dims: bool = True,
    target_merged_dim_size: int = 4096,
    partition_grads_into_blocks: bool = True,
    block_size: int = 256,
    params_partition_specs: Any | None = None,
    preconditioner_partition_spec: PartitionSpec | None = None,
    *,
    momentum_into_precond_update: bool = True,
    mesh: jax.sharding.Mesh | None = None,
    preconditioner_cache: str | None = "packed",
    preconditioner_update_style: str = "EQ",
    seed: int = 42,
    merge_rule: str = "balanced",
    independent_scanned_layers: bool = False,
    noise_draws: str = "per_block",
    block_padding: str = "inert",
    **kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
    """Scales updates by the PSGD Kron preconditioner.

    Each step, with n the 1-based step count:

    1. m ← β₁m + (1−β₁)g, m̂ = m / (1 − β₁ⁿ).
    2. With probability p(n) (realised by a deterministic counter: update when
       1/p steps have passed since the last update), fit the factors: with
       probability 0.01 balance their norms, draw V ~ N(0, I), and take one
       :func:`precond.jax._kron_math.update_factors` step on
       (m̂ + 2^-11.5·mean|m̂|·V, V) (or a generation-2 step: see
       ``preconditioner_update_style``).
    3. U = (⊗_i Q_iᵀQ_i)·m̂ with the updated factors, then U ← U / max(1, RMS(U)/1.1).

    An axis gets a diagonal factor if its size is 1 or exceeds
    ``max_size_triangular``, if the tensor has fewer than ``min_ndim_triangular``
    dims, or by ``memory_save_mode`` (see
    :func:`precond._common.factor_plan.plan_diagonal_axes`); otherwise an
    upper-triangular one. Scalars are treated as shape (1,).

    Newton mode: ``update(grads, state, params, Hvp=h, vector=v,
    update_preconditioner=flag)`` (all three, e.g. from
    :func:`precond.jax.hessian_helper`) fits the factors to the pairs (h, v) =
    (H·v, v) instead, without damping noise, so that P → H⁻¹ in the
    Kronecker-factored sense; ``flag`` replaces the update probability.

    Complex parameters: P = ⊗_i Q_iᴴQ_i (Hermitian); see :func:`kron`.

    Non-finite gradients: if any gradient (or Hvp) entry is NaN or ±Inf the whole
    step is skipped: the returned update is zero and the state (momentum, factors,
    counts) is returned unchanged, so one bad batch never corrupts the
    preconditioner.

    Args:
        b1: momentum decay β₁ in [0, 1); 0 keeps no momentum.
        preconditioner_update_probability: probability in [0, 1] of updating the
            preconditioner, or a schedule n ↦ p (default
            :func:`precond_update_prob_schedule`).
        max_size_triangular: axes longer than this get diagonal factors.
        min_ndim_triangular: tensors with fewer dims get only diagonal factors.
        memory_save_mode: None, 'one_diag' (largest axis diagonal) or 'all_diag'.
        momentum_into_precond_update: fit the preconditioner to m̂ (True) or to the
            raw gradient (False).
        preconditioner_lr: step size η of the factor updates.
        preconditioner_init_scale: initial P = s·I (each of k factors s^{1/k}·I).
        mu_dtype: momentum dtype (default: the gradient's; its complex
            counterpart for complex parameters).
        precond_dtype: storage dtype of the factors (default float32). The
            factors are updated and applied in at least float32, so bfloat16
            halves their memory; prefer a generation-2 style with it. Complex
            parameters' factors use its complex counterpart (complex64 for
            float32 and bfloat16, which has no complex type; complex128 for
            float64).
        precond_update_precision: matmul precision of factor updates.
        precond_grads_precision: matmul precision of applying the preconditioner.
        scanned_layers: pytree of bools with the structure of the params (or a
            callable params ↦ such a pytree) marking parameters whose leading axis
            stacks layers: each layer gets its own factors, fitted under ``vmap``.
        lax_map_scanned_layers: map over the layers with ``jax.lax.map`` in batches
            of ``lax_map_batch_size`` instead of one ``vmap``: less memory, slower.
        lax_map_batch_size: layers per batch with ``lax_map_scanned_layers``.
        merge_small_dims: precondition each tensor in a merged shape that groups
            adjacent axes into balanced dims of at most ``target_merged_dim_size``
            (see :func:`precond._common.factor_plan.merge_dims`): a (64, 32, 3, 3)
            kernel gets factors of 64 and 288.
        target_merged_dim_size: largest dim that merging may create.
        partition_grads_into_blocks: cut axes longer than ``block_size`` into
            blocks (the last one zero-padded), each with its own factors. Padding
            is inert: it gets no noise and never changes the real part.
        block_size: block length along each partitioned axis.
        params_partition_specs: a PartitionSpec per parameter (a pytree like the
            params; None entries mean replicated; for flax boxed params, one per
            box as ``nn.get_partition_spec`` gives). Momentum and updates are
            kept sharded like their parameter. Without it, specs are read from
            boxed params (``nn.Partitioned``) or from the params' types on an
            explicit mesh; when none is known, sharding is left to XLA.
        preconditioner_partition_spec: PartitionSpec whose mesh axes split the
            factor state, e.g. ``P('fsdp', None)`` or ``P('fsdp', 'tp')``. Kron
            keeps the factors of equal-shaped blocks in stacks and splits each
            stack along its leading (unit) axis over all the axes named here
            (padding it with empty units to a multiple of their size), so each
            device holds and fits whole factors of 1/N of the blocks and the
            kernels never communicate. Default: every mesh axis that shards a
            parameter. Use ``partition_grads_into_blocks`` so that large layers
            give many units to spread.
        mesh: the mesh that the partition specs refer to. Default: the context
            mesh (``with jax.set_mesh(mesh):``) or, on an explicit mesh, the one
            in the params' types.
        preconditioner_cache: how each triangular factor keeps P_i = Q_iᵀQ_i for
            the steps between factor updates. ``'packed'`` (default) stores it in
            Q_i's unused lower triangle plus one row (d more numbers per d×d
            factor); ``'dense'`` stores it as its own d×d matrix (twice the factor
            memory, no unpacking: the fastest steps); None stores Q_i alone, as
            distributed-kron does, and applies Q_iᵀ(Q_i·) (twice the matmuls).
        preconditioner_update_style: the factor-update rule. ``'EQ'``
            (default, as distributed-kron): the generation-1 step of
            :func:`precond.jax._kron_math.update_factors`, triangular Q with
            triangular solves. ``'QUAD'`` and ``'PRO'``: generation-2 steps
            (:func:`precond.jax._kron_math.update_factors_gen2`) that fit P·G̃
            to unit covariance with matmuls only, the step normalised by a
            smoothed Lipschitz estimate kept in ``KronState.lipschitz``, and the
            elementwise damping G̃ = G + (1e-9 + ε·|G|)⊙V; 'QUAD' keeps Q
            symmetric, 'PRO' keeps a full Q and rotates it toward symmetric with
            a Procrustes step (its 'packed' cache is stored 'dense'). Balancing
            and the update schedule are the same for every style.
        seed: seed of the noise and balancing decisions, which are drawn from
            ``fold_in(PRNGKey(seed), n)``: a restored run repeats them exactly,
            and on any mesh (see :func:`unit_noise`).
        merge_rule: how ``merge_small_dims`` groups axes. ``'balanced'``
            (default): :func:`precond._common.factor_plan.merge_dims`, which
            never merges a tensor into fewer than two dims and makes a merged dim
            longer than ``max_size_triangular`` diagonal, so small layers keep
            small factors. ``'distributed_kron'``: distributed-kron's rule
            (:func:`precond._common.factor_plan.merge_dims_by_loss`), which
            merges a small matrix into one long triangular axis (a (128, 10)
            kernel gets a 1280-long one, cut into blocks when blocking).
        independent_scanned_layers: each layer of a scanned parameter gets its
            own RMS clip and damping scale, exactly as if it were a separate
            parameter. Default False, as distributed-kron: one clip and one
            damping scale mean|m̂| per parameter (over all its layers and blocks).
        noise_draws: where the random draws of a factor update come from.
            ``'per_block'`` (default): each unit's noise from its own key (see
            ``seed``), the same on any mesh. ``'distributed_kron'``: as
            distributed-kron draws them from ``PRNGKey(seed)`` (its seed is 42,
            as precond's default): one normal array per parameter in its layout
            and its balancing decision, so the same seed gives its trajectory.
        block_padding: ``'inert'`` (default): blocking pads only the edge blocks
            of cut axes, and the padding never changes the real part (see
            ``partition_grads_into_blocks``). ``'distributed_kron'``: as
            distributed-kron, every axis is padded up to a multiple of
            ``block_size`` (a 10-long axis gets a 256×256 factor) and the padding
            is fitted with noise, counts in the balancing norms and dilutes the
            damping scale, which changes the real part.
        **kwargs: ``kron``'s own arguments (``learning_rate``,
            ``weight_decay``, ``weight_decay_mask``) are accepted and ignored,
            so one dict of arguments serves both (as in distributed-kron);
            any other name is a TypeError.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state is a
        :class:`KronState`.
    """
    unexpected = sorted(set(kwargs) - set(KRON_ALIAS_ARGS))
    if unexpected:
        raise TypeError(
            f"scale_by_kron() got an unexpected keyword argument {unexpected[0]!r}"
        )
    validate_kron_arguments(**locals())  # locals() are the arguments
    warn_if_xla_cpu_deadlock_possible()
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
    precond_dtype = jnp.dtype(jnp.float32 if precond_dtype is None else precond_dtype)
    # Factors are stored in precond_dtype (bfloat16 halves their memory) and
    # updated and applied in at least float32.
    compute_dtype = jnp.promote_types(precond_dtype, jnp.float32)
    generation_2 = preconditioner_update_style != "EQ"
    # Packing needs Q triangular ('EQ') or symmetric ('QUAD'); 'PRO' keeps a full
    # Q, so its 'packed' cache is stored 'dense'.
    cache = preconditioner_cache
    if preconditioner_update_style == "PRO" and cache == "packed":
        cache = "dense"
    keep_momentum = not (is_concrete_number(b1) and b1 == 0)

    def plan_tree(tree) -> tuple[Any, list[TensorPlan], list[StackPlan], ShardingPlan]:
        """The treedef of ``tree``, a plan per leaf, the stacks of their units, and
        where they live on the mesh."""
        leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
        flags = scanned_layers(tree) if callable(scanned_layers) else scanned_layers
        if flags is None:
            flags = [False] * len(leaves_with_paths)
        else:
            flags = per_parameter(flags, tree, "scanned_layers")
        plans = [
            layout.plan_tensor(
                x.shape,
                scanned=bool(flag),
                path=jax.tree_util.keystr(path),
                max_size_triangular=max_size_triangular,
                min_ndim_triangular=min_ndim_triangular,
                memory_save_mode=memory_save_mode,
                merge_small_dims=merge_small_dims,
                target_merged_dim_size=target_merged_dim_size,
                block_size=block_size if partition_grads_into_blocks else None,
                complex=km.is_complex(x),
                merge_rule=merge_rule,
                block_padding=block_padding,
            )
            for (path, x), flag in zip(leaves_with_paths, flags, strict=True)
        ]
        sharding = plan_sharding(
            tree,
            params_partition_specs=params_partition_specs,
            preconditioner_partition_spec=preconditioner_partition_spec,
            mesh=mesh,
        )
        shapes = [x.shape for _, x in leaves_with_paths]
        stacks = layout.plan_stacks(plans, shapes, units_multiple_of=sharding.shards)
        return treedef, plans, stacks, sharding

    def storage_dtype(x) -> jnp.dtype:
        """precond_dtype, or its complex counterpart for complex factors."""
        return km.complex_dtype(precond_dtype) if km.is_complex(x) else precond_dtype

    def working(x: jax.Array) -> jax.Array:
        """A stored factor in its compute dtype: compute_dtype, or its complex
        counterpart for complex factors."""
        return x.astype(
            km.complex_dtype(compute_dtype) if km.is_complex(x) else compute_dtype
        )

    def stored(Q: jax.Array) -> jax.Array:
        """The state array of a matrix factor, in the cache layout, precond_dtype."""
        if cache == "packed":
            Q = km.pack_factor(Q)
        elif cache == "dense":
            Q = jnp.stack([Q, km.factor_gram(Q)])
        return Q.astype(storage_dtype(Q))

    def factor_of(F: jax.Array) -> jax.Array:
        """Q_i (or the diagonal q_i) from a factor's state array."""
        F = working(F)
        if F.ndim == 1 or cache is None:
            return F
        if cache == "dense":
            return F[0]
        Q = km.unpack_factor(F)  # its upper triangle
        if preconditioner_update_style == "QUAD":  # symmetric (Hermitian)
            Q = Q + km.conj_transpose(jnp.triu(Q, 1))
        return Q

    def gram_of(F: jax.Array) -> jax.Array:
        """P_i = Q_iᵀQ_i (Q_iᴴQ_i) from a cached factor's state array."""
        F = working(F)
        if F.ndim == 1:
            return km.factor_gram(F)
        return km.unpack_gram(F) if cache == "packed" else F[1]

    def init_stack(stack: StackPlan, sharding: ShardingPlan) -> tuple[jax.Array, ...]:
        """Factors of every unit of a stack: s^{1/k}·I (or s^{1/k}·1) per axis."""
        units = len(stack.extents)
        dtype = km.complex_dtype(precond_dtype) if stack.complex else precond_dtype
        scale = jnp.asarray(preconditioner_init_scale, precond_dtype) ** (
            1.0 / len(stack.block_shape)
        )
        factors = []
        for size, diagonal in zip(stack.block_shape, stack.diagonal, strict=True):
            if diagonal:
                factor = (scale * jnp.ones((size,), precond_dtype)).astype(dtype)
            else:
                factor = stored(
                    (scale * jnp.eye(size, dtype=precond_dtype)).astype(dtype)
                )
            factor = jnp.broadcast_to(factor, (units, *factor.shape))
            factors.append(sharding.constrain(factor, sharding.stack_spec))
        return tuple(factors)

    def init_fn(params: optax.Params) -> KronState:
        if not jax.tree.leaves(params):
            return _leafless_state(params, keep_momentum, generation_2, precond_dtype)
        check_parameter_dtypes(params, "PSGD Kron", complex_ok=True)
        treedef, _, stacks, sharding = plan_tree(params)

        def body(params):
            mu = None
            if keep_momentum:
                mu = treedef.unflatten(
                    sharding.constrain_params(
                        [
                            jnp.zeros_like(p, dtype=_momentum_dtype(mu_dtype, p))
                            for p in jax.tree.leaves(params)
                        ]
                    )
                )
            # Counters replicated like the update's outputs, so the first update
            # compiles for the same input shardings as every later one.
            # (Two arrays, not one: a donated state must not alias a buffer.)
            count, update_counter = (
                sharding.constrain(jnp.zeros([], jnp.int32), PartitionSpec())
                for _ in range(2)
            )
            lipschitz = None
            if generation_2:
                lipschitz = tuple(
                    tuple(
                        sharding.constrain(
                            jnp.zeros(len(s.extents), jnp.float32), sharding.stack_spec
                        )
                        for _ in s.block_shape
                    )
                    for s in stacks
                )
            return KronState(
                count=count,
                mu=mu,
                preconditioners=tuple(init_stack(s, sharding) for s in stacks),
                update_counter=update_counter,
                lipschitz=lipschitz,
            )

        specs = _state_specs(
            sharding, treedef, _factor_structure(stacks), keep_momentum, generation_2
        )
        return sharding.run(body, specs, params)

    def over_units(fn: Callable, sharding: ShardingPlan, *stacked):
        """``fn`` applied to every unit of a stack (vmap, or lax.map in batches).

        A sharded stack is mapped shard by shard (a vmap over the shards of a
        lax.map over each shard's units), so that no device waits on another.
        """
        if not lax_map_scanned_layers:
            return jax.vmap(fn)(*stacked)
        shards = sharding.shards

        def local_map(*xs):
            return jax.lax.map(lambda xs: fn(*xs), xs, batch_size=lax_map_batch_size)

        if shards == 1:
            return local_map(*stacked)
        split = jax.tree.map(
            lambda x: sharding.constrain(
                x.reshape(shards, -1, *x.shape[1:]), sharding.stack_spec
            ),
            stacked,
        )
        out = jax.vmap(local_map)(*split)
        return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), out)

    def precondition_unit(factors, G):
        """U = P·G for one unit."""
        if cache is None:
            return km.precondition([factor_of(F) for F in factors], G)
        return km.precondition_with_grams([gram_of(F) for F in factors], G)

    def fit_unit(
        factors, lipschitz, G, V, ids, extent, damping, noise_key, balance, newton
    ):
        """One factor update of one unit from the pair (G, V).

        Whitening (not ``newton``): V is drawn (:func:`unit_noise`) unless given,
        and G gets damping noise. Newton: (G, V) = (H·v, v) as given.
        ``extent`` is the unit's real size per axis: padding beyond it holds
        zeros in G and V, gets no noise,
        and is kept out of the balancing norms and the generation-2 targets.
        ``damping`` is mean|G| over the unit's parameter (or layer: see
        ``independent_scanned_layers``). Returns the new factors and Lipschitz
        estimates.
        """
        valid = [jnp.arange(size) < extent[i] for i, size in enumerate(G.shape)]
        if not newton:
            inside = functools.reduce(
                jnp.logical_and,
                [
                    v.reshape([-1 if a == i else 1 for a in range(G.ndim)])
                    for i, v in enumerate(valid)
                ],
            )
            if V is None:
                V = unit_noise(noise_key, ids[0], ids[1], G.shape, G.dtype)
            V = jnp.where(inside, V, 0)
            if generation_2:
                G = km.add_relative_damping_noise(G, V)
            else:
                G = G + km.DAMPING_SCALE * damping.astype(G.dtype) * V
        old_factors, old_lipschitz = factors, lipschitz
        Qs = [factor_of(F) for F in factors]
        if len(Qs) > 1:
            balanced = km.balance_factors(Qs, valid)
            Qs = [jnp.where(balance, b, Q) for b, Q in zip(balanced, Qs, strict=True)]
        if generation_2:
            diagonal = [km.is_diagonal(Q) for Q in Qs]
            if newton:
                targets = [km.unfold_gram(V, i, d) for i, d in enumerate(diagonal)]
            else:
                targets = km.whitening_targets(valid, diagonal)
            Qs, lipschitz = km.update_factors_gen2(
                Qs,
                lipschitz,
                G,
                targets,
                preconditioner_lr,
                preconditioner_update_style,
            )
        else:
            Qs = km.update_factors(Qs, G, V, preconditioner_lr)
        factors = tuple(
            Q.astype(storage_dtype(Q)) if Q.ndim == 1 else stored(Q) for Q in Qs
        )
        # A fit that overflowed (a gradient too large for the grams, yet usable:
        # _guards) keeps the unit's old factors, as the other PSGD variants do.
        fitted = all_finite(factors, lipschitz)

        def keep(new, old):
            if new is None:
                return None
            return tuple(jnp.where(fitted, n, o) for n, o in zip(new, old, strict=True))

        return keep(factors, old_factors), keep(lipschitz, old_lipschitz)

    def fit_stacks(
        stacks,
        sharding,
        all_factors,
        all_lipschitz,
        G_stacks,
        key,
        V_stacks=None,
        damping_stacks=None,
        drawn=None,
    ):
        """One factor update of every unit (the 'update' branch of step 2);
        ``V_stacks`` are the Newton vectors (None: whitening, with the units'
        damping scales ``damping_stacks``). ``drawn``: whitening with the given
        (balancing decision, noise stacks) instead of drawing them from ``key``.
        Returns the new factors and Lipschitz estimates (None for 'EQ') of every
        stack."""
        newton = V_stacks is not None
        if drawn is None:
            balance, noise_key = fit_randomness(key)
        else:
            (balance, V_stacks), noise_key = drawn, None
        if V_stacks is None:
            V_stacks = [None] * len(stacks)
        if damping_stacks is None:
            damping_stacks = [jnp.zeros(len(s.extents)) for s in stacks]
        if all_lipschitz is None:
            all_lipschitz = [None] * len(stacks)
        new_factors, new_lipschitz = [], []
        for stack, factors, lipschitz, G, V, damping in zip(
            stacks,
            all_factors,
            all_lipschitz,
            G_stacks,
            V_stacks,
            damping_stacks,
            strict=True,
        ):
            with jax.named_scope("precond/kron/update_factors"):
                ids = sharding.constrain(
                    jnp.asarray(stack.unit_ids), sharding.stack_spec
                )
                extents = sharding.constrain(
                    jnp.asarray(stack.extents), sharding.stack_spec
                )

                damping = sharding.constrain(damping, sharding.stack_spec)

                def fit(factors, lipschitz, G, ids, extent, damping, *newton_V):
                    V = newton_V[0] if newton_V else None
                    return fit_unit(
                        factors,
                        lipschitz,
                        G,
                        V,
                        ids,
                        extent,
                        damping,
                        noise_key,
                        balance,
                        newton,
                    )

                newton_V = () if V is None else (V,)
                fitted, lipschitz = over_units(
                    fit,
                    sharding,
                    tuple(factors),
                    lipschitz,
                    G,
                    ids,
                    extents,
                    damping,
                    *newton_V,
                )
                new_factors.append(
                    tuple(sharding.constrain(F, sharding.stack_spec) for F in fitted)
                )
                new_lipschitz.append(
                    None
                    if lipschitz is None
                    else tuple(
                        sharding.constrain(L, sharding.stack_spec) for L in lipschitz
                    )
                )
        if not generation_2:
            return tuple(new_factors), None
        return tuple(new_factors), tuple(new_lipschitz)

    def update_fn(updates, state: KronState, params=None, **extra_args):
        newton = newton_arguments(updates, extra_args)
        if not jax.tree.leaves(updates):
            return updates, state._replace(count=_saturating_increment(state.count))
        treedef, plans, stacks, sharding = plan_tree(updates)
        check_state_matches(state, init_fn, params, updates, "PSGD Kron")
        del params

        def body(updates, state, newton):
            return sharded_update(
                updates, state, newton, treedef, plans, stacks, sharding
            )

        out_specs = (
            treedef.unflatten(
                sharding.param_specs or [PartitionSpec()] * treedef.num_leaves
            ),
            _state_specs(
                sharding,
                treedef,
                _factor_structure(stacks),
                keep_momentum,
                generation_2,
            ),
        )
        return sharding.run(body, out_specs, updates, state, newton)

    def sharded_update(updates, state, newton, treedef, plans, stacks, sharding):
        grads = sharding.constrain_params(jax.tree.leaves(updates))
        # A step whose gradient is unusable (NaN/Inf, or so large its square
        # overflows: _guards) keeps the old state and returns zeros. The guard is
        # fused into the elementwise work (no whole-state select or cond).
        checked = grads if newton is None else grads + jax.tree.leaves(newton["Hvp"])
        finite = gradients_are_usable(checked)
        count = jnp.where(finite, _saturating_increment(state.count), state.count)
        if keep_momentum:
            mus = [
                jnp.where(finite, b1 * m + (1 - b1) * g, m).astype(m.dtype)
                for m, g in zip(treedef.flatten_up_to(state.mu), grads, strict=True)
            ]
            mus = sharding.constrain_params(mus)
            mu_hats = []
            for m in mus:
                dtype = jnp.promote_types(m.dtype, jnp.float32)
                correction = 1 - jnp.asarray(b1, km.real_dtype(dtype)) ** count
                mu_hats.append((m.astype(dtype) / correction).astype(m.dtype))
        else:
            mus, mu_hats = None, grads

        if callable(preconditioner_update_probability):
            prob = preconditioner_update_probability(count)
        else:
            prob = preconditioner_update_probability
        update_counter = state.update_counter + 1
        if newton is None:
            do_update = finite & (
                update_counter.astype(jnp.float32)
                >= 1.0 / jnp.asarray(prob, jnp.float32)
            )
        else:
            do_update = finite & jnp.asarray(newton["update_preconditioner"], bool)
        update_counter = jnp.where(do_update, 0, update_counter)
        update_counter = jnp.where(finite, update_counter, state.update_counter)

        # Views of shape (layers?, *merged shape) in the factors' dtype.
        leads = [plan.lead(g.shape) for plan, g in zip(plans, grads, strict=True)]

        def stacked(tensors):
            views = [
                working(x.reshape(lead + plan.shape))
                for x, plan, lead in zip(tensors, plans, leads, strict=True)
            ]
            # Gathered whole first: the SPMD partitioner moves a sharded tensor into
            # blocks only by full rematerialisation, and gathering is cheaper and
            # predictable (see BENCHMARKS.md, kron_sharded).
            views = [sharding.constrain(v, PartitionSpec()) for v in views]
            return [
                sharding.constrain(x, sharding.stack_spec)
                for x in layout.to_stacks(views, plans, stacks)
            ]

        mu_hat_stacks = stacked(mu_hats)

        def seed_layout_draws(tensors):
            """distributed-kron's draws at this step: its balancing decision and
            one normal array per parameter in its (layers?, blocks?, *block)
            layout, cut to each unit's block and stacked."""
            key = jax.random.fold_in(jax.random.PRNGKey(seed), count - 1)
            _, key = jax.random.split(key)
            key, balance_key = jax.random.split(key)
            balance = jax.random.uniform(balance_key) <= BALANCE_PROBABILITY
            _, noise_key = jax.random.split(key)
            keys = jax.random.split(noise_key, len(tensors))
            blocked = partition_grads_into_blocks
            noise = []
            for k, x, plan, lead in zip(keys, tensors, plans, leads, strict=True):
                sizes = _seed_factor_sizes(plan, blocked, block_size)
                blocks = (math.prod(plan.blocks_per_axis),) if blocked else ()
                V = jax.random.normal(k, (*lead, *blocks, *sizes), x.dtype)
                V = V.reshape(-1, *sizes)
                V = V[(slice(None), *(slice(0, b) for b in plan.block_shape))]
                noise.append(working(V))
            stacked_noise = []
            for stack in stacks:
                parts = [noise[i] for i in stack.members]
                padding = len(stack.extents) - stack.real_units
                parts.append(jnp.zeros((padding, *stack.block_shape), parts[0].dtype))
                stacked_noise.append(
                    sharding.constrain(jnp.concatenate(parts), sharding.stack_spec)
                )
            return balance, stacked_noise

        def damping_scales(tensors):
            """Per stack, each unit's mean|x| over its parameter (its layer, with
            independent_scanned_layers): the scale of the damping noise."""
            means = []
            for x, plan, lead in zip(tensors, plans, leads, strict=True):
                if x.size == 0:  # in no stack
                    means.append(None)
                    continue
                magnitude = jnp.abs(x)
                magnitude = magnitude.astype(
                    jnp.promote_types(magnitude.dtype, jnp.float32)
                )
                # Fitted padding counts in the mean (as distributed-kron's).
                per_layer = math.prod(
                    plan.padded_shape if plan.fitted_padding else plan.shape
                )
                if independent_scanned_layers and lead:
                    total = jnp.sum(magnitude.reshape(lead[0], -1), axis=1)
                    mean = total / per_layer
                else:
                    mean = jnp.sum(magnitude) / (per_layer * math.prod(lead))
                    mean = jnp.broadcast_to(mean, lead)
                means.append(jnp.repeat(mean, math.prod(plan.blocks_per_axis)))
            out = []
            for stack in stacks:
                parts = [means[i] for i in stack.members]
                padding = len(stack.extents) - stack.real_units
                parts.append(jnp.zeros(padding, parts[0].dtype))
                out.append(jnp.concatenate(parts))
            return out

        def fit(preconditioner_state, mu_hat_stacks, newton):
            key = _fit_key(seed, count)
            if newton is not None:  # fit P to the pairs (H·v, v)
                hvp, vector = (
                    stacked(jax.tree.leaves(newton[name])) for name in ("Hvp", "vector")
                )
                return fit_stacks(
                    stacks, sharding, *preconditioner_state, hvp, key, vector
                )
            if momentum_into_precond_update:
                targets, sources = mu_hat_stacks, mu_hats
            else:
                targets, sources = stacked(grads), grads
            drawn = None
            if noise_draws == "distributed_kron":
                drawn = seed_layout_draws(sources)
            return fit_stacks(
                stacks,
                sharding,
                *preconditioner_state,
                targets,
                key,
                damping_stacks=damping_scales(sources),
                drawn=drawn,
            )

        def keep(preconditioner_state, *_):
            factors, lipschitz = preconditioner_state
            return tuple(factors), lipschitz

        with matmul_precision(precond_update_precision):
            all_factors, lipschitz = jax.lax.cond(
                do_update,
                fit,
                keep,
                (state.preconditioners, state.lipschitz),
                mu_hat_stacks,
                newton,
            )

        with (
            matmul_precision(precond_grads_precision),
            jax.named_scope("precond/kron/precondition"),
        ):
            U_stacks = [
                sharding.constrain(
                    over_units(precondition_unit, sharding, tuple(factors), G),
                    sharding.stack_spec,
                )
                for factors, G in zip(all_factors, mu_hat_stacks, strict=True)
            ]
        new_updates = []
        for U, g, lead in zip(
            layout.from_stacks(
                # Gathered whole, then cut to each parameter's sharding locally
                # (gathering each parameter's slice of a stack costs more: the
                # slices do not align with the shards).
                [sharding.constrain(U, PartitionSpec()) for U in U_stacks],
                plans,
                stacks,
                leads,
            ),
            grads,
            leads,
            strict=True,
        ):
            if U is None:  # a parameter with no entries
                new_updates.append(jnp.zeros_like(g))
                continue
            # RMS clip per parameter (per layer with independent_scanned_layers).
            axes = tuple(range(len(lead) if independent_scanned_layers else 0, U.ndim))
            power = km.squared_magnitude(U) if km.is_complex(U) else jnp.square(U)
            rms = jnp.sqrt(jnp.mean(power, axis=axes, keepdims=True))
            U = jnp.where(finite, U / jnp.maximum(1.0, rms / MAX_UPDATE_RMS), 0)
            new_updates.append(U.reshape(g.shape).astype(g.dtype))

        new_state = KronState(
            count=count,
            mu=None if mus is None else treedef.unflatten(mus),
            preconditioners=all_factors,
            update_counter=update_counter,
            lipschitz=lipschitz,
        )
        return (
            treedef.unflatten(sharding.constrain_params(new_updates)),
            new_state,
        )

    # For the state converters (kron_state_from_distributed_kron and back).
    init_fn.layout = _StateLayout(plan_tree, stored, factor_of)
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def kron(
    learning_rate: float | Callable = 0.0003,
    b1: float = 0.9,
    weight_decay: float = 0.0,
    weight_decay_mask: Any | Callable | None = None,
    # A pure function, as in distributed-kron's signature: safe as a default.
    preconditioner_update_probability: float | Callable = (
        precond_update_prob_schedule()  # noqa: B008
    ),
    max_size_triangular: int = 8192,
    min_ndim_triangular: int = 2,
    memory_save_mode: str | None = None,
    preconditioner_lr: float = 0.1,
    preconditioner_init_scale: float = 1.0,
    mu_dtype: Any | None = None,
    precond_dtype: Any | None = None,
    precond_update_precision: str | None = "tensorfloat32",
    precond_grads_precision: str | None = None,
    scanned_layers: Any | Callable | None = None,
    lax_map_scanned_layers: bool = False,
    lax_map_batch_size: int = 8,
    merge_small_dims: bool = True,
    target_merged_dim_size: int = 4096,
    partition_grads_into_blocks: bool = True,
    block_size: int = 256,
    params_partition_specs: Any | None = None,
    preconditioner_partition_spec: PartitionSpec | None = None,
    *,
    momentum_into_precond_update: bool = True,
    mesh: jax.sharding.Mesh | None = None,
    preconditioner_cache: str | None = "packed",
    preconditioner_update_style: str = "EQ",
    seed: int = 42,
    merge_rule: str = "balanced",
    independent_scanned_layers: bool = False,
    noise_draws: str = "per_block",
    block_padding: str = "inert",
) -> optax.GradientTransformationExtraArgs:
    """PSGD Kron: ``chain(scale_by_kron, add_decayed_weights, scale_by_learning_rate)``.

    θ ← θ − lr·(U + λ·mask⊙θ) with U the preconditioned, RMS-clipped momentum of
    :func:`scale_by_kron` (see it for every other argument). Kron usually wants a
    learning rate about 3× smaller than Adam's.

    The state is ``(core state, learning-rate state)`` whatever ``weight_decay``
    is (the decay keeps none), as ``optax.inject_hyperparams`` needs.

    Complex parameters: supported (complex64 and complex128, mixed freely with real
    ones), in every update style and cache. The preconditioner is Hermitian, P = ⊗_i
    Q_iᴴQ_i, fitted with conjugate transposes and circular complex noise
    (:mod:`precond.jax._kron_math`); complex parameters get complex factors (the
    complex counterpart of ``precond_dtype``: complex64 for float32 or bfloat16,
    complex128 for float64) and complex momentum, in stacks of their own, so real
    parameters are computed exactly as without them. As for every optax optimizer on
    complex parameters, pass the conjugate of ``jax.grad`` (which returns
    conj(2∂L/∂z̄) for a real loss, the conjugate of the descent direction): ``grads
    = jax.tree.map(jnp.conj, jax.grad(loss)(params))``
    (:func:`precond.jax.hessian_helper` returns it so).

    Args:
        learning_rate: float > 0 or a schedule of the step count.
        weight_decay: decoupled weight decay λ >= 0.
        weight_decay_mask: pytree of bools (or callable params ↦ pytree) selecting
            the parameters that decay.

    Example:
        >>> import jax.numpy as jnp
        >>> import precond.jax as pj
        >>> params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
        >>> optimizer = pj.kron(learning_rate=3e-4, weight_decay=0.01)
        >>> state = optimizer.init(params)
        >>> grads = {"w": jnp.full((4, 3), 0.1), "b": jnp.full(3, 0.1)}
        >>> updates, state = optimizer.update(grads, state, params)
    """
    core = scale_by_kron(
        b1=b1,
        preconditioner_update_probability=preconditioner_update_probability,
        max_size_triangular=max_size_triangular,
        min_ndim_triangular=min_ndim_triangular,
        memory_save_mode=memory_save_mode,
        momentum_into_precond_update=momentum_into_precond_update,
        preconditioner_lr=preconditioner_lr,
        preconditioner_init_scale=preconditioner_init_scale,
        mu_dtype=mu_dtype,
        precond_dtype=precond_dtype,
        precond_update_precision=precond_update_precision,
        precond_grads_precision=precond_grads_precision,
        scanned_layers=scanned_layers,
        lax_map_scanned_layers=lax_map_scanned_layers,
        lax_map_batch_size=lax_map_batch_size,
        merge_small_dims=merge_small_dims,
        target_merged_dim_size=target_merged_dim_size,
        partition_grads_into_blocks=partition_grads_into_blocks,
        block_size=block_size,
        params_partition_specs=params_partition_specs,
        preconditioner_partition_spec=preconditioner_partition_spec,
        mesh=mesh,
        preconditioner_cache=preconditioner_cache,
        preconditioner_update_style=preconditioner_update_style,
        seed=seed,
        merge_rule=merge_rule,
        independent_scanned_layers=independent_scanned_layers,
        noise_draws=noise_draws,
        block_padding=block_padding,
    )
    return with_decay_and_learning_rate(
        core, learning_rate, weight_decay, weight_decay_mask
    )


def get_opt_state_partition_specs(
    params: Any, scale_by_kron_only: bool = False, **kwargs: Any
) -> Any:
    """The PartitionSpec of every leaf of the state of ``kron(**kwargs)``.

    For ``jax.jit(..., out_shardings=...)`` or a checkpointer's restore targets:
    momentum follows its parameter, every stack of factors is split along its unit
    axis (see ``preconditioner_partition_spec``), everything else is replicated.
    ``params`` may be arrays or ``jax.ShapeDtypeStruct``s. On an explicit mesh,
    ``jax.eval_shape(optimizer.init, params)`` carries the same shardings.

    Args:
        params: the parameters (or their shapes).
        scale_by_kron_only: the state of ``scale_by_kron(**kwargs)`` instead
            (``kron``'s own arguments, such as ``learning_rate``, are ignored).
        **kwargs: the arguments given to ``kron`` (or ``scale_by_kron``).

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> params = {"w": jnp.ones((512, 256))}
        >>> kwargs = dict(params_partition_specs={"w": P("fsdp", None)},
        ...               preconditioner_partition_spec=P("fsdp", None))
        >>> optimizer = kron(**kwargs)
        >>> specs = get_opt_state_partition_specs(params, **kwargs)
    """
    if scale_by_kron_only:
        for name in ("learning_rate", "weight_decay", "weight_decay_mask"):
            kwargs.pop(name, None)
    factory = scale_by_kron if scale_by_kron_only else kron
    sharding = partition_specs_only(
        params,
        params_partition_specs=kwargs.get("params_partition_specs"),
        preconditioner_partition_spec=kwargs.get("preconditioner_partition_spec"),
        mesh=kwargs.get("mesh"),
    )
    # The state's structure does not depend on the sharding: trace it without.
    unsharded = dict(
        kwargs,
        params_partition_specs=None,
        preconditioner_partition_spec=None,
        mesh=None,
    )
    shapes = jax.eval_shape(factory(**unsharded).init, params)
    treedef = jax.tree.structure(params)

    def kron_specs(state: KronState) -> KronState:
        return _state_specs(
            sharding,
            treedef,
            state.preconditioners,
            keep_momentum=state.mu is not None,
            lipschitz=state.lipschitz is not None,
        )

    return jax.tree.map(
        lambda x: kron_specs(x) if isinstance(x, KronState) else PartitionSpec(),
        shapes,
        is_leaf=lambda x: isinstance(x, KronState),
    )


def _split_chain_state(state: Any) -> tuple[Any, Callable]:
    """The scale_by_kron state inside ``state`` (itself, or the first member of a
    ``kron`` chain's tuple) and a function that builds the same kind of state
    around a replacement (for a chain, its learning rate's state, the last
    member, follows; ``middle`` goes between them)."""
    if isinstance(state, tuple | list) and not isinstance(state, KronState):
        return state[0], lambda first, middle=(): type(state)(
            (first, *middle, state[-1])
        )
    return state, lambda first, middle=(): first


def _core_arguments(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k not in KRON_ALIAS_ARGS}


def _seed_factor_sizes(plan: TensorPlan, blocked: bool, block_size: int) -> list:
    """distributed-kron's factor size per axis: with blocking, every axis is
    padded up to a multiple of ``block_size`` (cut ones to exactly one block)."""
    if not blocked:
        return list(plan.block_shape)
    return [
        b if (not diagonal and d > block_size) else -(-d // block_size) * block_size
        for d, b, diagonal in zip(
            plan.shape, plan.block_shape, plan.diagonal, strict=True
        )
    ]


def kron_state_from_distributed_kron(
    state: Any, params: Any, **kwargs: Any
) -> KronState | tuple:
    """Converts a distributed-kron 1.0.0 state (its dict, or its ``kron`` chain's
    tuple, e.g. from a checkpoint) into the state of ``kron(**kwargs)`` (or of
    ``scale_by_kron``, for a dict alone).

    ``kwargs`` are the arguments the state was made with (and precond's own, e.g.
    ``merge_rule='distributed_kron'`` for its factor shapes). Counts and momentum
    are copied; each factor Q is copied into precond's layout. Where
    distributed-kron padded an axis up to a multiple of ``block_size``, the
    factor's leading part is kept (Q is upper triangular, so that part alone
    determines the preconditioner of the real entries). Only the 'EQ' style
    (distributed-kron's) has an equivalent state.

    Example:
        >>> state = kron_state_from_distributed_kron(
        ...     old_state, params, merge_rule="distributed_kron")  # doctest: +SKIP
    """
    seed_state, put_back = _split_chain_state(state)
    core = _core_arguments(kwargs)
    transform = scale_by_kron(**core)
    template = transform.init(params)
    if not isinstance(template.preconditioners, tuple):  # no parameters
        return put_back(template)
    treedef, _, stacks, _ = transform.init.layout.plan_tree(params)
    seed_factors = treedef.flatten_up_to(seed_state["Qs_preconditioners"])
    factors = []
    for stack, stored_stack in zip(stacks, template.preconditioners, strict=True):
        axes = []
        for axis, array in enumerate(stored_stack):
            size, diagonal = stack.block_shape[axis], stack.diagonal[axis]
            q_ndim = 1 if diagonal else 2
            parts = []
            for i in stack.members:
                Q = jnp.asarray(seed_factors[i][axis])
                Q = Q.reshape(-1, *Q.shape[Q.ndim - q_ndim :])
                parts.append(Q[(slice(None), *[slice(0, size)] * q_ndim)])
            Q = jnp.concatenate(parts).astype(array.dtype)
            if not diagonal:
                Q = jax.vmap(transform.init.layout.stored)(Q)
            axes.append(array.at[: len(Q)].set(Q.astype(array.dtype)))
        factors.append(tuple(axes))
    mu = seed_state["mu"]
    if template.mu is not None:
        mu = jax.tree.map(lambda m, t: jnp.asarray(m, t.dtype), mu, template.mu)
    return put_back(
        template._replace(
            count=jnp.asarray(seed_state["count"], jnp.int32),
            mu=mu if template.mu is not None else None,
            preconditioners=tuple(factors),
            update_counter=jnp.asarray(seed_state["update_counter"], jnp.int32),
        )
    )


def kron_state_to_distributed_kron(
    state: Any, params: Any, **kwargs: Any
) -> dict | tuple:
    """Converts the state of ``kron(**kwargs)`` (or of ``scale_by_kron``) into
    distributed-kron 1.0.0's layout: ``dict(count, mu, Qs_preconditioners,
    update_counter)``, its factors a tree like the params of per-axis lists of
    arrays shaped (layers?, blocks?, *factor). The inverse of
    :func:`kron_state_from_distributed_kron`; where distributed-kron pads an axis
    up to a multiple of ``block_size``, the padding gets its initial factor
    (identity times ``preconditioner_init_scale``^{1/k}). Only the 'EQ' style."""
    kron_state, put_back = _split_chain_state(state)
    core = _core_arguments(kwargs)
    transform = scale_by_kron(**core)
    if core.get("preconditioner_update_style", "EQ") != "EQ":
        raise ValueError(
            "Invalid preconditioner_update_style="
            f"{core['preconditioner_update_style']!r}: must be 'EQ' for a "
            "distributed-kron state"
        )
    parameters = inspect.signature(scale_by_kron).parameters
    options = {k: core.get(k, parameters[k].default) for k in parameters}
    treedef, plans, stacks, _ = transform.init.layout.plan_tree(params)
    param_leaves = treedef.flatten_up_to(params)
    leads = [p.lead(x.shape) for p, x in zip(plans, param_leaves, strict=True)]
    blocked = options["partition_grads_into_blocks"]
    per_parameter_factors: list[list] = [[] for _ in plans]
    for stack, stored_stack in zip(stacks, kron_state.preconditioners, strict=True):
        start = 0
        for i in stack.members:
            plan = plans[i]
            units = math.prod(leads[i]) * math.prod(plan.blocks_per_axis)
            sizes = _seed_factor_sizes(plan, blocked, options["block_size"])
            scale = float(options["preconditioner_init_scale"]) ** (1 / len(sizes))
            unit_axes = leads[i] + (
                (math.prod(plan.blocks_per_axis),) if blocked else ()
            )
            for axis, array in enumerate(stored_stack):
                F = array[start : start + units]
                size, target = stack.block_shape[axis], sizes[axis]
                if stack.diagonal[axis]:
                    Q = F.astype(jnp.float32 if not km.is_complex(F) else F.dtype)
                    Q = jnp.pad(Q, [(0, 0), (0, target - size)], constant_values=scale)
                else:
                    Q = jax.vmap(transform.init.layout.factor_of)(F)
                    padding = scale * jnp.eye(target, dtype=Q.dtype)
                    Q = (
                        jnp.broadcast_to(padding, (units, target, target))
                        .at[:, :size, :size]
                        .set(Q)
                    )
                dtype = jnp.dtype(options["precond_dtype"] or jnp.float32)
                per_parameter_factors[i].append(
                    Q.astype(dtype).reshape(*unit_axes, *Q.shape[1:])
                )
            start += units
    mu = kron_state.mu
    # distributed-kron's chain has add_decayed_weights between its core and its
    # learning rate when weight_decay > 0 (precond's keeps the state of none).
    weight_decay = kwargs.get("weight_decay", 0.0)
    decay = ()
    if weight_decay > 0.0:
        decay_transform = optax.add_decayed_weights(
            weight_decay, kwargs.get("weight_decay_mask")
        )
        decay = (decay_transform.init(params),)
    return put_back(
        {
            "count": kron_state.count,
            "mu": mu,
            "Qs_preconditioners": treedef.unflatten(per_parameter_factors),
            "update_counter": kron_state.update_counter,
        },
        decay,
    )
