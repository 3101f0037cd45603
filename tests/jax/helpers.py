"""Helpers shared by the JAX tests: float64 mode, states compared apart from their
counts of skipped steps, running updates, parameters after a few steps,
balancing seeds, the table of every optimizer."""

import contextlib
import importlib

import jax
import numpy as np
import optax

import precond.jax as pj
from precond.jax._core.skipped_steps import STATES_WITH_SKIP_COUNTS

# The module, not the ``kron`` function that precond.jax re-exports under its name.
kron_module = importlib.import_module("precond.jax.kron.transform")


@contextlib.contextmanager
def float64():
    """Float64 arrays inside the block, float32 again after it."""
    with jax.enable_x64(True):
        yield


def without_skip_counts(state):
    """``state`` with the count of skipped steps of each of precond's states in
    it (their ``skipped``) set to None: what a skipped step leaves unchanged."""

    def without(node):
        if isinstance(node, STATES_WITH_SKIP_COUNTS):
            return node._replace(skipped=None)
        return node

    return jax.tree.map(
        without, state, is_leaf=lambda x: isinstance(x, STATES_WITH_SKIP_COUNTS)
    )


def assert_skipped_once(new_state, state):
    """``new_state`` is ``state`` after one skipped step: its count of skipped
    steps is one higher, and every other leaf is equal."""
    assert int(pj.skipped_steps(new_state)) == int(pj.skipped_steps(state)) + 1
    jax.tree.map(
        np.testing.assert_array_equal,
        without_skip_counts(new_state),
        without_skip_counts(state),
    )


def run_updates(optimizer, params, grads_per_step):
    """The jitted updates of one step per gradient tree, and the final state."""
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    outputs = []
    for grads in grads_per_step:
        updates, state = update(grads, state)
        outputs.append(updates)
    return outputs, state


def params_after(optimizer, params, grads_per_step):
    """``params`` after one eager update per gradient tree, applied by optax."""
    state = optimizer.init(params)
    for grads in grads_per_step:
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def seed_that_balances_at_step(step: int) -> int:
    """A seed whose balancing draw (probability 0.01) fires at ``step``."""
    for seed in range(5000):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
        balance, _ = kron_module.fit_randomness(key)
        if bool(balance):
            return seed
    raise AssertionError("no balancing seed found")


def _kron(style, cache="packed"):
    return lambda lr: pj.kron(
        lr,
        preconditioner_update_style=style,
        preconditioner_cache=cache,
        preconditioner_update_probability=0.5,
    )


def _shampoo(graft, quantised):
    return lambda lr: pj.distributed_shampoo(
        lr,
        block_size=4,
        graft_type=graft,
        start_preconditioning_step=2,
        best_effort_memory_usage_reduction=quantised,
        # int16 statistics too (the seed quantises them only under pmap).
        quantize_statistics=quantised,
    )


# name ↦ (learning rate ↦ optimizer): every public JAX optimizer and variant, for
# the tables that run over all of them (robustness, checkpoints): Kron in every
# update style (EQ in every cache), pro (distributed-kron 2.0.0's), pro_adamw,
# XMat, LRA, Affine, Shampoo in every grafting type, and SOAP. Kron, pro,
# pro_adamw, XMat, LRA and Affine update their preconditioner at random steps
# (probability 0.5); Shampoo preconditions from step 2 on blocks of 4; SOAP
# refreshes its bases every 2 steps, on blocks of 4 (its default weight decay
# 0.01 off, as the others').
EVERY_OPTIMIZER = {
    "kron-EQ-packed": _kron("EQ"),
    "kron-EQ-dense": _kron("EQ", "dense"),
    "kron-EQ-none": _kron("EQ", None),
    "kron-QUAD": _kron("QUAD"),
    "kron-PRO": _kron("PRO"),
    "kron-QEQ": _kron("QEQ"),
    # lr_style='adam' divides pro's step by 5 (so that AdamW's rates carry over);
    # 5·lr undoes it (at 0.01 pro kept 0.77 of the robustness quadratic's loss
    # after 50 steps). No weight decay, as the others (pro's default is 0.1).
    "pro": lambda lr: pj.pro(
        5 * lr, weight_decay=0.0, preconditioner_update_probability=0.5
    ),
    # pro on the hidden matrices (here every ≥2-D leaf), AdamW on the rest, at
    # AdamW's rate (pro at 4 times it); no weight decay, as the others.
    "pro_adamw": lambda lr: pj.pro_adamw(
        lr, weight_decay=0.0, preconditioner_update_probability=0.5
    ),
    "xmat": lambda lr: pj.xmat(lr, preconditioner_update_probability=0.5),
    "lra": lambda lr: pj.low_rank_approximation(
        lr, preconditioner_update_probability=0.5
    ),
    "affine": lambda lr: pj.affine(lr, preconditioner_update_probability=0.5),
    **{
        f"shampoo-{graft.name}{'-int8' if quantised else ''}": _shampoo(
            graft, quantised
        )
        for graft in pj.GraftingType
        for quantised in (False, True)
        if quantised is False or graft in (pj.GraftingType.SGD, pj.GraftingType.ADAGRAD)
    },
    "soap": lambda lr: pj.soap(
        lr, weight_decay=0.0, precondition_frequency=2, block_size=4
    ),
}
