"""Where Shampoo's per-parameter buffers live on a device mesh.

The momentum, the grafting momentum and the grafting accumulator (trees like
the params) follow their parameter's sharding, as in
:func:`~precond.jax.shampoo._state.state_partition_specs` (an int8 momentum:
its values and scales as that function says). The parameters' specs come from
the keyword-only ``params_partition_specs`` (with ``mesh``, or the context mesh
of ``jax.set_mesh``), or else from the params' types on a mesh with Explicit
axes (``jax.typeof(x).sharding``), as Kron's (:mod:`mesh_placement`). The
statistics and roots stacks are placed by ``statistics_partition_spec`` (with
``shard_optimizer_states``), the step count and the root errors (a few floats
per parameter) replicate. Without specs, nothing is placed: XLA decides.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from precond.jax._core.mesh_placement import (
    ShardingPlan,
    check_spec,
    explicit_specs,
    partition_specs_only,
)
from precond.jax.shampoo._config import Config
from precond.jax.shampoo._math import QuantizedArray
from precond.jax.shampoo._state import ShampooState, buffer_spec, full_spec

# The ShampooState fields that are trees like the params.
PER_PARAMETER_FIELDS = ("momentum", "diagonal_momentum", "diagonal_statistics")


def parameter_placement(params: Any, config: Config) -> ShardingPlan | None:
    """The mesh and each parameter's spec for params like ``params`` (a tree of
    arrays, tracers or ``ShapeDtypeStruct``s); None when no spec is known.

    Raises a ``ValueError`` naming ``params_partition_specs`` when it does not
    fit the params (structure, mesh axes, rank) or when no mesh is found.
    """
    specs = config.params_partition_specs
    if specs is None:
        specs = explicit_specs(params)  # None unless on a mesh with Explicit axes
        if specs is None:
            return None
    plan = partition_specs_only(
        params,
        params_partition_specs=specs,
        preconditioner_partition_spec=None,
        mesh=config.mesh,
    )
    if plan.mesh is None:
        raise ValueError(
            f"Invalid params_partition_specs={config.params_partition_specs!r}: "
            "needs a mesh: call init and update under `with jax.set_mesh(mesh):`, "
            "or pass mesh=... to distributed_shampoo or scale_by_shampoo"
        )
    return plan


def check_stack_specs(config: Config) -> None:
    """At ``init``: ``preconditioner_partition_spec`` and the stored
    ``statistics_partition_spec``, when PartitionSpecs, name only axes of the
    mesh they will be used on (the context mesh, else ``mesh``), each error
    naming the argument (JAX's would name neither, at the first update)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        mesh = config.mesh
    if mesh is None:
        return
    for name in ("preconditioner_partition_spec", "statistics_partition_spec"):
        spec = getattr(config, name)
        if isinstance(spec, PartitionSpec):
            check_spec(spec, mesh, name)


def _placed(x: jax.Array, spec: PartitionSpec, plan: ShardingPlan) -> jax.Array:
    """``x`` laid out by ``spec`` on the plan's mesh: a reshard on an explicit
    mesh (where a constraint only asserts), else a sharding constraint."""
    entries = list(spec)
    while entries and entries[-1] is None:  # spelled as jit reports it
        entries.pop()
    spec = PartitionSpec(*entries)
    if not plan.explicit:
        return plan.constrain(x, spec)
    on_mesh = isinstance(plan.mesh, jax.sharding.Mesh)
    return jax.sharding.reshard(x, NamedSharding(plan.mesh, spec) if on_mesh else spec)


def _placed_buffer(buffer, spec: tuple, plan: ShardingPlan):
    """A per-parameter buffer placed as its parameter (of spec ``spec``)."""
    specs: Any = buffer_spec(buffer, spec)  # a spec, or a QuantizedArray of specs
    if not isinstance(buffer, QuantizedArray):
        return _placed(buffer, specs, plan)
    return QuantizedArray(
        _placed(buffer.values, specs.values, plan),
        _placed(buffer.scales, specs.scales, plan),
        buffer.diagonal,
    )


def placed_like_params(
    tree: Any, shapes: list, treedef, plan: ShardingPlan | None
) -> Any:
    """``tree`` (a tree like the params, of arrays, int8 ``QuantizedArray``s or
    None) with each parameter's buffer placed as the parameter, whose shape is
    its entry of ``shapes``."""
    if plan is None or plan.param_specs is None:
        return tree
    buffers = treedef.flatten_up_to(tree)
    placed = [
        None if b is None else _placed_buffer(b, full_spec(spec, len(shape)), plan)
        for b, spec, shape in zip(buffers, plan.param_specs, shapes, strict=True)
    ]
    return jax.tree.unflatten(treedef, placed)


def placed_state(
    state: ShampooState, like_params: Any, config: Config, updates: Any = None
) -> tuple[Any, ShampooState]:
    """``(updates, state)`` with the state's per-parameter buffers (and the
    ``updates``, a tree like the params, if given) placed as the parameters
    that ``like_params`` (the params or the gradients) stand for; unchanged
    when no spec is known (see the module docstring)."""
    if not jax.tree.leaves(like_params):  # no params, or optax's placeholder
        return updates, state
    plan = parameter_placement(like_params, config)
    if plan is None:
        return updates, state
    leaves, treedef = jax.tree.flatten(like_params)
    shapes = [tuple(x.shape) for x in leaves]
    if updates is not None:
        updates = placed_like_params(updates, shapes, treedef, plan)
    fields = {
        field: placed_like_params(getattr(state, field), shapes, treedef, plan)
        for field in PER_PARAMETER_FIELDS
    }
    return updates, state._replace(**fields)
