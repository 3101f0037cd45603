"""Kron's configuration, validated once, and the plan of a parameter tree under it.

:class:`KronConfig` holds ``scale_by_kron``'s arguments after their checks; the
module-level functions of ``kron._state`` and ``kron._step`` take it as their
first argument. :func:`plan_tree` derives, on shapes alone, how a tree is laid
out in stacks of units and where they live on the mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from precond._common.kron_constants import GENERATION_1_STYLE, stored_cache
from precond._common.validation import is_concrete_number
from precond.jax._core import factor_kernels as km
from precond.jax._core.argument_trees import check_per_parameter_bools
from precond.jax._core.mesh_placement import ShardingPlan, per_parameter, plan_sharding
from precond.jax.kron import _layout as layout
from precond.jax.kron._arguments import KRON_ALIAS_ARGS, validate_kron_arguments
from precond.jax.kron._layout import StackPlan, TensorPlan

__all__ = [
    "KronConfig",
    "TreePlan",
    "kron_config",
    "leads",
    "plan_tree",
    "probability_at",
]


@dataclasses.dataclass(frozen=True, eq=False)
class KronConfig:
    """The arguments of ``scale_by_kron`` (see it for each), checked.

    ``mu_dtype`` and ``precond_dtype`` are ``jnp.dtype``s (``precond_dtype``
    float32 by default). Hyperparameters may be schedules or, under
    ``optax.inject_hyperparams``, traced arrays: the config only holds them, so
    it compares by identity and is never a static argument of ``jit``.
    """

    b1: Any
    preconditioner_update_probability: Any
    max_size_triangular: int
    min_ndim_triangular: int
    memory_save_mode: str | None
    preconditioner_lr: Any
    preconditioner_init_scale: Any
    mu_dtype: jnp.dtype | None
    precond_dtype: jnp.dtype
    precond_update_precision: str | None
    precond_grads_precision: str | None
    scanned_layers: Any
    lax_map_scanned_layers: bool
    lax_map_batch_size: int
    merge_small_dims: bool
    target_merged_dim_size: int
    partition_grads_into_blocks: bool
    block_size: int
    params_partition_specs: Any
    preconditioner_partition_spec: PartitionSpec | None
    momentum_into_precond_update: bool
    mesh: Any
    preconditioner_cache: str | None
    preconditioner_update_style: str
    seed: int
    merge_rule: str
    independent_scanned_layers: bool
    noise_draws: str
    block_padding: str

    @property
    def generation_2(self) -> bool:
        """A generation-2 style (not 'EQ'): Lipschitz estimates in the state."""
        return self.preconditioner_update_style != GENERATION_1_STYLE

    @property
    def cache(self) -> str | None:
        """The layout triangular factors are stored in ('PRO' stores 'packed'
        as 'dense')."""
        return stored_cache(self.preconditioner_cache, self.preconditioner_update_style)

    @property
    def keep_momentum(self) -> bool:
        """Momentum is kept unless b1 is a concrete 0."""
        return not (is_concrete_number(self.b1) and self.b1 == 0)

    @property
    def compute_dtype(self) -> jnp.dtype:
        """Factors are updated and applied in at least float32."""
        return jnp.promote_types(self.precond_dtype, jnp.float32)

    @property
    def block_size_or_none(self) -> int | None:
        """The block length, None without blocking."""
        return self.block_size if self.partition_grads_into_blocks else None


def kron_config(arguments: dict[str, Any]) -> KronConfig:
    """The config of ``scale_by_kron(**arguments)``.

    ``arguments`` is its ``locals()``: every argument by name, ``kron``'s own
    (ignored) in ``kwargs``. Raises TypeError for any other keyword and
    ValueError/TypeError for an invalid value (:mod:`kron._arguments`).
    """
    arguments = dict(arguments)
    unexpected = sorted(set(arguments.pop("kwargs", {})) - set(KRON_ALIAS_ARGS))
    if unexpected:
        raise TypeError(
            f"scale_by_kron() got an unexpected keyword argument {unexpected[0]!r}"
        )
    validate_kron_arguments(**arguments)
    mu_dtype, precond_dtype = arguments["mu_dtype"], arguments["precond_dtype"]
    return KronConfig(
        **dict(
            arguments,
            mu_dtype=None if mu_dtype is None else jnp.dtype(mu_dtype),
            precond_dtype=jnp.dtype(
                jnp.float32 if precond_dtype is None else precond_dtype
            ),
        )
    )


class TreePlan(NamedTuple):
    """How a tree of parameters (or gradients) is preconditioned."""

    treedef: Any
    plans: list[TensorPlan]  # one per leaf
    stacks: list[StackPlan]  # the stacks of their units
    sharding: ShardingPlan  # where they live on the mesh


def _scanned_flags(config: KronConfig, tree: Any, paths: list[str]) -> list:
    """Per leaf, whether its leading axis stacks layers (``scanned_layers``, a
    callable called on ``tree``), each a bool (else a TypeError naming the
    leaf, whose paths are ``paths``)."""
    flags = config.scanned_layers
    if callable(flags):
        flags = flags(tree)
    if flags is None:
        return [False] * len(paths)
    flags = per_parameter(flags, tree, "scanned_layers")
    check_per_parameter_bools("scanned_layers", flags, paths)
    return flags


def plan_tree(config: KronConfig, tree: Any) -> TreePlan:
    """The treedef of ``tree``, a plan per leaf, the stacks of their units, and
    where they live on the mesh."""
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [jax.tree_util.keystr(path) for path, _ in leaves_with_paths]
    flags = _scanned_flags(config, tree, paths)
    plans = [
        layout.plan_tensor(
            x.shape,
            scanned=bool(flag),
            path=path,
            max_size_triangular=config.max_size_triangular,
            min_ndim_triangular=config.min_ndim_triangular,
            memory_save_mode=config.memory_save_mode,
            merge_small_dims=config.merge_small_dims,
            target_merged_dim_size=config.target_merged_dim_size,
            block_size=config.block_size_or_none,
            complex=km.is_complex(x),
            merge_rule=config.merge_rule,
            block_padding=config.block_padding,
        )
        for (_, x), flag, path in zip(leaves_with_paths, flags, paths, strict=True)
    ]
    sharding = plan_sharding(
        tree,
        params_partition_specs=config.params_partition_specs,
        preconditioner_partition_spec=config.preconditioner_partition_spec,
        mesh=config.mesh,
    )
    shapes = [x.shape for _, x in leaves_with_paths]
    stacks = layout.plan_stacks(plans, shapes, units_multiple_of=sharding.shards)
    return TreePlan(treedef, plans, stacks, sharding)


def leads(plans: list[TensorPlan], leaves: list[Any]) -> list[tuple[int, ...]]:
    """Per leaf, its layer axis ``(layers,)`` if scanned, () otherwise."""
    return [plan.lead(x.shape) for plan, x in zip(plans, leaves, strict=True)]


def probability_at(config: KronConfig, count: jax.Array) -> Any:
    """The preconditioner-update probability p(n) at step ``count``."""
    prob = config.preconditioner_update_probability
    return prob(count) if callable(prob) else prob
