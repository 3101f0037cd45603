"""optax's optimizer contract, as one table over every public JAX optimizer.

Rows are the optimizers (:data:`OPTIMIZERS`), tests are the properties optax
expects of any of its own optimizers (its alias, contrib and tree-utility tests
check them), each against an oracle:

* ``optax.tree.map_params``: the identity keeps the state; a marker changes
  exactly the parameter-shaped copies (momentum, ...) and nothing else; partition
  specs of the params give those copies their specs (the documented use); it
  sees through inject_hyperparams and chain.
* ``optax.inject_hyperparams``: the inner state is the plain optimizer's (tree,
  shapes, dtypes, whatever weight_decay is) and five steps give the same
  updates; without ``static_args`` the error names the argument to list there.
* ``GradientTransformationExtraArgs``: unknown keyword arguments of ``update``
  are ignored (optax's ``chain`` passes every member all of them);
  ``chain(clip_by_global_norm, masked(opt))`` is ``opt`` on the clipped
  gradients of the unmasked leaves (``MaskedNode`` in the inner state), the
  masked-out leaf gets its gradient; ``with_extra_args_support`` is a no-op.
* jit and scan: jitted ``init`` equals eager ``init``, five steps compile once,
  ``lax.scan`` over them equals the Python loop, ``jax.eval_shape(init)`` (and
  ``init`` itself) of abstract params is the real state's shape tree, update and
  state dtypes never change, and the state survives ``jax.tree``
  flatten/unflatten and ``jax.device_get`` (the next step is bit-identical).
* explicit meshes (optax's sharding tests): state types (shape, dtype,
  sharding) are the same from eager and jitted init and after a jitted step,
  and the updates equal the unsharded ones.
* dtypes and trees: params of several kinds (dict, nested tuple and list, shapes
  (), 1-D, 2-D, 3-D, a bare array, a ``None`` leaf, bfloat16 and float16 next
  to float32) keep structure and dtype through ``lax.cond`` (optax's check that
  state and update types are stable) and the loss falls; ``optax.MultiSteps``
  emits zeros until its k-th step.
* complex parameters: trains (proven in ``test_complex.py``: a complex
  least-squares problem converges to its imaginary optimum) or is refused at
  ``init`` with an error naming the parameter.

* training (the rows' ``train`` arguments; whitening mode, and Newton mode
  with a Hessian-vector product where the row has one, a skipped cell where
  not): beats optax.adam on a noisy ill-conditioned quadratic, converges on
  a deterministic one and on Rosenbrock, one compile for many donated steps,
  inject_hyperparams in Newton mode, ``optax.MultiSteps`` equals one step on
  the mean gradient, update and state dtypes (bfloat16 next to float32), a
  NaN/±Inf gradient skips the step.
* checkpoints: an orbax round trip of the state continues bit for bit.
* psgd-jax's shared arguments (XMat, LRA, Affine): checked, every seed form.

Tests share compiled programs: per row, one jitted update and its five-step
trajectory (:func:`_trajectory`), one scan (:func:`_scanned`) and one wrapped
step (:func:`_wrapped_step`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import precond.jax as pj
from tests.jax import test_complex
from tests.jax.helpers import assert_skipped_once


@dataclasses.dataclass(frozen=True)
class Row:
    """One optimizer of the table."""

    factory: Callable[..., optax.GradientTransformation]  # the public function
    kwargs: dict  # its arguments here (small blocks, preconditioning from step 1)
    static_args: tuple = ()  # what optax.inject_hyperparams must keep static
    # State fields that are trees like the params (optax.tree.map_params maps them).
    params_fields: tuple = ("mu",)
    # Or, for a state of several parts: state ↦ {name: tree like the params,
    # optax.MaskedNode where that part holds no entry}.
    params_trees: Callable[[Any], dict[str, Any]] | None = None
    # True: complex parameters train (a row of test_complex.CONVERGENCE);
    # False: init refuses them, naming the parameter.
    complex_params: bool = True
    # The training properties (convergence, compiles, MultiSteps, dtypes,
    # non-finite gradients): the arguments besides learning_rate, those added
    # in whitening (gradient-only) mode, and the rates each sweep tries.
    train: dict = dataclasses.field(default_factory=dict)
    whitening: dict = dataclasses.field(default_factory=dict)
    # psgd-jax's Newton mode: update takes Hvp, vector and update_preconditioner.
    newton: bool = False
    # The curvature of the ill-conditioned quadratic (see _quadratic) that the
    # preconditioner can represent.
    structure: str = "kronecker"
    learning_rates: tuple = (1.0, 0.3, 0.1, 0.03)
    rosenbrock_rates: tuple = (0.1, 0.03, 0.01)  # Newton mode: NEWTON_ROSENBROCK_RATES
    rosenbrock_train: dict = dataclasses.field(default_factory=dict)  # on top of train


def _kron(style: str) -> Row:
    kwargs = dict(
        learning_rate=0.05,
        preconditioner_update_style=style,
        preconditioner_update_probability=0.5,
    )
    return Row(
        pj.kron,
        kwargs,
        pj.KRON_STATIC_ARGS,
        train=dict(preconditioner_update_style=style),
        # Whitening fits every step; Newton mode on hessian_helper's draws.
        whitening=dict(preconditioner_update_probability=1.0),
        newton=True,
    )


def _scale_by_shampoo_chain(learning_rate, **kwargs) -> optax.GradientTransformation:
    """scale_by_shampoo's direction chained with the learning rate, as the README
    composes it (distributed_shampoo is the same chain under one name)."""
    return optax.chain(
        pj.scale_by_shampoo(**kwargs), optax.scale_by_learning_rate(learning_rate)
    )


# Its signature is learning_rate and scale_by_shampoo's (inject_hyperparams
# reads it to tell static arguments from traced ones).
_scale_by_shampoo_chain.__signature__ = inspect.signature(pj.scale_by_shampoo).replace(
    parameters=[
        inspect.Parameter("learning_rate", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        *inspect.signature(pj.scale_by_shampoo).parameters.values(),
    ]
)


# Shampoo trains on whole 16×8 blocks from step 1, with RMSProp-normalized
# grafting (SGD grafting takes SGD's step lengths, which blow up on
# Rosenbrock's steep valley walls as SGD's do at any rate above 1e-3).
SHAMPOO_TRAIN = dict(
    block_size=128,
    start_preconditioning_step=1,
    graft_type=pj.GraftingType.RMSPROP_NORMALIZED,
)
# 0.03 first: the deterministic sweep stops at the first rate that converges.
SHAMPOO_RATES = (0.03, 1.0, 0.1, 0.01)


def _pro_adamw_params_trees(state) -> dict[str, Any]:
    """pro_adamw's trees like the params: pro's momentum, AdamW's moments (each
    with MaskedNode for the other part's parameters; PARAMS' w and conv are
    pro's, b is AdamW's)."""
    pro = state.inner_states["pro"].inner_state[0]
    adamw = state.inner_states["adamw"].inner_state[0]
    return {"pro.mu": pro.mu, "adamw.mu": adamw.mu, "adamw.nu": adamw.nu}


# name ↦ row: every public JAX optimizer of precond.jax. A new optimizer is one
# more entry here; every property below then runs over it.
OPTIMIZERS: dict[str, Row] = {
    "kron-EQ": _kron("EQ"),
    "kron-QUAD": _kron("QUAD"),
    "kron-PRO": _kron("PRO"),
    "xmat": Row(pj.xmat, dict(learning_rate=0.05), newton=True, structure="x"),
    "lra": Row(
        pj.low_rank_approximation,
        dict(learning_rate=0.05),
        pj.LRA_STATIC_ARGS,
        newton=True,
        structure="low-rank",
    ),
    "affine": Row(
        pj.affine, dict(learning_rate=0.05), pj.AFFINE_STATIC_ARGS, newton=True
    ),
    "pro": Row(
        pj.pro,
        dict(learning_rate=0.05, block_size=4, preconditioner_update_probability=0.5),
        pj.PRO_STATIC_ARGS,
        complex_params=False,
        # Its default decoupled weight decay (0.1) pulls towards 0, not towards
        # Rosenbrock's (1, 1), and applies on skipped steps too.
        train=dict(weight_decay=0.0),
    ),
    "pro_adamw": Row(
        pj.pro_adamw,
        dict(learning_rate=0.05, block_size=4, preconditioner_update_probability=0.5),
        pj.PRO_ADAMW_STATIC_ARGS,
        params_trees=_pro_adamw_params_trees,
        complex_params=False,
        # No weight decay (its default is 1e-4), as pro's row. The rates are
        # AdamW's: pro's is 4 times it.
        train=dict(weight_decay=0.0),
        learning_rates=(0.3, 0.1, 0.03, 0.01),
        rosenbrock_rates=(0.03, 0.01),
        # Its momentum 0.5 (measured best on transformers) crawls along
        # Rosenbrock's curved valley: (0.9986, 0.9972) after the 2000 steps at
        # its best rate; pro's default 0.95 reaches (1, 1).
        rosenbrock_train=dict(b1=0.95),
    ),
    "shampoo": Row(
        pj.distributed_shampoo,
        dict(learning_rate=0.05, block_size=4, start_preconditioning_step=2),
        pj.SHAMPOO_STATIC_ARGS,
        params_fields=("momentum", "diagonal_momentum", "diagonal_statistics"),
        complex_params=False,
        train=SHAMPOO_TRAIN,
        learning_rates=SHAMPOO_RATES,
    ),
    "scale_by_shampoo": Row(
        _scale_by_shampoo_chain,
        dict(learning_rate=0.05, block_size=4, start_preconditioning_step=2),
        pj.SCALE_BY_SHAMPOO_STATIC_ARGS,
        params_fields=("momentum", "diagonal_momentum", "diagonal_statistics"),
        complex_params=False,
        train=SHAMPOO_TRAIN,
        learning_rates=SHAMPOO_RATES,
    ),
    "soap": Row(
        pj.soap,
        # max_precond_dim=3: w's 4×4 statistic from one (4, 3) gradient has
        # eigenvalues 0 and 0.015 (of 12), whose eigenvectors an ulp of the
        # gradient moves by 1e-4; w keeps its 3×3 one (gaps of 2.6 and more).
        dict(
            learning_rate=0.05,
            block_size=4,
            precondition_frequency=2,
            max_precond_dim=3,
        ),
        pj.SOAP_STATIC_ARGS,
        params_fields=("mu", "nu"),
        complex_params=False,
        # No weight decay (its default is 0.01), as pro's row: it pulls towards
        # 0, not towards Rosenbrock's (1, 1).
        train=dict(weight_decay=0.0),
    ),
}
NAMES = sorted(OPTIMIZERS)
STEPS = 5


def _make(name: str, **overrides) -> optax.GradientTransformation:
    row = OPTIMIZERS[name]
    return row.factory(**{**row.kwargs, **overrides})


def _tree(shapes: Any, dtype=jnp.float32, seed: int = 0) -> Any:
    """A tree like ``shapes`` (tuples of ints are shapes; None stays None) of
    N(0, 1) draws."""
    leaves, treedef = jax.tree.flatten(
        shapes,
        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x),
    )
    rng = np.random.default_rng(seed)
    return treedef.unflatten(
        [jnp.asarray(rng.normal(size=shape), dtype) for shape in leaves]
    )


PARAMS = _tree({"w": (4, 3), "b": (3,), "conv": (2, 2, 3)})
GRADS = [_tree(jax.tree.map(jnp.shape, PARAMS), seed=1 + step) for step in range(STEPS)]


def _assert_trees_equal(got, want, rtol=None):
    """Same structure, shapes and dtypes, and equal leaves: bitwise, or within
    ``rtol`` of each entry plus ``rtol`` times the leaf's largest entry (float32
    rounding of sums and products is relative to the operands, not to a result
    that cancels)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for path, a in jax.tree_util.tree_leaves_with_path(got):
        b = _at(want, path)
        where = jax.tree_util.keystr(path)
        assert jnp.shape(a) == jnp.shape(b), (where, jnp.shape(a), jnp.shape(b))
        assert jnp.result_type(a) == jnp.result_type(b), where
        a, b = (
            np.asarray(x, np.float64 if x.dtype == jnp.bfloat16 else None)
            for x in (a, b)
        )
        if rtol is None:
            np.testing.assert_array_equal(a, b, err_msg=where)
        else:
            atol = rtol * float(np.max(np.abs(b), initial=0.0))
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=where)


def _at(tree, path):
    for entry in path:
        if isinstance(entry, jax.tree_util.DictKey):
            tree = tree[entry.key]
        elif isinstance(entry, jax.tree_util.SequenceKey):
            tree = tree[entry.idx]
        elif isinstance(entry, jax.tree_util.GetAttrKey):
            tree = getattr(tree, entry.name)
        else:
            tree = jax.tree_util.tree_leaves(tree)[entry.key]
    return tree


def _avals(tree):
    return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


# What optax's chain passes every member along with (e.g.) a line search's
# ``value``: each optimizer must ignore keyword arguments it does not know.
EXTRA = dict(unexpected_extra_args_your_optimizer_doesnt_expect=1, value=2.0)


@dataclasses.dataclass
class Trajectory:
    optimizer: optax.GradientTransformation
    update: Callable  # jitted (grads, state, params, **EXTRA) ↦ (updates, state)
    traces: list  # one entry per trace of ``update``
    states: list  # the initial state and the state after each step
    updates: list  # the updates of each step
    # Traces of the five steps themselves: the trajectory is cached across tests,
    # and tests/trajectories.py clears JAX's caches, so a later call may trace
    # ``update`` again.
    loop_traces: int


@functools.cache
def _trajectory(name: str) -> Trajectory:
    """Five jitted steps of the row's optimizer on GRADS (params fixed), each
    called with the unknown keyword arguments EXTRA."""
    optimizer = _make(name)
    traces: list = []

    def update(grads, state, params, **extra):
        traces.append(1)
        return optimizer.update(grads, state, params, **extra)

    update = jax.jit(update)
    states, updates = [jax.jit(optimizer.init)(PARAMS)], []
    for grads in GRADS:
        step_updates, state = update(grads, states[-1], PARAMS, **EXTRA)
        states.append(state)
        updates.append(step_updates)
    return Trajectory(optimizer, update, traces, states, updates, len(traces))


# ------------------------------------------------------------------ map_params


def _core_state(state):
    """The optimizer's own state: the first member of an alias's chain."""
    return state[0] if type(state) is tuple else state


def _is_masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def _params_trees(row: Row, state) -> dict[str, Any]:
    """The subtrees of ``state`` that are trees like the params, by name: the
    row's ``params_fields`` of its core state (those that hold leaves), or
    what its ``params_trees`` finds."""
    if row.params_trees is not None:
        return row.params_trees(state)
    core = _core_state(state)
    return {
        f: getattr(core, f)
        for f in row.params_fields
        if jax.tree.leaves(getattr(core, f))
    }


@pytest.mark.parametrize("name", NAMES)
def test_map_params_maps_exactly_the_parameter_shaped_fields(name):
    """Identity: the same state. A marker (x ↦ x + 1): the leaves of the fields
    that are trees like the params change, every other leaf stays. Specs of the
    params with the rest mapped to None: those fields become the specs, and no
    other leaf is left (optax's way to build the state's partition specs; a
    MaskedNode, where a part of the optimizer holds no entry for a parameter,
    stays one)."""
    row, run = OPTIMIZERS[name], _trajectory(name)
    optimizer, state = run.optimizer, run.states[2]
    _assert_trees_equal(optax.tree.map_params(optimizer, lambda x: x, state), state)

    marked = optax.tree.map_params(optimizer, lambda x: x + 1, state)
    assert jax.tree.structure(marked) == jax.tree.structure(state)
    trees, marked_trees = _params_trees(row, state), _params_trees(row, marked)
    assert trees, "no field like the params"
    for f, tree in trees.items():
        # A tree like the params: one entry (or MaskedNode) per parameter.
        entries = jax.tree.leaves(tree, is_leaf=_is_masked)
        assert len(entries) == len(jax.tree.leaves(PARAMS)), f
        _assert_trees_equal(marked_trees[f], jax.tree.map(lambda x: x + 1, tree))
    # Nothing else changed.
    changed = [
        not np.array_equal(new, old)
        for new, old in zip(jax.tree.leaves(marked), jax.tree.leaves(state))
    ]
    assert sum(changed) == sum(len(jax.tree.leaves(t)) for t in trees.values())

    specs = {"w": P("x", None), "b": P(), "conv": P(None, None, "y")}
    keep_masked = lambda x, spec: x if _is_masked(x) else spec  # noqa: E731
    mapped = optax.tree.map_params(
        optimizer,
        keep_masked,
        state,
        specs,
        transform_non_params=lambda _: None,
        is_leaf=lambda x: isinstance(x, P) or _is_masked(x),
    )
    mapped_trees = _params_trees(row, mapped)
    for f, tree in trees.items():
        want = jax.tree.map(keep_masked, tree, specs, is_leaf=_is_masked)
        assert mapped_trees[f] == want, f
    leaves = jax.tree.leaves(mapped, is_leaf=lambda x: isinstance(x, P))
    assert len(leaves) == sum(len(jax.tree.leaves(t)) for t in trees.values())


@pytest.mark.parametrize("name", NAMES)
def test_map_params_through_inject_hyperparams_and_chain(name):
    """map_params sees through optax's wrappers: the parameter-shaped fields of
    the wrapped state change, the injected hyperparameters do not."""
    row = OPTIMIZERS[name]
    wrapped = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(row.factory, static_args=row.static_args)(
            **row.kwargs
        ),
    )
    state = wrapped.init(PARAMS)
    marked = optax.tree.map_params(wrapped, lambda x: x + 1, state)
    assert marked[1].hyperparams == state[1].hyperparams
    trees = _params_trees(row, state[1].inner_state)
    marked_trees = _params_trees(row, marked[1].inner_state)
    assert trees
    for f, tree in trees.items():
        _assert_trees_equal(marked_trees[f], jax.tree.map(lambda x: x + 1, tree))


# ------------------------------------------------------------------ inject_hyperparams


def _injected(name: str) -> optax.GradientTransformationExtraArgs:
    row = OPTIMIZERS[name]
    factory = optax.inject_hyperparams(row.factory, static_args=row.static_args)
    return factory(**row.kwargs)


@functools.cache
def _scanned(name: str):
    """The five steps of the trajectory as one lax.scan of the optimizer under
    optax.inject_hyperparams, without EXTRA (one program per row, shared by the
    inject and scan tests): its final state and stacked updates."""
    injected = _injected(name)

    @jax.jit
    def scanned(grads):
        def body(state, grads):
            updates, state = injected.update(grads, state, PARAMS)
            return state, updates

        return jax.lax.scan(body, injected.init(PARAMS), grads)

    return scanned(jax.tree.map(lambda *g: jnp.stack(g), *GRADS))


# Hyperparameters arrive as float32 arrays instead of Python floats (XLA folds
# 1 - b1 etc. in another precision), and the scan is another program than the
# loop's (XLA fuses the steps differently): an ulp here and there, amplified by
# cancellation in small entries and, in Shampoo, by its inverse roots.
SCAN_RTOL = 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_inject_hyperparams_keeps_the_state_and_the_updates(name):
    """The injected optimizer's inner state is the plain one's (tree, shapes,
    dtypes), at init and after five steps (scanned), whatever weight_decay is
    (inject_hyperparams passes it as an array); its updates are the plain
    trajectory's (test_jit_scan_and_eval_shape_agree_with_the_loop)."""
    run = _trajectory(name)
    state = jax.jit(_injected(name).init)(PARAMS)
    decayed = _make(name, weight_decay=0.01).init(PARAMS)
    assert jax.tree.structure(decayed) == jax.tree.structure(run.states[0])
    assert jax.tree.structure(state.inner_state) == jax.tree.structure(run.states[0])
    assert _avals(state.inner_state) == _avals(run.states[0])
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(
        OPTIMIZERS[name].kwargs["learning_rate"]
    )
    final, _ = _scanned(name)
    assert _avals(final.inner_state) == _avals(run.states[-1])


@pytest.mark.parametrize(
    "name", [n for n in NAMES if OPTIMIZERS[n].static_args], ids=str
)
def test_inject_hyperparams_without_static_args_names_them(name):
    """Arguments that fix shapes or code paths cannot be traced: without
    ``static_args`` the error says which argument and how to fix it."""
    row = OPTIMIZERS[name]
    injected = optax.inject_hyperparams(row.factory)(**row.kwargs)
    with pytest.raises(TypeError, match=r"Invalid \w+=.*static_args"):
        jax.jit(injected.update)(GRADS[0], injected.init(PARAMS), PARAMS)


# ------------------------------------------------------------------ extra arguments


# A frozen leaf next to PARAMS, masked out (optax.masked keeps a MaskedNode for
# it in the inner state), all behind optax's global-norm clip.
FROZEN = {**PARAMS, "frozen": jnp.ones((2, 2))}
MASK = {"w": True, "b": True, "conv": True, "frozen": False}


@functools.cache
def _wrapped_step(name: str):
    """One step of chain(clip_by_global_norm(1), masked(optimizer, MASK)) on
    FROZEN, called with EXTRA (one program per row, shared by two tests); and
    the gradients the optimizer must see (clipped over all leaves)."""
    optimizer = _trajectory(name).optimizer
    wrapped = optax.chain(optax.clip_by_global_norm(1.0), optax.masked(optimizer, MASK))
    grads = {**GRADS[0], "frozen": jnp.full((2, 2), 0.5)}
    norm = float(optax.tree.norm(grads))
    assert norm > 1.0  # so the clip does something
    clipped = jax.tree.map(lambda g: g / norm, grads)
    state = wrapped.init(FROZEN)
    updates, new_state = jax.jit(wrapped.update)(grads, state, FROZEN, **EXTRA)
    return state, updates, new_state, clipped


@pytest.mark.parametrize("name", NAMES)
def test_unknown_extra_arguments_are_ignored(name):
    """Every optimizer is a GradientTransformationExtraArgs (so optax passes it
    extra arguments, e.g. the Newton-mode Hvp, instead of dropping them). Its
    trajectory takes EXTRA at every step and equals the scan without them
    (test_jit_scan_and_eval_shape_agree_with_the_loop); inside optax's chain,
    behind a clip, called with EXTRA, it is the optimizer on the clipped
    gradients."""
    run = _trajectory(name)
    optimizer = run.optimizer
    assert isinstance(optimizer, optax.GradientTransformationExtraArgs)
    assert optax.with_extra_args_support(optimizer) is optimizer
    _, updates, new_state, clipped = _wrapped_step(name)
    want, want_state = run.update(
        {k: clipped[k] for k in PARAMS}, run.states[0], PARAMS, **EXTRA
    )
    # Another program, and optax's clip rounds g·(1/‖g‖) where this one has
    # g/‖g‖: an ulp in the gradient, which Shampoo's inverse roots of the
    # rank-one first statistic (condition ~1e6) amplify to ~1e-6 relative.
    tolerance = dict(rtol=1e-5)
    _assert_trees_equal({k: updates[k] for k in PARAMS}, want, **tolerance)
    # The inner state has MaskedNode (no leaves) for the frozen leaf: compare
    # the leaves, in order.
    inner = new_state[1].inner_state
    got_leaves, want_leaves = (
        jax.tree.leaves(_without_metrics(x)) for x in (inner, want_state)
    )
    _assert_trees_equal(got_leaves, want_leaves, **tolerance)


@pytest.mark.parametrize("name", NAMES)
def test_masked_leaves_get_their_gradients_and_no_state(name):
    """optax.masked: the masked-out leaf's update is its (clipped) gradient, the
    inner state holds a MaskedNode for it and is the state of the unmasked
    leaves alone (the other leaves' updates: the test above)."""
    state, updates, new_state, clipped = _wrapped_step(name)
    np.testing.assert_array_equal(updates["frozen"], clipped["frozen"])
    for inner in (state[1].inner_state, new_state[1].inner_state):
        nodes = jax.tree.leaves(
            inner, is_leaf=lambda x: isinstance(x, optax.MaskedNode)
        )
        assert any(isinstance(x, optax.MaskedNode) for x in nodes)
        want = _trajectory(name).states[0]
        assert _avals(jax.tree.leaves(inner)) == _avals(jax.tree.leaves(want))


# ------------------------------------------------------------------ jit, scan, state


def _without_metrics(state):
    """The state without Shampoo's training metrics (the residuals of its inverse
    roots: rounding noise, ~1e-7, that no two compiles reproduce)."""
    core = _core_state(state)
    if not hasattr(core, "training_metrics"):
        return state
    core = core._replace(training_metrics=None)
    return (core, *state[1:]) if type(state) is tuple else core


@pytest.mark.parametrize("name", NAMES)
def test_jit_scan_and_eval_shape_agree_with_the_loop(name):
    """jit(init) = init; five jitted steps trace once; lax.scan over them (of
    the optimizer under inject_hyperparams, without EXTRA) gives the loop's
    updates and state; eval_shape(init), of concrete or abstract params, is the
    real state's shapes and dtypes, and init takes abstract params directly (as
    optax's sharding tests call it); update and state dtypes never change."""
    run = _trajectory(name)
    optimizer = run.optimizer
    # Eager and jitted init: the same random factors (LRA's U, V) up to XLA's
    # fusion of their scaling.
    _assert_trees_equal(optimizer.init(PARAMS), run.states[0], rtol=1e-6)
    assert run.loop_traces == 1
    for state in run.states[1:]:
        assert _avals(state) == _avals(run.states[0])
    for updates in run.updates:
        assert _avals(updates) == _avals(GRADS[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), PARAMS)
    for params in (PARAMS, abstract):
        shapes = jax.eval_shape(optimizer.init, params)
        assert jax.tree.structure(shapes) == jax.tree.structure(run.states[0])
        assert _avals(shapes) == _avals(run.states[0])
    # init of abstract params outside eval_shape, as optax's sharding tests call it.
    assert _avals(optimizer.init(abstract)) == _avals(run.states[0])

    # The scan runs the optimizer under inject_hyperparams and without EXTRA:
    # the same trajectory also proves the injected hyperparameters and the
    # extra arguments change nothing.
    state, updates = _scanned(name)
    _assert_trees_equal(
        *map(_without_metrics, (state.inner_state, run.states[-1])), rtol=SCAN_RTOL
    )
    for step, want in enumerate(run.updates):
        got = jax.tree.map(lambda u, step=step: u[step], updates)
        _assert_trees_equal(got, want, rtol=SCAN_RTOL)


@pytest.mark.parametrize("name", NAMES)
def test_state_survives_flatten_and_device_get(name):
    """The state after two steps, flattened and unflattened, or fetched to host
    memory (NumPy arrays), continues with the same third step, bit for bit."""
    run = _trajectory(name)
    state = run.states[2]
    leaves, treedef = jax.tree.flatten(state)
    rebuilt = jax.tree.unflatten(treedef, leaves)
    host = jax.device_get(state)
    assert jax.tree.structure(host) == treedef
    assert all(isinstance(x, np.ndarray | np.generic) for x in jax.tree.leaves(host))
    counts = []
    for restored in (rebuilt, host):
        updates, new_state = run.update(GRADS[2], restored, PARAMS, **EXTRA)
        _assert_trees_equal(updates, run.updates[2])
        _assert_trees_equal(new_state, run.states[3])
        counts.append(len(run.traces))
    assert counts[1] == counts[0]  # host NumPy state: the same compiled update


# ------------------------------------------------------------------ explicit meshes


@pytest.mark.parametrize("name", NAMES)
def test_explicit_mesh_keeps_state_types_and_updates(name):
    """On a mesh with Explicit axes (sharding in types), as optax's sharding
    tests: eager and jitted init give the same types (shape, dtype, sharding),
    a jitted step keeps them, and its updates, sharded like the gradients, are
    the unsharded trajectory's first step."""
    run = _trajectory(name)
    optimizer = run.optimizer
    mesh = jax.make_mesh(
        (2,),
        ("x",),
        axis_types=(jax.sharding.AxisType.Explicit,),
        devices=jax.devices()[:2],
    )
    specs = {"w": P("x", None), "b": P(), "conv": P(None, "x", None)}
    with jax.set_mesh(mesh):
        place = lambda tree: jax.tree.map(  # noqa: E731
            lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)),
            tree,
            specs,
        )
        params, grads = place(PARAMS), place(GRADS[0])
        state = optimizer.init(params)
        types = jax.tree.map(jax.typeof, state)
        assert jax.tree.map(jax.typeof, jax.jit(optimizer.init)(params)) == types
        updates, new_state = jax.jit(optimizer.update)(grads, state, params)
        assert jax.tree.map(jax.typeof, new_state) == types
        assert jax.tree.map(jax.typeof, updates) == jax.tree.map(jax.typeof, grads)
    _assert_trees_equal(jax.device_get(updates), run.updates[0], rtol=1e-5)


# ------------------------------------------------------------------ trees and dtypes

# A tree of every kind a model's params come in: nested dict, tuple and list,
# shapes (), 2-D and 3-D (1-D: the bare array), a None leaf, bfloat16 and
# float16 next to float32.
KINDS = {
    "scalar": ((),),
    "layers": [{"kernel": (3, 2)}, ((2, 3, 2),)],
    "none": None,
}
DTYPES = {"kernel": jnp.bfloat16, "scalar": jnp.float16}


def _kinds_params():
    params = _tree(KINDS, seed=11)

    def cast(path, x):
        names = [getattr(k, "key", None) for k in path]
        dtype = next((DTYPES[n] for n in names if n in DTYPES), x.dtype)
        return x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


@pytest.mark.parametrize("params_kind", ["tree-of-every-kind", "bare-array"])
@pytest.mark.parametrize("name", NAMES)
def test_params_of_every_kind_keep_structure_and_dtypes(name, params_kind):
    """Steps on ½‖θ − θ*‖² inside lax.cond, as optax checks it: update and state
    types must equal the gradients' and the old state's (else the cond does not
    trace); params keep their dtypes, the None leaf stays None; the loss falls.
    The bare array (what optax's own tests optimize) goes through
    optax.MultiSteps(every 2): its first step leaves the params as they are."""
    optimizer = _trajectory(name).optimizer
    if params_kind == "bare-array":
        params, target = jnp.array([-1.0, 10.0, 1.0]), jnp.array([1.0, -1.0, 1.0])
        optimizer, steps = optax.MultiSteps(optimizer, every_k_schedule=2), 2 * STEPS
    else:
        params, steps = _kinds_params(), STEPS
        target = jax.tree.map(jnp.zeros_like, params)
    initial = params

    def loss(params):
        squares = jax.tree.map(
            lambda p, t: jnp.sum((p.astype(jnp.float32) - t) ** 2), params, target
        )
        return 0.5 * sum(jax.tree.leaves(squares))

    @jax.jit
    def step(params, state, take):
        grads = jax.grad(loss)(params)
        updates, state = jax.lax.cond(
            take,
            lambda: optimizer.update(grads, state, params),
            lambda: (grads, state),
        )
        return optax.apply_updates(params, updates), state

    state = optimizer.init(params)
    avals = _avals(state)
    for i in range(steps):
        params, state = step(params, state, True)
        if i == 0 and params_kind == "bare-array":
            np.testing.assert_array_equal(params, initial)
    assert _avals(state) == avals
    assert _avals(params) == _avals(initial)
    if params_kind != "bare-array":
        assert params["none"] is None
    assert float(loss(params)) < float(loss(initial))


@pytest.mark.parametrize(
    "name",
    [
        n
        for n in NAMES
        if "mu_dtype" in inspect.signature(OPTIMIZERS[n].factory).parameters
    ],
    ids=str,
)
def test_momentum_dtype_follows_mu_dtype(name):
    """As optax's explicit-dtype check: the momentum (found by
    optax.tree.get(state, 'mu')) has each parameter's dtype by default and
    mu_dtype when given."""
    params = {"w": jnp.ones((4, 3)), "h": jnp.ones(3, jnp.bfloat16)}
    for mu_dtype in (None, jnp.bfloat16, jnp.float32):
        mu = optax.tree.get(_make(name, mu_dtype=mu_dtype).init(params), "mu")
        want = jax.tree.map(lambda p, d=mu_dtype: jnp.dtype(d or p.dtype), params)
        assert jax.tree.map(lambda m: m.dtype, mu) == want, mu_dtype


# ------------------------------------------------------------------ complex parameters


@pytest.mark.parametrize("name", NAMES)
def test_complex_parameters_train_or_are_refused_at_init(name):
    """Where complex parameters are supported, test_complex.py proves it (a
    complex least-squares problem reaches its purely imaginary optimum, and one
    step equals a complex float64 reference); elsewhere init refuses them with an
    error naming the parameter, never a silent real-only step."""
    params = {"real": jnp.ones((2, 2)), "z": jnp.ones((3, 2), jnp.complex64)}
    if OPTIMIZERS[name].complex_params:
        assert name in test_complex.CONVERGENCE, (
            f"{name}: add its complex least-squares case to test_complex.CONVERGENCE"
        )
        state = _make(name).init(params)
        assert any(jnp.iscomplexobj(x) for x in jax.tree.leaves(state))
    else:
        assert name not in test_complex.CONVERGENCE
        with pytest.raises(
            TypeError, match=r"does not support complex parameters: parameter \['z'\]"
        ):
            _make(name).init(params)


# ------------------------------------------------------------------ training
#
# The properties of a trained optimizer, on each row's ``train`` arguments, in
# whitening mode (gradients only) and, for the rows with psgd-jax's Newton mode,
# with a Hessian-vector product.

NEWTON_ROSENBROCK_RATES = (1.0, 0.3, 0.1)


def _case(name: str, newton: bool):
    mode = "hvp" if newton else "whitening"
    marks = ()
    if newton and not OPTIMIZERS[name].newton:
        marks = pytest.mark.skip(
            reason=f"{name} has no Hessian-vector-product mode (no Hvp argument)"
        )
    return pytest.param(name, newton, id=f"{name}-{mode}", marks=marks)


CASES = [_case(name, newton) for name in NAMES for newton in (False, True)]
NEWTON_CASES = [_case(name, True) for name in NAMES]


def _train_make(name, newton, learning_rate, **kwargs):
    row = OPTIMIZERS[name]
    mode = {} if newton else row.whitening
    return row.factory(learning_rate=learning_rate, **{**row.train, **mode, **kwargs})


def _step_fn(name, newton, optimizer, loss):
    """One training step (params, state, key) ↦ (params, state), in either mode
    (``name`` labels the optimizer only)."""
    del name

    def step(params, state, key):
        if newton:
            # Every step fits the preconditioner, as psgd-jax's default.
            _, grads, hvp, vector, flag = pj.hessian_helper(key, loss, params)
            updates, state = optimizer.update(
                grads,
                state,
                params,
                Hvp=hvp,
                vector=vector,
                update_preconditioner=flag,
            )
        else:
            updates, state = optimizer.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    return step


def _trainer(name, newton, make_optimizer, loss, steps, seed=0):
    """A jitted (params, learning rate) ↦ (params, losses) after ``steps`` steps of
    ``make_optimizer(learning rate)``: the rate is traced, so one compile serves a
    whole learning-rate sweep."""
    keys = jax.random.split(jax.random.PRNGKey(seed), steps)

    def run(params, learning_rate):
        optimizer = make_optimizer(learning_rate)
        step = _step_fn(name, newton, optimizer, loss)

        def body(carry, key):
            params, state = carry
            params, state = step(params, state, key)
            return (params, state), loss(params)

        (params, _), losses = jax.lax.scan(body, (params, optimizer.init(params)), keys)
        return params, losses

    return jax.jit(run)


def _train(name, newton, optimizer, loss, params, steps, seed=0):
    """Params and losses after ``steps`` steps of ``optimizer`` (also used by
    test_shampoo_optimizer.py for its variants)."""
    return _trainer(name, newton, lambda _: optimizer, loss, steps, seed)(params, 0.0)


def _cosine_trainer(name, newton, loss, steps, **kwargs):
    """``_trainer`` of the row with a cosine decay from the rate over steps."""

    def make_optimizer(learning_rate):
        schedule = optax.cosine_decay_schedule(learning_rate, steps)
        return _train_make(name, newton, schedule, **kwargs)

    return _trainer(name, newton, make_optimizer, loss, steps)


def _spd(rng, d, condition):
    """A rotated SPD matrix with eigenvalues log-spaced from 1 to 1/condition."""
    basis, _ = np.linalg.qr(rng.normal(size=(d, d)))
    return basis @ np.diag(np.logspace(0, -np.log10(condition), d)) @ basis.T


def _quadratic(structure):
    """L(x) = ½ xᵀHx on x of shape (16, 8), with an ill-conditioned H that is not
    axis-aligned (so a diagonal method such as Adam cannot undo it) and that the
    optimizer's preconditioner can represent:

    * 'kronecker' (Kron, Affine, PRO, Shampoo): H = A ⊗ B, A 16×16 (condition
      1e3) and B 8×8 (1e2), both rotated: L = ½ tr(Xᵀ A X B).
    * 'x' (XMat): H = Q_HᵀQ_H with Q_H = diag(a) + antidiag(b) over the 128
      flattened entries, condition ≈ 1e4.
    * 'low-rank' (LRA): H = D + W·S·Wᵀ, D diagonal in [0.01, 0.1] and 5 random
      directions W with curvature 1 to 100.
    """
    rng = np.random.default_rng(0)
    n = 128
    if structure == "kronecker":
        H = np.kron(_spd(rng, 16, 1e3), _spd(rng, 8, 1e2))
    elif structure == "x":
        a = np.logspace(0, -2, n)[rng.permutation(n)]
        # Each pair (i, n−1−i) couples through b; det = a_i·a_j·(1 − 0.81·s_i·s_j).
        b = 0.9 * a[::-1] * rng.choice([-1, 1], n)
        Q = np.diag(a) + np.fliplr(np.diag(b[::-1]))
        H = Q.T @ Q
    else:
        assert structure == "low-rank"
        W, _ = np.linalg.qr(rng.normal(size=(n, 5)))
        H = np.diag(rng.uniform(0.01, 0.1, n)) + W @ np.diag(np.logspace(0, 2, 5)) @ W.T
    noise_root = jnp.asarray(np.linalg.cholesky(H), jnp.float32)
    H = jnp.asarray(H, jnp.float32)
    x0 = {"x": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)}

    def loss(params):
        x = params["x"].ravel()
        return 0.5 * x @ (H @ x)

    def noisy_loss(params, key):
        """A loss whose gradient is Hx + 0.1·Lz (z ~ N(0, I), LLᵀ = H): the noise
        has the curvature's covariance, as minibatch noise roughly does."""
        noise = 0.1 * noise_root @ jax.random.normal(key, (n,))
        return loss(params) + jnp.dot(jax.lax.stop_gradient(noise), params["x"].ravel())

    return loss, noisy_loss, x0


ADAM_LEARNING_RATES = (1.0, 0.3, 0.1, 0.03, 0.01, 0.003)
NOISY_STEPS, WINDOW = 300, 50


def _noisy_run(name, newton, make_optimizer, structure):
    """A jitted learning rate ↦ mean exact loss over the last 50 of 300 steps of
    ``make_optimizer(learning rate)`` on noisy gradients (one compile per sweep)."""
    loss, noisy_loss, x0 = _quadratic(structure)
    keys = jax.random.split(jax.random.PRNGKey(1), NOISY_STEPS)
    noise_keys = jax.random.split(jax.random.PRNGKey(2), NOISY_STEPS)

    def run(learning_rate):
        optimizer = make_optimizer(learning_rate)

        def body(carry, inputs):
            params, state = carry
            step_key, noise_key = inputs
            noisy = lambda p: noisy_loss(p, noise_key)  # noqa: E731
            step = _step_fn(name, newton, optimizer, noisy)
            params, state = step(params, state, step_key)
            return (params, state), loss(params)

        init = (x0, optimizer.init(x0))
        _, losses = jax.lax.scan(body, init, (keys, noise_keys))
        return jnp.mean(losses[-WINDOW:])

    return jax.jit(run)


@functools.cache
def _adam_noisy_loss(structure):
    run = _noisy_run("adam", False, optax.adam, structure)
    return min(float(run(lr)) for lr in ADAM_LEARNING_RATES)


@pytest.mark.optimized_xla
@pytest.mark.parametrize(("name", "newton"), CASES)
def test_beats_adam_on_noisy_ill_conditioned_quadratic(name, newton):
    """Best of a learning-rate sweep (cosine decay) against Adam's best of a wider
    sweep, at equal steps: the preconditioner captures the rotated curvature that
    Adam's diagonal cannot."""
    row = OPTIMIZERS[name]
    loss, _, x0 = _quadratic(row.structure)
    run = _noisy_run(
        name,
        newton,
        lambda lr: _train_make(
            name, newton, optax.cosine_decay_schedule(lr, NOISY_STEPS)
        ),
        row.structure,
    )
    finals = {lr: float(run(lr)) for lr in row.learning_rates}
    best, adam = min(finals.values()), _adam_noisy_loss(row.structure)
    assert best < float(loss(x0)) / 50, finals
    assert best < adam, (finals, adam)


@pytest.mark.optimized_xla
@pytest.mark.parametrize(("name", "newton"), CASES)
def test_converges_on_deterministic_ill_conditioned_quadratic(name, newton):
    """1e-4 of the initial loss within 2000 steps, for one rate of the sweep."""
    row = OPTIMIZERS[name]
    loss, _, x0 = _quadratic(row.structure)
    train, finals = _cosine_trainer(name, newton, loss, 2000), {}
    for lr in row.learning_rates:
        finals[lr] = float(train(x0, lr)[1][-1])
        if finals[lr] < 1e-4 * float(loss(x0)):
            return
    pytest.fail(f"no learning rate reached 1e-4 of the initial loss: {finals}")


@pytest.mark.optimized_xla
@pytest.mark.parametrize(("name", "newton"), CASES)
def test_converges_on_rosenbrock(name, newton):
    """Within 1e-3 of (1, 1) from (−1.5, 2) in 2000 steps, for one rate of a
    sweep: Newton-mode steps are unit-scale (P ≈ |H|⁻¹), whitening steps smaller.

    The point is a (2, 1) column, so that Kron fits a full 2×2 factor as the
    flattening optimizers do (a 1-D point gets a diagonal Kron factor: in
    Newton mode that crawls along the curved valley, about (0.8, 0.7) here).
    """

    def rosenbrock(params):
        x, y = params["xy"][:, 0]
        return (1 - x) ** 2 + 100 * (y - x**2) ** 2

    params = {"xy": jnp.array([[-1.5], [2.0]])}
    extra = OPTIMIZERS[name].rosenbrock_train
    train, ends = _cosine_trainer(name, newton, rosenbrock, 2000, **extra), {}
    rates = NEWTON_ROSENBROCK_RATES if newton else OPTIMIZERS[name].rosenbrock_rates
    for lr in rates:
        params_out, _ = train(params, lr)
        ends[lr] = params_out["xy"][:, 0].tolist()
        if np.allclose(params_out["xy"], 1.0, atol=1e-3):
            return
    pytest.fail(f"{name} did not reach (1, 1): {ends}")


STEP_PARAMS = {"w": jnp.ones((6, 5)), "b": jnp.zeros(5), "conv": jnp.ones((3, 2, 2, 2))}


def _gradients(params, step):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(step), len(leaves))
    return treedef.unflatten(
        [jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves)]
    )


def _newton_args(params, step, newton):
    """Hvp (of H = 2I + a ramp along the last axis), vector and flag; nothing in
    whitening mode."""
    if not newton:
        return {}
    vector = _gradients(params, 1000 + step)
    hvp = jax.tree.map(lambda v: 2 * v + 0.1 * jnp.cumsum(v, axis=-1), vector)
    return dict(Hvp=hvp, vector=vector, update_preconditioner=jnp.asarray(True))


@pytest.mark.parametrize(("name", "newton"), CASES)
def test_one_compile_for_many_donated_steps(name, newton):
    """The state donated, as training loops do (no two leaves may share a
    buffer): three steps, one trace."""
    optimizer = _train_make(name, newton, 0.01)
    traces = []

    def update(grads, state, extra):
        traces.append(1)
        return optimizer.update(grads, state, STEP_PARAMS, **extra)

    update = jax.jit(update, donate_argnums=1)
    state = optimizer.init(STEP_PARAMS)
    for step in range(3):
        _, state = update(
            _gradients(STEP_PARAMS, step),
            state,
            _newton_args(STEP_PARAMS, step, newton),
        )
    assert len(traces) == 1


@pytest.mark.parametrize(("name", "newton"), NEWTON_CASES)
def test_inject_hyperparams_gives_same_updates_in_newton_mode(name, newton):
    """Whitening mode under inject_hyperparams:
    test_inject_hyperparams_keeps_the_state_and_the_updates."""
    row = OPTIMIZERS[name]
    kwargs = dict(learning_rate=3e-3, b1=0.9, weight_decay=0.01)
    kwargs.update(row.train)
    factory = optax.inject_hyperparams(row.factory, static_args=row.static_args)
    plain, injected = row.factory(**kwargs), factory(**kwargs)
    states = [plain.init(STEP_PARAMS), injected.init(STEP_PARAMS)]
    updates = [jax.jit(plain.update), jax.jit(injected.update)]
    for step in range(4):
        grads = _gradients(STEP_PARAMS, step)
        extra = _newton_args(STEP_PARAMS, step, newton)
        want, states[0] = updates[0](grads, states[0], STEP_PARAMS, **extra)
        got, states[1] = updates[1](grads, states[1], STEP_PARAMS, **extra)
        # Hyperparameters arrive as float32 arrays instead of Python floats: an
        # ulp here and there, amplified by cancellation in small entries.
        jax.tree.map(
            lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-8),
            got,
            want,
        )


@pytest.mark.parametrize(("name", "newton"), CASES)
def test_multisteps_equals_one_step_on_the_mean_gradient(name, newton):
    """MultiSteps(k=2) emits, on its second call, the update of the mean gradient
    (with the Newton arguments of that call) and zeros on the first."""
    micro = [_gradients(STEP_PARAMS, 0), _gradients(STEP_PARAMS, 1)]
    extra = _newton_args(STEP_PARAMS, 1, newton)
    accumulated = optax.MultiSteps(_train_make(name, newton, 0.01), every_k_schedule=2)
    state = accumulated.init(STEP_PARAMS)
    update = jax.jit(accumulated.update)
    first, state = update(micro[0], state, STEP_PARAMS, **extra)
    for leaf in jax.tree.leaves(first):
        np.testing.assert_array_equal(leaf, 0.0)
    second, _ = update(micro[1], state, STEP_PARAMS, **extra)
    direct = _train_make(name, newton, 0.01)
    mean = jax.tree.map(lambda a, b: (a + b) / 2, *micro)
    want, _ = jax.jit(direct.update)(
        mean, direct.init(STEP_PARAMS), STEP_PARAMS, **extra
    )
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7),
        second,
        want,
    )


@pytest.mark.parametrize(("name", "newton"), CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_update_and_state_dtypes_are_stable(name, newton, dtype):
    params = {
        "w": jnp.ones((6, 5), dtype),
        "b": jnp.zeros(5, jnp.float32),  # mixed with the other dtype
    }
    optimizer = _train_make(name, newton, 0.01)
    state = optimizer.init(params)
    before = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    update = jax.jit(optimizer.update)
    for step in range(3):
        grads = _gradients(params, step)
        updates, state = update(
            grads, state, params, **_newton_args(params, step, newton)
        )
        assert jax.tree.map(lambda u: u.dtype, updates) == jax.tree.map(
            lambda g: g.dtype, grads
        )
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == before


@pytest.mark.parametrize(("name", "newton"), CASES)
def test_non_finite_gradient_skips_the_step(name, newton):
    """NaN, +Inf or -Inf in one entry: zero update, unchanged state (but for its
    count of skipped steps); the next
    finite step proceeds normally. (One compiled update serves every value.)"""
    optimizer = _train_make(name, newton, 0.01)
    update = jax.jit(optimizer.update)
    _, state = update(
        _gradients(STEP_PARAMS, 0),
        optimizer.init(STEP_PARAMS),
        STEP_PARAMS,
        **_newton_args(STEP_PARAMS, 0, newton),
    )
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        grads = _gradients(STEP_PARAMS, 1)
        grads["w"] = grads["w"].at[2, 3].set(bad)
        updates, new_state = update(
            grads, state, STEP_PARAMS, **_newton_args(STEP_PARAMS, 1, newton)
        )
        for leaf in jax.tree.leaves(updates):
            np.testing.assert_array_equal(leaf, 0.0, err_msg=str(bad))
        assert_skipped_once(new_state, state)
        _, after = update(
            _gradients(STEP_PARAMS, 2),
            new_state,
            STEP_PARAMS,
            **_newton_args(STEP_PARAMS, 2, newton),
        )
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(after)), bad


# ------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_round_trip_continues_bit_identically(name, tmp_path):
    """The state after two steps, saved with orbax and restored into the
    abstract state of a fresh init (jax.eval_shape), continues with the
    trajectory's third step bit for bit (every variant, from every step:
    test_checkpoints.py). orbax comes with flax (the dev extra); CI's run on the
    oldest supported JAX installs neither and skips this."""
    ocp = pytest.importorskip("orbax.checkpoint")
    run = _trajectory(name)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "state", run.states[2])
    checkpointer.wait_until_finished()
    abstract = jax.eval_shape(_make(name).init, PARAMS)
    restored = checkpointer.restore(tmp_path / "state", abstract)
    assert jax.tree.structure(restored) == jax.tree.structure(run.states[2])
    run.update(
        GRADS[2], run.states[2], PARAMS, **EXTRA
    )  # compiled, if caches were cleared
    compiled = len(run.traces)
    updates, state = run.update(GRADS[2], restored, PARAMS, **EXTRA)
    _assert_trees_equal(updates, run.updates[2])
    _assert_trees_equal(state, run.states[3])
    assert len(run.traces) == compiled  # the restored state: the same compiled update


# ------------------------------------------------------------ psgd-jax's arguments

# Arguments XMat, LRA and Affine share (psgd-jax's), each with a bad value, the
# error type and the start of its message. (Every optimizer's own: its file.)
PSGD_JAX = ["xmat", "lra", "affine"]
SHARED_BAD_ARGUMENTS = [
    (dict(nesterov="no"), TypeError, "Invalid nesterov='no': must be True or False"),
    (dict(nesterov=1), TypeError, "Invalid nesterov=1: must be True or False"),
    (dict(seed="abc"), TypeError, "Invalid seed='abc': must be None, a PRNG key"),
    (dict(seed=1.5), TypeError, "Invalid seed=1.5"),
    (dict(seed=np.zeros(3, np.uint32)), TypeError, "Invalid seed=array"),
    (dict(mu_dtype=jnp.int32), ValueError, "must be a floating dtype"),
    (dict(mu_dtype="no dtype"), ValueError, "Invalid mu_dtype='no dtype'"),
    (dict(b1=1.0), ValueError, "Invalid b1=1.0: must be in [0.0, 1.0)"),
    (dict(precond_lr=0.0), ValueError, "Invalid precond_lr=0.0: must be > 0.0"),
    (dict(preconditioner_update_probability=1.5), ValueError, "Invalid prec"),
    (dict(update_global_norm_clip=-1.0), ValueError, "Invalid update_global_no"),
    (dict(precond_init_scale=0.0), ValueError, "Invalid precond_init_scale=0.0"),
    (dict(step_normalizer_order="3rd"), ValueError, "Invalid step_normalizer_o"),
    (dict(precision="fast"), ValueError, "Invalid precision='fast'"),
]


@pytest.mark.parametrize("name", PSGD_JAX)
def test_shared_arguments_are_checked_at_construction(name):
    for kwargs, error, message in SHARED_BAD_ARGUMENTS:
        with pytest.raises(error, match=re.escape(message)):
            OPTIMIZERS[name].factory(**kwargs)


@pytest.mark.parametrize("name", PSGD_JAX)
def test_every_seed_form_psgd_jax_accepts_works(name):
    """None (psgd-jax's PRNGKey(36)), a raw or typed PRNG key, or an int n
    (PRNGKey(n)): the int and its raw key give the same state."""
    params = {"w": jnp.ones((3, 2))}
    states = {
        repr(seed): OPTIMIZERS[name].factory(seed=seed).init(params)
        for seed in (None, 7, jax.random.PRNGKey(7), jax.random.key(7))
    }
    int_state, key_state = states["7"], states[repr(jax.random.PRNGKey(7))]
    jax.tree.map(np.testing.assert_array_equal, int_state, key_state)


def test_every_psgd_jax_argument_has_a_check():
    """Each variant's scale_by_* arguments are exactly the shared table's plus
    its own table's: none goes unchecked."""
    from precond.jax.psgd._transform import PSGD_ARGUMENT_CHECKS
    from precond.jax.psgd.affine import AFFINE_ARGUMENT_CHECKS
    from precond.jax.psgd.lra import LRA_ARGUMENT_CHECKS

    own = {
        pj.scale_by_xmat: {},
        pj.scale_by_lra: LRA_ARGUMENT_CHECKS,
        pj.scale_by_affine: AFFINE_ARGUMENT_CHECKS,
    }
    for transform, checks in own.items():
        arguments = set(inspect.signature(transform).parameters)
        assert arguments == set(PSGD_ARGUMENT_CHECKS) | set(checks), transform
