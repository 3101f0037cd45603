"""The step guard every JAX optimizer applies to its gradients.

A step is *skipped* (zero update, state unchanged) when some leaf's squared norm
‖g‖² = Σ|gᵢ|² is not finite in its working precision (float32, or float64 for
float64 leaves). That covers NaN and ±Inf entries, and finite entries so large
that their squares overflow: from about 1.8e19 in float32 (√ of float32's max),
the preconditioners' second moments (G·Gᴴ, or products of that size) overflow to
Inf and would poison the state for good. No real gradient is that large; a
single one is a bad batch, not a signal to follow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
    # with it (BENCHMARKS.md, "pro: compile time").
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


def check_state_matches(state, init_fn, params, updates, optimizer: str) -> None:
    """Refuses, when ``update`` is traced, a state that ``init_fn`` would not
    make for these parameters (e.g. a checkpoint of another model), naming the
    first leaf that differs. Shapes are compared always, dtypes when ``params``
    is given (the gradients' dtypes may differ from the parameters')."""
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
