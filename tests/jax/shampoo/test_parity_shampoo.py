"""precond's distributed_shampoo as a drop-in for Google's.

The contract is the Google revision in the seed document (``003_*``): its
signature is written below as a table, since no package installs that revision.
The newer Google code, optax-shampoo 0.0.6 (``oracles.optax_shampoo()``), is the
oracle for the arguments it added and for trajectories: fed the same gradients
with the newer arguments set to 0.0.6's values, both optimizers move the
parameters the same way for 20 steps. Shampoo draws no random numbers (its power
iteration starts from a fixed vector in both), so nothing needs injecting.

0.0.6 was written for an older JAX. Two shims let it run on today's, and touch
only the oracle: ``jax.tree_map``/``tree_flatten``/``tree_unflatten`` (removed
from JAX) are aliased to ``jax.tree.*`` while a test runs, and the oracle
module's ``lax.while_loop`` casts the initial carry to the body's output dtypes
(its inverse-root loop starts a float error ratio as the Python bool ``True``,
which today's ``while_loop`` refuses; ``True`` is 1.0, the value it stood for).
A third, for its sharded mode (``shard_optimizer_states``) only, gives the oracle
module's ``pjit`` name the ``with_sharding_constraint`` and ``PartitionSpec``
that ``jax.experimental.pjit`` no longer exports (now ``jax.lax`` and
``jax.sharding``); that mode runs on a mesh with ``AxisType.Auto`` axes, the
only kind JAX had when 0.0.6 was written.
"""

from __future__ import annotations

import inspect
import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import precond.jax as ps
from precond.jax.shampoo import _math as sm
from tests import oracles

# The seed revision's distributed_shampoo, argument by argument (from 003_*).
SEED_SIGNATURE = [
    ("learning_rate", inspect.Parameter.empty),
    ("block_size", inspect.Parameter.empty),
    ("beta1", 0.9),
    ("beta2", 0.999),
    ("diagonal_epsilon", 1e-10),
    ("matrix_epsilon", 1e-6),
    ("weight_decay", 0.0),
    ("start_preconditioning_step", 5),
    ("preconditioning_compute_steps", 1),
    ("statistics_compute_steps", 1),
    ("best_effort_shape_interpretation", True),
    ("graft_type", ps.GraftingType.SGD),
    ("nesterov", True),
    ("exponent_override", 0),
    ("batch_axis_name", None),
    ("statistics_partition_spec", None),
    ("preconditioner_partition_spec", None),
    ("num_devices_for_pjit", None),
    ("shard_optimizer_states", False),
    ("best_effort_memory_usage_reduction", False),
    ("inverse_failure_threshold", 0.1),
    ("moving_average_for_momentum", False),
    ("skip_preconditioning_dim_size_gt", 4096),
    ("clip_by_scaled_gradient_norm", None),
    ("precision", lax.Precision.HIGHEST),
]
# 0.0.6's defaults that precond does not share, because the seed behaves
# otherwise: None merges small dims up to block_size, as the seed does.
SEED_DEFAULTS_OF_NEWER_ARGUMENTS = {"merge_small_dims_block_size": None}


@pytest.fixture(scope="module")
def google():
    """optax-shampoo 0.0.6's module, runnable on today's JAX (module docstring)."""
    yield from patched_optax_shampoo()


def patched_optax_shampoo():
    """Yields optax-shampoo 0.0.6's module with the shims of the module
    docstring applied, and removes them when resumed."""
    module = oracles.optax_shampoo()
    patch = pytest.MonkeyPatch()
    patch.setattr(jax, "tree_map", jax.tree.map, raising=False)
    patch.setattr(jax, "tree_flatten", jax.tree.flatten, raising=False)
    patch.setattr(jax, "tree_unflatten", jax.tree.unflatten, raising=False)

    def while_loop(cond, body, init):
        out = jax.eval_shape(body, init)
        init = jax.tree.map(lambda x, o: jnp.asarray(x, o.dtype), init, out)
        return lax.while_loop(cond, body, init)

    patched_lax = types.SimpleNamespace(
        **{name: getattr(lax, name) for name in dir(lax) if not name.startswith("__")}
    )
    patched_lax.while_loop = while_loop
    patch.setattr(module, "lax", patched_lax)
    # Its sharded mode calls jax.experimental.pjit's with_sharding_constraint
    # and PartitionSpec, which that module no longer exports: the names they
    # moved to, in a stand-in for the oracle's `pjit` alone.
    patch.setattr(
        module,
        "pjit",
        types.SimpleNamespace(
            with_sharding_constraint=lax.with_sharding_constraint,
            PartitionSpec=P,
        ),
    )
    yield module
    patch.undo()


# ------------------------------------------------------------------ signatures


def test_signature_matches_the_seed_revision():
    parameters = list(inspect.signature(ps.distributed_shampoo).parameters.values())
    seed = parameters[: len(SEED_SIGNATURE)]
    assert [(p.name, p.default) for p in seed] == SEED_SIGNATURE
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in seed)
    rest = parameters[len(SEED_SIGNATURE) :]
    assert rest
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in rest)


def test_newer_arguments_of_0_0_6_are_keyword_only_with_the_seeds_behaviour(google):
    theirs = inspect.signature(google.distributed_shampoo).parameters
    ours = inspect.signature(ps.distributed_shampoo).parameters
    seed_names = [name for name, _ in SEED_SIGNATURE]
    assert list(theirs)[: len(seed_names)] == seed_names
    newer = list(theirs)[len(seed_names) :]
    assert newer, "0.0.6 adds arguments"
    # Same order among themselves, all keyword-only after the seed's.
    assert [name for name in ours if name in newer] == newer
    for name in newer:
        assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        expected = SEED_DEFAULTS_OF_NEWER_ARGUMENTS.get(name, theirs[name].default)
        assert ours[name].default == expected, name
    # Their enums, by value and name.
    for ours_enum, theirs_enum in (
        (ps.GraftingType, google.GraftingType),
        (ps.PreconditionerType, google.PreconditionerType),
    ):
        for member in theirs_enum:
            assert ours_enum[member.name] == member.value


def test_current_google_arguments_are_accepted():
    """reuse_preconditioner and eigh come from the current google-research code.
    There reuse_preconditioner=True hands each previous root to the root
    routine, which discards it: the steps are the same, here bit for bit."""
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)}
    steps = {}
    for reuse in (False, True):
        opt = ps.distributed_shampoo(
            0.1,
            8,
            start_preconditioning_step=1,
            precondtioner_type=ps.PreconditionerType.INPUT,
            reuse_preconditioner=reuse,
            eigh=False,
            generate_training_metrics=False,
        )
        state = opt.init(params)
        assert isinstance(state.training_metrics, optax.MaskedNode)
        for _ in range(3):
            updates, state = opt.update(jax.tree.map(jnp.cos, params), state, params)
        steps[reuse] = (updates, state)
    jax.tree.map(np.testing.assert_array_equal, steps[True], steps[False])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precondtioner_type": 4}, "Invalid precondtioner_type=4"),
        ({"merge_small_dims_block_size": 0}, "Invalid merge_small_dims_block_size=0"),
        ({"lobpcg_topk_precondition": -1}, "Invalid lobpcg_topk_precondition=-1"),
        ({"skip_preconditioning_rank_lt": -1}, "Invalid skip_preconditioning_rank_lt"),
        ({"tensordot_precision": "fast"}, "Invalid tensordot_precision='fast'"),
        ({"decoupled_weight_decay": "yes"}, "Invalid decoupled_weight_decay='yes'"),
    ],
    ids=["precondtioner_type", "merge", "lobpcg", "rank_lt", "tensordot", "wd"],
)
def test_newer_arguments_are_validated(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ps.distributed_shampoo(0.1, 8, **kwargs)


# ------------------------------------------------------------------ trajectories

SHAPES = {"a": (6, 5), "b": (3, 4, 2), "c": (7,), "d": (), "e": (1, 9)}
STEPS = 20


def random_params_and_grads(shapes, steps, seed):
    """Standard normal float32 params and ``steps`` gradients like them (the
    gradients independent of the params, so every optimizer is fed the same)."""
    rng = np.random.default_rng(seed)
    params = {
        k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()
    }
    grads = [
        {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
        for _ in range(steps)
    ]
    return params, grads


def _trajectory(optimizer, shapes=SHAPES, steps=STEPS, seed=0):
    """Parameter displacements W_t − W_0 after each of ``steps`` updates, fed
    the same gradients (independent of W) whatever the optimizer."""
    params, grads = random_params_and_grads(shapes, steps, seed)
    start = params
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    out = []
    for g in grads:
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
        out.append(jax.tree.map(jnp.subtract, params, start))
    return out


def _relative_difference(ours, theirs) -> float:
    """max over steps and parameters of ‖Δ_ours − Δ_theirs‖ / ‖Δ_theirs‖."""
    worst = 0.0
    for a, b in zip(ours, theirs, strict=True):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            scale = float(jnp.linalg.norm(y))
            if scale:
                worst = max(worst, float(jnp.linalg.norm(x - y)) / scale)
    return worst


# The newer code's values for its own arguments, with a small merge limit so
# that rank-2 and rank-3 parameters keep several axes (block_size 4 blocks them).
NEWER = {"merge_small_dims_block_size": 8}
BASE = {"learning_rate": 0.1, "block_size": 4, "start_preconditioning_step": 3}
# (case id, arguments, precond-only arguments). Arguments that do not interact
# share a case, to compile fewer programs.
CASES = [
    *[
        (f"graft_{kind.name}", {"graft_type": kind}, {})
        for kind in ps.GraftingType
        if kind != ps.GraftingType.SQRT_N
    ],
    # 0.0.6 keeps a separate grafting momentum for SQRT_N; the seed shares it.
    ("graft_SQRT_N", {"graft_type": 5}, {"separate_grafting_momentum": True}),
    ("no_nesterov_moving_average",
     {"nesterov": False, "moving_average_for_momentum": True}, {}),
    ("coupled_weight_decay_and_learning_rate",
     {"weight_decay": 0.01, "decoupled_learning_rate": False}, {}),
    ("decoupled_weight_decay",
     {"weight_decay": 0.01, "decoupled_weight_decay": True}, {}),
    ("memory_mode", {"best_effort_memory_usage_reduction": True}, {}),
    ("memory_mode_rmsprop_no_nesterov",
     {"best_effort_memory_usage_reduction": True, "graft_type": 3, "nesterov": False},
     {}),
    ("absolute_epsilon_exponent_tensordot_precision",
     {"relative_matrix_epsilon": False, "exponent_override": 2,
      "tensordot_precision": lax.Precision.DEFAULT}, {}),
    ("input_preconditioner_skip_rank_below_2",
     {"precondtioner_type": 2, "skip_preconditioning_rank_lt": 2}, {}),
    ("no_merging_no_training_metrics",
     {"best_effort_shape_interpretation": False, "generate_training_metrics": False},
     {}),
    ("merge_up_to_4096_clipped_rmsprop",
     {"merge_small_dims_block_size": 4096, "graft_type": 3,
      "clip_by_scaled_gradient_norm": 0.5}, {}),
    # reuse_preconditioner=True: the current google-research code's flag, with
    # the same steps as 0.0.6's (its root routine discards the previous root).
    ("no_blocking", {"block_size": 0}, {"reuse_preconditioner": True}),
    # Roots refreshed every 3rd step from statistics updated every 2nd: the
    # first root is used once the statistics have full rank (start 9), since a
    # float32 Newton root of a rank-2 7x7 statistic plus 1e-6 ridge
    # (condition ~1e6) differs between two implementations by ~1e-5 (measured
    # 2.1e-5 with start 3, from step 3 on).
    ("every_few_steps",
     {"preconditioning_compute_steps": 3, "statistics_compute_steps": 2,
      "start_preconditioning_step": 9},
     {}),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_trajectories_match_optax_shampoo_0_0_6(google, case):
    """20 steps, same gradients: every grafting type, memory mode, momentum
    styles, weight decay and learning-rate coupling, and each newer argument."""
    _, arguments, ours_only = case
    kwargs = {**BASE, **NEWER, **arguments}
    theirs = _trajectory(google.distributed_shampoo(**kwargs))
    ours = _trajectory(ps.distributed_shampoo(**kwargs, **ours_only))
    worst = _relative_difference(ours, theirs)
    print(f"{case[0]}: worst relative difference {worst:.2e}")
    assert worst <= 1e-5, worst


def test_default_merging_is_the_seeds_up_to_block_size(google):
    """Without merge_small_dims_block_size precond merges up to block_size, as
    the seed; 0.0.6 does so when given that value."""
    kwargs = {**BASE, "block_size": 8}
    theirs = _trajectory(
        google.distributed_shampoo(**kwargs, merge_small_dims_block_size=8)
    )
    ours = _trajectory(ps.distributed_shampoo(**kwargs))
    assert _relative_difference(ours, theirs) <= 1e-5
    # and differs from 0.0.6's own default (4096), so the test can fail.
    other = _trajectory(google.distributed_shampoo(**kwargs))
    assert _relative_difference(ours, other) > 1e-3


def test_lobpcg_deflation_matches_optax_shampoo_0_0_6(google):
    """Top-k deflation (k = 1, 2). All statistics share one size here: with
    several sizes 0.0.6 measures the residual of a padded root against the full
    identity, reports 1.0 and keeps the old preconditioner of every smaller one
    (see docs/migrating/distributed-shampoo.md)."""
    shapes = {"a": (6, 5), "c": (30,)}
    worst = {}
    for k in (1, 2):
        kwargs = dict(
            learning_rate=0.1,
            block_size=64,
            merge_small_dims_block_size=64,
            start_preconditioning_step=10,
            beta2=0.5,
            lobpcg_topk_precondition=k,
            lobpcg_max_iter=10,
        )
        theirs = _trajectory(google.distributed_shampoo(**kwargs), shapes)
        ours = _trajectory(ps.distributed_shampoo(**kwargs), shapes)
        worst[k] = _relative_difference(ours, theirs)
    assert max(worst.values()) <= 1e-5, worst


def test_seed_layout_view_equals_0_0_6_state(google):
    """seed_parameter_stats shows the state in the seed's per-parameter layout:
    after 4 steps its statistics, roots (same block and axis order), momenta,
    diagonal statistics and root errors equal 0.0.6's."""
    rng = np.random.default_rng(3)
    shapes = {"a": (6, 5), "b": (3, 4, 2), "c": (7,), "d": ()}
    params = {
        k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()
    }
    kwargs = {
        **BASE,
        **NEWER,
        "graft_type": 2,
        "best_effort_memory_usage_reduction": True,
    }
    states = []
    for module in (google, ps):
        opt = module.distributed_shampoo(**kwargs)
        state = opt.init(params)
        for step in range(4):
            grads = jax.tree.map(lambda x, step=step: jnp.cos(x * (step + 1)), params)
            _, state = jax.jit(opt.update)(grads, state, params)
        states.append(state)
    theirs, ours = states
    view = ps.seed_parameter_stats(ours, params, **kwargs)

    def close(x, y):  # relative to the whole array: roots of early, rank-deficient
        # statistics differ by ~3e-5 in their smallest entries (float32 Newton).
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape
        assert np.linalg.norm(x - y) <= 1e-5 * max(np.linalg.norm(y), 1e-6)

    for name in shapes:
        mine, google_stats = view[name], theirs.stats[name]
        assert len(mine.statistics) == len(google_stats.statistics), name
        for x, y in zip(mine.statistics, google_stats.statistics, strict=True):
            close(x, y)
        for x, y in zip(
            mine.preconditioners, google_stats.preconditioners, strict=True
        ):
            close(x, y)
        close(mine.momentum, google_stats.momentum.to_float())
        close(mine.diagonal_momentum, google_stats.diagonal_momentum.to_float())
        close(mine.diagonal_statistics, google_stats.diagonal_statistics.to_float())
        if mine.statistics:
            # Newton residuals at rounding level (~1e-7): absolute tolerance.
            np.testing.assert_allclose(
                mine.training_metrics.inverse_pth_root_errors,
                google_stats.training_metrics.inverse_pth_root_errors,
                atol=1e-6,
            )


# ------------------------------------------------------ every argument of 0.0.6

WALK_PARAMS = {"w": (4, 3), "v": (3,)}
# A 7-vector: LOBPCG deflates statistics with more than 5k rows, and with
# statistics of one size only (see test_lobpcg_deflation_matches_optax_shampoo_0_0_6).
LOBPCG_PARAMS = {"u": (7,)}
WALK_BASE = {
    "learning_rate": 0.1,
    "block_size": 8,
    "merge_small_dims_block_size": 8,
    "start_preconditioning_step": 1,
}
# Every argument of 0.0.6 set to a value other than its default, in groups of
# arguments that do not mask each other (one compilation per group and
# optimizer). "mesh": under an 8-device mesh; "pmap": in pmap over one device;
# "sharded": 0.0.6's shard_optimizer_states mode.
WALK_GROUPS = [
    ("momentum_grafting_weight_decay", "jit", WALK_PARAMS,
     {"learning_rate": 0.05, "beta1": 0.5, "beta2": 0.9, "graft_type": 2,
      "diagonal_epsilon": 1e-2, "weight_decay": 0.01,
      "decoupled_weight_decay": True, "nesterov": False,
      "moving_average_for_momentum": True, "exponent_override": 2}),
    # start 0 roots a rank-1 statistic: a ridge of 1e-3 keeps its condition at
    # 1e3 (with 1e-6 two float32 Newton roots differ by 1.0e-5, measured).
    ("blocking_roots_precision", "jit", WALK_PARAMS,
     {"block_size": 2, "best_effort_shape_interpretation": False,
      "matrix_epsilon": 1e-3, "start_preconditioning_step": 0,
      "relative_matrix_epsilon": False, "precondtioner_type": 2,
      "precision": lax.Precision.DEFAULT,
      "tensordot_precision": lax.Precision.DEFAULT, "num_devices_for_pjit": 8,
      "decoupled_learning_rate": False, "skip_preconditioning_rank_lt": 2}),
    ("every_few_steps_clipped_rmsprop_skip_large", "jit", WALK_PARAMS,
     {"preconditioning_compute_steps": 2, "statistics_compute_steps": 2,
      "graft_type": 3, "clip_by_scaled_gradient_norm": 0.1,
      "skip_preconditioning_dim_size_gt": 3}),
    ("memory_mode_merging_no_metrics", "jit", WALK_PARAMS,
     {"best_effort_memory_usage_reduction": True,
      "merge_small_dims_block_size": 2, "generate_training_metrics": False}),
    ("every_root_rejected", "jit", WALK_PARAMS,
     {"inverse_failure_threshold": 1e-12}),
    ("lobpcg", "jit", LOBPCG_PARAMS,
     {"lobpcg_topk_precondition": 1, "lobpcg_max_iter": 3}),
    # (memory mode in pmap, int16 statistics: test_google_single_step_cases_*
    # and test_shampoo_seed_state; here the rank-1 statistic of step 0 rounded
    # to int16 gives roots 1.9e-5 apart after 2 steps, measured)
    ("pmap", "pmap", WALK_PARAMS, {"batch_axis_name": "batch"}),
    ("specs_without_sharded_states", "mesh", WALK_PARAMS,
     {"statistics_partition_spec": P("data", None, None),
      "preconditioner_partition_spec": P("data", None, None)}),
    ("sharded_states", "sharded", WALK_PARAMS,
     {"shard_optimizer_states": True, "num_devices_for_pjit": 8,
      "statistics_partition_spec": P("data", None, None),
      "preconditioner_partition_spec": P("data", None, None)}),
]  # fmt: skip


def _two_steps(module, kwargs, shapes, runner):
    """Displacements after each of 2 steps (gradients cos((t+1)·W))."""
    params = {
        k: jnp.linspace(-1.0, 1.0, int(np.prod(s))).reshape(s)
        for k, s in shapes.items()
    }
    grads = [jax.tree.map(lambda x, t=t: jnp.cos((t + 1) * x), params) for t in (0, 1)]
    opt = module.distributed_shampoo(**kwargs)
    if runner == "pmap":
        add = lambda x: x[None]  # noqa: E731
        step = jax.pmap(opt.update, axis_name="batch", devices=jax.devices()[:1])
        init = jax.pmap(opt.init, devices=jax.devices()[:1])
        state, start, out = init(jax.tree.map(add, params)), params, []
        for g in grads:
            updates, state = step(*map(lambda t: jax.tree.map(add, t), (g,)),
                                  state, jax.tree.map(add, params))  # fmt: skip
            params = optax.apply_updates(params, jax.tree.map(lambda x: x[0], updates))
            out.append(jax.tree.map(jnp.subtract, params, start))
        return out
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        if runner == "sharded":
            state = jax.jit(opt.init(None).init_fn)(params)
        else:
            state = opt.init(params)
        update, start, out = jax.jit(opt.update), params, []
        for g in grads:
            updates, state = update(g, state, params)
            params = optax.apply_updates(params, updates)
            out.append(jax.tree.map(jnp.subtract, params, start))
    return out


def test_every_argument_of_0_0_6_runs_as_in_0_0_6(google):
    """Walks 0.0.6's signature: every argument is set, in some group, to a value
    other than its default, is accepted, and the group's two steps equal
    0.0.6's given the same arguments. An argument 0.0.6 has and no group sets
    fails here (so no case can be skipped for a missing argument)."""
    theirs = inspect.signature(google.distributed_shampoo).parameters
    covered = {
        name
        for _, _, _, arguments in WALK_GROUPS
        for name, value in arguments.items()
        if value is not theirs[name].default and value != theirs[name].default
    }
    assert covered == set(theirs), set(theirs) - covered
    worst, moved = {}, {}
    for name, runner, shapes, arguments in WALK_GROUPS:
        kwargs = {**WALK_BASE, **arguments}
        want = _two_steps(google, kwargs, shapes, runner)
        got = _two_steps(ps, kwargs, shapes, runner)
        worst[name] = _relative_difference(got, want)
        moved[name] = max(float(jnp.linalg.norm(x)) for x in jax.tree.leaves(want[-1]))
    print("largest relative differences:", worst)
    assert max(worst.values()) <= 1e-5, worst
    assert min(moved.values()) > 0, moved


# ------------------------------------------------------------------ optax contract


def test_update_accepts_extra_arguments():
    opt = ps.distributed_shampoo(0.1, 8)
    assert isinstance(opt, optax.GradientTransformationExtraArgs)
    params = {"w": jnp.ones((4, 3))}
    state = opt.init(params)
    plain, _ = opt.update(params, state, params)
    extra, _ = opt.update(params, state, params, loss=jnp.ones(()), key=0)
    np.testing.assert_array_equal(plain["w"], extra["w"])
    chained = optax.chain(optax.clip(1e3), opt)
    chained.update(params, chained.init(params), params, value=1.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"graft_type": ps.GraftingType.ADAGRAD},
        {"graft_type": ps.GraftingType.SQRT_N},
        {"best_effort_memory_usage_reduction": True},
    ],
    ids=["adagrad", "sqrt_n", "memory"],
)
def test_map_params_maps_exactly_the_parameter_shaped_fields(kwargs):
    opt = ps.distributed_shampoo(0.1, 4, **kwargs)
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones((3,))}
    state = opt.init(params)
    same = optax.tree.map_params(opt, lambda v: v, state)
    assert jax.tree.structure(same) == jax.tree.structure(state)
    jax.tree.map(np.testing.assert_array_equal, same, state)
    marked = optax.tree.map_params(
        opt, lambda v: "param", state, transform_non_params=lambda _: "other"
    )
    assert marked.count == "other"
    assert marked.statistics == "other"
    assert set(jax.tree.leaves(marked.momentum)) == {"param"}
    if kwargs.get("graft_type") == ps.GraftingType.ADAGRAD:
        assert set(jax.tree.leaves(marked.diagonal_statistics)) == {"param"}


# ------------------------------------------------------------------ explicit meshes


def test_explicit_axis_mesh_equals_unsharded():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    shapes = {"w": (16, 8), "b": (8,)}
    kwargs = dict(learning_rate=0.1, block_size=8, start_preconditioning_step=1)
    plain = _trajectory(ps.distributed_shampoo(**kwargs), shapes, steps=4)
    with jax.set_mesh(mesh):
        sharded = _trajectory(
            ps.distributed_shampoo(
                **kwargs,
                preconditioner_partition_spec=P("data", None, None),
                shard_optimizer_states=True,
                sharded_init_fns=False,
                precondition_with_previous_roots=False,  # as unsharded
            ),
            shapes,
            steps=4,
        )
    assert _relative_difference(sharded, plain) <= 1e-5


def test_seed_init_fn_state_builds_out_shardings():
    """With shard_optimizer_states, init returns the seed's InitFnState; its
    pspec_fn gives out_shardings for init_fn, and the state trains like the
    unsharded one."""
    mesh = jax.make_mesh((8,), ("data",))
    shapes = {"w": (16, 8), "b": (8,)}
    params = {k: jnp.ones(s) for k, s in shapes.items()}
    kwargs = dict(learning_rate=0.1, block_size=8, start_preconditioning_step=1)
    opt = ps.distributed_shampoo(
        **kwargs,
        shard_optimizer_states=True,
        statistics_partition_spec=P("data", None, None),
    )
    with jax.set_mesh(mesh):
        init_fns = opt.init(None)
        assert isinstance(init_fns, ps.InitFnState)
        specs = init_fns.pspec_fn(params, {"w": P(), "b": P()}, P("data", None, None))
        shardings = jax.tree.map(
            lambda s: jax.sharding.NamedSharding(mesh, s),
            specs,
            is_leaf=lambda x: isinstance(x, P),
        )
        state = jax.jit(init_fns.init_fn, out_shardings=shardings)(params)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == jax.tree.map(
            lambda x: (x.shape, x.dtype), init_fns.shape_and_dtype_fn(params)
        )
        assert state.statistics[0].sharding.spec[0] == "data"
        updates, _ = jax.jit(opt.update)(params, state, params)
    plain = ps.distributed_shampoo(**kwargs)
    want, _ = plain.update(params, plain.init(params), params)
    for x, y in zip(jax.tree.leaves(updates), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6)


# ------------------------------------------------------------ Google's own cases
# Equivalents of optax_shampoo/distributed_shampoo_test.py, written for precond,
# each compared with 0.0.6 instead of only checked for finiteness.

GOOGLE_PARAMS = (
    jnp.array([[1.0, 3.0], [2.0, 4.0]]),
    jnp.array([[3.0, 4.0], [3.0, 4.0]]),
)
GOOGLE_GRADS = (
    jnp.array([[500.0, 5.0], [500.0, 5.0]]),
    jnp.array([[300.0, 3.0], [300.0, 3.0]]),
)


def _google_step(module, axis_name, **kwargs):
    opt = module.distributed_shampoo(
        0.1, 32, batch_axis_name=axis_name, preconditioning_compute_steps=2, **kwargs
    )
    state = opt.init(GOOGLE_PARAMS)
    if axis_name is None:
        return jax.jit(opt.update)(GOOGLE_GRADS, state, GOOGLE_PARAMS)
    step = jax.pmap(
        lambda _: opt.update(GOOGLE_GRADS, state, GOOGLE_PARAMS),
        axis_name=axis_name,
        devices=jax.devices()[:1],
    )
    return jax.tree.map(lambda x: x[0], step(jnp.ones((1,))))


@pytest.mark.parametrize("axis_name", ["batch", None], ids=["pmap", "no_pmap"])
def test_google_single_step_cases_match_0_0_6(google, axis_name):
    for memory, metrics in itertools.product((False, True), (True, False)):
        kwargs = dict(
            best_effort_memory_usage_reduction=memory,
            generate_training_metrics=metrics,
        )
        theirs, _ = _google_step(google, axis_name, **kwargs)
        ours, state = _google_step(ps, axis_name, **kwargs)
        assert all(jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(state))
        for x, y in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, err_msg=str(kwargs))
        # int16 statistics exactly where Google has them: memory mode in pmap.
        quantized = isinstance(state.statistics[0], sm.QuantizedArray)
        assert quantized == (memory and axis_name is not None)


def _conditioned_matrix(rng, n, condition):
    q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    return (q * condition ** (-np.arange(n) / (n - 1))) @ q.T


@pytest.mark.parametrize("p", [2, 4, 8], ids=["p2", "p4", "p8"])
def test_inverse_root_of_a_conditioned_matrix(p):
    """Google's test_matrix_inverse_root: H^p·A ≈ I for condition 10 and 1e3."""
    rng = np.random.default_rng(1234)
    for condition in (10.0, 1e3):
        a = _conditioned_matrix(rng, 10, condition)
        root, error = sm.matrix_inverse_pth_root(
            jnp.asarray(a, jnp.float32), p, ridge_epsilon=0.0
        )
        h = np.asarray(root, np.float64)
        residual = np.linalg.matrix_power(h, p) @ a - np.eye(10)
        assert np.max(np.abs(residual)) < 1e-3 * condition ** (1 / 2), condition
        assert float(error) < 1e-3


@pytest.mark.parametrize("p", [2, 4, 6, 8], ids=["p2", "p4", "p6", "p8"])
def test_inverse_root_gap_is_accurate(p):
    """Google's test_pth_root_difference: (w+a)^(-1/p) − (w+b)^(-1/p) without
    cancellation, for a <= b, against float64."""
    values = [0.0, 1e-6, 1e-5, 1.0]
    for w, a, b in itertools.product([1e-6, 1e-5, 1.0, 1e3], values, values):
        if a > b:
            continue
        expected = (np.float64(w) + a) ** (-1 / p) - (np.float64(w) + b) ** (-1 / p)
        actual = float(sm._inverse_root_gap(jnp.float32(w), a, jnp.float32(b), p))
        assert actual == pytest.approx(expected, rel=1e-2, abs=1e-7), (w, a, b)


@pytest.mark.parametrize("p", [2, 4, 8], ids=["p2", "p4", "p8"])
def test_lobpcg_deflation_is_no_worse_than_plain(p):
    """Google's test_lobpcg_preconditioning: deflating the top 2 eigenpairs keeps
    H^p·A at least as close to I as the plain root (within 2x)."""
    rng = np.random.RandomState(42)
    x = jnp.asarray(rng.random((11, 11)), jnp.float32)
    a = jnp.matmul(x.T, x, precision=lax.Precision.HIGHEST)
    spectrum, entries = {}, {}
    for k in (0, 2):
        root, _ = jax.jit(
            lambda m, k=k: sm.matrix_inverse_pth_root(
                m, p, ridge_epsilon=1e-4, lobpcg_topk_precondition=k, lobpcg_max_iter=10
            )
        )(a)
        inverse = np.linalg.matrix_power(np.asarray(root, np.float64), p)
        product = inverse @ np.asarray(a, np.float64)
        spectrum[k] = np.median(np.abs(1 - np.linalg.eigvals(product).real))
        entries[k] = np.mean(np.abs(product - np.eye(11)))
    assert spectrum[2] <= 2 * spectrum[0], spectrum
    assert entries[2] <= 2 * entries[0], entries
