"""The step guard every JAX optimizer applies to its gradients.

A step is *skipped* (zero update, state unchanged but for its count of skipped
steps: ``step_policy``) when some leaf's squared norm
‖g‖² = Σ|gᵢ|² is not finite in its working precision (float32, or float64 for
float64 leaves). That covers NaN and ±Inf entries, and finite entries so large
that their squares overflow: from about 1.8e19 in float32 (√ of float32's max),
the preconditioners' second moments (G·Gᴴ, or products of that size) overflow to
Inf and would poison the state for good. No real gradient is that large; a
single one is a bad batch, not a signal to follow.

Also the checks of what every JAX optimizer's ``init`` and ``update`` are given:
parameter dtypes, gradients shaped as the parameters, a state made for them,
and Python or NumPy scalars taken as arrays.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precond.jax._core.argument_trees import tree_mismatch


def _squared_norm(x: jax.Array) -> jax.Array:
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    x = x.astype(dtype) if not jnp.iscomplexobj(x) else x
    return jnp.sum(jnp.real(x * jnp.conj(x)))


def gradients_are_usable(*trees) -> jax.Array:
    """A bool scalar: every leaf of ``trees`` has a finite squared norm."""
    leaves = [x for tree in trees for x in jax.tree.leaves(tree)]
    if not leaves:
        return jnp.asarray(True)
    finite = jnp.stack([jnp.isfinite(_squared_norm(x)) for x in leaves])
    # Reduced after a sort, which XLA neither rewrites nor copies: it rewrites a
    # reduction of stacked scalars into a chain of ``and``s over all the leaves
    # and fuses a copy of that chain into every consumer (each leaf's masked
    # update and state), so the program grew as leaves², and its compile time
    # with it (BENCHMARKS.md's git history, "pro: compile time").
    return jnp.all(jax.lax.sort(finite.astype(jnp.int32)))


def all_finite(*trees) -> jax.Array:
    """A bool scalar: no leaf of ``trees`` has a NaN or ±Inf entry."""
    leaves = [x for tree in trees for x in jax.tree.leaves(tree)]
    if not leaves:
        return jnp.asarray(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def is_params_placeholder(params) -> bool:
    """Whether ``init`` was called by ``optax.tree.map_params``, which passes an
    instance of optax's private ``_ParamsPlaceholder`` (a pytree node without
    leaves) to learn where the state holds trees like the params. Per-parameter
    buffers should be that object; other fields must not contain it."""
    return type(params).__name__ == "_ParamsPlaceholder" and not jax.tree.leaves(params)


def check_parameter_dtypes(params, optimizer: str, *, complex_ok: bool) -> None:
    """Refuses, at ``init``, parameters no step can move: integer or bool leaves
    (and complex ones where ``complex_ok`` is False), naming the first such leaf."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or jnp.issubdtype(dtype, jnp.floating):
            continue
        where = f"parameter {jax.tree_util.keystr(path) or '(the root)'} is {dtype}"
        if jnp.issubdtype(dtype, jnp.complexfloating):
            if complex_ok:
                continue
            raise TypeError(
                f"{optimizer} does not support complex parameters: {where}. PSGD "
                "(precond.jax.kron, xmat, low_rank_approximation, affine) does."
            )
        raise TypeError(
            f"{optimizer} needs floating-point parameters: {where}. Leave it out "
            "of the optimized tree (e.g. optax.masked or optax.set_to_zero)."
        )


_SCALARS = (numbers.Number, np.generic)


def as_arrays(tree):
    """``tree`` with its Python and NumPy scalar leaves as JAX arrays, as optax's
    own optimizers take them (``{"w": 1.0}`` is a tree of one scalar parameter);
    ``tree`` itself when it has none."""
    if not any(isinstance(x, _SCALARS) for x in jax.tree.leaves(tree)):
        return tree

    def convert(x):
        return jnp.asarray(x) if isinstance(x, _SCALARS) else x

    return jax.tree.map(convert, tree)


def accepting_scalars(
    transform: optax.GradientTransformationExtraArgs,
) -> optax.GradientTransformationExtraArgs:
    """``transform`` whose ``init`` and ``update`` take Python and NumPy scalars
    among the params and gradients (:func:`as_arrays`)."""

    def init_fn(params):
        return transform.init(as_arrays(params))

    def update_fn(updates, state, params=None, **extra_args):
        return transform.update(
            as_arrays(updates), state, as_arrays(params), **extra_args
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class _ParamsPlaceholder:
    """What ``optax.tree.map_params`` passes to ``init`` (its class is private):
    a leafless node where the params go, so that ``init`` tells which fields of
    its state are trees like the params."""


jax.tree_util.register_pytree_node(
    _ParamsPlaceholder, lambda _: ((), None), lambda *_: _ParamsPlaceholder()
)


def _parameter_shaped_trees(state, init_fn) -> list:
    """The subtrees of ``state`` that are trees like the params (the momentum,
    say), as ``init_fn`` marks them for ``optax.tree.map_params``."""
    found = []

    def visit(marker, value):
        if isinstance(marker, _ParamsPlaceholder):
            found.append(value)
        return marker

    try:
        jax.tree.map(
            visit,
            init_fn(_ParamsPlaceholder()),
            state,
            is_leaf=lambda x: isinstance(x, _ParamsPlaceholder),
        )
    except Exception:  # a diagnostic only: where init fails, none is found
        return []
    return found


def _check_gradient_shapes(updates, params, state, init_fn, optimizer: str) -> None:
    """Refuses gradients that are not shaped as the parameters ``init`` saw:
    ``params`` when given, else the state's trees like the params (when it
    keeps one), naming the parameter and both shapes."""
    if params is None:
        treedef = jax.tree.structure(updates)
        params = next(
            (
                tree
                for tree in _parameter_shaped_trees(state, init_fn)
                if jax.tree.structure(tree) == treedef
                and all(hasattr(x, "shape") for x in jax.tree.leaves(tree))
            ),
            None,
        )
        if params is None:
            return
    elif jax.tree.structure(updates) != jax.tree.structure(params):
        problem = tree_mismatch(params, updates, ("the params", "the gradients"))
        raise ValueError(
            f"{optimizer}: the gradients' tree structure differs from the "
            f"params': {problem or jax.tree.structure(updates)}"
        )
    for (path, g), p in zip(
        jax.tree_util.tree_flatten_with_path(updates)[0],
        jax.tree.leaves(params),
        strict=True,
    ):
        if jnp.shape(g) != jnp.shape(p):
            raise ValueError(
                f"{optimizer}: the gradient of parameter "
                f"{jax.tree_util.keystr(path) or '(the root)'} has shape "
                f"{jnp.shape(g)}, expected {jnp.shape(p)} (the parameter's shape, "
                "as init saw it)"
            )


def check_state_matches(state, init_fn, params, updates, optimizer: str) -> None:
    """Refuses, when ``update`` is traced, gradients not shaped as the
    parameters (naming the parameter), and a state that ``init_fn`` would not
    make for these parameters (e.g. a checkpoint of another model), naming the
    first leaf that differs. Shapes are compared always, dtypes when ``params``
    is given (the gradients' dtypes may differ from the parameters')."""
    _check_gradient_shapes(updates, params, state, init_fn, optimizer)
    expected = jax.eval_shape(init_fn, updates if params is None else params)
    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(state)
    want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(expected)
    problem = None
    for (got_path, got), (want_path, want) in zip(
        got_leaves, want_leaves, strict=False
    ):
        where = jax.tree_util.keystr(want_path)
        if got_path != want_path:
            problem = f"it has {jax.tree_util.keystr(got_path)} where {where} belongs"
        elif jnp.shape(got) != want.shape:
            problem = f"{where} has shape {jnp.shape(got)}, expected {want.shape}"
        elif params is not None and jnp.result_type(got) != want.dtype:
            problem = f"{where} is {jnp.result_type(got)}, expected {want.dtype}"
        if problem:
            break
    if problem is None and got_tree != want_tree:
        problem = f"its structure is {got_tree}, expected {want_tree}"
    if problem is not None:
        raise ValueError(
            f"{optimizer}: the state does not match these parameters: {problem} "
            "(a state of another model, or made with other optimizer arguments or "
            "on another mesh?)"
        )
