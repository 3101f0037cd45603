"""Arguments that are trees matched against the params' tree (masks, per-parameter
flags and partition specs): where one stops fitting the params, and leaves that
must be bools, each error naming the argument and the leaf's path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

IsLeaf = Callable[[Any], bool] | None


def _is_leaf(node: Any, is_leaf: IsLeaf) -> bool:
    """A leaf of a tree (None and empty containers are nodes without children)."""
    leaves = jax.tree.leaves(node, is_leaf=is_leaf)
    return len(leaves) == 1 and leaves[0] is node


def _one_level(node: Any) -> tuple[Any, list[tuple[Any, Any]]]:
    """The node's own structure (its type, keys and arity) and its children with
    their keys."""

    def below(x):
        return x is not node

    children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=below)
    return jax.tree.structure(node, is_leaf=below), children


def _key_name(key: Any) -> Any:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return getattr(key, attribute)
    return key


def _describe(node: Any, is_leaf: IsLeaf) -> str:
    if _is_leaf(node, is_leaf):
        if hasattr(node, "shape"):
            return f"a leaf of shape {tuple(node.shape)}"
        return f"a leaf ({node!r})"
    if node is None:
        return "None"
    _, children = _one_level(node)
    keys = tuple(_key_name(path[0]) for path, _ in children)
    return f"a {type(node).__name__} with keys {keys}"


def tree_mismatch(
    prefix: Any,
    full: Any,
    names: tuple[str, str],
    *,
    prefix_is_leaf: IsLeaf = None,
    full_is_leaf: IsLeaf = None,
) -> str | None:
    """Where ``prefix`` stops being a prefix of ``full`` (the tree down to
    ``prefix``'s leaves, each of which stands for a whole subtree of ``full``),
    as ``"at <path>: <what prefix has> in <names[0]>, <what full has> in
    <names[1]>"``; None where it is one."""

    def walk(a, b, path):
        if _is_leaf(a, prefix_is_leaf):
            return None
        problem = _is_leaf(b, full_is_leaf)
        if not problem:
            a_structure, a_children = _one_level(a)
            b_structure, b_children = _one_level(b)
            problem = a_structure != b_structure
        if problem:
            where = jax.tree_util.keystr(path) or "the root"
            return (
                f"at {where}: {_describe(a, prefix_is_leaf)} in {names[0]}, "
                f"{_describe(b, full_is_leaf)} in {names[1]}"
            )
        for (key, a_child), (_, b_child) in zip(a_children, b_children, strict=True):
            found = walk(a_child, b_child, (*path, *key))
            if found:
                return found
        return None

    return walk(prefix, full, ())


def is_bool(value: Any) -> bool:
    """A Python or NumPy bool, or a bool scalar array."""
    if isinstance(value, bool | np.bool_):
        return True
    dtype = getattr(value, "dtype", None)
    return getattr(dtype, "kind", None) == "b" and getattr(value, "ndim", 1) == 0


def check_bool_leaves(name: str, tree: Any, rule: str) -> None:
    """Every leaf of ``tree`` a bool: else ``TypeError("Invalid
    <name><path>=<leaf!r>: must be True or False")``, or, for a tree that is a
    single leaf, ``must be <rule>`` (what the whole argument may be)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not is_bool(leaf):
            where = jax.tree_util.keystr(path)
            must = f"True or False ({name}: {rule})" if where else rule
            raise TypeError(f"Invalid {name}{where}={leaf!r}: must be {must}")


def check_per_parameter_bools(name: str, entries: list, paths: list[str]) -> None:
    """Each parameter's entry of a flag tree (``scanned_layers``, resolved) a
    bool: else ``TypeError`` naming the parameter's path."""
    for entry, path in zip(entries, paths, strict=True):
        if not is_bool(entry):
            raise TypeError(f"Invalid {name}{path}={entry!r}: must be True or False")


def check_fits_params(name: str, tree: Any, params: Any, *, prefix: bool) -> None:
    """``tree`` (an argument, resolved if it was a callable) fits ``params``: a
    prefix of its tree when ``prefix`` (optax's masks), else the same tree down
    to the params' leaves. Raises ``ValueError`` naming where it does not."""
    if prefix:
        problem = tree_mismatch(tree, params, (name, "the params"))
    else:
        problem = tree_mismatch(params, tree, ("the params", name))
    if problem is not None:
        rule = (
            "a prefix of the params' tree (a leaf stands for a whole subtree)"
            if prefix
            else "the params' tree, with one entry per parameter"
        )
        raise ValueError(f"Invalid {name}: must be {rule}; {problem}")


def check_partition_spec(name, value) -> None:
    if value is not None and not isinstance(value, PartitionSpec):
        raise ValueError(
            f"Invalid {name}={value!r}: must be a jax.sharding.PartitionSpec or None"
        )


def check_mesh(name, value) -> None:
    """None or a mesh (every JAX optimizer's ``mesh``)."""
    if value is not None and not isinstance(
        value, jax.sharding.Mesh | jax.sharding.AbstractMesh
    ):
        raise TypeError(
            f"Invalid {name}={value!r}: must be None or a jax.sharding.Mesh"
        )


def check_partition_specs_tree(name, value) -> None:
    """None or a pytree of PartitionSpecs (or None), at construction (pro's and
    Shampoo's ``params_partition_specs``; its structure is checked against the
    params by ``init``)."""
    is_spec = lambda x: x is None or isinstance(x, PartitionSpec)  # noqa: E731
    leaves = jax.tree.leaves(value, is_leaf=is_spec)
    if value is not None and not all(is_spec(x) for x in leaves):
        raise TypeError(
            f"Invalid {name}={value!r}: must be None or a pytree of PartitionSpecs "
            "(or None) like the params"
        )


SCANNED_LAYERS_RULE = (
    "None, a pytree of bools like the params, or a callable of the params returning one"
)


def check_scanned_layers(name, value) -> None:
    """None, a callable of the params, or a pytree of bools; ``init`` matches it
    against the params (and checks what a callable returns)."""
    if value is None or callable(value):
        return
    check_bool_leaves(name, value, SCANNED_LAYERS_RULE)


def checked_at_init(name, value) -> None:
    """Pytrees matched against the params (``params_partition_specs``): ``init``
    checks them, with the params."""
