"""precond.jax.pro_adamw: the hand-written recipe it replaces, its split of the
parameters, its step policy, its checkpoints and its argument checks.

(1) Oracle: the recipe written by hand, an ``optax.multi_transform`` of
    ``pro(2·lr, b1=0.7, 'QEQ', the probability schedule)`` on the hidden
    matrices and ``optax.adamw(lr)`` on the rest, gives the same parameters
    step by step (float32 rounding between two programs: 1e-6 relative).
(2) The default rule picks exactly the hidden matrices of a model with an
    embedding, two hidden matrices, a bias, a norm scale and a head; a tree or
    a callable overrides it.
(3) One step policy: an unusable gradient in either part skips both (state
    unchanged, weight decay alone), as each precond optimizer skips.
(4) A state saved to host arrays and restored continues bit for bit.
(5) Bad arguments raise ``Invalid <name>=<value!r>: must be <rule>``.
(The optax contract, robustness and orbax checkpoint tables run it too:
tests/jax/test_optax_contract.py, helpers.EVERY_OPTIMIZER.)
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import precond.jax as pj
from precond._common.pro_adamw_recipe import PRO_LR_MULTIPLIER
from tests.jax.helpers import assert_skipped_once

LR = 3e-3


def _model(seed=0):
    """Params named as a transformer's: an embedding, two hidden matrices (one
    with a bias), a norm scale and an output head."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(0.3 * rng.standard_normal(shape), jnp.float32)

    return {
        "embedding": normal(16, 8),
        "layers": [
            {"mlp_in": {"weight": normal(12, 8), "bias": normal(12)}},
            {"mlp_out": {"weight": normal(8, 12)}},
        ],
        "norm": {"scale": 1.0 + normal(8)},
        "head": {"weight": normal(16, 8)},
    }


HIDDEN = {
    "embedding": False,
    "layers": [
        {"mlp_in": {"weight": True, "bias": False}},
        {"mlp_out": {"weight": True}},
    ],
    "norm": {"scale": False},
    "head": {"weight": False},
}


def _gradients(params, steps, seed=1):
    rng = np.random.default_rng(seed)
    return [
        jax.tree.map(
            lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params
        )
        for _ in range(steps)
    ]


def _run(optimizer, params, grads, state=None):
    """(params after each step, final state), jitted."""
    state = optimizer.init(params) if state is None else state
    update = jax.jit(optimizer.update)
    trajectory = []
    for g in grads:
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
        trajectory.append(params)
    return trajectory, state


def _hand_written_recipe(learning_rate, hidden):
    """The recipe before pro_adamw, written out with optax.multi_transform."""
    schedule = pj.precond_update_prob_schedule(
        min_prob=0.2, decay=0.005, flat_start=200
    )
    pro_rate = (
        (lambda n: 2 * learning_rate(n))
        if callable(learning_rate)
        else 2 * learning_rate
    )
    pro = pj.pro(
        pro_rate,
        b1=0.7,
        weight_decay=1e-4,
        preconditioner_update_style="QEQ",
        preconditioner_update_probability=schedule,
    )
    rest = optax.adamw(learning_rate, weight_decay=1e-4)
    labels = jax.tree.map(lambda h: "hidden" if h else "rest", hidden)
    return optax.multi_transform({"hidden": pro, "rest": rest}, labels)


# ------------------------------------------------------------------ (1) oracle


@pytest.mark.parametrize("schedule", [False, True], ids=["constant", "cosine"])
def test_equals_the_hand_written_recipe(schedule):
    params = _model()
    learning_rate = optax.cosine_decay_schedule(LR, 10) if schedule else LR
    grads = _gradients(params, 6)
    got, _ = _run(pj.pro_adamw(learning_rate), params, grads)
    want, _ = _run(_hand_written_recipe(learning_rate, HIDDEN), params, grads)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        jax.tree.map(
            lambda x, y, step=step: np.testing.assert_allclose(
                x, y, rtol=1e-6, atol=1e-7, err_msg=f"step {step}"
            ),
            a,
            b,
        )


# ------------------------------------------------------------------ (2) the split


def _pro_leaves(state):
    """The leaves pro keeps a momentum for (the others are MaskedNode)."""
    mu = state.inner_states["pro"].inner_state[0].mu
    return jax.tree.map(
        lambda x: not isinstance(x, optax.MaskedNode),
        mu,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),
    )


def _adam_leaves(state):
    mu = state.inner_states["adamw"].inner_state[0].mu
    return jax.tree.map(
        lambda x: not isinstance(x, optax.MaskedNode),
        mu,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),
    )


def test_the_default_rule_picks_exactly_the_hidden_matrices():
    params = _model()
    assert pj.pro_adamw_hidden_matrices(params) == HIDDEN
    state = pj.pro_adamw(LR).init(params)
    assert _pro_leaves(state) == HIDDEN
    assert _adam_leaves(state) == jax.tree.map(lambda h: not h, HIDDEN)


def test_the_default_rule_is_the_bench_s_split_of_its_char_lm():
    """On the bench's transformer (byte and position embeddings, attention and
    MLP matrices, norms, biases, a head) the rule picks the matrices that the
    bench's hand-written split (Muon's, the recipe's) picks."""
    from precond.bench import jax_models

    params = jax.eval_shape(lambda: jax_models.init_char_lm(0))
    assert pj.pro_adamw_hidden_matrices(params) == jax_models.char_lm_hidden_matrices(
        params
    )


def test_a_tree_or_a_callable_overrides_the_rule():
    """A prefix tree (the whole 'layers' subtree to pro, the head too), and a
    callable of the params (every 2-D leaf): pro's leaves are those, and the
    steps are the hand-written recipe's with that split."""
    params = _model()
    tree = {"embedding": False, "layers": True, "norm": False, "head": True}
    every_matrix = jax.tree.map(lambda p: p.ndim == 2, params)
    # The parameters pro takes, by shape: the layers' three leaves and the head.
    want_tree = [(12,), (12, 8), (8, 12), (16, 8)]
    want_matrices = [(16, 8), (12, 8), (8, 12), (16, 8)]
    grads = _gradients(params, 3)
    for given, mask, want in (
        (tree, tree, want_tree),
        (lambda p: every_matrix, every_matrix, want_matrices),
    ):
        optimizer = pj.pro_adamw(LR, preconditioned=given)
        mu = optimizer.init(params).inner_states["pro"].inner_state[0].mu
        assert sorted(x.shape for x in jax.tree.leaves(mu)) == sorted(want)
        got, _ = _run(optimizer, params, grads)
        expected, _ = _run(_hand_written_recipe(LR, mask), params, grads)
        jax.tree.map(
            lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7),
            got[-1],
            expected[-1],
        )


def test_all_to_one_part_works():
    """Every leaf to pro, or none: the other part holds no leaf and the steps
    are pro's (resp. AdamW's) alone."""
    params = _model()
    grads = _gradients(params, 2)
    schedule = pj.precond_update_prob_schedule(
        min_prob=0.2, decay=0.005, flat_start=200
    )
    pro = pj.pro(
        2 * LR,
        b1=0.7,
        weight_decay=1e-4,
        preconditioner_update_style="QEQ",
        preconditioner_update_probability=schedule,
    )
    for flag, alone in ((True, pro), (False, optax.adamw(LR, weight_decay=1e-4))):
        got, _ = _run(pj.pro_adamw(LR, preconditioned=flag), params, grads)
        want, _ = _run(alone, params, grads)
        jax.tree.map(
            lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7),
            got[-1],
            want[-1],
        )


def test_map_params_gives_the_state_s_partition_specs():
    """optax.tree.map_params reaches both parts' parameter-shaped fields (pro's
    momentum, AdamW's moments); with MaskedNode kept as it is, the specs of the
    params give a spec tree shaped as the state."""
    params = _model()
    optimizer = pj.pro_adamw(LR)
    state = optimizer.init(params)
    specs = jax.tree.map(lambda p: P(*([None] * p.ndim)), params)
    is_leaf = lambda x: isinstance(x, P | optax.MaskedNode)  # noqa: E731
    mapped = optax.tree.map_params(
        optimizer,
        lambda x, spec: x if isinstance(x, optax.MaskedNode) else spec,
        state,
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=is_leaf,
    )
    pro_mu = mapped.inner_states["pro"].inner_state[0].mu
    assert pro_mu["layers"][0]["mlp_in"]["weight"] == P(None, None)
    assert isinstance(pro_mu["embedding"], optax.MaskedNode)
    adam_nu = mapped.inner_states["adamw"].inner_state[0].nu
    assert adam_nu["embedding"] == P(None, None)


# ------------------------------------------------------------------ (3) skipping


@pytest.mark.parametrize("where", ["hidden matrix", "norm scale"])
def test_an_unusable_gradient_in_either_part_skips_both(where):
    """NaN in a pro leaf or in an AdamW leaf: no state changes, and every
    parameter moves by its part's weight decay alone (−c·lr·λ·θ, c = 4 on
    pro's leaves); the next step goes on from the old state."""
    params = _model()
    optimizer = pj.pro_adamw(LR, weight_decay=0.1)
    _, state = _run(optimizer, params, _gradients(params, 2))
    grads = _gradients(params, 1, seed=7)[0]
    if where == "hidden matrix":
        grads["layers"][1]["mlp_out"]["weight"] = (
            grads["layers"][1]["mlp_out"]["weight"].at[0, 0].set(jnp.nan)
        )
    else:
        grads["norm"]["scale"] = grads["norm"]["scale"].at[3].set(jnp.inf)
    updates, new_state = jax.jit(optimizer.update)(grads, state, params)
    assert_skipped_once(new_state, state)
    want = jax.tree.map(
        lambda p, h: -(PRO_LR_MULTIPLIER if h else 1.0) * LR * 0.1 * p,
        params,
        HIDDEN,
    )
    jax.tree.map(
        lambda u, w: np.testing.assert_allclose(u, w, rtol=1e-6), updates, want
    )


# ------------------------------------------------------------------ (4) checkpoints


def test_a_restored_state_continues_bit_identically(tmp_path):
    """The state after 3 steps, saved leaf by leaf with NumPy and unflattened
    into the tree of a fresh init, continues as the uninterrupted run."""
    params = _model()
    optimizer = pj.pro_adamw(LR, preconditioner_update_probability=0.5)
    grads = _gradients(params, 6)
    want, _ = _run(optimizer, params, grads)
    middle, state = _run(optimizer, params, grads[:3])
    leaves = jax.tree.leaves(jax.device_get(state))
    np.savez(tmp_path / "state.npz", *leaves)
    with np.load(tmp_path / "state.npz") as saved:
        loaded = [saved[f"arr_{i}"] for i in range(len(leaves))]
    fresh = pj.pro_adamw(LR, preconditioner_update_probability=0.5)
    treedef = jax.tree.structure(jax.eval_shape(fresh.init, params))
    restored = jax.tree.unflatten(treedef, loaded)
    got, _ = _run(fresh, middle[-1], grads[3:], restored)
    jax.tree.map(np.testing.assert_array_equal, got[-1], want[-1])


# ------------------------------------------------------------------ (5) arguments

BAD_ARGUMENTS = [
    ("learning_rate", -1.0, ValueError, ">= 0.0"),
    ("b1", 1.0, ValueError, "in [0.0, 1.0)"),
    ("adam_b1", 1.0, ValueError, "in [0.0, 1.0)"),
    ("adam_b2", -0.1, ValueError, "in [0.0, 1.0)"),
    ("adam_eps", float("nan"), ValueError, "finite"),
    ("weight_decay", -0.1, ValueError, ">= 0.0"),
    ("pro_lr_multiplier", 0.0, ValueError, "> 0.0"),
    ("preconditioned", "yes", TypeError, "None, a pytree of bools"),
    ("preconditioned", {"w": 1}, TypeError, "True or False"),
    ("preconditioner_update_style", "EQ", ValueError, "one of 'PRO', 'QUAD', 'QEQ'"),
    ("preconditioner_update_probability", 0.0, ValueError, "in (0.0, 1.0]"),
    ("preconditioner_lr", -1.0, ValueError, ">= 0.0"),
    ("preconditioner_init_scale", 0.0, ValueError, "> 0.0"),
    ("normalize_grads", "no", TypeError, "True or False"),
    ("max_size_dense", -1, ValueError, ">= 0"),
    ("block_size", 0, ValueError, ">= 1"),
    ("noise_scale", -1e-9, ValueError, ">= 0.0"),
    ("dtype", jnp.float64, ValueError, "float32 or bfloat16"),
    ("draws", "numpy", ValueError, "one of 'distributed_kron', 'compact'"),
]


@pytest.mark.parametrize(
    ("name", "value", "error", "rule"),
    BAD_ARGUMENTS,
    ids=[f"{name}={value!r}" for name, value, _, _ in BAD_ARGUMENTS],
)
def test_bad_arguments_raise_the_standard_message(name, value, error, rule):
    message = f"Invalid {name}"
    with pytest.raises(error, match=re.escape(message)) as info:
        pj.pro_adamw(**{name: value})
    assert rule in str(info.value)


def test_every_argument_has_a_check():
    import inspect

    from precond.jax.kron.pro_adamw import PRO_ADAMW_ARGUMENT_CHECKS

    arguments = list(inspect.signature(pj.pro_adamw).parameters)
    assert arguments == list(PRO_ADAMW_ARGUMENT_CHECKS)


def test_an_override_that_does_not_fit_the_params_is_refused_at_init():
    params = _model()
    with pytest.raises(ValueError, match=r"Invalid preconditioned: must be a prefix"):
        pj.pro_adamw(preconditioned={"embedding": True}).init(params)
    with pytest.raises(TypeError, match=r"Invalid preconditioned\['head'\]=0"):
        pj.pro_adamw(preconditioned=lambda p: {**HIDDEN, "head": 0}).init(params)


def test_integer_parameters_are_refused_at_init():
    with pytest.raises(TypeError, match=r"pro_adamw needs floating-point.*\['n'\]"):
        pj.pro_adamw().init({"w": jnp.ones((3, 2)), "n": jnp.ones(3, jnp.int32)})
