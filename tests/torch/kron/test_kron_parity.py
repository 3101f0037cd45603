"""precond.torch's PSGD Kron against precond.jax's and the float64 NumPy references.

Everything runs in float64 (JAX under a module-scoped ``jax.enable_x64``), so the
frameworks can only differ by rounding: summation order, batched versus single
matmuls, and triangular solves of well-conditioned factors. The kernels of both
frameworks are checked against the references, and against each other, by one
table: tests/common/test_kron_kernels.py.

(c) Three whole steps of ``precond.torch.Kron`` equal three steps of
    ``precond.jax.kron`` with the same hyperparameters (and, in one case, a
    skipped step with a NaN gradient between them): torch's two random sources
    (``unit_noise``, ``balance_draw``) are monkeypatched to return the draws that
    ``precond.jax.kron`` makes itself (``fit_randomness`` and ``unit_noise`` of
    ``fold_in(PRNGKey(seed), n)``), so both see the same V per parameter and step
    and balance at the same steps (never, or at step 2).
(d) Complex parameters against the complex128 reference.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from precond._common.factor_plan import merge_dims
from precond.jax import kron as jax_kron
from precond.torch._core import factor_kernels as tkm
from precond.torch.kron import _kron_randomness as torch_kron_randomness
from tests.jax.helpers import kron_module as jax_kron_module
from tests.jax.helpers import seed_that_balances_at_step
from tests.reference import kron_reference as ref

# Kron with the rules these tests were written for (precond's former defaults).
from tests.torch.kron.test_kron_optimizer import Kron

# Frameworks and references differ only by float64 rounding of O(1) quantities.
RTOL = 1e-12


@pytest.fixture(scope="module", autouse=True)
def _float64():
    with jax.enable_x64(True):
        yield


SHAPES = [(7,), (5, 4), (3, 4, 2)]
# Every diagonal/triangular mix of every shape: 2 + 4 + 8 = 14 cases.
CASES = [
    pytest.param(shape, mask, id=f"{shape}-" + "".join("dt"[not m] for m in mask))
    for shape in SHAPES
    for mask in itertools.product([True, False], repeat=len(shape))
]

# --- (c) whole optimizer steps: precond.torch.Kron vs precond.jax.kron ----------

# Sorted names, so that JAX's leaf order (sorted dict keys) is the torch order.
PARAM_SHAPES = {
    "a_matrix": (5, 4),
    "b_vector": (6,),
    "c_tensor": (3, 2, 4),
    "d_scalar": (),
    "e_matrix_twin": (5, 4),  # stacked with a_matrix in both frameworks
}
# (hyperparameters, seed choice): None finds a seed whose balancing draw fires at
# none of the steps, an int one that balances at that step. One JAX compile each
# (~5 s), so the variations are combined rather than crossed.
CONFIGS = {
    "default": (dict(), None),
    "balances_at_step_2": (dict(), 2),
    "merged_one_diag": (dict(merge_small_dims=True, memory_save_mode="one_diag"), 3),
    "no_momentum_half_prob": (
        dict(b1=0.0, momentum_into_precond_update=False, probability=0.5),
        None,
    ),
    # (5, 4): axis 0 diagonal; a larger factor step; a NaN gradient entry at
    # step 2, which both skip (state kept, weight decay applied).
    "small_triangular_nan_step": (
        dict(max_size_triangular=4, precond_lr=0.3, nan_at_step=2),
        None,
    ),
    # The generation-2 rules (Lipschitz-normalised, solve-free), one balancing.
    "quad_balances_at_step_2": (dict(preconditioner_update_style="QUAD"), 2),
    "pro": (dict(preconditioner_update_style="PRO"), None),
    "qeq": (dict(preconditioner_update_style="QEQ"), None),
}
STEPS = 3


def _merged_shape(shape, merge):
    """The shape a parameter is preconditioned in (scalars as (1,))."""
    shape = shape or (1,)
    if not merge:
        return shape
    return tuple(math.prod(shape[a] for a in g) for g in merge_dims(shape, 2048))


def _seed_without_balancing(steps: int) -> int:
    for seed in range(1000):
        draws = [
            jax_kron_module.fit_randomness(
                jax.random.fold_in(jax.random.PRNGKey(seed), n)
            )[0]
            for n in range(1, steps + 1)
        ]
        if not any(bool(d) for d in draws):
            return seed
    raise AssertionError("no seed without balancing")


@functools.partial(jax.jit, static_argnums=2)
def _jax_kron_draws(seed, step, shapes):
    """What precond.jax.kron draws at step n: ``balance, key = fit_randomness(
    fold_in(PRNGKey(seed), n))`` and, for leaf i (one unit, index 0),
    ``V = unit_noise(key, i, 0, merged_shape, compute_dtype)``."""
    balance, key = jax_kron_module.fit_randomness(
        jax.random.fold_in(jax.random.PRNGKey(seed), step)
    )
    noise = [
        jax_kron_module.unit_noise(key, i, 0, shape, jnp.float64)
        for i, shape in enumerate(shapes)
    ]
    return balance, noise


def _jax_draws_for_torch(monkeypatch, shapes):
    """Makes torch's random sources return precond.jax.kron's draws.

    torch's ``index`` is the parameter's position in the optimizer, which is the
    JAX leaf index here; ``shapes`` are the merged shapes, in that order.
    """
    calls = {"noise": 0, "balance": 0}

    def unit_noise(shape, seed, step, index, dtype, device):
        calls["noise"] += 1
        assert dtype == torch.float64
        assert tuple(shape) == shapes[index]
        _, noise = _jax_kron_draws(seed, step, shapes)
        return torch.from_numpy(np.array(noise[index])).to(device=device)

    def balance_draw(seed, step, *_):
        calls["balance"] += 1
        balance, _ = _jax_kron_draws(seed, step, shapes)
        return 0.0 if bool(balance) else 1.0

    monkeypatch.setattr(torch_kron_randomness, "unit_noise", unit_noise)
    monkeypatch.setattr(torch_kron_randomness, "balance_draw", balance_draw)
    return calls


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_three_steps_match_jax_kron(monkeypatch, config_name):
    config, seed = CONFIGS[config_name]
    config = dict(config)
    if seed is None:
        seed = _seed_without_balancing(STEPS)
    else:
        seed = seed_that_balances_at_step(seed)
    probability = config.pop("probability", 1.0)
    nan_at_step = config.pop("nan_at_step", None)
    precond_lr = config.pop("precond_lr", 0.1)
    common = dict(
        b1=config.pop("b1", 0.9),
        weight_decay=0.1,
        preconditioner_update_probability=probability,
        seed=seed,
        **config,
    )
    rng = np.random.default_rng(7)
    params = {k: np.asarray(rng.standard_normal(s)) for k, s in PARAM_SHAPES.items()}
    # Gradient scales from 0.1 to 1e5, one per parameter.
    grads = [
        {
            k: np.asarray(rng.standard_normal(s)) * 10.0 ** (i - 1)
            for i, (k, s) in enumerate(PARAM_SHAPES.items())
        }
        for _ in range(STEPS)
    ]
    if nan_at_step is not None:
        bad = {k: v.copy() for k, v in grads[0].items()}
        bad["c_tensor"][1, 0, 2] = np.nan
        grads.insert(nan_at_step - 1, bad)

    merged_shapes = tuple(
        _merged_shape(shape, common.get("merge_small_dims", False))
        for shape in PARAM_SHAPES.values()
    )
    calls = _jax_draws_for_torch(monkeypatch, merged_shapes)
    torch_params = [torch.nn.Parameter(torch.tensor(params[k])) for k in PARAM_SHAPES]
    optimizer = Kron(
        torch_params,
        lr=0.1,
        precond_lr=precond_lr,
        precond_dtype=torch.float64,
        merge_small_dims=common.get("merge_small_dims", False),
        **{k: v for k, v in common.items() if k != "merge_small_dims"},
    )
    for step_grads in grads:
        for p, k in zip(torch_params, PARAM_SHAPES, strict=True):
            p.grad = torch.tensor(step_grads[k])
        optimizer.step()

    # precond.jax.kron's own merging and blocking defaults are distributed-kron's;
    # Kron has neither unless asked: both are given explicitly.
    jax_layout = dict(
        merge_small_dims=common.pop("merge_small_dims", False),
        target_merged_dim_size=2048,
        partition_grads_into_blocks=False,
    )
    tx = jax_kron(
        learning_rate=0.1,
        preconditioner_lr=precond_lr,
        **jax_layout,
        precond_dtype=jnp.float64,
        precond_update_precision=None,
        precond_grads_precision=None,
        **common,
    )
    jax_params = {k: jnp.asarray(v) for k, v in params.items()}
    state = tx.init(jax_params)
    update = jax.jit(tx.update)
    for step_grads in grads:
        g = {k: jnp.asarray(v) for k, v in step_grads.items()}
        updates, state = update(g, state, jax_params)
        jax_params = jax.tree.map(lambda p, u: p + u, jax_params, updates)

    # The counter fits the factors every round(1/p) steps; one V per parameter.
    fitted_steps = STEPS // round(1 / probability)  # finite steps only
    assert calls["noise"] == fitted_steps * len(PARAM_SHAPES)
    assert calls["balance"] > 0
    # Measured: at most ~5e-16 apart (parameters of size ~1); 1e-10 as issue 6 asks.
    for p, k in zip(torch_params, PARAM_SHAPES, strict=True):
        np.testing.assert_allclose(
            p.detach().numpy(),
            np.asarray(jax_params[k]),
            rtol=1e-10,
            atol=1e-10,
            err_msg=k,
        )
        # The steps moved the parameter (not a vacuous match).
        assert not np.allclose(p.detach().numpy(), params[k], atol=1e-3), k


# --- (d) complex parameters against the complex128 reference --------------------


def random_complex_problems(rng, shape, mask, stack):
    """``stack`` complex (factors, G, V): triangular factors with a real positive
    diagonal and a complex strict upper triangle (condition ≲ 10), real positive
    diagonal factors stored as complex, complex normal G and V."""

    def cnormal(*size):
        return (rng.standard_normal(size) + 1j * rng.standard_normal(size)) / np.sqrt(2)

    problems = []
    for _ in range(stack):
        Qs = []
        for d, diagonal in zip(shape, mask, strict=True):
            if diagonal:
                Qs.append(rng.uniform(0.5, 2.0, d).astype(np.complex128))
            else:
                Q = np.triu(cnormal(d, d), 1) * 0.3
                Q[np.diag_indices(d)] = rng.uniform(0.5, 2.0, d)
                Qs.append(Q)
        problems.append((Qs, cnormal(*shape), cnormal(*shape)))
    return problems


def complex_stack(arrays) -> torch.Tensor:
    return torch.from_numpy(np.stack(arrays)).to(torch.complex128)


def assert_close_complex(actual, desired, rtol=RTOL, name=""):
    actual, desired = np.asarray(actual), np.asarray(desired)
    assert actual.shape == desired.shape, name
    scale = np.max(np.abs(desired)) if desired.size else 0.0
    np.testing.assert_allclose(
        actual, desired, rtol=rtol, atol=rtol * scale, err_msg=name
    )


@pytest.mark.parametrize(("shape", "mask"), CASES)
def test_complex_kernels_equal_the_hermitian_reference(shape, mask):
    """On stacks of 3 complex128 problems: P·G with P = ⊗ Q_iᴴQ_i, the factor
    step (A·Aᴴ, B = V ×_i Q_i^{-H}), and lb of a Hermitian matrix (a lower bound
    on its spectral norm); triangular factors keep a real diagonal."""
    problems = random_complex_problems(np.random.default_rng(12), shape, mask, 3)
    Qs_t = [
        complex_stack([Qs[axis] for Qs, _, _ in problems]) for axis in range(len(shape))
    ]
    G_t = complex_stack([G for _, G, _ in problems])
    V_t = complex_stack([V for _, _, V in problems])
    preconditioned = tkm.precondition(Qs_t, G_t)
    damped = tkm.add_damping_noise(G_t, V_t)
    updated = tkm.update_factors(Qs_t, damped, V_t, 0.1)
    for b, (Qs, G, V) in enumerate(problems):
        assert_close_complex(
            preconditioned[b].numpy(), ref.precondition(Qs, G), name="PG"
        )
        G_ref = G + ref.DAMPING_SCALE * np.mean(np.abs(G)) * V
        assert_close_complex(damped[b].numpy(), G_ref, name="damped")
        want = ref.update_factors(Qs, G_ref, V, 0.1)
        for axis, (Q_t, Q_ref) in enumerate(zip(updated, want, strict=True)):
            assert_close_complex(Q_t[b].numpy(), Q_ref, name=f"Q_{axis}")
            diag = np.diagonal(Q_t[b].numpy()) if Q_ref.ndim == 2 else Q_t[b].numpy()
            np.testing.assert_allclose(diag.imag, 0.0, atol=1e-15)
            assert (diag.real > 0).all()
    rng = np.random.default_rng(13)
    X = rng.standard_normal((3, 5, 7)) + 1j * rng.standard_normal((3, 5, 7))
    S = X @ X.conj().transpose(0, 2, 1)
    got = tkm.norm_lower_bound(torch.from_numpy(S)).numpy()
    for b in range(3):
        assert got[b] == pytest.approx(ref.norm_lower_bound(S[b]), rel=RTOL)
        assert got[b] <= np.linalg.norm(S[b], 2) * (1 + RTOL)


def test_complex_kron_steps_equal_the_hermitian_reference(monkeypatch):
    """Three steps of Kron on a complex128 (5, 4) parameter and a complex (6,)
    one (update probability 1, fixed V, no balancing, float64 factors) equal the
    complex128 reference step by step: momentum, m̂, the factor fit on
    m̂ + 2^-11.5·mean|m̂|·V, U = P·m̂ clipped to RMS 1.1, θ ← θ − lr·U."""
    shapes = [(5, 4), (6,)]
    rng = np.random.default_rng(14)

    def cnormal(shape):
        return rng.standard_normal(shape) + 1j * rng.standard_normal(shape)

    steps = 3
    noises = {
        (n, i): cnormal(s) / np.sqrt(2)
        for n in range(1, steps + 1)
        for i, s in enumerate(shapes)
    }
    grads = [[cnormal(s) for s in shapes] for _ in range(steps)]

    def unit_noise(shape, seed, step, index, dtype, device):
        assert dtype == torch.complex128
        return torch.from_numpy(noises[(step, index)]).to(device)

    monkeypatch.setattr(torch_kron_randomness, "unit_noise", unit_noise)
    monkeypatch.setattr(torch_kron_randomness, "balance_draw", lambda *args: 1.0)
    lr, b1 = 0.05, 0.9
    starts = [cnormal(s) for s in shapes]
    params = [torch.nn.Parameter(torch.from_numpy(x.copy())) for x in starts]
    optimizer = Kron(
        params,
        lr=lr,
        b1=b1,
        preconditioner_update_probability=1.0,
        precond_dtype=torch.float64,
        precond_init_scale=1.5,
    )
    thetas = [x.copy() for x in starts]
    momenta = [np.zeros(s, np.complex128) for s in shapes]
    factors = [
        [
            np.full(d, 1.5 ** (1 / len(s)) + 0j)
            if len(s) == 1
            else 1.5 ** (1 / len(s)) * np.eye(d, dtype=np.complex128)
            for d in s
        ]
        for s in shapes
    ]
    for n in range(1, steps + 1):
        for p, g in zip(params, grads[n - 1], strict=True):
            p.grad = torch.from_numpy(g.copy())
        optimizer.step()
        for i in range(len(shapes)):
            momenta[i] = b1 * momenta[i] + (1 - b1) * grads[n - 1][i]
            mu_hat = momenta[i] / (1 - b1**n)
            V = noises[(n, i)]
            damped = mu_hat + ref.DAMPING_SCALE * np.mean(np.abs(mu_hat)) * V
            factors[i] = ref.update_factors(factors[i], damped, V, 0.1)
            U = ref.precondition(factors[i], mu_hat)
            rms = np.sqrt(np.mean(np.abs(U) ** 2))
            thetas[i] = thetas[i] - lr * U / max(1.0, rms / 1.1)
            state = optimizer.state[params[i]]
            for Q_t, Q_ref in zip(state["Q"], factors[i], strict=True):
                assert Q_t.dtype == torch.complex128
                assert_close_complex(Q_t.numpy(), Q_ref, rtol=1e-11, name=f"Q{n}")
            assert_close_complex(
                params[i].detach().numpy(), thetas[i], rtol=1e-11, name=f"θ{n}"
            )


@pytest.mark.parametrize(
    ("style", "cache"),
    [("EQ", None), ("EQ", "packed"), ("QUAD", "packed"), ("PRO", "dense")],
)
def test_complex_least_squares_converges(style, cache):
    """L(Z) = ‖A Z − B‖²_F with complex A (8, 5), Z (5, 3): Kron (complex64, the
    default float32 factors) drives L to its least-squares minimum from 1e2 times
    above it, and the state stays complex and finite, in every update style and
    factor layout."""
    generator = torch.Generator().manual_seed(15)
    A = torch.randn(8, 5, dtype=torch.complex64, generator=generator)
    B = torch.randn(8, 3, dtype=torch.complex64, generator=generator)
    Z = torch.nn.Parameter(torch.zeros(5, 3, dtype=torch.complex64))
    best = torch.linalg.lstsq(A.to(torch.complex128), B.to(torch.complex128))
    floor = (A.to(torch.complex128) @ best.solution - B).abs().square().sum().item()
    optimizer = Kron(
        [Z],
        lr=0.02,
        preconditioner_update_probability=1.0,
        preconditioner_update_style=style,
        preconditioner_cache=cache,
    )

    def loss():
        return (A @ Z - B).abs().square().sum()

    initial = loss().item()
    for _ in range(300):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    final = loss().item()
    assert initial - floor > 100 * (final - floor), (initial, final, floor)
    state = optimizer.state[Z]
    assert state["momentum"].dtype == torch.complex64
    assert all(Q.dtype == torch.complex64 for Q in state["Q"])
    assert all(torch.isfinite(torch.view_as_real(Q)).all() for Q in state["Q"])


@pytest.mark.parametrize("style", ["QUAD", "PRO", "QEQ"])
@pytest.mark.parametrize(("shape", "mask"), CASES)
def test_complex_generation_2_step_equals_the_hermitian_reference(shape, mask, style):
    """One 'QUAD'/'PRO'/'QEQ' factor step on stacks of 3 complex128 problems equals
    the complex reference (T1 = Pg_(i)Pg_(i)ᴴ, unitary Procrustes rotation,
    Hermitian QUAD factors), Lipschitz estimates included."""
    problems = random_complex_problems(np.random.default_rng(16), shape, mask, 3)
    Qs_t = [
        complex_stack([Qs[axis] for Qs, _, _ in problems]) for axis in range(len(shape))
    ]
    G_t = complex_stack([G for _, G, _ in problems])
    L_t = [torch.full((3,), 0.5, dtype=torch.float64) for _ in shape]
    targets = tkm.whitening_targets(
        [torch.ones(d, dtype=torch.bool) for d in shape], mask
    )
    got_Qs, got_L = tkm.update_factors_gen2(Qs_t, L_t, G_t, targets, 0.2, style)
    for b, (Qs, G, _) in enumerate(problems):
        want_Qs, want_L = ref.update_factors_gen2(
            Qs, [0.5] * len(shape), G, [t.numpy() for t in targets], 0.2, style
        )
        for axis, (Q_t, Q_ref) in enumerate(zip(got_Qs, want_Qs, strict=True)):
            assert_close_complex(Q_t[b].numpy(), Q_ref, name=f"Q_{axis}")
            if style == "QUAD" and Q_ref.ndim == 2:  # Hermitian
                np.testing.assert_allclose(Q_t[b].numpy(), Q_t[b].numpy().conj().T)
        for L_t_axis, L_ref in zip(got_L, want_L, strict=True):
            assert float(L_t_axis[b]) == pytest.approx(L_ref, rel=RTOL)
