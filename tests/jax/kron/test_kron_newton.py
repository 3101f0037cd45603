"""Kron's Newton mode (fit to Hessian-vector products) and ``hessian_helper``.

The fitting property (algorithms.md, oracle recipe): on a fixed SPD H = H₁ ⊗ H₂
with pairs (h, v) = (H·v, v), repeated factor updates drive P·h to v, i.e.
P → H⁻¹. The helper's HVP equals ``jax.jvp(jax.grad(loss))`` in float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precond.jax as pj
from tests.jax.helpers import float64, kron_module
from tests.reference import kron_reference as ref


@pytest.fixture(autouse=True)
def _float64():
    with float64():
        yield


def _spd(rng, n, condition):
    Q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    return Q @ np.diag(np.geomspace(1.0, condition, n)) @ Q.T


def test_newton_fit_drives_p_h_to_v():
    rng = np.random.default_rng(0)
    H1, H2 = _spd(rng, 6, 10.0), _spd(rng, 5, 10.0)
    optimizer = pj.scale_by_kron(
        b1=0.0, precond_dtype=jnp.float64, preconditioner_lr=0.1
    )
    params = {"w": jnp.zeros((6, 5))}
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)

    def hvp(v):
        return H1 @ v @ H2  # (H₁ ⊗ H₂)·vec(v) in matrix form

    def relative_error(state):
        v = 0.5 * rng.normal(size=(6, 5))  # small: no RMS clipping of P·h
        Ph, _ = update(
            {"w": jnp.asarray(hvp(v))},
            state,
            Hvp={"w": jnp.zeros((6, 5))},
            vector={"w": jnp.zeros((6, 5))},
            update_preconditioner=False,
        )
        return np.linalg.norm(Ph["w"] - v) / np.linalg.norm(v)

    before = relative_error(state)
    for _ in range(1500):
        v = rng.normal(size=(6, 5))
        _, state = update(
            {"w": jnp.zeros((6, 5))},
            state,
            Hvp={"w": jnp.asarray(hvp(v))},
            vector={"w": jnp.asarray(v)},
            update_preconditioner=True,
        )
    after = relative_error(state)
    assert before > 0.5
    assert after < 0.05


def test_newton_mode_uses_no_noise_and_equals_the_kernel():
    """One Newton update = update_factors on (h, v) from identity factors."""
    rng = np.random.default_rng(1)
    h, v, g = (rng.normal(size=(4, 3)) for _ in range(3))
    seed = 0
    key = jax.random.fold_in(jax.random.PRNGKey(seed), 1)
    balance, _ = kron_module.fit_randomness(key)
    assert not bool(balance)
    optimizer = pj.scale_by_kron(b1=0.0, precond_dtype=jnp.float64, seed=seed)
    state = optimizer.init({"w": jnp.zeros((4, 3))})
    U, _ = optimizer.update(
        {"w": jnp.asarray(g)},
        state,
        Hvp={"w": jnp.asarray(h)},
        vector={"w": jnp.asarray(v)},
        update_preconditioner=True,
    )
    Qs = ref.update_factors([np.eye(4), np.eye(3)], h, v, 0.1)
    want = ref.precondition(Qs, g)
    want = want / max(1.0, np.sqrt(np.mean(want**2)) / 1.1)
    np.testing.assert_allclose(U["w"], want, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (("Hvp",), "missing vector, update_preconditioner"),
        (("Hvp", "vector"), "missing update_preconditioner"),
        (("update_preconditioner",), "missing Hvp, vector"),
    ],
)
def test_partial_newton_arguments_name_what_is_missing(given, message):
    params = {"w": jnp.zeros((3, 3))}
    optimizer = pj.kron()
    extra = {"Hvp": params, "vector": params, "update_preconditioner": True}
    with pytest.raises(ValueError, match=message):
        optimizer.update(
            params, optimizer.init(params), params, **{k: extra[k] for k in given}
        )


def test_hvp_of_another_shape_is_an_error():
    params = {"w": jnp.zeros((3, 3))}
    optimizer = pj.kron()
    with pytest.raises(ValueError, match=r"Invalid Hvp\['w'\]: shape \(3, 2\)"):
        optimizer.update(
            params,
            optimizer.init(params),
            params,
            Hvp={"w": jnp.zeros((3, 2))},
            vector=params,
            update_preconditioner=True,
        )


def _loss(params, x):
    h = jnp.tanh(x @ params["w1"])
    return jnp.sum((h @ params["w2"]) ** 2) + jnp.sum(params["b"] ** 4)


def _params():
    rng = np.random.default_rng(2)
    return {
        "w1": jnp.asarray(rng.normal(size=(4, 5))),
        "w2": jnp.asarray(rng.normal(size=(5, 2))),
        "b": jnp.asarray(rng.normal(size=(3,))),
    }


def test_hessian_helper_hvp_equals_jvp_of_grad():
    params, x = _params(), jnp.ones((7, 4))
    loss, grads, hvp, vector, update = pj.hessian_helper(
        jax.random.PRNGKey(0), _loss, params, loss_fn_extra_args=(x,)
    )
    assert bool(update)
    want_grads = jax.grad(_loss)(params, x)
    _, want_hvp = jax.jvp(lambda p: jax.grad(_loss)(p, x), (params,), (vector,))
    np.testing.assert_allclose(loss, _loss(params, x), rtol=1e-12)
    for k in params:
        np.testing.assert_allclose(grads[k], want_grads[k], rtol=1e-12)
        np.testing.assert_allclose(hvp[k], want_hvp[k], rtol=1e-12, atol=1e-14)
        assert np.any(np.asarray(vector[k]) != 0)


def test_hessian_helper_skips_the_hvp_when_not_updating():
    params, x = _params(), jnp.ones((7, 4))

    def helper(probability, **kwargs):
        return pj.hessian_helper(
            jax.random.PRNGKey(0),
            _loss,
            params,
            loss_fn_extra_args=(x,),
            preconditioner_update_probability=probability,
            **kwargs,
        )

    # Probability 0: no HVP is even traced (no cond, no second-order work).
    jaxpr = str(jax.make_jaxpr(lambda: helper(0.0))())
    assert "cond" not in jaxpr
    _, _, hvp, _, update = helper(0.0)
    assert not bool(update)
    assert all(not np.any(np.asarray(h)) for h in jax.tree.leaves(hvp))
    # psgd-jax's rule: the first two steps always update.
    assert bool(helper(0.0, train_step=1)[4])
    assert "cond" in str(jax.make_jaxpr(lambda: helper(0.5))())


def test_hessian_helper_with_aux():
    params, x = _params(), jnp.ones((7, 4))
    (loss, aux), grads, *_ = pj.hessian_helper(
        jax.random.PRNGKey(0),
        lambda p, x: (_loss(p, x), {"twice": 2 * _loss(p, x)}),
        params,
        loss_fn_extra_args=(x,),
        has_aux=True,
    )
    np.testing.assert_allclose(aux["twice"], 2 * loss, rtol=1e-12)
    want = jax.grad(_loss)(params, x)
    for k in params:
        np.testing.assert_allclose(grads[k], want[k], rtol=1e-12)
