"""Kron's hyperparameters: named constants, the update-probability schedule and
the construction-time checks of every argument of ``scale_by_kron``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from precond._common.factor_plan import MEMORY_SAVE_MODES
from precond._common.kron_arguments import KRON_SHARED_ARGUMENT_CHECKS
from precond._common.kron_constants import (
    BLOCK_PADDINGS,
    MERGE_RULES,
    NOISE_DRAWS,
    PRECONDITIONER_CACHES,
)
from precond._common.schedules import check_update_prob_schedule
from precond._common.validation import check_bool, check_choice, check_int, check_real
from precond.jax._core.argument_trees import (
    check_mesh,
    check_partition_spec,
    check_scanned_layers,
    checked_at_init,
)
from precond.jax._core.precision import (
    MATMUL_PRECISIONS,
    check_floating_dtype,
    check_momentum_dtype,
)

__all__ = [
    "KRON_ALIAS_ARGS",
    "KRON_ARGUMENT_CHECKS",
    "KRON_STATIC_ARGS",
    "NOISE_DRAWS",
    "PRECONDITIONER_CACHES",
    "precond_update_prob_schedule",
    "validate_kron_arguments",
]

# kron's own arguments, which scale_by_kron accepts and ignores (as
# distributed-kron's does), so that one dict of kron arguments serves both.
KRON_ALIAS_ARGS = ("learning_rate", "weight_decay", "weight_decay_mask")
# Integer arguments that fix shapes or seeds: they must stay Python ints, so pass
# them as ``static_args`` to ``optax.inject_hyperparams``.
KRON_STATIC_ARGS = (
    "max_size_triangular",
    "min_ndim_triangular",
    "lax_map_batch_size",
    "target_merged_dim_size",
    "block_size",
    "seed",
)


def precond_update_prob_schedule(
    max_prob: float = 1.0,
    min_prob: float = 0.03,
    decay: float = 0.001,
    flat_start: float = 500,
) -> Callable[[jax.Array], jax.Array]:
    """Probability of updating the preconditioner at step n (1-based).

    p(n) = clip(max_prob · exp(−decay · (n − flat_start)), min_prob, max_prob):
    flat at ``max_prob`` for ``flat_start`` steps, then annealed towards
    ``min_prob``. The defaults update every step for 500 steps and reach one
    update every ~33 steps after about 4000 steps.

    Args:
        max_prob: the probability of the first ``flat_start`` steps, the largest.
        min_prob: the smallest probability, reached as it decays.
        decay: the rate of the exponential decay per step after ``flat_start``.
        flat_start: steps before the decay starts.

    Returns:
        The schedule: a function of the step count n (1-based) returning p(n), a float32
        scalar.

    Example:
        >>> import precond.jax as pj
        >>> optimizer = pj.kron(
        ...     preconditioner_update_probability=pj.precond_update_prob_schedule(
        ...         min_prob=0.05, flat_start=1000))
    """
    check_update_prob_schedule(max_prob, min_prob, decay, flat_start)

    def schedule(n: jax.Array) -> jax.Array:
        prob = max_prob * jnp.exp(-decay * (jnp.asarray(n, jnp.float32) - flat_start))
        return jnp.clip(prob, min_prob, max_prob)

    return schedule


def _positive(name, value, **kwargs) -> None:
    check_real(name, value, low=0.0, low_inclusive=False, **kwargs)


# One check per argument of scale_by_kron, in signature order; each raises
# ``Invalid <name>=<value!r>: must be <rule>`` (TypeError for a wrong type).
_SHARED = KRON_SHARED_ARGUMENT_CHECKS
KRON_ARGUMENT_CHECKS = {
    "b1": _SHARED["b1"],
    "preconditioner_update_probability": functools.partial(
        check_real, low=0.0, high=1.0, allow_schedule=True
    ),
    "max_size_triangular": _SHARED["max_size_triangular"],
    "min_ndim_triangular": _SHARED["min_ndim_triangular"],
    "memory_save_mode": functools.partial(check_choice, choices=MEMORY_SAVE_MODES),
    "preconditioner_lr": _positive,
    "preconditioner_init_scale": _positive,
    "mu_dtype": check_momentum_dtype,
    "precond_dtype": check_floating_dtype,
    "precond_update_precision": functools.partial(
        check_choice, choices=MATMUL_PRECISIONS
    ),
    "precond_grads_precision": functools.partial(
        check_choice, choices=MATMUL_PRECISIONS
    ),
    "scanned_layers": check_scanned_layers,
    "lax_map_scanned_layers": check_bool,
    "lax_map_batch_size": functools.partial(check_int, low=1),
    "merge_small_dims": _SHARED["merge_small_dims"],
    "target_merged_dim_size": _SHARED["target_merged_dim_size"],
    "partition_grads_into_blocks": check_bool,
    "block_size": functools.partial(check_int, low=1),
    "params_partition_specs": checked_at_init,
    "preconditioner_partition_spec": check_partition_spec,
    # Keyword-only, after distributed-kron's arguments.
    "momentum_into_precond_update": _SHARED["momentum_into_precond_update"],
    "mesh": check_mesh,
    "preconditioner_cache": _SHARED["preconditioner_cache"],
    "preconditioner_update_style": _SHARED["preconditioner_update_style"],
    "seed": check_int,
    "merge_rule": functools.partial(check_choice, choices=MERGE_RULES),
    "independent_scanned_layers": check_bool,
    "noise_draws": functools.partial(check_choice, choices=NOISE_DRAWS),
    "block_padding": functools.partial(check_choice, choices=BLOCK_PADDINGS),
}


def validate_kron_arguments(**arguments) -> None:
    """Checks every argument of ``scale_by_kron`` with :data:`KRON_ARGUMENT_CHECKS`."""
    for name, check in KRON_ARGUMENT_CHECKS.items():
        check(name, arguments[name])
