"""PSGD Kron as an optax transformation: ``kron``, ``scale_by_kron`` and its schedule.

Drop-in for ``distributed_kron.kron`` on one device: same argument names and
defaults. The preconditioner of each parameter is P = ⊗_i Q_iᵀQ_i with one
triangular or diagonal factor Q_i per axis, fitted online so that P·m̂ is whitened
(Li 2018, arXiv:1809.10232; Li 2024, arXiv:2402.11858).

``scale_by_kron`` checks its arguments once into a frozen
:class:`~precond.jax.kron._config.KronConfig` and returns module-level functions
over it: ``kron._config`` (the config and the plan of a tree), ``kron._state``
(the state and ``init``) and ``kron._step`` (``update``), on the shared plan of
:mod:`precond._common.kron_plan` and the kernels of ``factor_kernels``.

Arguments are documented on :func:`scale_by_kron` and :func:`kron`, where
``help()`` and the docs site show them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec

from precond._common.kron_constants import MAX_UPDATE_RMS as MAX_UPDATE_RMS
from precond.jax._core.alias import with_decay_and_learning_rate
from precond.jax._core.guards import accepting_scalars
from precond.jax._core.mesh_placement import partition_specs_only
from precond.jax._core.step_policy import SkipWarning
from precond.jax.kron._arguments import (
    KRON_ALIAS_ARGS,
    KRON_STATIC_ARGS,
    precond_update_prob_schedule,
)
from precond.jax.kron._config import kron_config
from precond.jax.kron._randomness import fit_randomness as fit_randomness
from precond.jax.kron._randomness import unit_noise as unit_noise
from precond.jax.kron._state import KronState, init, partition_specs
from precond.jax.kron._step import update

__all__ = [
    "KRON_STATIC_ARGS",
    "KronState",
    "get_opt_state_partition_specs",
    "kron",
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

    Args:
        b1: momentum decay β₁ in [0, 1); 0 keeps no momentum.
        preconditioner_update_probability: probability in [0, 1] of updating the
            preconditioner, or a schedule n ↦ p (default
            :func:`precond_update_prob_schedule`).
        max_size_triangular: axes longer than this get diagonal factors.
        min_ndim_triangular: tensors with fewer dims get only diagonal factors.
        memory_save_mode: None, 'one_diag' (largest axis diagonal) or 'all_diag'.
        preconditioner_lr: step size η of the factor updates.
        preconditioner_init_scale: initial P = s·I (each of k factors s^{1/k}·I).
        mu_dtype: momentum dtype (default: the gradient's; its complex counterpart for
            complex parameters).
        precond_dtype: storage dtype of the factors (default float32). The factors are
            updated and applied in at least float32, so bfloat16 halves their memory;
            prefer a generation-2 style with it. Complex parameters' factors use its
            complex counterpart (complex64 for float32 and bfloat16, which has no
            complex type; complex128 for float64).
        precond_update_precision: matmul precision of factor updates.
        precond_grads_precision: matmul precision of applying the preconditioner.
        scanned_layers: pytree of bools with the structure of the params (or a callable
            params ↦ such a pytree) marking parameters whose leading axis stacks layers:
            each layer gets its own factors, fitted under ``vmap``.
        lax_map_scanned_layers: map over the layers with ``jax.lax.map`` in batches of
            ``lax_map_batch_size`` instead of one ``vmap``: less memory, slower.
            (Without it, on a CPU, the fit of a stack of units smaller than their
            largest factor, such as distributed-kron's blocks of one vector, is batched
            anyway, so that its temporaries stay near 64 MiB.)
        lax_map_batch_size: layers per batch with ``lax_map_scanned_layers``.
        merge_small_dims: precondition each tensor in a merged shape that groups
            adjacent axes into balanced dims of at most ``target_merged_dim_size`` (see
            :func:`precond._common.factor_plan.merge_dims`): a (64, 32, 3, 3) kernel
            gets factors of 64 and 288.
        target_merged_dim_size: largest dim that merging may create.
        partition_grads_into_blocks: cut axes longer than ``block_size`` into blocks
            (the last one zero-padded), each with its own factors. Padding is inert: it
            gets no noise and never changes the real part.
        block_size: block length along each partitioned axis.
        params_partition_specs: a PartitionSpec per parameter (a pytree like the params;
            None entries mean replicated; for flax boxed params, one per box as
            ``nn.get_partition_spec`` gives). Momentum and updates are kept sharded like
            their parameter. Without it, specs are read from boxed params
            (``nn.Partitioned``) or from the params' types on an explicit mesh; when
            none is known, sharding is left to XLA.
        preconditioner_partition_spec: PartitionSpec whose mesh axes split the factor
            state, e.g. ``P('fsdp', None)`` or ``P('fsdp', 'tp')``. Kron keeps the
            factors of equal-shaped blocks in stacks and splits each stack along its
            leading (unit) axis over all the axes named here (padding it with empty
            units to a multiple of their size), so each device holds and fits whole
            factors of 1/N of the blocks and the kernels never communicate. Default:
            every mesh axis that shards a parameter. Use ``partition_grads_into_blocks``
            so that large layers give many units to spread.
        momentum_into_precond_update: fit the preconditioner to m̂ (True) or to the raw
            gradient (False).
        mesh: the mesh that the partition specs refer to. Default: the context mesh
            (``with jax.set_mesh(mesh):``) or, on an explicit mesh, the one in the
            params' types.
        preconditioner_cache: how each triangular factor keeps P_i = Q_iᵀQ_i for the
            steps between factor updates. ``'packed'`` (default) stores it in Q_i's
            unused lower triangle plus one row (d more numbers per d×d factor);
            ``'dense'`` stores it as its own d×d matrix (twice the factor memory, no
            unpacking: the fastest steps); None stores Q_i alone, as distributed-kron
            does, and applies Q_iᵀ(Q_i·) (twice the matmuls).
        preconditioner_update_style: the factor-update rule. ``'EQ'`` (default, as
            distributed-kron): the generation-1 step of
            :func:`precond.jax._core.factor_kernels.update_factors`, triangular Q with
            triangular solves. ``'QUAD'``, ``'PRO'`` and ``'QEQ'``: generation-2 steps
            (:func:`precond.jax._core.factor_kernels.update_factors_gen2`) that fit P·G̃
            to unit covariance with matmuls only, the step normalised by a smoothed
            Lipschitz estimate kept in ``KronState.lipschitz``, and the elementwise
            damping G̃ = G + (1e-9 + ε·|G|)⊙V; 'QUAD' keeps Q symmetric, 'PRO' keeps a
            full Q and rotates it toward symmetric with a Procrustes step, 'QEQ' keeps a
            full Q and steps it on its right (one d³ product per fit where 'PRO' takes
            three; 'PRO''s and 'QEQ''s 'packed' cache is stored 'dense'). Balancing and
            the update schedule are the same for every style.
        seed: seed of the noise and balancing decisions, which are drawn from
            ``fold_in(PRNGKey(seed), n)``: a restored run repeats them exactly, and on
            any mesh (see :func:`unit_noise`).
        merge_rule: how ``merge_small_dims`` groups axes. ``'balanced'`` (default):
            :func:`precond._common.factor_plan.merge_dims`, which never merges a tensor
            into fewer than two dims and makes a merged dim longer than
            ``max_size_triangular`` diagonal, so small layers keep small factors.
            ``'distributed_kron'``: distributed-kron's rule
            (:func:`precond._common.factor_plan.merge_dims_by_loss`), which merges a
            small matrix into one long triangular axis (a (128, 10) kernel gets a
            1280-long one, cut into blocks when blocking).
        independent_scanned_layers: each layer of a scanned parameter gets its own RMS
            clip and damping scale, exactly as if it were a separate parameter. Default
            False, as distributed-kron: one clip and one damping scale mean|m̂| per
            parameter (over all its layers and blocks).
        noise_draws: where the random draws of a factor update come from.
            ``'per_block'`` (default): each unit's noise from its own key (see
            ``seed``), the same on any mesh. ``'distributed_kron'``: as distributed-kron
            draws them from ``PRNGKey(seed)`` (its seed is 42, as precond's default):
            one normal array per parameter in its layout and its balancing decision, so
            the same seed gives its trajectory.
        block_padding: ``'inert'`` (default): blocking pads only the edge blocks of cut
            axes, and the padding never changes the real part (see
            ``partition_grads_into_blocks``). ``'distributed_kron'``: as
            distributed-kron, every axis is padded up to a multiple of ``block_size`` (a
            10-long axis gets a 256×256 factor) and the padding is fitted with noise,
            counts in the balancing norms and dilutes the damping scale, which changes
            the real part.
        **kwargs: ``kron``'s own arguments (``learning_rate``, ``weight_decay``,
            ``weight_decay_mask``) are accepted and ignored, so one dict of arguments
            serves both (as in distributed-kron); any other name is a TypeError.

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
    :func:`scale_by_kron`. Kron usually wants a learning rate about 3× smaller than
    Adam's.

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
        b1: momentum decay β₁ in [0, 1); 0 keeps no momentum.
        weight_decay: decoupled weight decay λ >= 0.
        weight_decay_mask: pytree of bools (or callable params ↦ pytree) selecting the
            parameters that decay.
        preconditioner_update_probability: probability in [0, 1] of updating the
            preconditioner, or a schedule n ↦ p (default
            :func:`precond_update_prob_schedule`).
        max_size_triangular: axes longer than this get diagonal factors.
        min_ndim_triangular: tensors with fewer dims get only diagonal factors.
        memory_save_mode: None, 'one_diag' (largest axis diagonal) or 'all_diag'.
        preconditioner_lr: step size η of the factor updates.
        preconditioner_init_scale: initial P = s·I (each of k factors s^{1/k}·I).
        mu_dtype: momentum dtype (default: the gradient's; its complex counterpart for
            complex parameters).
        precond_dtype: storage dtype of the factors (default float32). The factors are
            updated and applied in at least float32, so bfloat16 halves their memory;
            prefer a generation-2 style with it. Complex parameters' factors use its
            complex counterpart (complex64 for float32 and bfloat16, which has no
            complex type; complex128 for float64).
        precond_update_precision: matmul precision of factor updates.
        precond_grads_precision: matmul precision of applying the preconditioner.
        scanned_layers: pytree of bools with the structure of the params (or a callable
            params ↦ such a pytree) marking parameters whose leading axis stacks layers:
            each layer gets its own factors, fitted under ``vmap``.
        lax_map_scanned_layers: map over the layers with ``jax.lax.map`` in batches of
            ``lax_map_batch_size`` instead of one ``vmap``: less memory, slower.
            (Without it, on a CPU, the fit of a stack of units smaller than their
            largest factor, such as distributed-kron's blocks of one vector, is batched
            anyway, so that its temporaries stay near 64 MiB.)
        lax_map_batch_size: layers per batch with ``lax_map_scanned_layers``.
        merge_small_dims: precondition each tensor in a merged shape that groups
            adjacent axes into balanced dims of at most ``target_merged_dim_size`` (see
            :func:`precond._common.factor_plan.merge_dims`): a (64, 32, 3, 3) kernel
            gets factors of 64 and 288.
        target_merged_dim_size: largest dim that merging may create.
        partition_grads_into_blocks: cut axes longer than ``block_size`` into blocks
            (the last one zero-padded), each with its own factors. Padding is inert: it
            gets no noise and never changes the real part.
        block_size: block length along each partitioned axis.
        params_partition_specs: a PartitionSpec per parameter (a pytree like the params;
            None entries mean replicated; for flax boxed params, one per box as
            ``nn.get_partition_spec`` gives). Momentum and updates are kept sharded like
            their parameter. Without it, specs are read from boxed params
            (``nn.Partitioned``) or from the params' types on an explicit mesh; when
            none is known, sharding is left to XLA.
        preconditioner_partition_spec: PartitionSpec whose mesh axes split the factor
            state, e.g. ``P('fsdp', None)`` or ``P('fsdp', 'tp')``. Kron keeps the
            factors of equal-shaped blocks in stacks and splits each stack along its
            leading (unit) axis over all the axes named here (padding it with empty
            units to a multiple of their size), so each device holds and fits whole
            factors of 1/N of the blocks and the kernels never communicate. Default:
            every mesh axis that shards a parameter. Use ``partition_grads_into_blocks``
            so that large layers give many units to spread.
        momentum_into_precond_update: fit the preconditioner to m̂ (True) or to the raw
            gradient (False).
        mesh: the mesh that the partition specs refer to. Default: the context mesh
            (``with jax.set_mesh(mesh):``) or, on an explicit mesh, the one in the
            params' types.
        preconditioner_cache: how each triangular factor keeps P_i = Q_iᵀQ_i for the
            steps between factor updates. ``'packed'`` (default) stores it in Q_i's
            unused lower triangle plus one row (d more numbers per d×d factor);
            ``'dense'`` stores it as its own d×d matrix (twice the factor memory, no
            unpacking: the fastest steps); None stores Q_i alone, as distributed-kron
            does, and applies Q_iᵀ(Q_i·) (twice the matmuls).
        preconditioner_update_style: the factor-update rule. ``'EQ'`` (default, as
            distributed-kron): the generation-1 step of
            :func:`precond.jax._core.factor_kernels.update_factors`, triangular Q with
            triangular solves. ``'QUAD'``, ``'PRO'`` and ``'QEQ'``: generation-2 steps
            (:func:`precond.jax._core.factor_kernels.update_factors_gen2`) that fit P·G̃
            to unit covariance with matmuls only, the step normalised by a smoothed
            Lipschitz estimate kept in ``KronState.lipschitz``, and the elementwise
            damping G̃ = G + (1e-9 + ε·|G|)⊙V; 'QUAD' keeps Q symmetric, 'PRO' keeps a
            full Q and rotates it toward symmetric with a Procrustes step, 'QEQ' keeps a
            full Q and steps it on its right (one d³ product per fit where 'PRO' takes
            three; 'PRO''s and 'QEQ''s 'packed' cache is stored 'dense'). Balancing and
            the update schedule are the same for every style.
        seed: seed of the noise and balancing decisions, which are drawn from
            ``fold_in(PRNGKey(seed), n)``: a restored run repeats them exactly, and on
            any mesh (see :func:`unit_noise`).
        merge_rule: how ``merge_small_dims`` groups axes. ``'balanced'`` (default):
            :func:`precond._common.factor_plan.merge_dims`, which never merges a tensor
            into fewer than two dims and makes a merged dim longer than
            ``max_size_triangular`` diagonal, so small layers keep small factors.
            ``'distributed_kron'``: distributed-kron's rule
            (:func:`precond._common.factor_plan.merge_dims_by_loss`), which merges a
            small matrix into one long triangular axis (a (128, 10) kernel gets a
            1280-long one, cut into blocks when blocking).
        independent_scanned_layers: each layer of a scanned parameter gets its own RMS
            clip and damping scale, exactly as if it were a separate parameter. Default
            False, as distributed-kron: one clip and one damping scale mean|m̂| per
            parameter (over all its layers and blocks).
        noise_draws: where the random draws of a factor update come from.
            ``'per_block'`` (default): each unit's noise from its own key (see
            ``seed``), the same on any mesh. ``'distributed_kron'``: as distributed-kron
            draws them from ``PRNGKey(seed)`` (its seed is 42, as precond's default):
            one normal array per parameter in its layout and its balancing decision, so
            the same seed gives its trajectory.
        block_padding: ``'inert'`` (default): blocking pads only the edge blocks of cut
            axes, and the padding never changes the real part (see
            ``partition_grads_into_blocks``). ``'distributed_kron'``: as
            distributed-kron, every axis is padded up to a multiple of ``block_size`` (a
            10-long axis gets a 256×256 factor) and the padding is fitted with noise,
            counts in the balancing norms and dilutes the damping scale, which changes
            the real part.

    Returns:
        An ``optax.GradientTransformationExtraArgs``: the chain of
        :func:`scale_by_kron`, the decay and the learning rate; its state is
        ``(KronState, learning-rate state)``.

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
        scale_by_kron_only: the state of ``scale_by_kron(**kwargs)`` instead (``kron``'s
            own arguments, such as ``learning_rate``, are ignored).
        **kwargs: the arguments given to ``kron`` (or ``scale_by_kron``).

    Returns:
        A tree like the state of ``kron(**kwargs)`` (or of ``scale_by_kron``) with a
        ``PartitionSpec`` for each leaf.

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


def _core_arguments(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k not in KRON_ALIAS_ARGS}
