"""Helpers shared by the JAX tests: float64 mode, running updates, balancing seeds."""

import contextlib
import importlib

import jax

# The module, not the ``kron`` function that precond.jax re-exports under its name.
kron_module = importlib.import_module("precond.jax.kron")


@contextlib.contextmanager
def float64():
    """Float64 arrays inside the block, float32 again after it."""
    with jax.enable_x64(True):
        yield


def run_updates(optimizer, params, grads_per_step):
    """The jitted updates of one step per gradient tree, and the final state."""
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    outputs = []
    for grads in grads_per_step:
        updates, state = update(grads, state)
        outputs.append(updates)
    return outputs, state


def seed_that_balances_at_step(step: int) -> int:
    """A seed whose balancing draw (probability 0.01) fires at ``step``."""
    for seed in range(5000):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
        balance, _ = kron_module.fit_randomness(key)
        if bool(balance):
            return seed
    raise AssertionError("no balancing seed found")
