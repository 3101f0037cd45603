"""PSGD 'pro': distributed-kron 2.0's generation-2 PSGD recipe as an optax optimizer.

Per parameter (after its leading layer axis when it is a scanned layer), the
momentum m̂ is read as a vector (a 0-D or 1-D parameter, or one whose dims are
all 1 but one) or as a matrix (dims merged into the two most balanced groups) and
preconditioned by P = Q_lᵀQ_l ⊗ Q_rᵀQ_r, a Kronecker product of two factors:

* a side of at most ``max_size_dense`` is *dense* and split into blocks of
  ``block_size``: each block has its own dense factors, a larger side keeps one
  diagonal factor (a vector) along its whole length;
* a vector parameter has one diagonal factor.

Each step fits every block's factors to the noisy momentum G̃ = m̂ + (δ + ε|m̂|)⊙V
(δ = ``noise_scale``, V ~ N(0, I)) with the generation-2 rule
(:func:`precond.jax._core.factor_kernels.update_factors_gen2`: 'PRO', 'QUAD' or
'QEQ', step size ``preconditioner_lr`` over a smoothed Lipschitz estimate, no
triangular solves), rebalances the two factors' norms every 100 steps, and returns
U = clip(P·m̂) with each tensor's RMS clipped to 1.1, divided by 5 when
``lr_style='adam'`` so that Adam's learning rates carry over.

Random draws come from fixed keys folded with the step count: every device and
every resumed run draws the same. With ``draws='distributed_kron'`` (the
default) they are those of distributed-kron 2.0.0, draw for draw, which is what
its trajectory-parity tests check.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from precond._common.validation import is_concrete_number
from precond.jax._core.alias import (
    ALIAS_ARGUMENT_CHECKS,
    arguments_for,
    with_mask_checked_at_init,
)
from precond.jax._core.guards import accepting_scalars
from precond.jax.kron._pro_config import (
    PRO_ARGUMENT_CHECKS,
    ProState,
    _recipe,
    _unboxed,
)
from precond.jax.kron._pro_step import _init, _update


def scale_by_pro(
    lr_style: str | None = "adam",
    b1: float = 0.95,
    normalize_grads: bool = False,
    max_size_dense: int = 16384,
    preconditioner_lr: float = 0.5,
    preconditioner_init_scale: float = 1.0,
    preconditioner_update_style: str = "PRO",
    dtype: Any = jnp.float32,
    scanned_layers: Any | Callable | None = None,
    block_size: int = 256,
    pipeline_axis_name: str | None = None,
    pipeline_axis_size: int = 1,
    params_partition_specs: Any | None = None,
    noise_scale: float = 1e-9,
    *,
    draws: str = "distributed_kron",
    preconditioner_update_probability: float | Callable = 1.0,
) -> optax.GradientTransformationExtraArgs:
    """PSGD 'pro' preconditioning (the module docstring has the math).

    Args:
        lr_style: 'adam' divides the clipped update by 5 (use AdamW's learning rates);
            None leaves it.
        b1: momentum EMA coefficient (bias-corrected); 0 preconditions the gradient.
        normalize_grads: divide each momentum tensor by its norm (+1e-6) first.
        max_size_dense: sides longer than this get a diagonal factor.
        preconditioner_lr: the fit's step size η (over the Lipschitz estimate).
        preconditioner_init_scale: every factor starts as this times identity.
        preconditioner_update_style: 'PRO' (Procrustes-rotated Q), 'QUAD' (symmetric Q)
            or 'QEQ' (Q ← Q − μQE: one d³ product per dense factor where 'PRO' takes
            three; an addition of precond's).
        dtype: float32 or bfloat16, of the momentum and factors (and the fit).
        scanned_layers: None, a pytree of bools like the params, or a callable of the
            params returning one: True marks a parameter stacked along a leading layer
            axis (each layer gets its own factors).
        block_size: length of the blocks a dense side is split into.
        pipeline_axis_name: a mesh axis the factor stacks are split along.
        pipeline_axis_size: that axis's size (stacks are padded to its multiple).
        params_partition_specs: the params' PartitionSpecs (momentum and the update
            follow them).
        noise_scale: δ, the floor of the damping noise's scale.
        draws: 'distributed_kron' draws exactly distributed-kron 2.0.0's random numbers
            (cut from its zero-padded blocks); 'compact' draws as many as the blocks
            have entries (the same distribution, cheaper).
        preconditioner_update_probability: p, or a schedule p(step): the factors are
            fitted on the first step and then once 1/p steps have passed since the last
            fit (every step at p = 1, distributed-kron's behaviour); other steps
            precondition with the factors as they are, at a fraction of the cost.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`ProState`.

    Example, with a schedule and clipping of one's own:

        >>> import optax
        >>> opt = optax.chain(
        ...     optax.clip_by_global_norm(1.0),
        ...     scale_by_pro(),
        ...     optax.scale_by_learning_rate(optax.cosine_decay_schedule(1e-3, 1000)),
        ... )
        >>> params = {"w": jnp.zeros((4, 3))}
        >>> updates, state = opt.update({"w": jnp.ones((4, 3))}, opt.init(params))
    """
    arguments = dict(locals())
    for name, value in arguments.items():
        PRO_ARGUMENT_CHECKS[name](name, value)
    recipe = _recipe(arguments)
    # optax's OptState (chex.ArrayTree) admits no state type narrower than any
    # ArrayTree.
    return accepting_scalars(
        optax.GradientTransformationExtraArgs(
            functools.partial(_init, recipe=recipe),
            functools.partial(_update, recipe=recipe),  # pyright: ignore[reportArgumentType]
        )
    )


def pro(
    learning_rate: float | Callable = 0.001,
    lr_style: str | None = "adam",
    b1: float = 0.95,
    weight_decay: float = 0.1,
    weight_decay_mask: Any | Callable | None = None,
    normalize_grads: bool = False,
    max_size_dense: int = 16384,
    preconditioner_lr: float = 0.5,
    preconditioner_init_scale: float = 1.0,
    preconditioner_update_style: str = "PRO",
    dtype: Any = jnp.float32,
    scanned_layers: Any | Callable | None = None,
    block_size: int = 256,
    pipeline_axis_name: str | None = None,
    pipeline_axis_size: int = 1,
    params_partition_specs: Any | None = None,
    noise_scale: float = 1e-9,
    *,
    draws: str = "distributed_kron",
    preconditioner_update_probability: float | Callable = 1.0,
) -> optax.GradientTransformationExtraArgs:
    """PSGD 'pro' (:func:`scale_by_pro`) with decoupled weight decay and a learning
    rate: θ ← θ − lr·(U + λ·mask⊙θ). A drop-in for distributed-kron 2.0's
    ``pro``: same arguments, order, defaults and trajectory (``draws`` and
    ``preconditioner_update_probability``, keyword only, are precond's). With
    ``lr_style='adam'`` use AdamW's learning rate.

    Args:
        learning_rate: the step size lr > 0, or a schedule of the step count.
        lr_style: 'adam' divides the clipped update by 5 (use AdamW's learning rates);
            None leaves it.
        b1: momentum EMA coefficient (bias-corrected); 0 preconditions the gradient.
        weight_decay: decoupled weight decay λ >= 0, added as λ·mask⊙θ before the
            learning rate.
        weight_decay_mask: a pytree of bools like the params (or a callable of the
            params returning one) selecting the parameters that decay; None decays all.
        normalize_grads: divide each momentum tensor by its norm (+1e-6) first.
        max_size_dense: sides longer than this get a diagonal factor.
        preconditioner_lr: the fit's step size η (over the Lipschitz estimate).
        preconditioner_init_scale: every factor starts as this times identity.
        preconditioner_update_style: 'PRO' (Procrustes-rotated Q), 'QUAD' (symmetric Q)
            or 'QEQ' (Q ← Q − μQE: one d³ product per dense factor where 'PRO' takes
            three; an addition of precond's).
        dtype: float32 or bfloat16, of the momentum and factors (and the fit).
        scanned_layers: None, a pytree of bools like the params, or a callable of the
            params returning one: True marks a parameter stacked along a leading layer
            axis (each layer gets its own factors).
        block_size: length of the blocks a dense side is split into.
        pipeline_axis_name: a mesh axis the factor stacks are split along.
        pipeline_axis_size: that axis's size (stacks are padded to its multiple).
        params_partition_specs: the params' PartitionSpecs (momentum and the update
            follow them).
        noise_scale: δ, the floor of the damping noise's scale.
        draws: 'distributed_kron' draws exactly distributed-kron 2.0.0's random numbers
            (cut from its zero-padded blocks); 'compact' draws as many as the blocks
            have entries (the same distribution, cheaper).
        preconditioner_update_probability: p, or a schedule p(step): the factors are
            fitted on the first step and then once 1/p steps have passed since the last
            fit (every step at p = 1, distributed-kron's behaviour); other steps
            precondition with the factors as they are, at a fraction of the cost.

    Returns:
        An ``optax.GradientTransformationExtraArgs``: the chain of :func:`scale_by_pro`,
        the decay (left out when ``weight_decay`` is 0) and the learning rate.

    Example:
        >>> optimizer = pro(learning_rate=1e-3, weight_decay=0.1)
    """
    for name in ("learning_rate", "weight_decay", "weight_decay_mask"):
        ALIAS_ARGUMENT_CHECKS[name](name, locals()[name])
    transforms: list[optax.GradientTransformation] = [
        with_mask_checked_at_init(
            scale_by_pro(**arguments_for(scale_by_pro, locals())),
            "weight_decay_mask",
            weight_decay_mask,
        )
    ]
    if not (isinstance(weight_decay, int | float) and weight_decay <= 0):
        transforms.append(optax.add_decayed_weights(weight_decay, weight_decay_mask))
    transforms.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*transforms)


def pro_opt_state_partition_specs(params, **pro_kwargs):
    """PartitionSpecs of ``pro(**pro_kwargs).init(params)``'s state, for
    ``jax.jit(..., out_shardings=...)``: the momentum follows
    ``params_partition_specs`` (replicated without them), factor stacks are split
    along ``pipeline_axis_name`` (replicated without it), the counters replicated.
    As distributed-kron 2.0's ``get_opt_state_partition_specs`` (a tuple of the
    chain's states; None for the stateless decay and learning rate).

    Args:
        params: the parameters (or their shapes).
        **pro_kwargs: the arguments given to :func:`pro` (those of :func:`scale_by_pro`
            are read).

    Returns:
        A tuple like ``pro(**pro_kwargs).init(params)``'s state with a ``PartitionSpec``
        (or None) for each leaf.

    Example, the momentum sharded as its parameter on a mesh axis "data":

        >>> from jax.sharding import PartitionSpec
        >>> params = {"w": jnp.zeros((4, 3))}
        >>> specs = pro_opt_state_partition_specs(
        ...     params, params_partition_specs={"w": PartitionSpec("data")}
        ... )
        >>> specs[0].mu["w"] == PartitionSpec("data"), specs[1:]
        (True, (None, None))
    """
    core = {
        k: v
        for k, v in pro_kwargs.items()
        if k in inspect.signature(scale_by_pro).parameters
    }
    axis = core.pop("pipeline_axis_name", None)
    param_specs = core.pop("params_partition_specs", None)
    shapes = jax.eval_shape(scale_by_pro(**core).init, params)

    def stack_spec(x):
        return PartitionSpec() if axis is None else PartitionSpec(axis)

    leaves, treedef, _ = _unboxed(params)
    mu = None
    if shapes.mu is not None:
        mu = param_specs or treedef.unflatten([PartitionSpec()] * len(leaves))
    # A tree shaped like a state whose leaves are specs, not arrays.
    specs = ProState(
        count=PartitionSpec(),  # pyright: ignore[reportArgumentType]
        mu=mu,
        factors=jax.tree.map(stack_spec, shapes.factors),
        lipschitz=jax.tree.map(stack_spec, shapes.lipschitz),
        update_counter=PartitionSpec(),  # pyright: ignore[reportArgumentType]
        skipped=PartitionSpec(),  # pyright: ignore[reportArgumentType]
    )
    weight_decay = pro_kwargs.get("weight_decay", 0.1)
    if is_concrete_number(weight_decay) and weight_decay <= 0:
        return (specs, None)
    return (specs, None, None)


# distributed-kron 2.0's name, for `from distributed_kron.pro import ...` users.
get_opt_state_partition_specs = pro_opt_state_partition_specs
