"""The step policy of every JAX optimizer: counting, random keys, skipping.

Counting. A state's ``count`` (int32 scalar) is the number of steps taken with
usable gradients: :func:`next_count` adds 1, saturating at 2³¹ − 1 (a count
never wraps to a negative step), and leaves it unchanged on a skipped step.

Randomness. The draws of step n (n = the count after the step, so 1 on the
first) come from :func:`step_key` (seed, n) = fold_in(PRNGKey(seed), n), a
function of (seed, n) alone: a run restored from a checkpoint repeats the same
draws, and every device draws the same without communication. Streams inside a
step are split or folded from that key by the identity of what they draw for (a
unit, a stack), never by its place on a mesh. The exception is psgd-jax's
XMat/LRA/Affine, whose trajectories are pinned to psgd-jax's by the parity
tests: they carry a key in their state and split it each step in psgd-jax's
order. That key is state like the count, so both guarantees hold for them too.

Skipping. A step is *usable* (:func:`step_is_usable`) when every leaf of its
gradients (and Hessian-vector products) has a finite squared norm Σ|gᵢ|² in its
working precision. NaN, ±Inf and finite entries so large that their squares
overflow (|g| ≳ 1.8e19 in float32) make it unusable: such a gradient would
overflow the second moments (G·Gᴴ) that the preconditioners fit. An unusable
step returns zero updates (:func:`zeros_unless_usable`) and leaves the whole
state as it was (:func:`state_unless_skipped`; :func:`fields_unless_skipped`
where the large fields kept their old values in their own update). A fit that
still overflows on a usable step keeps the old factors
(:func:`keep_if_overflowed`); the rest of the step goes on.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from precond.jax._guards import all_finite, gradients_are_usable

INT32_MAX = jnp.iinfo(jnp.int32).max


def step_key(seed: int | jax.Array, count: jax.Array | int) -> jax.Array:
    """The key of step ``count``'s draws: fold_in(PRNGKey(seed), count).

    ``seed`` is an int or already a PRNG key (then folded as it is).
    """
    key = jax.random.PRNGKey(seed) if isinstance(seed, int) else seed
    return jax.random.fold_in(key, count)


def next_count(count: jax.Array, usable: jax.Array | bool = True) -> jax.Array:
    """count + 1 (saturating at 2³¹ − 1) when ``usable``, else count."""
    incremented = jnp.where(count < INT32_MAX, count + 1, count)
    return jnp.where(usable, incremented, count)


def step_is_usable(*trees) -> jax.Array:
    """A bool scalar: every leaf of ``trees`` (gradients, Hessian-vector
    products) has a finite squared norm, so the step may change the state."""
    return gradients_are_usable(*trees)


def zeros_unless_usable(usable: jax.Array, updates: Any, like: Any) -> Any:
    """``updates`` where the step is usable, else zeros; in ``like``'s dtypes
    (a tree like ``updates``, e.g. the gradients)."""
    return jax.tree.map(
        lambda u, g: jnp.where(usable, u, 0).astype(g.dtype), updates, like
    )


def state_unless_skipped(usable: jax.Array, new_state: Any, old_state: Any) -> Any:
    """``new_state`` after a usable step, else ``old_state``, leaf by leaf."""
    return jax.tree.map(
        lambda new, old: jnp.where(usable, new, old), new_state, old_state
    )


def fields_unless_skipped(
    usable: jax.Array, new_state: Any, old_state: Any, already_kept: tuple[str, ...]
) -> Any:
    """:func:`state_unless_skipped` over every field of the NamedTuple
    ``new_state`` except those named in ``already_kept``, taken from
    ``new_state`` as they are: their update already kept the old values on a
    skipped step, and a select over them would copy them on every step."""
    kept = {field: getattr(new_state, field) for field in already_kept}
    empty = dict.fromkeys(already_kept, ())
    rest = state_unless_skipped(
        usable, new_state._replace(**empty), old_state._replace(**empty)
    )
    return rest._replace(**kept)


def keep_if_overflowed(new: Any, old: Any) -> Any:
    """``new`` (fitted factors, a tree like ``old``) if all its entries are
    finite, else ``old``: a fit that overflowed is dropped. Leaves keep
    ``old``'s dtypes."""
    fitted = all_finite(new)
    return jax.tree.map(lambda n, o: jnp.where(fitted, n, o).astype(o.dtype), new, old)
