"""Where Kron's state and work live on a device mesh.

Momentum follows its parameter. Preconditioner factors live in stacks of equal
units (see ``kron._layout``), and every stack is split along its unit axis over
the *unit axes* of the mesh, so that each device holds and fits about 1/N of the
factors and a unit's kernels never communicate. The unit axes are the mesh axes
named in ``preconditioner_partition_spec``, or else every mesh axis that shards a
parameter (in the order the parameter specs first name them).

Parameter shardings come, in this order, from ``params_partition_specs``, from
boxed parameters (flax ``nn.Partitioned``), or from the parameters' types (explicit
meshes, where ``jax.typeof(x).sharding`` carries them); the mesh from the ``mesh``
argument, the context mesh (``jax.set_mesh``) or the parameters' shardings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from precond.jax._core.argument_trees import tree_mismatch


class ShardingPlan(NamedTuple):
    """How one call of Kron's init or update places arrays on the mesh."""

    mesh: Any  # jax.sharding.Mesh or AbstractMesh; None without a mesh
    param_specs: tuple | None  # a PartitionSpec per parameter leaf; None: not known
    unit_axes: tuple[str, ...]  # mesh axes that split the unit axis of every stack
    explicit: bool  # the mesh has Explicit axes: the body runs under auto_axes

    @property
    def shards(self) -> int:
        """Number of pieces each stack is split into."""
        if self.mesh is None:
            return 1
        return math.prod(self.mesh.shape[axis] for axis in self.unit_axes)

    @property
    def stack_spec(self) -> PartitionSpec:
        """Spec of a stack of units (units, ...): split along the unit axis."""
        if not self.unit_axes:
            return PartitionSpec()
        axes = self.unit_axes
        return PartitionSpec(axes[0] if len(axes) == 1 else axes)

    def constrain(self, x: jax.Array, spec: PartitionSpec | None) -> jax.Array:
        """``x`` with the sharding ``spec`` (a no-op without a mesh or spec)."""
        if self.mesh is None or spec is None:
            return x
        if jax.sharding.get_abstract_mesh().empty:
            # No context mesh: name the mesh (a concrete one, from the mesh
            # argument or the parameters' shardings).
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
        return jax.lax.with_sharding_constraint(x, spec)

    def constrain_params(self, leaves: Sequence[jax.Array]) -> list[jax.Array]:
        """Each leaf with the sharding of its parameter."""
        if self.param_specs is None:
            return list(leaves)
        return [
            self.constrain(x, spec)
            for x, spec in zip(leaves, self.param_specs, strict=True)
        ]

    def run(self, body: Callable, out_specs: Any, *args) -> Any:
        """``body(*args)``; on an explicit mesh, under ``auto_axes`` so that its
        internal sharding constraints apply, with outputs sharded by
        ``out_specs`` (a pytree of PartitionSpecs like the outputs)."""
        if not self.explicit:
            return body(*args)
        return jax.sharding.auto_axes(body, out_sharding=out_specs)(*args)


def is_box(node: Any) -> bool:
    """A flax-style box around one parameter (``nn.Partitioned`` and kin)."""
    return hasattr(node, "unbox") and hasattr(node, "get_partition_spec")


def per_parameter(option: Any, params: Any, name: str) -> list:
    """``option`` (a pytree like ``params``) as one entry per parameter leaf.

    ``option`` may have the structure of ``params`` with an entry per leaf, or, for
    boxed params (flax ``nn.Partitioned``), an entry per box, as
    ``nn.get_partition_spec`` returns.
    """
    treedef = jax.tree.structure(params)
    is_spec_leaf = lambda x: x is None or isinstance(x, PartitionSpec)  # noqa: E731
    try:
        return treedef.flatten_up_to(option)
    except (ValueError, TypeError):
        pass
    boxes, box_treedef = jax.tree.flatten(params, is_leaf=is_box)
    try:
        entries = box_treedef.flatten_up_to(option)
    except (ValueError, TypeError):
        entries = None
    if entries is None or any(len(jax.tree.leaves(box)) != 1 for box in boxes):
        problem = tree_mismatch(
            params, option, ("the params", name), full_is_leaf=is_spec_leaf
        )
        raise ValueError(
            f"Invalid {name}: must have the structure of the params ({treedef}), "
            f"with one entry per parameter; got "
            f"{jax.tree.structure(option, is_leaf=is_spec_leaf)}"
            + ("" if problem is None else f"; {problem}")
        )
    return entries


def typed_sharding(x: Any) -> NamedSharding | None:
    """The sharding in ``x``'s type (explicit meshes only; the same in and out of
    ``jit``, unlike a concrete array's ``.sharding``)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
        return sharding
    return None


def explicit_specs(tree: Any) -> Any | None:
    """Each leaf's PartitionSpec from its type (``PartitionSpec()`` if it has
    none) when some leaf lives on a mesh with Explicit axes; None otherwise."""
    leaves, treedef = jax.tree.flatten(tree)
    shardings = [typed_sharding(x) for x in leaves]
    if not any(
        s is not None and AxisType.Explicit in s.mesh.axis_types for s in shardings
    ):
        return None
    return treedef.unflatten(
        [PartitionSpec() if s is None else s.spec for s in shardings]
    )


def _mesh_from_leaves(leaves: Sequence[Any]) -> Any:
    for x in leaves:
        sharding = typed_sharding(x)
        if sharding is not None:
            return sharding.mesh
    return None


def _specs_from_leaves(leaves: Sequence[Any]) -> tuple | None:
    """Each leaf's spec from its type, or None if some leaf's type has none."""
    shardings = [typed_sharding(x) for x in leaves]
    specs = tuple(s.spec for s in shardings if s is not None)
    return specs if len(specs) == len(shardings) else None


def _canonical(spec: PartitionSpec) -> PartitionSpec:
    """``spec`` without trailing Nones, as jit reports shardings: P('x', None) and
    P('x') place an array the same, but jit caches on the spelling."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _mesh_axes(spec: PartitionSpec) -> list[str]:
    axes = []
    for entry in spec:
        if entry is None:
            continue
        axes.extend(entry if isinstance(entry, tuple) else (entry,))
    return axes


def check_spec(
    spec: Any,
    mesh: Any,
    name: str,
    ndim: int | None = None,
    shape: tuple[int, ...] | None = None,
) -> None:
    """A clear error unless ``spec`` is a PartitionSpec valid on ``mesh`` (if any)
    for an array of ``ndim`` dims or of ``shape`` (whose dims the mesh axes that
    split them must divide: JAX places no array unevenly)."""
    if not isinstance(spec, PartitionSpec):
        raise ValueError(f"Invalid {name}={spec!r}: must be a PartitionSpec")
    axes = _mesh_axes(spec)
    if mesh is not None:
        unknown = [axis for axis in axes if axis not in mesh.axis_names]
        if unknown:
            raise ValueError(
                f"Invalid {name}={spec}: names mesh axes {unknown} that are not in "
                f"the mesh, whose axes are {tuple(mesh.axis_names)}"
            )
    if len(set(axes)) != len(axes):
        raise ValueError(f"Invalid {name}={spec}: names a mesh axis twice")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and len(spec) > ndim:
        raise ValueError(
            f"Invalid {name}={spec}: has {len(spec)} entries for an array with "
            f"{ndim} dims"
        )
    if shape is not None and mesh is not None:
        _check_divides(spec, mesh, name, tuple(shape))


def _check_divides(spec: PartitionSpec, mesh: Any, name: str, shape: tuple) -> None:
    """Each dim of ``shape`` a multiple of the devices its mesh axes split it in."""
    sizes = dict(mesh.shape)
    for dim, entry in enumerate(spec):
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        pieces = math.prod(sizes[axis] for axis in axes)
        if shape[dim] % pieces:
            raise ValueError(
                f"Invalid {name}={spec}: splits dim {dim} of the parameter's shape "
                f"{shape} over mesh axes {axes} ({pieces} devices), which does "
                f"not divide {shape[dim]} (mesh axis sizes: {sizes}); JAX places "
                "no array unevenly"
            )


def plan_sharding(
    params: Any,
    *,
    params_partition_specs: Any,
    preconditioner_partition_spec: PartitionSpec | None,
    mesh: Any,
) -> ShardingPlan:
    """Resolves the mesh, every parameter's spec and the unit axes (see module).

    Inferred unit axes are the mesh axes in the order the parameter specs first
    name them. Raises if specs are given but no mesh is found: init and update
    need one to place arrays (:func:`partition_specs_only` does not).
    """
    plan = partition_specs_only(
        params,
        params_partition_specs=params_partition_specs,
        preconditioner_partition_spec=preconditioner_partition_spec,
        mesh=mesh,
    )
    if plan.mesh is None and (
        params_partition_specs is not None or preconditioner_partition_spec is not None
    ):
        raise ValueError(
            "params_partition_specs and preconditioner_partition_spec need a mesh: "
            "call init and update under `with jax.set_mesh(mesh):`, or pass "
            "mesh=... to kron"
        )
    return plan


def partition_specs_only(
    params: Any,
    *,
    params_partition_specs: Any,
    preconditioner_partition_spec: PartitionSpec | None,
    mesh: Any,
) -> ShardingPlan:
    """:func:`plan_sharding` without the need for a mesh (the specs are checked
    against one only if there is one)."""
    leaves, treedef = jax.tree.flatten(params)
    if mesh is None and not jax.sharding.get_abstract_mesh().empty:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None:
        mesh = _mesh_from_leaves(leaves)
    if params_partition_specs is not None:
        specs = per_parameter(params_partition_specs, params, "params_partition_specs")
        specs = tuple(PartitionSpec() if s is None else s for s in specs)
    elif any(is_box(node) for node in jax.tree.leaves(params, is_leaf=is_box)):
        specs = tuple(
            node.get_partition_spec() if is_box(node) else PartitionSpec()
            for node in jax.tree.leaves(params, is_leaf=is_box)
        )
    else:
        specs = _specs_from_leaves(leaves) if mesh is not None else None
    if specs is not None:
        for spec, x, path in zip(
            specs, leaves, _leaf_paths(treedef, len(leaves)), strict=True
        ):
            check_spec(spec, mesh, f"params_partition_specs{path}", shape=x.shape)
        specs = tuple(_canonical(spec) for spec in specs)
    if preconditioner_partition_spec is not None:
        check_spec(preconditioner_partition_spec, mesh, "preconditioner_partition_spec")
        unit_axes = tuple(_mesh_axes(preconditioner_partition_spec))
    elif specs is not None:
        unit_axes = tuple(dict.fromkeys(a for s in specs for a in _mesh_axes(s)))
    else:
        unit_axes = ()
    explicit = any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
    return ShardingPlan(mesh, specs, unit_axes, explicit)


def _leaf_paths(treedef: Any, count: int) -> list[str]:
    paths = jax.tree_util.tree_flatten_with_path(treedef.unflatten([0] * count))[0]
    return [jax.tree_util.keystr(path) for path, _ in paths]


def with_auto_axes(body: Callable, out_like: Any, *args) -> Any:
    """``body(*args)``; when some argument lives on a mesh with Explicit axes
    (sharding in types), under ``jax.sharding.auto_axes``: the compiler places
    the preconditioner's work (reshapes of sharded leaves included) as on an
    auto mesh, and the outputs are sharded like ``out_like`` (a tree with the
    outputs' structure; replicated where it has no sharding)."""
    specs = explicit_specs(args)
    if specs is None:
        return body(*args)
    out_specs = explicit_specs(out_like)
    if out_specs is None:
        out_specs = jax.tree.map(lambda _: PartitionSpec(), out_like)
    return jax.sharding.auto_axes(body, out_sharding=out_specs)(*args)
