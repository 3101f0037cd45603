"""Distributed Shampoo with grafting, for optax (Google's ``distributed_shampoo``).

For a parameter W with gradient G, cut (after merging small dims) into blocks
G_b, Shampoo keeps one statistic per block and axis,
S_{b,k} ← β2·S_{b,k} + (1−β2)·G_b ⋅_{¬k} G_b (contraction over every other axis),
and preconditions with their inverse p-th roots, p = 2·rank:
P(G)_b = G_b ×_0 S_{b,0}^{-1/p} ×_1 S_{b,1}^{-1/p} … . The direction is grafted
to the norm of a first-order method's step u_g (SGD, AdaGrad, RMSProp, …):
u = P(G)·‖u_g‖/‖P(G)‖, then momentum (optionally Nesterov) and −lr.

``scale_by_shampoo`` is the transform (the direction, without the learning
rate) and ``distributed_shampoo`` the alias with Google's signature, as optax's
``scale_by_adam`` and ``adam``. Every statistic of every parameter lives in one
stack per (size, exponent), so the inverse roots of all of them run as one
vmapped program, which a partition spec or a ``batch_axis_name`` spreads over
devices. Modules: ``shampoo._config`` (argument checks), ``shampoo._layout``
(blocks and stacks), ``shampoo._state`` (state, storage, init),
``shampoo._update`` (the step), ``shampoo._seed`` (the seed's layout),
``shampoo._math`` (matrix kernels).

At step t (0-based), for each parameter W, gradient G, block b and axis k:

    S_{b,k} ← β2·S_{b,k} + (1−β2)·G_b ⋅_{¬k} G_b        if t % stat_steps = 0
    P_{b,k} ← (S_{b,k} + ε·λ_max·I)^{-1/p}               if t % precond_steps = 0
    u_s = P(G)·‖u_g‖/‖P(G)‖,  P(G)_b = G_b ×_0 P_{b,0} ×_1 P_{b,1} …
    m_s ← β1·m_s + w·(u_s + λW),  m_g ← β1·m_g + w·(u_g + λW)
    m, u = (m_s, u_s) if t >= start_preconditioning_step else (m_g, u_g)
    v = w·u + β1·m if nesterov else m,   ΔW = −lr(t)·v

with u_g the grafting method's step, p = 2·rank (``exponent_override``) and
w = 1−β1 with ``moving_average_for_momentum`` else 1 (with
``shard_optimizer_states``, P(G) uses the P of step t − 1, as Google's sharded
mode; see ``precondition_with_previous_roots``). S starts at ε·I and P
at I. A root whose error max|P^p·(S+ε'I) − I| is NaN or >=
``inverse_failure_threshold`` is not used: the previous P stays, and the error
shows in ``state.training_metrics.inverse_pth_root_errors``; a statistic
that would overflow keeps its previous value too, and roots of statistics up
to the dtype's largest value are computed on a power-of-two rescaling.

Bad steps are skipped: when some gradient leaf has a squared norm ‖G‖² that
is not finite in float32 (float64 for float64 leaves) -- NaN or ±Inf entries,
or finite ones from about 1.8e19, whose squares would overflow the
statistics -- the step returns zero updates and leaves the whole state
unchanged (count included), as the PSGD optimizers do, but for its count of
skipped steps, ``state.skipped`` (:func:`precond.jax.skipped_steps`; the first
skipped step is logged at WARNING when asked for).

Parameters must be real floating-point arrays (complex and integer ones are
refused at ``init``); scalars, empty tensors and tensors with a dim above
``skip_preconditioning_dim_size_gt`` take the grafting step alone. ``update``
refuses, when it is traced, a state whose structure or shapes (and dtypes,
when ``params`` are given) differ from what ``init`` gives for these
parameters, e.g. another model's checkpoint, naming the first such leaf.

Arguments are documented on :func:`distributed_shampoo` and
:func:`scale_by_shampoo`, where ``help()`` and the docs site show them.

References:
    V. Gupta, T. Koren, Y. Singer, *Shampoo: Preconditioned Stochastic Tensor
    Optimization*, ICML 2018.
    R. Anil, V. Gupta, T. Koren, K. Regan, Y. Singer, *Scalable Second Order
    Optimization for Deep Learning*, arXiv:2002.09018.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from jax import lax
from jax.sharding import PartitionSpec

from precond.jax._core.guards import accepting_scalars
from precond.jax._core.mesh_placement import with_auto_axes
from precond.jax._core.step_policy import SkipWarning
from precond.jax.shampoo._config import (
    SCALE_BY_SHAMPOO_STATIC_ARGS,
    SHAMPOO_STATIC_ARGS,
    Config,
    GraftingType,
    PreconditionerType,
    validated,
)
from precond.jax.shampoo._placement import check_stack_specs, placed_state
from precond.jax.shampoo._seed import (
    ParameterStats,
    SeedShampooState,
)
from precond.jax.shampoo._state import (
    InitFnState,
    ShampooState,
    TrainingMetrics,
    init_state,
    sharded_in_types,
)
from precond.jax.shampoo._update import shampoo_update
from precond.jax.shampoo.state_views import _seed_init_fns

__all__ = [
    "SCALE_BY_SHAMPOO_STATIC_ARGS",
    "SHAMPOO_STATIC_ARGS",
    "GraftingType",
    "InitFnState",
    "ParameterStats",
    "PreconditionerType",
    "SeedShampooState",
    "ShampooState",
    "TrainingMetrics",
    "distributed_shampoo",
    "scale_by_shampoo",
]


def scale_by_shampoo(
    block_size: int,
    beta1: float = 0.9,
    beta2: float = 0.999,
    diagonal_epsilon: float = 1e-10,
    matrix_epsilon: float = 1e-6,
    weight_decay: float = 0.0,
    start_preconditioning_step: int = 5,
    preconditioning_compute_steps: int = 1,
    statistics_compute_steps: int = 1,
    best_effort_shape_interpretation: bool = True,
    graft_type: GraftingType = GraftingType.SGD,
    nesterov: bool = True,
    exponent_override: int = 0,
    batch_axis_name: Any = None,
    statistics_partition_spec: PartitionSpec | None = None,
    preconditioner_partition_spec: PartitionSpec | None = None,
    num_devices_for_pjit: int | None = None,
    shard_optimizer_states: bool = False,
    best_effort_memory_usage_reduction: bool = False,
    inverse_failure_threshold: float = 0.1,
    moving_average_for_momentum: bool = False,
    skip_preconditioning_dim_size_gt: int = 4096,
    clip_by_scaled_gradient_norm: float | None = None,
    precision: lax.Precision = lax.Precision.HIGHEST,
    *,
    tensordot_precision: lax.Precision | None = None,
    relative_matrix_epsilon: bool = True,
    merge_small_dims_block_size: int | None = None,
    lobpcg_topk_precondition: int = 0,
    lobpcg_max_iter: int = 0,
    precondtioner_type: PreconditionerType = PreconditionerType.ALL,
    skip_preconditioning_rank_lt: int = 1,
    generate_training_metrics: bool = True,
    reuse_preconditioner: bool = False,
    eigh: bool = False,
    separate_grafting_momentum: bool = False,
    quantize_statistics: bool | None = None,
    precondition_with_previous_roots: bool | None = None,
    params_partition_specs: Any = None,
    mesh: jax.sharding.Mesh | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Distributed Shampoo's direction v (the module docstring's update, without
    −lr), for ``optax.chain`` with a learning rate, schedule, clip or mask.

    Its arguments are ``distributed_shampoo``'s without the four that involve the
    learning rate: weight decay here is the coupled λ·W added before momentum
    (chain ``optax.add_decayed_weights`` for a decoupled one), ``init`` returns
    the state itself, and
    ``SCALE_BY_SHAMPOO_STATIC_ARGS`` are static under ``optax.inject_hyperparams``.
    Its state is ``distributed_shampoo``'s, and for float32 (or float64)
    parameters, with the default decoupled learning rate and no decoupled
    weight decay, ``distributed_shampoo(lr, ...)`` equals
    ``chain(scale_by_shampoo(...), optax.scale_by_learning_rate(lr))`` bit for
    bit, for a constant lr or a schedule (both read the step count t; after a
    skipped step, see the module docstring, ``distributed_shampoo``'s schedule
    stays on the steps taken while optax's counts every call). For bfloat16 or
    float16 parameters the alias rounds −lr·v once, the chain v and then −lr·v.

    Args:
        block_size: axes longer than this are cut into blocks of this size (the last one
            shorter); 0 keeps axes whole. Small adjacent dims are merged up to this size
            first (``best_effort_shape_interpretation``).
        beta1: momentum.
        beta2: EMA factor of the statistics (and of RMSProp grafting); 1 sums them.
        diagonal_epsilon: ε of AdaGrad/RMSProp grafting: G/(√D + ε).
        matrix_epsilon: relative ridge: roots of S + ε·max(λ_max(S), 1e-6)·I.
        weight_decay: λ, added to both directions before momentum (coupled).
        start_preconditioning_step: steps before this one use the grafting method alone
            (the statistics are still accumulated).
        preconditioning_compute_steps: recompute the roots every this many steps.
        statistics_compute_steps: update the statistics every this many steps.
        best_effort_shape_interpretation: merge small adjacent dims, e.g. (1, 2, 512, 1,
            2048, 1, 3, 4) → (1024, 2048, 12) for block 1024.
        graft_type: a :class:`GraftingType`.
        nesterov: Nesterov momentum.
        exponent_override: p of the inverse roots if > 0, else 2·rank.
        batch_axis_name: the mapped axis name when this runs inside ``shard_map`` or
            ``pmap`` data parallelism: the root computation is split over that axis and
            all-gathered. Gradients must already be averaged over it (``lax.pmean``), as
            with the optimizer this replaces.
        statistics_partition_spec: sharding of the stored (K, n, n) stacks of statistics
            and roots with ``shard_optimizer_states`` (ignored without it, as in
            Google's code).
        preconditioner_partition_spec: sharding of the stacks while their roots are
            computed: split the leading axis so each device computes its share, e.g.
            ``PartitionSpec('data', None, None)``. Needs an active mesh
            (``jax.set_mesh``) unless given as a ``NamedSharding``.
        num_devices_for_pjit: stacks are padded to a multiple of this (default:
            ``jax.device_count()``) when a partition spec is given.
        shard_optimizer_states: store the stacks sharded by
            ``statistics_partition_spec`` (defaults to the preconditioner spec).
        best_effort_memory_usage_reduction: momenta of rank > 1 parameters in int8,
            statistics and roots in int16 with their diagonals in float32 (per column
            scales; see ``quantize`` in ``shampoo._math``), the int16 part only with
            ``batch_axis_name`` as Google's (see ``quantize_statistics``).
        inverse_failure_threshold: roots with a larger error are rejected.
        moving_average_for_momentum: w = 1 − β1 instead of 1.
        skip_preconditioning_dim_size_gt: parameters with a dim larger than this (before
            merging and blocking), and scalars, use the grafting step.
        clip_by_scaled_gradient_norm: with RMSProp grafting, divide u_g by max(1,
            RMS(u_g)/clip).
        precision: ``lax.Precision`` of the matrix products (or 'default', 'high',
            'highest').
        tensordot_precision: precision of the statistics' products; None uses
            ``precision`` (Google's code uses the backend default for them).
        relative_matrix_epsilon: the ridge is ε·max(λ_max, 1e-6); False: ε.
        merge_small_dims_block_size: merge small dims up to this size; None (default)
            merges up to ``block_size`` as the seed revision does (Google's 0.0.6
            defaults to 4096).
        lobpcg_topk_precondition: k > 0 deflates the k largest eigenpairs of each
            statistic (LOBPCG) before its Newton root and restores them after;
            statistics with at most 5k rows are rooted as they are.
        lobpcg_max_iter: LOBPCG iterations (0: k).
        precondtioner_type: a :class:`PreconditionerType` (Google's spelling): ALL axes,
            INPUT (all but the last) or OUTPUT (the last only); p is twice the number of
            preconditioned axes.
        skip_preconditioning_rank_lt: parameters of lower rank take the grafting step
            alone.
        generate_training_metrics: keep ``training_metrics`` (else it is an
            ``optax.MaskedNode``).
        reuse_preconditioner: accepted for Google's current code, where it hands each
            previous root to the inverse-root routine as a warm start that the routine
            then discards; results are the same either way, and precond computes every
            root from the statistic alone.
        eigh: compute roots by an eigendecomposition instead of coupled Newton.
        separate_grafting_momentum: with SQRT_N grafting, keep a grafting momentum of
            its own, as Google's 0.0.6 does (the seed shares one).
        quantize_statistics: store statistics and roots in int16 (with
            ``best_effort_memory_usage_reduction``); None: only with
            ``batch_axis_name``, where Google's code does.
        precondition_with_previous_roots: precondition step t with the roots computed at
            step t − 1 (and store step t's for the next step), as Google's sharded mode
            does; None (default): only with ``shard_optimizer_states``, as Google's
            code. False with ``shard_optimizer_states`` gives the same steps as
            unsharded.
        params_partition_specs: keyword only, precond's: a PartitionSpec (or None) per
            parameter, a pytree like the params. ``init`` (under ``jax.jit``, no
            ``out_shardings`` needed) places the momentum, grafting momentum and
            grafting accumulator of each parameter as its spec says, and ``update``
            keeps them (and the updates) there; the stacks follow
            ``statistics_partition_spec`` with ``shard_optimizer_states``, the rest
            (count, root errors) replicates. None (default): taken from the params'
            types on a mesh with Explicit axes (``jax.typeof(x).sharding``), else
            nothing is placed (XLA decides, as Google's code).
        mesh: keyword only, precond's: the ``jax.sharding.Mesh`` that
            ``params_partition_specs`` names; None: the context mesh (``jax.set_mesh``).

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state is a
        :class:`ShampooState`.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> import precond.jax as pj
        >>> opt = optax.chain(
        ...     optax.clip_by_global_norm(1.0),
        ...     pj.scale_by_shampoo(block_size=128),
        ...     optax.scale_by_learning_rate(optax.cosine_decay_schedule(0.1, 1000)),
        ... )
        >>> state = opt.init({"w": jnp.ones((4, 3))})
    """
    return _transformation(validated(**locals()))


def distributed_shampoo(
    learning_rate: float | Callable[[jax.Array], jax.Array],
    block_size: int,
    beta1: float = 0.9,
    beta2: float = 0.999,
    diagonal_epsilon: float = 1e-10,
    matrix_epsilon: float = 1e-6,
    weight_decay: float = 0.0,
    start_preconditioning_step: int = 5,
    preconditioning_compute_steps: int = 1,
    statistics_compute_steps: int = 1,
    best_effort_shape_interpretation: bool = True,
    graft_type: GraftingType = GraftingType.SGD,
    nesterov: bool = True,
    exponent_override: int = 0,
    batch_axis_name: Any = None,
    statistics_partition_spec: PartitionSpec | None = None,
    preconditioner_partition_spec: PartitionSpec | None = None,
    num_devices_for_pjit: int | None = None,
    shard_optimizer_states: bool = False,
    best_effort_memory_usage_reduction: bool = False,
    inverse_failure_threshold: float = 0.1,
    moving_average_for_momentum: bool = False,
    skip_preconditioning_dim_size_gt: int = 4096,
    clip_by_scaled_gradient_norm: float | None = None,
    precision: lax.Precision = lax.Precision.HIGHEST,
    *,
    tensordot_precision: lax.Precision | None = None,
    relative_matrix_epsilon: bool = True,
    merge_small_dims_block_size: int | None = None,
    lobpcg_topk_precondition: int = 0,
    lobpcg_max_iter: int = 0,
    precondtioner_type: PreconditionerType = PreconditionerType.ALL,
    skip_preconditioning_rank_lt: int = 1,
    decoupled_learning_rate: bool = True,
    decoupled_weight_decay: bool = False,
    generate_training_metrics: bool = True,
    reuse_preconditioner: bool = False,
    eigh: bool = False,
    separate_grafting_momentum: bool = False,
    quantize_statistics: bool | None = None,
    sharded_init_fns: bool = True,
    precondition_with_previous_roots: bool | None = None,
    params_partition_specs: Any = None,
    mesh: jax.sharding.Mesh | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Distributed Shampoo (Anil et al. 2020), with Google's arguments and defaults.

    ΔW = −lr(t)·v (module docstring), v the direction of :func:`scale_by_shampoo` (see
    there for when the two agree bit for bit). lr(t) reads the state's own step count:
    the state stays the seed's :class:`ShampooState` (older checkpoints load;
    ``scale_by_shampoo``'s is the same). With ``decoupled_learning_rate=False`` lr
    scales u_g and u_s before momentum instead; ``decoupled_weight_decay`` adds lr·λ·W
    to v (then −lr·v, as Google's code).

    Args:
        learning_rate: step size, or a schedule of the step count t.
        block_size: axes longer than this are cut into blocks of this size (the last one
            shorter); 0 keeps axes whole. Small adjacent dims are merged up to this size
            first (``best_effort_shape_interpretation``).
        beta1: momentum.
        beta2: EMA factor of the statistics (and of RMSProp grafting); 1 sums them.
        diagonal_epsilon: ε of AdaGrad/RMSProp grafting: G/(√D + ε).
        matrix_epsilon: relative ridge: roots of S + ε·max(λ_max(S), 1e-6)·I.
        weight_decay: λ, added to both directions before momentum (coupled).
        start_preconditioning_step: steps before this one use the grafting method alone
            (the statistics are still accumulated).
        preconditioning_compute_steps: recompute the roots every this many steps.
        statistics_compute_steps: update the statistics every this many steps.
        best_effort_shape_interpretation: merge small adjacent dims, e.g. (1, 2, 512, 1,
            2048, 1, 3, 4) → (1024, 2048, 12) for block 1024.
        graft_type: a :class:`GraftingType`.
        nesterov: Nesterov momentum.
        exponent_override: p of the inverse roots if > 0, else 2·rank.
        batch_axis_name: the mapped axis name when this runs inside ``shard_map`` or
            ``pmap`` data parallelism: the root computation is split over that axis and
            all-gathered. Gradients must already be averaged over it (``lax.pmean``), as
            with the optimizer this replaces.
        statistics_partition_spec: sharding of the stored (K, n, n) stacks of statistics
            and roots with ``shard_optimizer_states`` (ignored without it, as in
            Google's code).
        preconditioner_partition_spec: sharding of the stacks while their roots are
            computed: split the leading axis so each device computes its share, e.g.
            ``PartitionSpec('data', None, None)``. Needs an active mesh
            (``jax.set_mesh``) unless given as a ``NamedSharding``.
        num_devices_for_pjit: stacks are padded to a multiple of this (default:
            ``jax.device_count()``) when a partition spec is given.
        shard_optimizer_states: store the stacks sharded by
            ``statistics_partition_spec`` (defaults to the preconditioner spec).
        best_effort_memory_usage_reduction: momenta of rank > 1 parameters in int8,
            statistics and roots in int16 with their diagonals in float32 (per column
            scales; see ``quantize`` in ``shampoo._math``), the int16 part only with
            ``batch_axis_name`` as Google's (see ``quantize_statistics``).
        inverse_failure_threshold: roots with a larger error are rejected.
        moving_average_for_momentum: w = 1 − β1 instead of 1.
        skip_preconditioning_dim_size_gt: parameters with a dim larger than this (before
            merging and blocking), and scalars, use the grafting step.
        clip_by_scaled_gradient_norm: with RMSProp grafting, divide u_g by max(1,
            RMS(u_g)/clip).
        precision: ``lax.Precision`` of the matrix products (or 'default', 'high',
            'highest').
        tensordot_precision: precision of the statistics' products; None uses
            ``precision`` (Google's code uses the backend default for them).
        relative_matrix_epsilon: the ridge is ε·max(λ_max, 1e-6); False: ε.
        merge_small_dims_block_size: merge small dims up to this size; None (default)
            merges up to ``block_size`` as the seed revision does (Google's 0.0.6
            defaults to 4096).
        lobpcg_topk_precondition: k > 0 deflates the k largest eigenpairs of each
            statistic (LOBPCG) before its Newton root and restores them after;
            statistics with at most 5k rows are rooted as they are.
        lobpcg_max_iter: LOBPCG iterations (0: k).
        precondtioner_type: a :class:`PreconditionerType` (Google's spelling): ALL axes,
            INPUT (all but the last) or OUTPUT (the last only); p is twice the number of
            preconditioned axes.
        skip_preconditioning_rank_lt: parameters of lower rank take the grafting step
            alone.
        decoupled_learning_rate: lr scales the final update (True, the seed's behaviour)
            or the directions before momentum (False).
        decoupled_weight_decay: add lr·λ·W after momentum (scaled by lr again when the
            learning rate is decoupled, as Google's code) instead of λ·W before it.
        generate_training_metrics: keep ``training_metrics`` (else it is an
            ``optax.MaskedNode``).
        reuse_preconditioner: accepted for Google's current code, where it hands each
            previous root to the inverse-root routine as a warm start that the routine
            then discards; results are the same either way, and precond computes every
            root from the statistic alone.
        eigh: compute roots by an eigendecomposition instead of coupled Newton.
        separate_grafting_momentum: with SQRT_N grafting, keep a grafting momentum of
            its own, as Google's 0.0.6 does (the seed shares one).
        quantize_statistics: store statistics and roots in int16 (with
            ``best_effort_memory_usage_reduction``); None: only with
            ``batch_axis_name``, where Google's code does.
        sharded_init_fns: with ``shard_optimizer_states``, ``init`` returns the seed's
            :class:`InitFnState` triple (ignoring its argument); False: ``init(params)``
            returns the state itself.
        precondition_with_previous_roots: precondition step t with the roots computed at
            step t − 1 (and store step t's for the next step), as Google's sharded mode
            does; None (default): only with ``shard_optimizer_states``, as Google's
            code. False with ``shard_optimizer_states`` gives the same steps as
            unsharded.
        params_partition_specs: keyword only, precond's: a PartitionSpec (or None) per
            parameter, a pytree like the params. ``init`` (under ``jax.jit``, no
            ``out_shardings`` needed) places the momentum, grafting momentum and
            grafting accumulator of each parameter as its spec says, and ``update``
            keeps them (and the updates) there; the stacks follow
            ``statistics_partition_spec`` with ``shard_optimizer_states``, the rest
            (count, root errors) replicates. None (default): taken from the params'
            types on a mesh with Explicit axes (``jax.typeof(x).sharding``), else
            nothing is placed (XLA decides, as Google's code).
        mesh: keyword only, precond's: the ``jax.sharding.Mesh`` that
            ``params_partition_specs`` names; None: the context mesh (``jax.set_mesh``).

    Returns:
        An optax ``GradientTransformationExtraArgs``; ``update(grads, state,
        params, **extra_args)`` needs ``params`` only when ``weight_decay`` is
        not 0 and ignores extra keyword arguments. Its state is a
        :class:`ShampooState` (an :class:`InitFnState` from ``init`` with
        ``shard_optimizer_states`` and ``sharded_init_fns``), described by
        :func:`distributed_shampoo_partition_specs` and
        :func:`distributed_shampoo_state_shapes`, viewed in the seed's layout by
        :func:`seed_parameter_stats` and loaded from it by
        :func:`shampoo_state_from_seed`.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> import precond.jax as pj
        >>> opt = pj.distributed_shampoo(learning_rate=0.1, block_size=128)
        >>> params = {"w": jnp.ones((4, 3))}
        >>> updates, state = opt.update(params, opt.init(params), params)
        >>> params = optax.apply_updates(params, updates)
    """
    arguments = dict(locals())
    transformation = _transformation(validated(**arguments))
    if not (shard_optimizer_states and sharded_init_fns):
        return transformation
    init = _seed_init_fns(arguments, transformation.init)
    return optax.GradientTransformationExtraArgs(init, transformation.update)


def _transformation(config: Config) -> optax.GradientTransformationExtraArgs:
    """init and update of the transform for ``config``."""
    warning = SkipWarning("distributed_shampoo")

    def update(updates, state, params=None, **extra_args):
        del extra_args  # optax's GradientTransformationExtraArgs contract
        if not sharded_in_types(updates):
            outputs, state = shampoo_update(updates, state, params, config, warning)
            # The buffers (and the updates) stay where the params are.
            return placed_state(state, updates, config, outputs)
        # Gradients split over a mesh with Explicit axes (shardings in their
        # types): the step runs under auto_axes, which its reshapes and grams
        # need, and its outputs are sharded as its inputs.
        return with_auto_axes(
            lambda u, s, p: shampoo_update(u, s, p, config, warning),
            (updates, state),
            updates,
            state,
            params,
        )

    def init(params):
        check_stack_specs(config)
        return placed_state(init_state(params, config), params, config)[1]

    return accepting_scalars(optax.GradientTransformationExtraArgs(init, update))
