"""precond.jax.kron against distributed-kron 1.0.0 (the oracle, test-only).

Parity: both optimizers get the same gradients and the same random draws (the
oracle's balancing decision and one noise draw per unit, injected into both), and
their updates must agree to a relative difference of 1e-5 in float32 for 20 steps.
Blocked cases use dims that are multiples of the block size: the oracle pads every
axis up to a multiple of the block size and fits the padding with noise, which
precond does not do (docs/migrating/distributed-kron.md).
"""

from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precond.jax as pj
from precond.jax.kron import _randomness as _kron_randomness
from precond.jax.kron import _step as _kron_step
from tests import oracles

STEPS = 20
RTOL = 1e-5


def _oracle_fit_draws(count):
    """The oracle's balancing flag and noise key at (1-based) step ``count``."""
    key = jax.random.fold_in(jax.random.PRNGKey(42), count - 1)
    _, key = jax.random.split(key)  # update_fn's split
    key, subkey = jax.random.split(key)
    balance = jax.random.uniform(subkey) <= 0.01
    _, noise_key = jax.random.split(key)
    return balance, noise_key


def _inject_randomness(monkeypatch, dk, lead_axes):
    """Both draw the oracle's balancing decisions and, per unit, the noise of
    ``unit_noise`` from the oracle's noise key. ``lead_axes``: per parameter
    leaf, how many leading axes of the oracle's noise array index units (layers
    and blocks)."""
    # precond: the step's key carries the step count, from which the oracle's
    # draws are derived.
    monkeypatch.setattr(
        _kron_step,
        "step_key",
        lambda seed, count: jnp.stack([jnp.zeros_like(count), count]).astype(
            jnp.uint32
        ),
    )
    monkeypatch.setattr(
        _kron_step,
        "fit_randomness",
        lambda key: _oracle_fit_draws(key[1].astype(jnp.int32)),
    )

    def tree_noise(key, tree, dtype=None):
        leaves, treedef = jax.tree.flatten(tree)
        out = []
        for index, (leaf, lead) in enumerate(zip(leaves, lead_axes, strict=True)):
            units, block = math.prod(leaf.shape[:lead]), leaf.shape[lead:]
            draws = [
                _kron_randomness.unit_noise(key, index, u, block, dtype or leaf.dtype)
                for u in range(units)
            ]
            out.append(jnp.stack(draws).reshape(leaf.shape))
        return treedef.unflatten(out)

    monkeypatch.setattr(dk, "_tree_random_like", tree_noise)


def _gradients(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
        for _ in range(STEPS)
    ]


def _run(optimizer, params, grads):
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    outputs = []
    for g in grads:
        updates, state = update(g, state, params)
        outputs.append(updates)
    return outputs, state


def _relative_difference(got, want):
    diff = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(got, want, strict=True))
    norm = sum(float(jnp.sum(b**2)) for b in want)
    return math.sqrt(diff / norm)


SHAPES = {"b": (16,), "w": (16, 24), "x": (8, 8, 16)}
SCANNED_SHAPES = {"b": (16,), "stack": (3, 8, 16), "w": (16, 24)}
PADDED_SHAPES = {
    "b": (10,),
    "s": (),
    "stack": (2, 5, 12),
    "w": (12, 20),
    "x": (5, 6, 7),
}
PADDED_SCANNED = {"b": False, "s": False, "stack": True, "w": False, "x": False}
# name ↦ (shapes, arguments given to both): together they cover every setting
# the two share (each case compiles both optimizers, so settings are combined).
SCANNED = {"b": False, "stack": True, "w": False}
CASES = {
    "plain": (SHAPES, dict(merge_small_dims=False, partition_grads_into_blocks=False)),
    "one_diag_merged": (
        SHAPES,
        dict(
            memory_save_mode="one_diag",
            target_merged_dim_size=64,
            partition_grads_into_blocks=False,
        ),
    ),
    "all_diag_blocked": (
        SHAPES,
        dict(memory_save_mode="all_diag", merge_small_dims=False, block_size=8),
    ),
    "merged_blocked_decay_schedule": (
        SHAPES,
        dict(
            target_merged_dim_size=64,
            block_size=8,
            learning_rate=lambda n: 1e-2 / (1 + n),
            weight_decay=0.1,
            weight_decay_mask={"b": False, "w": True, "x": True},
            preconditioner_lr=0.3,
            preconditioner_init_scale=0.5,
        ),
    ),
    "b1_0_probability_sizes": (
        SHAPES,
        dict(
            b1=0.0,
            preconditioner_update_probability=0.4,
            max_size_triangular=16,
            min_ndim_triangular=3,
            block_size=8,
        ),
    ),
    "scanned": (
        SCANNED_SHAPES,
        dict(
            scanned_layers=SCANNED,
            merge_small_dims=False,
            partition_grads_into_blocks=False,
        ),
    ),
    "scanned_blocked_lax_map": (
        SCANNED_SHAPES,
        dict(
            scanned_layers=SCANNED,
            lax_map_scanned_layers=True,
            lax_map_batch_size=2,
            block_size=8,
        ),
    ),
    # Dims that are not multiples of the block size: distributed-kron pads them
    # (and fits the padding); precond does so with block_padding='distributed_kron'.
    "padded_blocks": (
        PADDED_SHAPES,
        dict(
            scanned_layers=PADDED_SCANNED,
            target_merged_dim_size=64,
            block_size=8,
        ),
    ),
}


def _oracle_lead_axes(shapes, arguments):
    scanned = arguments.get("scanned_layers") or {}
    blocked = arguments.get("partition_grads_into_blocks", True)
    return [int(scanned.get(k, False)) + int(blocked) for k in sorted(shapes)]


def _compare(case, optimizers, params, grads):
    got, want = (_run(o, params, grads)[0] for o in optimizers)
    worst = 0.0
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        difference = _relative_difference(jax.tree.leaves(g), jax.tree.leaves(w))
        worst = max(worst, difference)
        assert difference <= RTOL, (case, step, difference)
    # Not vacuous: every parameter's last update is nonzero.
    assert all(float(jnp.max(jnp.abs(u))) > 0 for u in jax.tree.leaves(got[-1]))
    print(f"{case}: worst relative difference {worst:.2e}")


@pytest.mark.parametrize("cache", ["packed", None])
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_seed_gives_distributed_kron_trajectory(case, cache):
    """With distributed-kron's merge rule and random draws (and its padding where
    it pads), 20 steps of updates equal distributed-kron 1.0.0's (relative 1e-5,
    float32); every other argument is the same for both, nothing injected. With
    precond's default cache ('packed', P = QᵀQ applied in one product) and with
    distributed-kron's storage (None, Qᵀ(Q·G)), which docs/migrating recommends."""
    dk = oracles.distributed_kron()
    shapes, arguments = CASES[case]
    arguments = {"learning_rate": 0.01, **arguments}
    ours = pj.kron(
        **arguments,
        merge_rule="distributed_kron",
        noise_draws="distributed_kron",
        block_padding="distributed_kron" if case == "padded_blocks" else "inert",
        preconditioner_cache=cache,
    )
    _compare(case, (ours, dk.kron(**arguments)), _params(shapes), _gradients(shapes))


@pytest.mark.parametrize("case", ["scanned_blocked_lax_map"])
def test_default_draws_injected_match_distributed_kron(case, monkeypatch):
    """precond's own (per-block) draws, given to the oracle too: the same
    trajectory, so the draws are the only difference of noise_draws."""
    dk = oracles.distributed_kron()
    shapes, arguments = CASES[case]
    arguments = {"learning_rate": 0.01, **arguments}
    _inject_randomness(monkeypatch, dk, _oracle_lead_axes(shapes, arguments))
    ours = pj.kron(**arguments, merge_rule="distributed_kron")
    _compare(case, (ours, dk.kron(**arguments)), _params(shapes), _gradients(shapes))


def _params(shapes):
    return _gradients(shapes, seed=1)[0]


# The entry points distributed-kron 1.0.0 exports.
ENTRY_POINTS = (
    "kron",
    "scale_by_kron",
    "get_opt_state_partition_specs",
    "precond_update_prob_schedule",
)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_signature_matches_distributed_kron(name):
    """Every argument of 1.0.0 in its place: name, kind, default; precond's own
    additions only keyword-only after them (before a ``**kwargs`` the seed has)."""
    dk = oracles.distributed_kron()
    theirs = list(inspect.signature(getattr(dk, name)).parameters.values())
    ours = list(inspect.signature(getattr(pj, name)).parameters.values())
    var_keyword = inspect.Parameter.VAR_KEYWORD
    seed_arguments = [p for p in theirs if p.kind is not var_keyword]
    for theirs_p, ours_p in zip(seed_arguments, ours, strict=False):
        assert (ours_p.name, ours_p.kind) == (theirs_p.name, theirs_p.kind)
        if theirs_p.default is not inspect.Parameter.empty and callable(
            theirs_p.default
        ):  # the default update-probability schedule
            steps = jnp.arange(0, 6000, 7)
            np.testing.assert_allclose(
                ours_p.default(steps), theirs_p.default(steps), rtol=1e-6
            )
        else:
            assert ours_p.default == theirs_p.default, ours_p.name
    additions = ours[len(seed_arguments) :]
    if theirs[-1].kind is var_keyword:
        assert additions[-1].kind is var_keyword
        assert additions[-1].name == theirs[-1].name
        additions = additions[:-1]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in additions), name
    # distributed-kron 2.0.0 changed none of these signatures (its additions are a
    # separate optimizer, pro), so there is nothing newer to accept.


def test_accepted_values_of_distributed_kron():
    """Values the seed documents are accepted: dtypes as strings, each matmul
    precision, each memory_save_mode, a one-entry preconditioner spec, and
    kron's own arguments passed to scale_by_kron (which ignores them)."""
    params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
    for precision in ("bfloat16", "tensorfloat32", "float32", None):
        for mode in (None, "one_diag", "all_diag"):
            optimizer = pj.kron(
                mu_dtype="bfloat16",
                precond_dtype="float32",
                precond_update_precision=precision,
                precond_grads_precision=precision,
                memory_save_mode=mode,
            )
    state = optimizer.init(params)
    updates, _ = optimizer.update(params, state, params)
    assert jax.tree.map(lambda u: u.dtype, updates) == {
        "b": jnp.float32,
        "w": jnp.float32,
    }
    assert jax.tree.leaves(state)[1].dtype == jnp.bfloat16  # momentum of "b"
    pj.scale_by_kron(learning_rate=3e-4, weight_decay=0.1, weight_decay_mask=None)
    with pytest.raises(TypeError, match="not_an_argument"):
        pj.scale_by_kron(not_an_argument=1)
    with pytest.raises(ValueError, match=r"Invalid merge_rule='greedy': must be"):
        pj.kron(merge_rule="greedy")


def test_positional_call_binds_as_in_distributed_kron():
    """A positional call written for 1.0.0 binds each value to the same name."""
    values = (1e-3, 0.95, 0.01, None, 0.5, 1024, 2, "one_diag", 0.2, 2.0)
    for name in ("kron",):
        dk = oracles.distributed_kron()
        theirs = inspect.signature(getattr(dk, name)).bind(*values).arguments
        ours = inspect.signature(getattr(pj, name)).bind(*values).arguments
        assert ours == theirs
    pj.kron(*values)  # and is accepted


# The seed document's snippets (000_*), only the import changed; small sizes.


def test_seed_snippet_basic_usage():
    import optax

    from precond.jax import kron

    params = {"w": jnp.ones((8, 4)), "b": jnp.zeros(4)}
    grads = jax.tree.map(lambda p: 0.1 * jnp.ones_like(p), params)

    optimizer = kron()
    opt_state = optimizer.init(params)

    updates, opt_state = optimizer.update(grads, opt_state)
    params = optax.apply_updates(params, updates)

    # The default learning rate is 1.0.0's 3e-4, and the update is clipped to
    # RMS <= 1.1 before it: every entry moved, none by more than 3e-4 · 1.1·√n.
    moved = jnp.abs(params["w"] - 1)
    assert float(jnp.min(moved)) > 0
    assert float(jnp.max(moved)) <= 3e-4 * 1.1 * 6


def test_seed_snippet_partition_specs():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from precond.jax import get_opt_state_partition_specs, kron

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
    params = {"layers": jnp.ones((2, 16, 8)), "head": jnp.ones((16, 8))}
    train_state_shapes = {"params": jax.eval_shape(lambda: params)}
    scanned_layers_pytree = {"layers": True, "head": False}
    params_partition_specs = {"layers": P(None, "fsdp"), "head": P("fsdp")}

    kron_kwargs = dict(
        learning_rate=0.0003,
        weight_decay=0.01,
        scanned_layers=scanned_layers_pytree,
        params_partition_specs=params_partition_specs,
        preconditioner_partition_spec=P("fsdp", None),
    )

    optimizer = kron(**kron_kwargs)

    opt_state_partition_specs = get_opt_state_partition_specs(
        params=train_state_shapes["params"], scale_by_kron_only=False, **kron_kwargs
    )

    # As the seed's users use them: out_shardings of the jitted init.
    with jax.set_mesh(mesh):
        shardings = jax.tree.map(
            lambda spec: NamedSharding(mesh, spec), opt_state_partition_specs
        )
        state = jax.jit(optimizer.init, out_shardings=shardings)(params)
        _, state = jax.jit(optimizer.update)(params, state, params)
    for leaf, spec in zip(
        jax.tree.leaves(state), jax.tree.leaves(opt_state_partition_specs), strict=True
    ):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim)


def test_seed_snippet_update_probability_schedule():
    from precond.jax import kron, precond_update_prob_schedule

    optimizer = kron(
        preconditioner_update_probability=precond_update_prob_schedule(
            min_prob=0.05,
            flat_start=1000,
        )
    )
    params = {"w": jnp.ones((4, 4))}
    state = optimizer.init(params)
    _, state = optimizer.update(params, state, params)
    schedule = precond_update_prob_schedule(min_prob=0.05, flat_start=1000)
    assert float(schedule(1000)) == 1.0
    assert float(schedule(100_000)) == pytest.approx(0.05)


def _continue(optimizer, state, params, grads):
    update = jax.jit(optimizer.update)
    outputs = []
    for g in grads:
        updates, state = update(g, state, params)
        outputs.append(updates)
    return outputs


@pytest.mark.parametrize("direction", ["from_distributed_kron", "to_distributed_kron"])
def test_state_conversion_continues_the_trajectory(direction, monkeypatch):
    """A state converted after 5 steps (either way) continues on the other
    optimizer exactly as the uninterrupted run on the first."""
    dk = oracles.distributed_kron()
    shapes = SCANNED_SHAPES
    arguments = dict(
        learning_rate=0.01,
        weight_decay=0.1,
        scanned_layers=SCANNED,
        target_merged_dim_size=64,
        block_size=8,
    )
    _inject_randomness(monkeypatch, dk, _oracle_lead_axes(shapes, arguments))
    ours_arguments = dict(arguments, merge_rule="distributed_kron")
    params = _gradients(shapes, seed=1)[0]
    grads = _gradients(shapes)
    theirs, ours = dk.kron(**arguments), pj.kron(**ours_arguments)
    first, second = (
        (theirs, ours)
        if direction == "from_distributed_kron"
        else (
            ours,
            theirs,
        )
    )
    state = first.init(params)
    update = jax.jit(first.update)
    for g in grads[:5]:
        _, state = update(g, state, params)
    uninterrupted = _continue(first, state, params, grads[5:])
    if direction == "from_distributed_kron":
        converted = pj.kron_state_from_distributed_kron(state, params, **ours_arguments)
        assert jax.tree.structure(converted) == jax.tree.structure(ours.init(params))
        back = pj.kron_state_to_distributed_kron(converted, params, **ours_arguments)
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    else:
        converted = pj.kron_state_to_distributed_kron(state, params, **ours_arguments)
        assert jax.tree.structure(converted) == jax.tree.structure(theirs.init(params))
    continued = _continue(second, converted, params, grads[5:])
    for step, (g, w) in enumerate(zip(continued, uninterrupted, strict=True), 6):
        difference = _relative_difference(jax.tree.leaves(g), jax.tree.leaves(w))
        assert difference <= RTOL, (direction, step, difference)
