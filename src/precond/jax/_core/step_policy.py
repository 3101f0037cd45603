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

Reporting. The one field a skipped step changes is the state's ``skipped``
(int32 scalar): :func:`skip_counted` adds 1, saturating at 2³¹ − 1, and
:func:`precond.jax.skipped_steps` reads the counters of a whole optax state.
Asked for, the first skipped step of each optimizer is also logged at WARNING
on the ``precond.jax`` logger (:class:`SkipWarning`), through a host callback
that only runs on a skipped step. It is compiled in only when that logger's own
level is set to WARNING or lower when the step is traced
(:func:`warning_wanted`): a host callback costs every step, taken or not (it
makes the dispatch of the step synchronous and XLA:CPU schedules the program
around it; CHANGELOG.md has the measurement), and a program holding one is not
written to JAX's persistent compilation cache.
"""

from __future__ import annotations

import logging
import numbers
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precond.jax._core.guards import all_finite, gradients_are_usable

INT32_MAX = jnp.iinfo(jnp.int32).max
LOGGER_NAME = "precond.jax"
SKIP_MESSAGE = (
    "precond.jax.%s skipped a step (steps taken so far: %d): a gradient is NaN, "
    "±Inf or so large that its squared norm overflows, so no state changed and "
    "its update is zero (the parameters moved by weight decay alone, if any). "
    "precond.jax.skipped_steps(opt_state) counts such steps; this warning is not "
    "repeated."
)
# Held while a SkipWarning checks and sets its flag: the callback of a sharded
# step may run on several devices' threads at once.
_WARNING_LOCK = threading.Lock()


def step_key(seed: int | jax.Array, count: jax.Array | int) -> jax.Array:
    """The key of step ``count``'s draws: fold_in(PRNGKey(seed), count).

    ``seed`` is an integer (Python's or NumPy's) or already a PRNG key (then
    folded as it is).
    """
    key = jax.random.PRNGKey(seed) if isinstance(seed, numbers.Integral) else seed
    return jax.random.fold_in(key, count)


def saturating_increment(count: jax.Array) -> jax.Array:
    """count + 1, saturating at the int32 maximum 2³¹ − 1."""
    return jnp.where(count < INT32_MAX, count + 1, count)


def next_count(count: jax.Array, usable: jax.Array | bool = True) -> jax.Array:
    """count + 1 (saturating at 2³¹ − 1) when ``usable``, else count."""
    return jnp.where(usable, saturating_increment(count), count)


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


class SkipWarning:
    """The WARNING of an optimizer's first skipped step: one object per
    optimizer (per ``scale_by_*`` call), so each logs once per process, however
    many steps it skips, programs it is traced into or devices run its callback.

    Called on the host by :func:`warn_if_skipped`'s callback with the step's
    ``usable`` flag and step count; under ``jax.vmap`` both are batched and the
    callback runs for every step, usable or not, so it checks ``usable`` itself.
    """

    def __init__(self, optimizer: str):
        self.optimizer = optimizer  # its name in precond.jax, e.g. "kron"
        self.warned = False

    def __call__(self, usable: Any, count: Any) -> None:
        usable, count = np.broadcast_arrays(np.asarray(usable), np.asarray(count))
        skipped = np.flatnonzero(~usable)
        if skipped.size == 0:
            return
        with _WARNING_LOCK:
            if self.warned:
                return
            self.warned = True
        logging.getLogger(LOGGER_NAME).warning(
            SKIP_MESSAGE, self.optimizer, int(count.flat[skipped[0]])
        )


def warning_wanted() -> bool:
    """Whether skipped steps are to be logged from inside the step: the
    ``precond.jax`` logger's own level is set (not inherited) and lets WARNING
    through, as ``logging.getLogger("precond.jax").setLevel(logging.WARNING)``
    sets it."""
    logger = logging.getLogger(LOGGER_NAME)
    return logger.level != logging.NOTSET and logger.isEnabledFor(logging.WARNING)


def warn_if_skipped(usable: jax.Array, count: jax.Array, warning: SkipWarning) -> None:
    """Calls ``warning(usable, count)`` on the host when the step is not
    ``usable``; adds nothing to the program unless :func:`warning_wanted` when
    the step is traced. The programs with and without the callback are fused
    apart by XLA: a float32 result may differ in its last bit."""
    if not warning_wanted():
        return
    jax.lax.cond(
        usable,
        lambda: None,
        lambda: jax.debug.callback(warning, usable, count),
    )


def skip_counted(usable: jax.Array, state: Any, warning: SkipWarning) -> Any:
    """``state`` (an optimizer's state NamedTuple after the step's guard, with
    fields ``count`` and ``skipped``) with this step counted in ``skipped``
    when it is not ``usable``: +1, saturating at 2³¹ − 1, and reported to
    ``warning`` (:func:`warn_if_skipped`) with the steps taken so far."""
    warn_if_skipped(usable, state.count, warning)
    skipped = jnp.where(usable, state.skipped, saturating_increment(state.skipped))
    return state._replace(skipped=skipped)
