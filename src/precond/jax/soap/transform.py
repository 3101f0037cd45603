"""SOAP for optax: Adam run in the eigenbasis of Shampoo's factors.

For a parameter W with gradient G (cut, after merging small dims, into blocks
G_b when ``block_size`` is given: each block is its own SOAP), SOAP keeps per
block axis k a statistic S_k ← β_s·S_k + (1−β_s)·G ⋅_{¬k} G (the contraction
over every other axis) and its eigenbasis Q_k, and runs Adam on the projected
gradient G' = G ×_k Q_kᵀ (every axis k) with both moments in the eigenbasis:

    M ← β1·M + (1−β1)·G',  V ← β2·V + (1−β2)·G'²
    U = (M / (√V + ε)) ×_k Q_k,   ΔW = −lr·(√(1−β2ᵗ)/(1−β1ᵗ)·U + λ·W)

The first step only accumulates the statistics and takes Q_k = eigh(S_k) (no
preconditioned step; weight decay applies). Every ``precondition_frequency``
Adam steps each Q_k is refreshed by one power step: its columns (and V's
entries along k) sorted by descending diag(Q_kᵀS_kQ_k), then
Q_k ← qr(S_k·Q_k).Q (or eigh again, ``refresh='eigh'``); M is rotated into the
new bases exactly. An axis longer than ``max_precond_dim`` keeps the identity
(one-sided SOAP); a tensor without a statistic is trained by Adam. The
definition is ``tests/reference/soap_reference.py`` (float64 NumPy).

Statistics and bases of all parameters live in stacks of equal block length,
whose eigendecompositions and QR steps run as one mapped program, split over
the devices of a mesh along the stack axis (``params_partition_specs``,
``preconditioner_partition_spec``).

Bad steps are skipped: when some gradient leaf has a squared norm that is not
finite (NaN, ±Inf, or entries from about 1.8e19 in float32), the step returns
zero updates and leaves the state unchanged but for its count of skipped steps
(:func:`precond.jax.skipped_steps`); ``soap``'s decoupled weight decay still
applies. Parameters must be real floating-point arrays.

References:
    N. Vyas, D. Morwani, R. Zhao, I. Shapira, D. Brandfonbrener, L. Janson,
    S. Kakade, *SOAP: Improving and Stabilizing Shampoo using Adam*,
    arXiv:2409.11321, 2024.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec

from precond.jax._core.alias import arguments_for, with_decay_and_learning_rate
from precond.jax._core.guards import accepting_scalars
from precond.jax._core.step_policy import SkipWarning
from precond.jax.soap._config import (
    SCALE_BY_SOAP_STATIC_ARGS,
    SOAP_STATIC_ARGS,
    Config,
    check_arguments,
    validated,
)
from precond.jax.soap._state import SoapState, init_state
from precond.jax.soap._step import soap_update

__all__ = [
    "SCALE_BY_SOAP_STATIC_ARGS",
    "SOAP_STATIC_ARGS",
    "SoapState",
    "scale_by_soap",
    "soap",
]


def scale_by_soap(
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: float = -1.0,
    eps: float = 1e-8,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    merge_dims: bool = False,
    precondition_1d: bool = False,
    normalize_grads: bool = False,
    correct_bias: bool = True,
    *,
    refresh: str = "qr",
    block_size: int | None = None,
    precond_dtype: Any = None,
    precision: str | None = "highest",
    params_partition_specs: Any = None,
    preconditioner_partition_spec: PartitionSpec | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> optax.GradientTransformationExtraArgs:
    """SOAP's direction √(1−β2ᵗ)/(1−β1ᵗ)·U (the module docstring's update, without
    −lr and the weight decay), for ``optax.chain`` with a learning rate, schedule,
    decay, clip or mask. ``soap(lr, ...)`` is ``chain(scale_by_soap(...),
    add_decayed_weights(λ, mask), scale_by_learning_rate(lr))``.

    Args:
        b1: β1, the decay of the first moment M.
        b2: β2, the decay of the second moment V (and of the statistics when
            ``shampoo_beta`` is negative).
        shampoo_beta: β_s, the decay of the statistics S; negative: ``b2``.
        eps: ε of Adam's direction M/(√V + ε).
        precondition_frequency: refresh the bases every this many Adam steps.
        max_precond_dim: a (merged, blocked) axis longer than this has no statistic
            and keeps the identity basis; with ``merge_dims`` the limit of a merge.
        merge_dims: merge adjacent dims while their product stays within
            ``max_precond_dim`` (e.g. (2, 3, 6) → (6, 6) for 6), as the authors'.
        precondition_1d: give 1-D parameters a statistic (else Adam trains them).
        normalize_grads: divide each block's direction by its RMS (plus 1e-30).
        correct_bias: Adam's bias correction √(1−β2ᵗ)/(1−β1ᵗ) (t the Adam step).
        refresh: ``'qr'``: one power step with QR (the paper's); ``'eigh'``: the
            eigenvectors of each statistic again.
        block_size: cut (merged) axes longer than this into blocks of this length
            (the last one shorter), each block its own SOAP; None keeps them whole.
        precond_dtype: dtype of the stored statistics and bases; None: float32 (or
            the params' when wider). The decompositions run in at least float32.
        precision: matmul precision of the projections, grams and power steps (a
            name ``jax.default_matmul_precision`` takes, or None for JAX's default).
        params_partition_specs: a PartitionSpec per parameter (a pytree like the
            params; None entries replicate). The moments and updates are kept sharded
            like their parameter. None: read from boxed params or from the params'
            types on an explicit mesh; when none is known, XLA decides.
        preconditioner_partition_spec: a PartitionSpec whose mesh axes split the
            (K, n, n) stacks of statistics and bases along K (padded with empty rows
            to a multiple of their devices), so that each device holds and refreshes
            1/N of them, e.g. ``P('fsdp')``. Default: every mesh axis that shards a
            parameter.
        mesh: the mesh that the partition specs name; None: the context mesh
            (``jax.set_mesh``) or the one in the params' types.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state is a
        :class:`SoapState`; ``SCALE_BY_SOAP_STATIC_ARGS`` are static under
        ``optax.inject_hyperparams``.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> import precond.jax as pj
        >>> opt = optax.chain(pj.scale_by_soap(), optax.scale_by_learning_rate(3e-3))
        >>> state = opt.init({"w": jnp.ones((4, 3))})
    """
    return _transformation(validated(**locals()))


def soap(
    learning_rate: float | Callable[[jax.Array], jax.Array] = 3e-3,
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: float = -1.0,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    merge_dims: bool = False,
    precondition_1d: bool = False,
    normalize_grads: bool = False,
    correct_bias: bool = True,
    *,
    refresh: str = "qr",
    block_size: int | None = None,
    weight_decay_mask: Any = None,
    precond_dtype: Any = None,
    precision: str | None = "highest",
    params_partition_specs: Any = None,
    preconditioner_partition_spec: PartitionSpec | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> optax.GradientTransformationExtraArgs:
    """SOAP (Vyas et al. 2024) with the paper's arguments and defaults:
    ΔW = −lr·(√(1−β2ᵗ)/(1−β1ᵗ)·U + λ·W), U Adam's direction in the eigenbasis of
    Shampoo's statistics (module docstring). The weight decay is decoupled (on the
    parameter before the step, as optax's ``adamw``) and applies on every step,
    the first included.

    Args:
        learning_rate: lr, a number or an optax schedule of the step count.
        b1: β1, the decay of the first moment M.
        b2: β2, the decay of the second moment V (and of the statistics when
            ``shampoo_beta`` is negative).
        shampoo_beta: β_s, the decay of the statistics S; negative: ``b2``.
        eps: ε of Adam's direction M/(√V + ε).
        weight_decay: λ of the decoupled weight decay.
        precondition_frequency: refresh the bases every this many Adam steps.
        max_precond_dim: a (merged, blocked) axis longer than this has no statistic
            and keeps the identity basis; with ``merge_dims`` the limit of a merge.
        merge_dims: merge adjacent dims while their product stays within
            ``max_precond_dim`` (e.g. (2, 3, 6) → (6, 6) for 6), as the authors'.
        precondition_1d: give 1-D parameters a statistic (else Adam trains them).
        normalize_grads: divide each block's direction by its RMS (plus 1e-30).
        correct_bias: Adam's bias correction √(1−β2ᵗ)/(1−β1ᵗ) (t the Adam step).
        refresh: ``'qr'``: one power step with QR (the paper's); ``'eigh'``: the
            eigenvectors of each statistic again.
        block_size: cut (merged) axes longer than this into blocks of this length
            (the last one shorter), each block its own SOAP; None keeps them whole.
        weight_decay_mask: which parameters decay: None (all), a pytree of bools (a
            prefix of the params' tree) or a callable of the params returning one.
        precond_dtype: dtype of the stored statistics and bases; None: float32 (or
            the params' when wider). The decompositions run in at least float32.
        precision: matmul precision of the projections, grams and power steps (a
            name ``jax.default_matmul_precision`` takes, or None for JAX's default).
        params_partition_specs: a PartitionSpec per parameter (a pytree like the
            params; None entries replicate). The moments and updates are kept sharded
            like their parameter. None: read from boxed params or from the params'
            types on an explicit mesh; when none is known, XLA decides.
        preconditioner_partition_spec: a PartitionSpec whose mesh axes split the
            (K, n, n) stacks of statistics and bases along K (padded with empty rows
            to a multiple of their devices), so that each device holds and refreshes
            1/N of them, e.g. ``P('fsdp')``. Default: every mesh axis that shards a
            parameter.
        mesh: the mesh that the partition specs name; None: the context mesh
            (``jax.set_mesh``) or the one in the params' types.

    Returns:
        An ``optax.GradientTransformationExtraArgs``; ``update(grads, state,
        params)`` needs ``params`` when ``weight_decay`` is not 0. Its state is
        ``(SoapState, the learning rate's state)``; ``SOAP_STATIC_ARGS`` are static
        under ``optax.inject_hyperparams``.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> import precond.jax as pj
        >>> opt = pj.soap(learning_rate=3e-3)
        >>> params = {"w": jnp.ones((4, 3))}
        >>> updates, state = opt.update(params, opt.init(params), params)
        >>> params = optax.apply_updates(params, updates)
    """
    arguments = dict(locals())
    check_arguments(arguments)
    core = scale_by_soap(**arguments_for(scale_by_soap, arguments))
    return with_decay_and_learning_rate(
        core, learning_rate, weight_decay, weight_decay_mask
    )


def _transformation(config: Config) -> optax.GradientTransformationExtraArgs:
    """init and update of the transform for ``config``."""
    warning = SkipWarning("soap")

    def update(updates, state, params=None, **extra_args):
        del extra_args  # optax's GradientTransformationExtraArgs contract
        return soap_update(updates, state, params, config, warning)

    def init(params):
        return init_state(params, config)

    return accepting_scalars(optax.GradientTransformationExtraArgs(init, update))
