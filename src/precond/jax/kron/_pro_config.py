"""PSGD pro's state, arguments and recipe: ``ProState``, the construction-time
check of every argument of ``scale_by_pro``, and the recipe its step reads.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from precond._common.pro_arguments import PRO_SHARED_ARGUMENT_CHECKS
from precond._common.validation import check_choice, check_int, is_concrete_number
from precond.jax._core.argument_trees import (
    check_fits_params,
    check_partition_specs_tree,
    check_per_parameter_bools,
    check_scanned_layers,
)
from precond.jax._core.mesh_placement import is_box
from precond.jax._core.step_policy import SkipWarning

DRAWS = ("distributed_kron", "compact")


class ProState(NamedTuple):
    """State of :func:`scale_by_pro`.

    ``factors[s]`` holds stack s's factors, one array per side: (units, d, d) for
    a dense side, (units, d) for a diagonal one (``lipschitz[s]``: (units,) each,
    float32). Stacks group blocks of one shape (see ``_plan``).

    Attributes:
        count: int32 scalar: the steps taken.
        mu: the momentum, a tree like the params in ``dtype``; None when b1 == 0.
        factors: per stack, one array per side: (units, d, d) dense or (units, d)
            diagonal.
        lipschitz: per stack, one float32 (units,) array of Lipschitz estimates per
            side.
        update_counter: int32 scalar: the steps since the factors were last fitted.
        skipped: int32 scalar: the steps skipped for unusable gradients.
    """

    count: jax.Array  # [] int32: steps taken
    mu: Any  # momentum like the params, in ``dtype``; None when b1 == 0
    # Both one placeholder array in the state optax.tree.map_params sees.
    factors: tuple | jax.Array
    lipschitz: tuple | jax.Array
    update_counter: jax.Array  # [] int32: steps since the factors were fitted
    skipped: jax.Array  # [] int32: steps skipped (unusable gradients)


def _check_dtype(name: str, value) -> None:
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(
            f"Invalid {name}={value!r}: must be float32 or bfloat16 (a dtype or "
            "its name)"
        )


def _check_optional_axis(name: str, value) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"Invalid {name}={value!r}: must be None or a mesh axis name")


# Every argument of scale_by_pro (and pro's own, from the alias table), with the
# check run at construction: Invalid <name>=<value!r>: must be <rule>, in
# signature order. The arguments precond.torch.Pro takes under the same name and
# rule are checked by precond._common.pro_arguments; the rest are JAX's own and
# checked here: dtype (a jnp dtype), scanned_layers, the pipeline axis, the
# params' partition specs and draws.
_SHARED = PRO_SHARED_ARGUMENT_CHECKS


PRO_ARGUMENT_CHECKS = {
    "lr_style": _SHARED["lr_style"],
    "b1": _SHARED["b1"],
    "normalize_grads": _SHARED["normalize_grads"],
    "max_size_dense": _SHARED["max_size_dense"],
    "preconditioner_lr": _SHARED["preconditioner_lr"],
    "preconditioner_init_scale": _SHARED["preconditioner_init_scale"],
    "preconditioner_update_style": _SHARED["preconditioner_update_style"],
    "dtype": _check_dtype,
    "scanned_layers": check_scanned_layers,
    "block_size": _SHARED["block_size"],
    "pipeline_axis_name": _check_optional_axis,
    "pipeline_axis_size": lambda n, v: check_int(n, v, low=1),
    "params_partition_specs": check_partition_specs_tree,
    "noise_scale": _SHARED["noise_scale"],
    "draws": lambda n, v: check_choice(n, v, DRAWS),
    "preconditioner_update_probability": _SHARED["preconditioner_update_probability"],
}


# Arguments that fix shapes or code paths: static under optax.inject_hyperparams.
PRO_STATIC_ARGS = (
    "lr_style",
    "normalize_grads",
    "max_size_dense",
    "preconditioner_update_style",
    "dtype",
    "scanned_layers",
    "block_size",
    "pipeline_axis_name",
    "pipeline_axis_size",
    "params_partition_specs",
    "draws",
)


def _unboxed(tree):
    """(leaves with flax boxes unboxed, treedef, the boxes or None)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_box)
    if not any(is_box(x) for x in leaves):
        return leaves, treedef, None
    return [x.unbox() if is_box(x) else x for x in leaves], treedef, leaves


def _scanned_flags(scanned_layers, params, treedef) -> list[bool]:
    """Per leaf of ``params``, whether it stacks layers: ``scanned_layers``
    (called on ``params`` if callable), checked against them."""
    if scanned_layers is None:
        return [False] * treedef.num_leaves
    flags = scanned_layers(params) if callable(scanned_layers) else scanned_layers
    try:
        entries = treedef.flatten_up_to(flags)
    except (ValueError, TypeError):
        check_fits_params("scanned_layers", flags, params, prefix=False)
        raise
    leaves_with_paths = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = [jax.tree_util.keystr(path) for path, _ in leaves_with_paths]
    check_per_parameter_bools("scanned_layers", entries, paths)
    return [bool(f) for f in entries]


class _Recipe(NamedTuple):
    """scale_by_pro's arguments as its step uses them (b1 and the rates may be
    arrays under ``optax.inject_hyperparams``)."""

    lr_style: str | None
    b1: Any
    keep_momentum: bool
    normalize_grads: bool
    preconditioner_lr: Any
    style: str
    dtype: jnp.dtype
    noise_scale: Any
    padded_draws: bool  # draws='distributed_kron'
    update_probability: Any
    always_fit: bool  # a concrete update probability of 1
    pipeline_spec: PartitionSpec | None
    params_partition_specs: Any
    init_scale: float
    scanned_layers: Any
    max_size_dense: int
    block_size: int
    pipeline_axis_size: int
    skip_warning: SkipWarning  # this optimizer's, logged at its first skipped step


def _recipe(arguments: dict[str, Any]) -> _Recipe:
    """The recipe of scale_by_pro's (checked) arguments."""
    b1, prob = arguments["b1"], arguments["preconditioner_update_probability"]
    axis = arguments["pipeline_axis_name"]
    return _Recipe(
        lr_style=arguments["lr_style"],
        b1=b1,
        # b1 may be an array under optax.inject_hyperparams: only a concrete 0
        # drops the momentum buffer.
        keep_momentum=not (is_concrete_number(b1) and b1 == 0),
        normalize_grads=arguments["normalize_grads"],
        preconditioner_lr=arguments["preconditioner_lr"],
        style=arguments["preconditioner_update_style"],
        dtype=jnp.dtype(arguments["dtype"]),
        noise_scale=arguments["noise_scale"],
        padded_draws=arguments["draws"] == "distributed_kron",
        update_probability=prob,
        always_fit=is_concrete_number(prob) and prob == 1,
        pipeline_spec=None if axis is None else PartitionSpec(axis),
        params_partition_specs=arguments["params_partition_specs"],
        init_scale=arguments["preconditioner_init_scale"],
        scanned_layers=arguments["scanned_layers"],
        max_size_dense=arguments["max_size_dense"],
        block_size=arguments["block_size"],
        pipeline_axis_size=arguments["pipeline_axis_size"],
        skip_warning=SkipWarning("pro"),
    )
