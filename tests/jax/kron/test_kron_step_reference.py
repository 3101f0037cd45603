"""Whole scale_by_kron steps against a float64 NumPy reference of algorithms.md §1.

The reference re-draws the same noise V and balancing decision (the optimizer's
randomness is a pure function of seed, step and unit), then runs momentum, the factor
update, preconditioning and RMS clipping in NumPy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precond._common.factor_plan import plan_diagonal_axes
from tests.jax.helpers import float64, kron_module, seed_that_balances_at_step
from tests.reference import kron_reference as ref

SHAPES = {"a_matrix": (5, 4), "b_vector": (6,), "c_tensor": (3, 2, 4), "d_scalar": ()}


@pytest.fixture(autouse=True)
def _float64():
    with float64():
        yield


def _reference_run(grads_per_step, seed, b1, probability, momentum_into_fit):
    Qs = {}
    for name, shape in SHAPES.items():
        shape = shape or (1,)
        diagonal = plan_diagonal_axes(
            shape,
            max_size_triangular=8192,
            min_ndim_triangular=2,
            memory_save_mode=None,
        )
        Qs[name] = [
            np.ones(d) if diag else np.eye(d) for d, diag in zip(shape, diagonal)
        ]
    mu = {name: np.zeros(shape) for name, shape in SHAPES.items()}
    counter, outputs = 0, []
    for n, grads in enumerate(grads_per_step, start=1):
        mu = {k: b1 * mu[k] + (1 - b1) * grads[k] for k in SHAPES}
        mu_hat = {k: mu[k] / (1 - b1**n) for k in SHAPES}
        counter += 1
        if counter >= 1 / probability:
            counter = 0
            key = jax.random.fold_in(jax.random.PRNGKey(seed), n)
            balance, noise_key = kron_module.fit_randomness(key)
            # Leaf order is the sorted order of SHAPES' keys; each parameter is
            # one unit.
            for leaf, (k, shape) in enumerate(sorted(SHAPES.items())):
                V = np.asarray(
                    kron_module.unit_noise(
                        noise_key, leaf, 0, shape or (1,), jnp.float64
                    )
                )
                target = mu_hat[k] if momentum_into_fit else grads[k]
                target = target.reshape(shape or (1,))
                if bool(balance) and len(Qs[k]) > 1:
                    Qs[k] = ref.balance_factors(Qs[k])
                Qs[k] = ref.update_factors(
                    Qs[k], ref.add_damping_noise(target, V), V, 0.1
                )
        step_out = {}
        for k, shape in SHAPES.items():
            U = ref.precondition(Qs[k], mu_hat[k].reshape(shape or (1,)))
            U = U / max(1.0, np.sqrt(np.mean(U**2)) / 1.1)
            step_out[k] = U.reshape(shape)
        outputs.append(step_out)
    return outputs


@pytest.mark.parametrize("preconditioner_cache", ["packed", "dense", None])
@pytest.mark.parametrize(
    ("b1", "probability", "momentum_into_fit"),
    [(0.9, 1.0, True), (0.5, 0.4, True), (0.9, 1.0, False)],
)
def test_steps_match_reference(
    preconditioner_cache, b1, probability, momentum_into_fit
):
    seed = seed_that_balances_at_step(2)
    rng = np.random.default_rng(0)
    grads_per_step = [
        {k: rng.normal(size=s) * 10.0 ** rng.uniform(-2, 2) for k, s in SHAPES.items()}
        for _ in range(5)
    ]
    expected = _reference_run(grads_per_step, seed, b1, probability, momentum_into_fit)
    optimizer = kron_module.scale_by_kron(
        b1=b1,
        preconditioner_update_probability=probability,
        momentum_into_precond_update=momentum_into_fit,
        precond_dtype=jnp.float64,
        preconditioner_cache=preconditioner_cache,
        seed=seed,
        merge_small_dims=False,
        partition_grads_into_blocks=False,
    )
    params = {k: jnp.zeros(s, jnp.float64) for k, s in SHAPES.items()}
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    for grads, want in zip(grads_per_step, expected):
        updates, state = update(jax.tree.map(jnp.asarray, grads), state)
        for k in SHAPES:
            np.testing.assert_allclose(updates[k], want[k], rtol=1e-10, atol=1e-14)
