"""Kron's hyperparameters: named constants, the update-probability schedule and
the construction-time checks of every argument of ``scale_by_kron``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from precond._common.factor_plan import MEMORY_SAVE_MODES
from precond._common.schedules import check_update_prob_schedule
from precond._common.validation import (
    check_bool,
    check_choice,
    check_int,
    check_real,
)
from precond.jax import _kron_math as km
from precond.jax._precision import MATMUL_PRECISIONS, check_floating_dtype

# Layouts of the cached P_i = Q_iᵀQ_i (see scale_by_kron's preconditioner_cache).
PRECONDITIONER_CACHES = ("packed", "dense", None)
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

    Example:
        >>> kron(preconditioner_update_probability=precond_update_prob_schedule(
        ...     min_prob=0.05, flat_start=1000))  # doctest: +SKIP
    """
    check_update_prob_schedule(max_prob, min_prob, decay, flat_start)

    def schedule(n: jax.Array) -> jax.Array:
        prob = max_prob * jnp.exp(-decay * (jnp.asarray(n, jnp.float32) - flat_start))
        return jnp.clip(prob, min_prob, max_prob)

    return schedule


def validate_kron_arguments(
    *,
    b1,
    preconditioner_update_probability,
    max_size_triangular,
    min_ndim_triangular,
    memory_save_mode,
    preconditioner_lr,
    preconditioner_init_scale,
    mu_dtype,
    precond_dtype,
    precond_update_precision,
    precond_grads_precision,
    lax_map_batch_size,
    target_merged_dim_size,
    block_size,
    preconditioner_partition_spec,
    mesh,
    preconditioner_cache,
    preconditioner_update_style,
    seed,
    momentum_into_precond_update,
    lax_map_scanned_layers,
    merge_small_dims,
    partition_grads_into_blocks,
) -> None:
    check_real("b1", b1, low=0.0, high=1.0, high_inclusive=False)
    check_real(
        "preconditioner_update_probability",
        preconditioner_update_probability,
        low=0.0,
        high=1.0,
        allow_schedule=True,
    )
    check_int("max_size_triangular", max_size_triangular, low=0)
    check_int("min_ndim_triangular", min_ndim_triangular, low=0)
    check_choice("memory_save_mode", memory_save_mode, MEMORY_SAVE_MODES)
    check_real("preconditioner_lr", preconditioner_lr, low=0.0, low_inclusive=False)
    check_real(
        "preconditioner_init_scale",
        preconditioner_init_scale,
        low=0.0,
        low_inclusive=False,
    )
    check_floating_dtype("mu_dtype", mu_dtype)
    check_floating_dtype("precond_dtype", precond_dtype)
    check_choice(
        "precond_update_precision", precond_update_precision, MATMUL_PRECISIONS
    )
    check_choice("precond_grads_precision", precond_grads_precision, MATMUL_PRECISIONS)
    check_int("lax_map_batch_size", lax_map_batch_size, low=1)
    check_int("target_merged_dim_size", target_merged_dim_size, low=1)
    check_int("block_size", block_size, low=1)
    if preconditioner_partition_spec is not None and not isinstance(
        preconditioner_partition_spec, PartitionSpec
    ):
        raise ValueError(
            f"Invalid preconditioner_partition_spec={preconditioner_partition_spec!r}:"
            " must be a jax.sharding.PartitionSpec or None"
        )
    if mesh is not None and not isinstance(
        mesh, jax.sharding.Mesh | jax.sharding.AbstractMesh
    ):
        raise ValueError(f"Invalid mesh={mesh!r}: must be a jax.sharding.Mesh or None")
    check_choice("preconditioner_cache", preconditioner_cache, PRECONDITIONER_CACHES)
    check_choice(
        "preconditioner_update_style", preconditioner_update_style, km.UPDATE_STYLES
    )
    check_int("seed", seed)
    check_bool("momentum_into_precond_update", momentum_into_precond_update)
    check_bool("lax_map_scanned_layers", lax_map_scanned_layers)
    check_bool("merge_small_dims", merge_small_dims)
    check_bool("partition_grads_into_blocks", partition_grads_into_blocks)
