"""Checkpoints of every JAX optimizer (DESIGN.md §7.5): a state saved with orbax
after any step of a run, restored into the abstract state of a fresh ``init`` and
continued, ends bit-identical to the uninterrupted run; a state that does not fit
the parameters (another model's checkpoint) is refused when ``update`` is traced,
naming the first leaf that differs.

The runs cover several preconditioner updates (random steps with probability 0.5
for PSGD, every step from step 2 for Shampoo), so the save points fall before,
on and after them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from tests.jax.helpers import EVERY_OPTIMIZER

NAMES = list(EVERY_OPTIMIZER)
STEPS = 6
PARAMS = {"w": jnp.ones((8, 6)), "b": jnp.zeros(6)}


def _gradients(params, step):
    """Deterministic, step-dependent gradients of a quadratic."""
    scale = 1.0 + 0.1 * step
    return jax.tree.map(lambda p: scale * (p - 0.5) + 0.01 * step, params)


@pytest.mark.parametrize("name", NAMES)
def test_resume_from_any_step_equals_the_uninterrupted_run(name, tmp_path):
    optimizer = EVERY_OPTIMIZER[name](0.01)

    @jax.jit
    def step(params, state, k):
        updates, state = optimizer.update(_gradients(params, k), state, params)
        return optax.apply_updates(params, updates), state

    checkpointer = ocp.StandardCheckpointer()
    params, state = PARAMS, optimizer.init(PARAMS)
    saved = []
    for k in range(STEPS):
        path = tmp_path / f"step_{k}"
        checkpointer.save(path, {"params": params, "state": state})
        saved.append(path)
        params, state = step(params, state, k)
    checkpointer.wait_until_finished()
    want = {"params": params, "state": state}

    fresh = EVERY_OPTIMIZER[name](0.01)
    abstract = jax.eval_shape(lambda: {"params": PARAMS, "state": fresh.init(PARAMS)})
    for k, path in enumerate(saved):
        restored = checkpointer.restore(path, abstract)
        params, state = restored["params"], restored["state"]
        for j in range(k, STEPS):
            params, state = step(params, state, j)
        got = {"params": params, "state": state}
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for leaf_got, leaf_want in zip(
            jax.tree.leaves(got), jax.tree.leaves(want), strict=True
        ):
            np.testing.assert_array_equal(leaf_got, leaf_want, err_msg=f"from {k}")


OTHER_MODELS = {
    "a wider layer": ({"w": jnp.ones((8, 7)), "b": jnp.zeros(6)}, r"\['w'\]"),
    "another layer": (
        {"w": jnp.ones((8, 6)), "b": jnp.zeros(6), "c": jnp.zeros(6)},
        r"\['c'\]|structure",
    ),
}


@pytest.mark.parametrize("name", NAMES)
def test_a_state_of_another_model_is_refused(name):
    """The state of PARAMS given with the parameters (and gradients) of another
    model: a ValueError naming the leaf, before anything runs."""
    optimizer = EVERY_OPTIMIZER[name](0.01)
    state = optimizer.init(PARAMS)
    for label, (params, leaf) in OTHER_MODELS.items():
        with pytest.raises(ValueError, match=leaf) as info:
            jax.jit(optimizer.update)(_gradients(params, 0), state, params)
        assert "does not match these parameters" in str(info.value), label
