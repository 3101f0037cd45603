"""PSGD Kron as an optax transformation: ``kron``, ``scale_by_kron`` and its schedule.

Drop-in for ``distributed_kron.kron`` on one device: same argument names and
defaults. The preconditioner of each parameter is P = ⊗_i Q_iᵀQ_i with one
triangular or diagonal factor Q_i per axis, fitted online so that P·m̂ is whitened
(Li 2018, arXiv:1809.10232; Li 2024, arXiv:2402.11858).

``scale_by_kron`` checks its arguments once into a frozen
:class:`~precond.jax.kron._config.KronConfig` and returns module-level functions
over it: ``_kron_config`` (the config and the plan of a tree), ``_kron_state``
(the state and ``init``) and ``_kron_step`` (``update``), on the shared plan of
:mod:`precond._common.kron_plan` and the kernels of ``_kron_math``.

Arguments (of ``scale_by_kron``; ``kron`` adds ``learning_rate``,
``weight_decay`` and ``weight_decay_mask``, documented on it):

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
        (Without it, on a CPU, the fit of a stack of units smaller than their
        largest factor, such as distributed-kron's blocks of one vector, is
        batched anyway, so that its temporaries stay near 64 MiB.)
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
        :func:`precond.jax._core.factor_kernels.update_factors`, triangular Q with
        triangular solves. ``'QUAD'``, ``'PRO'`` and ``'QEQ'``: generation-2 steps
        (:func:`precond.jax._core.factor_kernels.update_factors_gen2`) that fit P·G̃
        to unit covariance with matmuls only, the step normalised by a
        smoothed Lipschitz estimate kept in ``KronState.lipschitz``, and the
        elementwise damping G̃ = G + (1e-9 + ε·|G|)⊙V; 'QUAD' keeps Q
        symmetric, 'PRO' keeps a full Q and rotates it toward symmetric with
        a Procrustes step, 'QEQ' keeps a full Q and steps it on its right
        (one d³ product per fit where 'PRO' takes three; 'PRO''s and
        'QEQ''s 'packed' cache is stored 'dense'). Balancing and the update
        schedule are the same for every style.
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
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from precond._common.kron_constants import MAX_UPDATE_RMS as MAX_UPDATE_RMS
from precond._common.kron_plan import StackPlan, TensorPlan, seed_factor_sizes
from precond.jax._core import factor_kernels as km
from precond.jax._core.alias import with_decay_and_learning_rate
from precond.jax._core.guards import accepting_scalars
from precond.jax._core.mesh_placement import partition_specs_only
from precond.jax._core.step_policy import SkipWarning
from precond.jax.kron._arguments import (
    KRON_ALIAS_ARGS,
    KRON_STATIC_ARGS,
    precond_update_prob_schedule,
)
from precond.jax.kron._config import KronConfig, kron_config, plan_tree
from precond.jax.kron._randomness import fit_randomness as fit_randomness
from precond.jax.kron._randomness import unit_noise as unit_noise
from precond.jax.kron._state import (
    KronState,
    factor_of,
    init,
    partition_specs,
    stored,
)
from precond.jax.kron._step import update

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
       :func:`precond.jax._core.factor_kernels.update_factors` step on
       (m̂ + 2^-11.5·mean|m̂|·V, V) (or a generation-2 step: see
       ``preconditioner_update_style``).
    3. U = (⊗_i Q_iᵀQ_i)·m̂ with the updated factors, then U ← U / max(1, RMS(U)/1.1).

    Each axis gets an upper-triangular or a diagonal factor (scalars are shape
    (1,)): :func:`precond._common.factor_plan.plan_diagonal_axes` has the rule.

    Newton mode: ``update(grads, state, params, Hvp=h, vector=v,
    update_preconditioner=flag)`` (all three, e.g. from
    :func:`precond.jax.hessian_helper`) fits the factors to the pairs (h, v) =
    (H·v, v) instead, without damping noise, so that P → H⁻¹ in the
    Kronecker-factored sense; ``flag`` replaces the update probability.

    Complex parameters: P = ⊗_i Q_iᴴQ_i (Hermitian); see :func:`kron`. Bad steps:
    a gradient (or Hvp) with a non-finite squared norm (NaN, ±Inf, or entries
    from about 1.8e19) skips the step: a zero update, the state unchanged but
    for its count of skipped steps (:func:`precond.jax.skipped_steps`).
    Arguments: this module's docstring (``precond.jax.kron``).

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state is a
        :class:`KronState`. Example:

        >>> import jax.numpy as jnp, optax
        >>> opt = optax.chain(scale_by_kron(), optax.scale_by_learning_rate(3e-4))
        >>> params = {"w": jnp.zeros((4, 3))}
        >>> updates, state = opt.update({"w": jnp.ones((4, 3))}, opt.init(params))
    """
    config = kron_config(locals())  # locals() are the arguments
    # optax's OptState admits no None leaf (mu) nor a narrower state type.
    core = optax.GradientTransformationExtraArgs(
        partial(init, config),  # pyright: ignore[reportArgumentType]
        partial(update, config, SkipWarning("kron")),  # pyright: ignore[reportArgumentType]
    )
    return accepting_scalars(core)


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
    (:mod:`precond.jax._core.factor_kernels`); complex parameters get complex factors
    (the complex counterpart of ``precond_dtype``: complex64 for float32 or
    bfloat16, complex128 for float64) and complex momentum, in stacks of their
    own, so real parameters are computed exactly as without them. As for every optax
    optimizer on complex parameters, pass the conjugate of ``jax.grad`` (which
    returns conj(2∂L/∂z̄) for a real loss, the conjugate of the descent direction):
    ``grads = jax.tree.map(jnp.conj, jax.grad(loss)(params))``
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
    # Every argument, by name: scale_by_kron ignores kron's own (KRON_ALIAS_ARGS).
    core = scale_by_kron(**locals())
    return with_decay_and_learning_rate(
        core, learning_rate, weight_decay, weight_decay_mask
    )


def _seed_factors_of_parameter(
    config: KronConfig,
    plan: TensorPlan,
    lead: tuple[int, ...],
    stack: StackPlan,
    stored_stack: tuple,
    start: int,
    units: int,
) -> list[jax.Array]:
    """distributed-kron's factors (one per axis, shaped (layers?, blocks?,
    *factor)) of the parameter whose ``units`` units begin at ``start`` of
    ``stack``."""
    blocked = config.partition_grads_into_blocks
    sizes = seed_factor_sizes(plan, blocked, config.block_size)
    scale = float(config.preconditioner_init_scale) ** (1 / len(sizes))
    unit_axes = lead + ((math.prod(plan.blocks_per_axis),) if blocked else ())
    factors = []
    for axis, array in enumerate(stored_stack):
        Q = _padded_seed_factor(
            config,
            array[start : start + units],
            stack.diagonal[axis],
            stack.block_shape[axis],
            sizes[axis],
            scale,
        )
        factors.append(Q.astype(config.precond_dtype).reshape(*unit_axes, *Q.shape[1:]))
    return factors


def _padded_seed_factor(
    config: KronConfig,
    F: jax.Array,
    diagonal: bool,
    size: int,
    target: int,
    scale: float,
) -> jax.Array:
    """Factors Q (units, size[, size]) from their stored arrays ``F``, padded to
    distributed-kron's ``target`` size with the initial factor ``scale``·I."""
    if diagonal:
        Q = F.astype(jnp.float32 if not km.is_complex(F) else F.dtype)
        return jnp.pad(Q, [(0, 0), (0, target - size)], constant_values=scale)
    Q = jax.vmap(partial(factor_of, config))(F)
    padding = scale * jnp.eye(target, dtype=Q.dtype)
    return (
        jnp.broadcast_to(padding, (len(F), target, target)).at[:, :size, :size].set(Q)
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
        kwargs = _core_arguments(kwargs)
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
        return partition_specs(
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


def _core_config(kwargs: dict) -> KronConfig:
    """The config of ``scale_by_kron`` given ``kron``'s arguments ``kwargs``
    (its own ignored), validated as ``scale_by_kron`` validates them."""
    bound = inspect.signature(scale_by_kron).bind(**_core_arguments(kwargs))
    bound.apply_defaults()
    return kron_config(bound.arguments)


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

    Example (``old_state`` would come from a distributed-kron checkpoint; here it
    is :func:`kron_state_to_distributed_kron` of a precond state):
        >>> import jax.numpy as jnp
        >>> params = {"w": jnp.ones((4, 3))}
        >>> kwargs = dict(merge_rule="distributed_kron")
        >>> ours = kron(**kwargs).init(params)
        >>> old_state = kron_state_to_distributed_kron(ours, params, **kwargs)
        >>> state = kron_state_from_distributed_kron(old_state, params, **kwargs)
    """
    seed_state, put_back = _split_chain_state(state)
    config = _core_config(kwargs)
    template = init(config, params)
    if not isinstance(template.preconditioners, tuple):  # no parameters
        return put_back(template)
    treedef, _, stacks, _ = plan_tree(config, params)
    seed_factors = treedef.flatten_up_to(seed_state["Qs_preconditioners"])
    factors = tuple(
        _stack_from_seed_factors(config, stack, stored_stack, seed_factors)
        for stack, stored_stack in zip(stacks, template.preconditioners, strict=True)
    )
    mu = seed_state["mu"]
    if template.mu is not None:
        mu = jax.tree.map(lambda m, t: jnp.asarray(m, t.dtype), mu, template.mu)
    return put_back(
        template._replace(
            count=jnp.asarray(seed_state["count"], jnp.int32),
            mu=mu if template.mu is not None else None,
            preconditioners=factors,
            update_counter=jnp.asarray(seed_state["update_counter"], jnp.int32),
        )
    )


def _stack_from_seed_factors(
    config: KronConfig, stack: StackPlan, stored_stack: tuple, seed_factors: list
) -> tuple[jax.Array, ...]:
    """One stack's stored factors with distributed-kron's factors of its members
    (per parameter, per axis) cut to the stack's block and copied in."""
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
            Q = jax.vmap(partial(stored, config))(Q)
        axes.append(array.at[: len(Q)].set(Q.astype(array.dtype)))
    return tuple(axes)


def kron_state_to_distributed_kron(
    state: Any, params: Any, **kwargs: Any
) -> dict | tuple:
    """Converts the state of ``kron(**kwargs)`` (or of ``scale_by_kron``) into
    distributed-kron 1.0.0's layout: ``dict(count, mu, Qs_preconditioners,
    update_counter)``, its factors a tree like the params of per-axis lists of
    arrays shaped (layers?, blocks?, *factor). The inverse of
    :func:`kron_state_from_distributed_kron`; where distributed-kron pads an axis
    up to a multiple of ``block_size``, the padding gets its initial factor
    (identity times ``preconditioner_init_scale``^{1/k}). Only the 'EQ' style.

    Example (a 4×3 matrix, one 256-wide block per axis as distributed-kron pads it):

        >>> import jax, jax.numpy as jnp
        >>> params = {"w": jnp.zeros((4, 3))}
        >>> theirs = kron_state_to_distributed_kron(kron().init(params), params)
        >>> jax.tree.map(jnp.shape, theirs[0]["Qs_preconditioners"])
        {'w': [(1, 256, 256), (1, 256, 256)]}
    """
    kron_state, put_back = _split_chain_state(state)
    config = _core_config(kwargs)
    if config.preconditioner_update_style != "EQ":
        raise ValueError(
            "Invalid preconditioner_update_style="
            f"{config.preconditioner_update_style!r}: must be 'EQ' for a "
            "distributed-kron state"
        )
    treedef, plans, stacks, _ = plan_tree(config, params)
    param_leaves = treedef.flatten_up_to(params)
    leads = [p.lead(x.shape) for p, x in zip(plans, param_leaves, strict=True)]
    per_parameter_factors: list[list] = [[] for _ in plans]
    for stack, stored_stack in zip(stacks, kron_state.preconditioners, strict=True):
        start = 0
        for i in stack.members:
            units = math.prod(leads[i]) * math.prod(plans[i].blocks_per_axis)
            per_parameter_factors[i] = _seed_factors_of_parameter(
                config, plans[i], leads[i], stack, stored_stack, start, units
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
