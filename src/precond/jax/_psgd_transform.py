"""The optax skeleton shared by PSGD XMat, LRA and Affine (psgd-jax semantics).

Each of them differs only in the preconditioner P = QᵀQ: how Q starts, how one
fit on a pair (v, h) changes it, and how P is applied. :class:`Preconditioner`
holds those three functions; :func:`scale_by_psgd` does the rest, the same for
all of them:

1. With probability p (or the caller's ``update_preconditioner`` flag in Newton
   mode) fit Q to (v, h): Newton mode uses ``Hvp=h, vector=v``; whitening uses
   h = the raw gradient and v ~ N(0, I) (drawn here, or by or integrated out
   in the preconditioner); in whitening mode the first two steps always fit.
   The random draws follow psgd-jax's order from the same key, so a seed gives
   psgd-jax's trajectory.
2. m ← β₁m + (1−β₁)g, m̂ = m/(1−β₁ⁿ) (Nesterov: β₁m/(1−β₁ⁿ⁺¹) +
   (1−β₁)g/(1−β₁ⁿ)).
3. U = P·m̂, clipped to the global norm ``update_global_norm_clip``.

A step whose gradient (or Hvp) has a NaN or ±Inf entry returns zeros and leaves
the state unchanged; a fit that overflows (a finite but huge gradient) keeps the
old factors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec
from optax import tree_utils as otu

from precond._common.validation import (
    check_bool,
    check_choice,
    check_real,
    is_concrete_number,
)
from precond._common.xla_workarounds import warn_if_xla_cpu_deadlock_possible
from precond.jax._guards import (
    all_finite,
    check_parameter_dtypes,
    check_state_matches,
    gradients_are_usable,
)
from precond.jax._kron_math import complex_dtype, is_complex
from precond.jax._kron_sharding import explicit_specs
from precond.jax._precision import MATMUL_PRECISIONS, check_floating_dtype
from precond.jax.hessian import newton_arguments

STEP_NORMALIZER_ORDERS = ("1st", "2nd")
DEFAULT_SEED = 36  # psgd-jax's PRNGKey(36)


class PSGDState(NamedTuple):
    """State of :func:`scale_by_psgd` (XMat, LRA, Affine): arrays only."""

    count: jax.Array  # shape=(), int32: steps taken
    key: jax.Array  # PRNG key (uint32[2]): the update decisions and noise
    mu: optax.Updates | None  # like params; None when b1 == 0
    preconditioner: Any  # the optimizer's factors of Q (a NamedTuple of arrays)
    updates: jax.Array  # shape=(), int32: preconditioner fits so far


class Preconditioner(NamedTuple):
    """The functions that make one PSGD variant.

    init(params, scale, key) -> (factors, key): Q = scale·I (``scale`` is 1.0
        when the caller asked for automatic scaling; ``fit`` rescales at the
        first fit); random initial factors split their draws off ``key`` and
        return what is left of it (psgd-jax's order of draws).
    fit(factors, h, v, lr, first, key, newton) -> factors: one step of Q on the
        pair (v, h), pytrees like the gradients. ``v`` is None in whitening mode
        when ``draws_vector`` is False (the preconditioner integrates v out or
        draws it from ``key``). ``first`` (a bool array) asks for the automatic
        initial scaling of Q; ``newton`` (a Python bool) says whether v came from
        the caller (scale from Σv²/Σh²) or is whitening noise (E[Σv²] = n).
        ``key`` is a fresh subkey when ``fit_uses_key``, else None.
    apply(factors, m) -> P·m, a pytree like m.
    draws_vector: in whitening mode the transform draws v ~ N(0, I) like the
        gradients (``optax.tree.random_like``) before deciding to fit.
    fit_uses_key: each fit splits a subkey off the state's key.
    """

    init: Callable[[Any, float, jax.Array], tuple[Any, jax.Array]]
    fit: Callable[..., Any]
    apply: Callable[[Any, Any], Any]
    draws_vector: bool = True
    fit_uses_key: bool = False


def flat_size_and_dtype(params: Any) -> tuple[int, jnp.dtype]:
    """The number of entries of all leaves of ``params`` and the dtype
    ``ravel_pytree`` would flatten them to (float32 when there are none), from
    shapes alone: ``params`` may be abstract (``jax.ShapeDtypeStruct``)."""
    leaves = jax.tree.leaves(params)
    n = sum(math.prod(jnp.shape(x)) for x in leaves)
    dtype = jnp.result_type(*(x.dtype for x in leaves)) if leaves else jnp.float32
    return n, jnp.dtype(dtype)


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


def _optional(check: Callable) -> Callable:
    """``check``, skipped for None."""

    def check_optional(name, value):
        if value is not None:
            check(name, value)

    return check_optional


_positive = functools.partial(check_real, low=0.0, low_inclusive=False)

# One check per argument every PSGD variant shares (psgd-jax's), each raising
# ``Invalid <name>=<value!r>: must be <rule>``; XMat, LRA and Affine add their
# own (e.g. LRA_ARGUMENT_CHECKS) and tests tie them to their signatures.
PSGD_ARGUMENT_CHECKS = {
    "preconditioner_update_probability": functools.partial(
        check_real, low=0.0, high=1.0
    ),
    "b1": functools.partial(check_real, low=0.0, high=1.0, high_inclusive=False),
    "nesterov": check_bool,
    "precond_lr": functools.partial(_positive, allow_schedule=True),
    "precond_init_scale": _optional(_positive),
    "update_global_norm_clip": _optional(_positive),
    "step_normalizer_order": functools.partial(
        check_choice, choices=STEP_NORMALIZER_ORDERS
    ),
    "seed": lambda name, value: check_seed(value),
    "mu_dtype": check_floating_dtype,
    "precision": functools.partial(check_choice, choices=MATMUL_PRECISIONS),
}


def check_psgd_arguments(**arguments) -> None:
    """Construction-time checks of the arguments every PSGD variant shares."""
    for name, check in PSGD_ARGUMENT_CHECKS.items():
        check(name, arguments[name])


def check_seed(seed) -> None:
    """psgd-jax's ``seed``: None, a PRNG key (``jax.random.PRNGKey(n)`` or a
    typed key), or, as a convenience, a Python int."""
    if seed is None or (isinstance(seed, int) and not isinstance(seed, bool)):
        return
    if isinstance(seed, jax.Array | np.ndarray):
        if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) and seed.shape == ():
            return
        if seed.dtype == jnp.uint32 and seed.shape == (2,):
            return
    raise TypeError(
        f"Invalid seed={seed!r}: must be None, a PRNG key (jax.random.PRNGKey(n) "
        "or jax.random.key(n)) or a Python int"
    )


def key_from_seed(seed: jax.Array | int | None) -> jax.Array:
    """A PRNG key from psgd-jax's ``seed`` argument (default PRNGKey(36))."""
    if seed is None:
        return jax.random.PRNGKey(DEFAULT_SEED)
    if isinstance(seed, int):
        return jax.random.PRNGKey(seed)
    return seed


def momentum_dtype(mu_dtype: Any | None, param: Any) -> jnp.dtype:
    """``mu_dtype`` (default the parameter's); its complex counterpart for a
    complex parameter (a real momentum would drop the imaginary part)."""
    dtype = jnp.dtype(mu_dtype or param.dtype)
    return complex_dtype(dtype) if is_complex(param) else dtype


def scale_by_psgd(
    preconditioner: Preconditioner,
    *,
    preconditioner_update_probability: float,
    b1: float,
    nesterov: bool,
    precond_lr: float | Callable,
    precond_init_scale: float | None,
    update_global_norm_clip: float | None,
    seed: jax.Array | int | None,
    mu_dtype: Any | None,
    step_normalizer_order: str,
    precision: str | None,
) -> optax.GradientTransformationExtraArgs:
    """The PSGD transformation around ``preconditioner`` (see the module docstring).

    Checks the shared arguments (:func:`check_psgd_arguments`) at construction;
    ``step_normalizer_order`` and ``precision`` are only checked here (the
    preconditioner, built by the caller, uses them).
    """
    check_psgd_arguments(**locals())  # first: locals() are the arguments
    warn_if_xla_cpu_deadlock_possible()
    keep_momentum = not (is_concrete_number(b1) and b1 == 0)
    auto_scale = precond_init_scale is None

    def init_fn(params):
        check_parameter_dtypes(params, "PSGD", complex_ok=True)
        mu = None
        if keep_momentum:
            mu = jax.tree.map(
                lambda p: jnp.zeros_like(p, dtype=momentum_dtype(mu_dtype, p)), params
            )
        scale = 1.0 if auto_scale else precond_init_scale
        factors, key = preconditioner.init(params, scale, key_from_seed(seed))
        return PSGDState(
            count=jnp.zeros([], jnp.int32),
            key=key,
            mu=mu,
            preconditioner=factors,
            updates=jnp.zeros([], jnp.int32),
        )

    def update_fn(updates, state: PSGDState, params=None, **extra_args):
        check_state_matches(state, init_fn, params, updates, "PSGD")
        del params
        newton = newton_arguments(updates, extra_args)
        key = state.key
        if newton is not None:
            h, v = newton["Hvp"], newton["vector"]
            do_update = jnp.asarray(newton["update_preconditioner"], bool)
            finite = gradients_are_usable(updates, h)
        else:
            # psgd-jax's draws: the decision, then (XMat, LRA) v like the
            # gradients; the first two steps always fit.
            key, decision_key = jax.random.split(key)
            do_update = (
                jax.random.uniform(decision_key) < preconditioner_update_probability
            ) | (state.count < 2)
            h, v = updates, None
            if preconditioner.draws_vector:
                key, vector_key = jax.random.split(key)
                v = optax.tree.random_like(vector_key, updates, jax.random.normal)
            finite = gradients_are_usable(updates)
        count = state.count + 1
        lr = precond_lr(count) if callable(precond_lr) else precond_lr
        first = (state.updates == 0) & auto_scale
        fit_key = None
        if preconditioner.fit_uses_key:
            key_after_fit, fit_key = jax.random.split(key)
            key = jnp.where(do_update & finite, key_after_fit, key)

        def fit(factors):
            return preconditioner.fit(
                factors, h, v, lr, first, fit_key, newton is not None
            )

        factors = jax.lax.cond(
            do_update & finite, fit, lambda f: f, state.preconditioner
        )
        # A fit can still overflow (e.g. on a huge Hessian-vector product): keep
        # the old Q.
        fit_finite = all_finite(factors)
        factors = jax.tree.map(
            lambda new, old: jnp.where(fit_finite, new, old),
            factors,
            state.preconditioner,
        )
        if keep_momentum:
            # m ← β₁m + (1−β₁)g; m̂ = m/(1−β₁ⁿ); Nesterov (Dozat): m̂ =
            # β₁m/(1−β₁ⁿ⁺¹) + (1−β₁)g/(1−β₁ⁿ), as psgd-jax.
            moment = otu.tree_update_moment(updates, state.mu, b1, 1)
            if nesterov:
                m_hat = jax.tree.map(
                    lambda m, g: b1 * m + (1 - b1) * g,
                    otu.tree_bias_correction(moment, b1, count + 1),
                    otu.tree_bias_correction(updates, b1, count),
                )
            else:
                m_hat = otu.tree_bias_correction(moment, b1, count)
            mu = jax.tree.map(lambda m, old: m.astype(old.dtype), moment, state.mu)
        else:
            mu, m_hat = None, updates
        U = preconditioner.apply(factors, m_hat)
        if update_global_norm_clip is not None:
            U, _ = optax.clip_by_global_norm(update_global_norm_clip).update(
                U, optax.EmptyState()
            )
        new_updates = jax.tree.map(
            lambda u, g: jnp.where(finite, u, 0).astype(g.dtype), U, updates
        )
        new_state = PSGDState(
            count=count,
            key=key,
            mu=mu,
            preconditioner=factors,
            updates=state.updates + (do_update & finite & fit_finite).astype(jnp.int32),
        )
        # A non-finite gradient leaves everything as it was (the fit is already
        # skipped; momentum and counters are reverted here).
        new_state = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old), new_state, state
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
