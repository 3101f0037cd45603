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

Counting and skipping follow the JAX step policy (:mod:`step_policy`): a step
whose gradient (or Hvp) is unusable (a NaN or ±Inf entry, or a squared norm that
overflows) returns zeros and leaves the state unchanged, count included, but
for its count of skipped steps; a fit that still overflows keeps the old
factors. The random draws are psgd-jax's, from a key carried in the state (the
policy's seed-compatible exception).
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
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec

from precond._common.validation import (
    check_bool,
    check_choice,
    check_real,
    is_concrete_number,
)
from precond.jax._core.alias import arguments_for, with_decay_and_learning_rate
from precond.jax._core.argument_trees import (
    check_mesh,
    check_partition_spec,
    checked_at_init,
)
from precond.jax._core.factor_kernels import (
    complex_dtype,
    is_complex,
    squared_magnitude,
)
from precond.jax._core.guards import (
    accepting_scalars,
    all_finite,
    check_parameter_dtypes,
    check_state_matches,
)
from precond.jax._core.mesh_placement import with_auto_axes
from precond.jax._core.momentum import bias_correction, moving_average
from precond.jax._core.newton import newton_arguments
from precond.jax._core.precision import (
    MATMUL_PRECISIONS,
    check_momentum_dtype,
    matmul_precision,
)
from precond.jax._core.step_policy import (
    SkipWarning,
    fields_unless_skipped,
    keep_if_overflowed,
    next_count,
    skip_counted,
    step_is_usable,
    zeros_unless_usable,
)
from precond.jax.psgd._placement import (
    PLACEMENT_ARGUMENTS,
    placed_factors,
    placed_like_params,
    psgd_sharding,
    unpadded_factors,
)

STEP_NORMALIZER_ORDERS = ("1st", "2nd")
DEFAULT_SEED = 36  # psgd-jax's PRNGKey(36)


class PSGDState(NamedTuple):
    """State of :func:`scale_by_psgd` (XMat, LRA, Affine): arrays only.

    Attributes:
        count: int32 scalar: the steps taken.
        key: the PRNG key of the update decisions and the noise.
        mu: the momentum, a tree like the params; None when b1 == 0.
        preconditioner: the variant's factors of Q (a NamedTuple of arrays).
        updates: int32 scalar: the preconditioner fits so far.
        skipped: int32 scalar: the steps skipped for unusable gradients.
    """

    count: jax.Array  # shape=(), int32: steps taken
    key: jax.Array  # PRNG key (uint32[2]): the update decisions and noise
    mu: optax.Updates | None  # like params; None when b1 == 0
    preconditioner: Any  # the optimizer's factors of Q (a NamedTuple of arrays)
    updates: jax.Array  # shape=(), int32: preconditioner fits so far
    skipped: jax.Array  # shape=(), int32: steps skipped (unusable gradients)


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
    name: the optimizer's name in ``precond.jax`` (its skipped-step warning's).
    """

    init: Callable[[Any, float, jax.Array], tuple[Any, jax.Array]]
    fit: Callable[..., Any]
    apply: Callable[[Any, Any], Any]
    draws_vector: bool = True
    fit_uses_key: bool = False
    name: str = "psgd"


def flat_size_and_dtype(params: Any) -> tuple[int, jnp.dtype]:
    """The number of entries of all leaves of ``params`` and the dtype
    ``ravel_pytree`` would flatten them to (float32 when there are none), from
    shapes alone: ``params`` may be abstract (``jax.ShapeDtypeStruct``)."""
    leaves = jax.tree.leaves(params)
    n = sum(math.prod(jnp.shape(x)) for x in leaves)
    dtype = jnp.result_type(*(x.dtype for x in leaves)) if leaves else jnp.float32
    return n, jnp.dtype(dtype)


def first_fit_scale(h: jax.Array, v: jax.Array | None, power: float) -> jax.Array:
    """(Σ|v|²/Σ|h|²)^power, the automatic initial scale of Q at the first fit
    (P·h ≈ v in size): Σ|v|² of the caller's v, or n = h.size, its expectation
    for whitening noise v ~ N(0, I), when ``v`` is None."""
    real = jnp.finfo(h.dtype).dtype
    v_energy = jnp.asarray(h.size, real) if v is None else jnp.sum(squared_magnitude(v))
    h_energy = jnp.sum(squared_magnitude(h)) + jnp.finfo(real).tiny
    return (v_energy / h_energy) ** power


def flattened_preconditioner(
    init_vector: Callable[[int, Any, float, jax.Array], tuple[Any, jax.Array]],
    fit_vector: Callable[..., Any],
    precondition_vector: Callable[..., jax.Array],
    *,
    precision: str | None,
    name: str,
    fit_uses_key: bool = False,
) -> Preconditioner:
    """A :class:`Preconditioner` of all parameters flattened into one vector of
    n entries (XMat, LRA), its factors in promote(params dtype, float32).

    ``init_vector(n, dtype, scale, key) -> (factors, key)``;
    ``fit_vector(factors, h, v, lr, rescale, key) -> factors`` on the flat h
    and v (v ~ N(0, I) in whitening, drawn by the transform) in the factors'
    dtype, where ``rescale(x)`` is x·(Σv²/Σh²)^{1/4} at the first fit with
    automatic scaling (:func:`first_fit_scale`), else x;
    ``precondition_vector(*factors, g) -> P·g``. The fit and P·g run under
    ``precision`` and the named scopes precond/<name>/update and
    precond/<name>/precondition; ``name`` is the preconditioner's.
    """

    def init(params, scale, key):
        n, dtype = flat_size_and_dtype(params)
        dtype = jnp.promote_types(dtype, jnp.float32) if n else jnp.float32
        return init_vector(n, dtype, scale, key)

    def fit_flat(factors, h, v, lr, first, key, newton):
        if flat_size_and_dtype(h)[0] == 0:  # no parameters: nothing to fit
            return factors
        dtype = jax.tree.leaves(factors)[0].dtype
        h = ravel_pytree(h)[0].astype(dtype)
        v = ravel_pytree(v)[0].astype(dtype)
        # Whitening: E[Σv²] = n stands for the drawn Σv² (as psgd-jax).
        scale = first_fit_scale(h, v if newton else None, 0.25)

        def rescale(x):
            return jnp.where(first, x * scale, x)

        with matmul_precision(precision), jax.named_scope(f"precond/{name}/update"):
            return fit_vector(factors, h, v, lr, rescale, key)

    def apply_flat(factors, m):
        flat, unravel = ravel_pytree(m)
        g = flat.astype(jax.tree.leaves(factors)[0].dtype)
        with (
            matmul_precision(precision),
            jax.named_scope(f"precond/{name}/precondition"),
        ):
            return unravel(precondition_vector(*factors, g))

    return auto_axes_preconditioner(
        init, fit_flat, apply_flat, fit_uses_key=fit_uses_key, name=name
    )


def auto_axes_preconditioner(
    init: Callable[[Any, float, jax.Array], tuple[Any, jax.Array]],
    fit_all: Callable[..., Any],
    apply_all: Callable[[Any, Any], Any],
    *,
    draws_vector: bool = True,
    fit_uses_key: bool = False,
    name: str = "psgd",
) -> Preconditioner:
    """A :class:`Preconditioner` (named ``name``) from its work on whole trees,
    each run under :func:`with_auto_axes`: ``fit_all(factors, h, v, lr, first,
    key, newton)`` (new factors placed like the old) and ``apply_all(factors,
    m)`` (P·m placed like m)."""

    def fit(factors, h, v, lr, first, key, newton):
        fit_newton = functools.partial(fit_all, newton=newton)
        return with_auto_axes(fit_newton, factors, factors, h, v, lr, first, key)

    def apply(factors, m):
        return with_auto_axes(apply_all, m, factors, m)

    return Preconditioner(init, fit, apply, draws_vector, fit_uses_key, name)


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
    "mu_dtype": check_momentum_dtype,
    "precision": functools.partial(check_choice, choices=MATMUL_PRECISIONS),
    # Keyword-only, precond's (see psgd._placement).
    "params_partition_specs": checked_at_init,
    "preconditioner_partition_spec": check_partition_spec,
    "mesh": check_mesh,
}


def psgd_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """The arguments :func:`scale_by_psgd` takes besides the preconditioner,
    picked from a variant's ``locals()``."""
    return {name: arguments[name] for name in PSGD_ARGUMENT_CHECKS}


def psgd_alias(
    scale_by: Callable, arguments: dict[str, Any]
) -> optax.GradientTransformationExtraArgs:
    """A psgd-jax alias from its ``locals()``: ``chain(scale_by(...),
    add_decayed_weights, scale_by_learning_rate)``, θ ← θ − lr·(U + λ·mask⊙θ)."""
    core = scale_by(**arguments_for(scale_by, arguments))
    return with_decay_and_learning_rate(
        core,
        arguments["learning_rate"],
        arguments["weight_decay"],
        arguments["mask"],
        mask_name="mask",
    )


def check_arguments(checks: dict[str, Callable], arguments: dict[str, Any]) -> None:
    """Construction-time checks: ``check(name, arguments[name])`` for every
    ``name: check`` of ``checks`` (:data:`PSGD_ARGUMENT_CHECKS` or a variant's
    own), ``arguments`` being the caller's ``locals()``."""
    for name, check in checks.items():
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


def init_psgd_state(
    preconditioner: Preconditioner,
    params: Any,
    *,
    keep_momentum: bool,
    mu_dtype: Any | None,
    scale: float,
    seed: jax.Array | int | None,
) -> PSGDState:
    """The state before the first step: m = 0 (when kept), Q = scale·I (or the
    preconditioner's random start, drawn from the seed's key), counters 0."""
    check_parameter_dtypes(params, "PSGD", complex_ok=True)
    mu = None
    if keep_momentum:
        mu = jax.tree.map(
            lambda p: jnp.zeros_like(p, dtype=momentum_dtype(mu_dtype, p)), params
        )
    factors, key = preconditioner.init(params, scale, key_from_seed(seed))
    return PSGDState(
        count=jnp.zeros([], jnp.int32),
        key=key,
        mu=mu,
        preconditioner=factors,
        updates=jnp.zeros([], jnp.int32),
        skipped=jnp.zeros([], jnp.int32),
    )


def placed_state(state: PSGDState, plan) -> PSGDState:
    """``state`` with m placed as the params and the factors split (and padded)
    as ``plan`` says (:mod:`psgd._placement`); as it is without a plan."""
    if plan is None:
        return state
    return state._replace(
        mu=placed_like_params(state.mu, plan),
        preconditioner=placed_factors(state.preconditioner, plan),
    )


def unplaced_factors(preconditioner: Preconditioner, factors, like, key, plan):
    """``factors`` without the padding :func:`placed_state` added (their shapes
    from ``preconditioner.init`` of params like ``like``); as they are without
    a plan."""
    if plan is None:
        return factors
    shapes = jax.eval_shape(lambda g: preconditioner.init(g, 1.0, key)[0], like)
    return unpadded_factors(factors, shapes)


def fit_pair_and_decision(
    preconditioner: Preconditioner,
    updates: Any,
    state: PSGDState,
    newton: dict | None,
    probability: float,
) -> tuple[Any, Any, jax.Array, jax.Array, jax.Array]:
    """(h, v, do_update, key, usable) of one step.

    Newton mode: the caller's (Hvp, vector, update_preconditioner). Whitening:
    h = the gradient; psgd-jax's draws from the state's key, in its order: the
    decision (u < p, or one of the first two steps), then (XMat, LRA) v like
    the gradients. ``usable`` is the step policy's test of g (and Hvp).
    """
    if newton is not None:
        h, v = newton["Hvp"], newton["vector"]
        do_update = jnp.asarray(newton["update_preconditioner"], bool)
        return h, v, do_update, state.key, step_is_usable(updates, h)
    key, decision_key = jax.random.split(state.key)
    do_update = (jax.random.uniform(decision_key) < probability) | (state.count < 2)
    v = None
    if preconditioner.draws_vector:
        key, vector_key = jax.random.split(key)
        v = optax.tree.random_like(vector_key, updates, jax.random.normal)
    return updates, v, do_update, key, step_is_usable(updates)


def fit_if(
    preconditioner: Preconditioner,
    factors: Any,
    fit_now: jax.Array,
    key: jax.Array,
    fit: Callable[[Any, jax.Array | None], Any],
) -> tuple[Any, jax.Array, jax.Array]:
    """(factors, key, fitted): ``fit(factors, fit_key)`` when ``fit_now``, else
    the factors as they are (no copy). A fit splits its subkey off ``key`` when
    the preconditioner uses one; a fit that overflows keeps the old factors
    (``fitted`` is False then)."""
    fit_key = None
    if preconditioner.fit_uses_key:
        key_after_fit, fit_key = jax.random.split(key)
        key = jnp.where(fit_now, key_after_fit, key)

    def fitted_or_kept(old):
        new = fit(old, fit_key)
        return keep_if_overflowed(new, old), all_finite(new)

    factors, fitted = jax.lax.cond(
        fit_now, fitted_or_kept, lambda old: (old, jnp.asarray(True)), factors
    )
    return factors, key, fitted


def momentum_estimate(
    updates: Any, mu: Any, b1: float, nesterov: bool, count: jax.Array
) -> tuple[Any, Any]:
    """(new m, m̂): m ← β₁m + (1−β₁)g, m̂ = m/(1−β₁ⁿ); Nesterov (Dozat, as
    psgd-jax): m̂ = β₁m/(1−β₁ⁿ⁺¹) + (1−β₁)g/(1−β₁ⁿ). m keeps its dtype; m̂ of a
    real g is real (m may be complex: mu_dtype)."""
    moment = jax.tree.map(lambda g, m: moving_average(m, g, b1), updates, mu)

    def corrected(tree, n):
        # 1 − β₁ⁿ as b1 and n promote; the division in each leaf's dtype.
        correction = bias_correction(b1, n)
        return jax.tree.map(lambda t: t / correction.astype(t.dtype), tree)

    if nesterov:
        m_hat = jax.tree.map(
            lambda m, g: b1 * m + (1 - b1) * g,
            corrected(moment, count + 1),
            corrected(updates, count),
        )
    else:
        m_hat = corrected(moment, count)
    # A real gradient's complex momentum (mu_dtype complex) is real.
    m_hat = jax.tree.map(
        lambda m, g: jnp.real(m) if is_complex(m) and not is_complex(g) else m,
        m_hat,
        updates,
    )
    return jax.tree.map(lambda m, old: m.astype(old.dtype), moment, mu), m_hat


def _guarded_output(usable, U, updates, new_state: PSGDState, state, plan, warning):
    """(U, new state) placed on the mesh, or zeros and ``state`` where the step
    is not ``usable`` (counted in its ``skipped``, and reported by ``warning``).
    The factors are taken as they are: they were fitted only on a usable step
    (``fit_now``), and a select over them would copy every factor on every
    step."""
    U = placed_like_params(zeros_unless_usable(usable, U, updates), plan)
    new_state = placed_state(new_state, plan)
    kept = ("preconditioner",)
    guarded = fields_unless_skipped(usable, new_state, state, already_kept=kept)
    return U, skip_counted(usable, guarded, warning)


def clip_to_global_norm(U: Any, max_norm: float | None) -> Any:
    """U scaled down to global norm ``max_norm`` if above it (None: U)."""
    if max_norm is None:
        return U
    return optax.clip_by_global_norm(max_norm).update(U, optax.EmptyState())[0]


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
    params_partition_specs: Any = None,
    preconditioner_partition_spec: PartitionSpec | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> optax.GradientTransformationExtraArgs:
    """The PSGD transformation around ``preconditioner`` (see the module docstring),
    its state placed on a mesh by :mod:`psgd._placement`. Checks the shared
    arguments (:data:`PSGD_ARGUMENT_CHECKS`) at construction; ``step_normalizer_order``
    and ``precision`` only here (the caller's preconditioner uses them)."""
    arguments = dict(locals())  # first: locals() = the arguments
    check_arguments(PSGD_ARGUMENT_CHECKS, arguments)
    keep_momentum = not (is_concrete_number(b1) and b1 == 0)
    auto_scale = precond_init_scale is None
    placement = {name: arguments[name] for name in PLACEMENT_ARGUMENTS}
    warning = SkipWarning(preconditioner.name)

    def init_fn(params):
        state = init_psgd_state(
            preconditioner,
            params,
            keep_momentum=keep_momentum,
            mu_dtype=mu_dtype,
            scale=1.0 if precond_init_scale is None else precond_init_scale,
            seed=seed,
        )
        return placed_state(state, psgd_sharding(params, placement))

    def update_fn(updates, state: PSGDState, params=None, **extra_args):
        check_state_matches(state, init_fn, params, updates, "PSGD")
        del params
        newton = newton_arguments(updates, extra_args)
        h, v, do_update, key, usable = fit_pair_and_decision(
            preconditioner, updates, state, newton, preconditioner_update_probability
        )
        count = next_count(state.count)
        lr = precond_lr(count) if callable(precond_lr) else precond_lr
        first = (state.updates == 0) & auto_scale

        def fit(factors, fit_key):
            return preconditioner.fit(
                factors, h, v, lr, first, fit_key, newton is not None
            )

        fit_now = do_update & usable
        plan = psgd_sharding(updates, placement)
        factors = unplaced_factors(preconditioner, state.preconditioner, h, key, plan)
        factors, key, fitted = fit_if(preconditioner, factors, fit_now, key, fit)
        mu, m_hat = None, updates
        if keep_momentum:
            mu, m_hat = momentum_estimate(updates, state.mu, b1, nesterov, count)
        U = clip_to_global_norm(
            preconditioner.apply(factors, m_hat), update_global_norm_clip
        )
        new_state = PSGDState(
            count=count,
            key=key,
            mu=mu,
            preconditioner=factors,
            updates=state.updates + (fit_now & fitted).astype(jnp.int32),
            skipped=state.skipped,
        )
        return _guarded_output(usable, U, updates, new_state, state, plan, warning)

    # optax's OptState (chex.ArrayTree) admits neither a None leaf (PSGDState.mu
    # without momentum) nor a state type narrower than any ArrayTree.
    return accepting_scalars(
        optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
    )
