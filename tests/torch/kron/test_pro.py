"""precond.torch.Pro against precond.jax.pro and AdamW.

(1) The torch generation-2 kernels with sampled norm bounds equal
    ``precond.jax._kron_math.update_factors_gen2`` given the same normal draws,
    and whole steps of ``Pro`` equal steps of ``precond.jax.pro`` when both make
    the same draws (each framework's draw function is replaced by one that
    returns fixed arrays, a function of the requested shape).
(2) Per kind of parameter: it trains faster than AdamW at the same step scale,
    a resumed run is the uninterrupted one bit for bit, a NaN gradient changes
    nothing; bad arguments raise the standard message. (Copies, tensor lr,
    schedulers and param groups: tests/torch/test_optimizer_conventions.py.)
(3) The stacks it fits are ``precond.jax.pro``'s (the planner is shared,
    ``precond._common.pro_layout``): checked once, on what Pro actually fits.

Float32 throughout: the frameworks differ by float32 rounding (batched versus
vmapped matmuls, summation order), hence tolerances of 1e-5 relative.
"""

from __future__ import annotations

import io
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import precond.jax as pj
import precond.torch.kron.pro as pro_module
from precond._common.pro_layout import _plan as jax_pro_plan
from precond._common.pro_layout import merged_shape
from precond.jax._core import factor_kernels as jkm
from precond.jax._core import normal_draws
from precond.torch import Pro
from precond.torch._core import factor_kernels as tkm


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _fixed_normal(shape) -> np.ndarray:
    """The draw both frameworks return for ``shape`` (a function of it alone)."""
    shape = tuple(int(d) for d in shape)
    rng = np.random.default_rng([len(shape), *shape])
    return rng.standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------ (1) kernels

# (id, factor kinds per side ('dense' or 'diagonal'), block shape)
KERNEL_CASES = [
    ("dense", ("dense", "dense"), (6, 5)),
    ("one_sided", ("diagonal", "dense"), (7, 4)),
    ("diagonal", ("diagonal", "diagonal"), (5, 3)),
    ("vector", ("diagonal",), (9,)),
]
UNITS = 2  # stack entries of the torch call, each compared to its own JAX call


@pytest.mark.parametrize("style", ["PRO", "QUAD", "QEQ"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_gen2_fit_equals_jax_with_the_same_draws(case, style):
    _, kinds, shape = case
    rng = np.random.default_rng(0)
    factors, lipschitz = [], []
    for d, kind in zip(shape, kinds, strict=True):
        if kind == "dense":  # not symmetric, so the rotation has work to do
            Q = np.eye(d) + 0.2 * rng.standard_normal((UNITS, d, d))
        else:
            Q = 1 + 0.2 * np.abs(rng.standard_normal((UNITS, d)))
        factors.append(Q.astype(np.float32))
        lipschitz.append(rng.uniform(0, 50, UNITS).astype(np.float32))
    G = rng.standard_normal((UNITS, *shape)).astype(np.float32)
    diagonal = [k == "diagonal" for k in kinds]
    draws = []  # the torch call's draws, in order: (UNITS, k, d) each

    def torch_draw(generator, draw_shape, dtype, device):
        W = np.random.default_rng(len(draws)).standard_normal(draw_shape)
        draws.append(W.astype(np.float32))
        return torch.from_numpy(draws[-1]).to(dtype)

    generator = torch.Generator().manual_seed(0)
    new_t, L_t = tkm.update_factors_gen2(
        [torch.from_numpy(Q) for Q in factors],
        [torch.from_numpy(L) for L in lipschitz],
        torch.from_numpy(G),
        tkm.whitening_targets(
            [torch.ones(d, dtype=torch.bool) for d in shape], diagonal
        ),
        0.5,
        style,
        [None if diag else generator for diag in diagonal],
        torch_draw,
    )
    dense_sides = sum(not d for d in diagonal)
    assert len(draws) == dense_sides * (2 if style == "PRO" else 1)
    for b in range(UNITS):
        calls = iter(range(len(draws)))

        def jax_draw(key, draw_shape, dtype, b=b, calls=calls):
            W = draws[next(calls)][b]
            assert W.shape == tuple(draw_shape)
            return jnp.asarray(W, dtype)

        new_j, L_j = jkm.update_factors_gen2(
            [jnp.asarray(Q[b]) for Q in factors],
            [jnp.asarray(L[b]) for L in lipschitz],
            jnp.asarray(G[b]),
            jkm.whitening_targets([jnp.ones(d, bool) for d in shape], diagonal),
            0.5,
            style,
            [None if diag else jax.random.PRNGKey(1) for diag in diagonal],
            jax_draw,
        )
        assert next(calls, None) is None  # JAX made exactly torch's draws
        for side in range(len(shape)):
            assert _relative(new_t[side][b], new_j[side]) <= 1e-5, side
            assert _relative(L_t[side][b], L_j[side]) <= 1e-5, side


# ------------------------------------------------------------------ (1) steps

# Every layout path (block_size 16, max_size_dense 45), as the JAX parity test.
SHAPES = {
    "blocked": (40, 16),
    "diagonal_both": (50, 60),
    "diagonal_left": (50, 16),
    "diagonal_right": (16, 50),
    "row": (1, 7),
    "scalar": (),
    "tensor": (2, 8, 16),
    "vector": (8,),
}  # sorted: JAX flattens a dict in key order, torch takes this order
LAYOUT = dict(block_size=16, max_size_dense=45)
STEP_CASES = [
    ("PRO", dict(LAYOUT, learning_rate=1.0), 3),
    (
        "QUAD-plain-normalized",
        dict(
            LAYOUT,
            learning_rate=0.5,
            preconditioner_update_style="QUAD",
            b1=0.0,
            lr_style=None,
            normalize_grads=True,
            noise_scale=1e-6,
            preconditioner_init_scale=0.5,
        ),
        3,
    ),
    (
        "sometimes-fit",
        dict(LAYOUT, learning_rate=1.0, preconditioner_update_probability=0.5),
        4,
    ),
]


def _problem(steps):
    rng = np.random.default_rng(1)
    params = {
        n: np.asarray(0.1 * rng.standard_normal(s), np.float32)
        for n, s in SHAPES.items()
    }
    grads = [
        {
            n: np.asarray((1 + i) * rng.standard_normal(s), np.float32)
            for i, (n, s) in enumerate(SHAPES.items())
        }
        for _ in range(steps)
    ]
    return params, grads


@pytest.mark.parametrize("case", STEP_CASES, ids=[c[0] for c in STEP_CASES])
def test_steps_equal_precond_jax_pro_with_the_same_draws(case, monkeypatch):
    _, kwargs, steps = case
    params, grads = _problem(steps)

    def jax_normal(key, shape=(), dtype=jnp.float32, **_):
        return jnp.asarray(_fixed_normal(shape), dtype)

    def torch_normal(generator, shape, dtype, device):
        # (units, *block): every unit gets the block's fixed draw, as JAX's
        # vmapped fit does with a draw that ignores its key.
        W = torch.from_numpy(_fixed_normal(shape[1:])).to(dtype=dtype, device=device)
        return W.expand(shape)

    optimizer = pj.pro(draws="compact", **kwargs)
    jax_params = {n: jnp.asarray(p) for n, p in params.items()}
    with monkeypatch.context() as patch:
        patch.setattr(normal_draws, "standard_normal", jax_normal)
        state = optimizer.init(jax_params)
        update = jax.jit(optimizer.update)
        jax_steps = []
        for g in grads:
            u, state = update(
                {n: jnp.asarray(x) for n, x in g.items()}, state, jax_params
            )
            jax_params = optax.apply_updates(jax_params, u)
            jax_steps.append(u)

    monkeypatch.setattr(pro_module, "draw_normal", torch_normal)
    torch_kwargs = {k: v for k, v in kwargs.items() if k != "learning_rate"}
    tensors = {n: torch.tensor(p, requires_grad=True) for n, p in params.items()}
    opt = Pro(list(tensors.values()), lr=kwargs["learning_rate"], **torch_kwargs)
    for t, g in enumerate(grads):
        before = {n: p.detach().clone() for n, p in tensors.items()}
        for n, p in tensors.items():
            p.grad = torch.from_numpy(g[n])
        opt.step()
        for n, p in tensors.items():
            delta = (p.detach() - before[n]).numpy()
            assert _relative(delta, jax_steps[t][n]) <= 1e-5, (t, n)


# ------------------------------------------------------------------ (2) properties

PROPERTY_LAYOUT = dict(block_size=8, max_size_dense=24)
# (id, shape, loss threshold after TRAIN_STEPS): Pro (lr_style=None: updates of
# AdamW's scale) ends below it, AdamW at the same lr above it (measured: Pro
# 1.18 / 0.38 / 0.59 / 27.5 / 5.9 / 13.0; AdamW 2.05 / 3.6 / 0.96 / 102 / 11.4
# / 34.6). 'blocked' is cut into 8x8, 8x4, 4x8 and 4x4 blocks; 'merged' is read
# as 12x6; 'wide''s 40 > max_size_dense is a diagonal side.
PROPERTY_CASES = [
    ("scalar", (), 1.5),
    ("vector", (7,), 1.0),
    ("row", (1, 9), 0.75),
    ("blocked", (20, 12), 50.0),
    ("merged", (3, 4, 6), 8.0),
    ("wide", (6, 40), 20.0),
]
PROPERTY_IDS = [c[0] for c in PROPERTY_CASES]
TRAIN_STEPS, TRAIN_LR = 100, 0.01


def _quadratic(shape):
    """An ill-conditioned convex quadratic with its minimum at a random T: for a
    matrix view (r, c), ½‖A(X − T)B‖²/√(rc) with A, B of condition 100 in random
    bases (a Kronecker-factored Hessian that AdamW's diagonal cannot undo); for
    a vector, ½‖s⊙(x − T)‖² with scales from 0.1 to 10."""
    g = torch.Generator().manual_seed(0)
    view = merged_shape(shape)
    if len(view) <= 1:
        n = math.prod(shape)
        scales = torch.logspace(-1, 1, n) if n > 1 else torch.tensor([3.0])
        T = torch.randn(n, generator=g)
        return lambda p: 0.5 * (scales * (p.reshape(-1) - T)).square().sum()
    r, c = view

    def conditioned(d):
        basis, _ = torch.linalg.qr(torch.randn(d, d, generator=g))
        return basis @ torch.diag(torch.logspace(-1, 1, d)) @ basis.T

    A, B, T = conditioned(r), conditioned(c), torch.randn(r, c, generator=g)
    return lambda p: (
        0.5 * (A @ (p.reshape(r, c) - T) @ B).square().sum() / (r * c) ** 0.5
    )


def _train(shape, make_optimizer, steps):
    p = torch.nn.Parameter(torch.zeros(shape))
    loss_fn = _quadratic(shape)
    optimizer = make_optimizer([p])
    for _ in range(steps):
        optimizer.zero_grad()
        loss_fn(p).backward()
        optimizer.step()
    return loss_fn(p).item()


@pytest.mark.parametrize("case", PROPERTY_CASES, ids=PROPERTY_IDS)
def test_trains_past_adamw_at_the_same_step_scale(case):
    _, shape, threshold = case
    pro = _train(
        shape,
        lambda ps: Pro(
            ps, lr=TRAIN_LR, lr_style=None, weight_decay=0.0, **PROPERTY_LAYOUT
        ),
        TRAIN_STEPS,
    )
    adamw = _train(
        shape,
        lambda ps: torch.optim.AdamW(ps, lr=TRAIN_LR, weight_decay=0.0),
        TRAIN_STEPS,
    )
    assert pro < threshold < adamw, (pro, adamw)


def _gradients(shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


def _run(optimizer, params, grads):
    for g in grads:
        for p, x in zip(params, g, strict=True):
            p.grad = x.to(p.dtype)
        optimizer.step()


def _state_tensors(optimizer):
    """Every tensor and number of the state, flattened in a fixed order."""
    out = []

    def walk(x):
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k])
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)
        else:
            out.append(x.clone() if isinstance(x, torch.Tensor) else x)

    walk(optimizer.state_dict()["state"])
    return out


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("case", PROPERTY_CASES, ids=PROPERTY_IDS)
def test_resumed_run_equals_the_uninterrupted_one(case):
    """Save after 3 steps (torch.save), load into a fresh optimizer and params,
    take 3 more: params and state equal 6 uninterrupted steps, bit for bit. A
    second parameter is bfloat16; the state is bfloat16 for both (``dtype``)."""
    _, shape, _ = case
    grads = list(zip(_gradients(shape, 6), _gradients((5, 3), 6, seed=1), strict=True))
    kwargs = dict(PROPERTY_LAYOUT, lr=0.1, dtype=torch.bfloat16)

    def fresh():
        params = [
            torch.nn.Parameter(torch.ones(shape)),
            torch.nn.Parameter(torch.ones(5, 3, dtype=torch.bfloat16)),
        ]
        return params, Pro(params, **kwargs)

    params, optimizer = fresh()
    _run(optimizer, params, grads)
    first, resumed = fresh()
    _run(resumed, first, grads[:3])
    buffer = io.BytesIO()
    torch.save(
        {"params": [p.detach() for p in first], "opt": resumed.state_dict()}, buffer
    )
    buffer.seek(0)
    saved = torch.load(buffer)
    second, resumed = fresh()
    with torch.no_grad():
        for p, q in zip(second, saved["params"], strict=True):
            p.copy_(q)
    resumed.load_state_dict(saved["opt"])
    _run(resumed, second, grads[3:])
    for p, q in zip(params, second, strict=True):
        assert torch.equal(p, q)
    assert _same(_state_tensors(optimizer), _state_tensors(resumed))
    # The float32 parameter's bfloat16 state stays bfloat16 (torch's load
    # would cast it to the parameter's dtype).
    state = resumed.state[second[0]]
    assert state["factors"][0][0].dtype == state["momentum"].dtype == torch.bfloat16


@pytest.mark.parametrize("bad", ["nan", "inf", "huge"])
@pytest.mark.parametrize("case", PROPERTY_CASES, ids=PROPERTY_IDS)
def test_unusable_gradient_changes_nothing(case, bad):
    """A NaN, Inf or overflowing (squares past float32's range) gradient of one
    parameter: no state changes, no parameter moves (weight decay 0); the next
    usable step is the step the run would have taken without it."""
    _, shape, _ = case
    value = {"nan": float("nan"), "inf": float("inf"), "huge": 1e30}[bad]
    grads = list(zip(_gradients(shape, 3), _gradients((4, 5), 3, seed=1), strict=True))
    runs = []
    for poisoned in (False, True):
        params = [
            torch.nn.Parameter(torch.ones(shape)),
            torch.nn.Parameter(torch.ones(4, 5)),
        ]
        optimizer = Pro(params, lr=0.1, weight_decay=0.0, **PROPERTY_LAYOUT)
        _run(optimizer, params, grads[:2])
        if poisoned:
            before = ([p.detach().clone() for p in params], _state_tensors(optimizer))
            bad_grad = torch.ones(shape).reshape(-1)
            bad_grad[0] = value
            _run(optimizer, params, [(bad_grad.reshape(shape), torch.ones(4, 5))])
            assert all(
                torch.equal(p, q) for p, q in zip(params, before[0], strict=True)
            )
            assert _same(_state_tensors(optimizer), before[1])
        _run(optimizer, params, grads[2:])
        runs.append([p.detach().clone() for p in params])
    assert all(torch.equal(p, q) for p, q in zip(*runs, strict=True))


def test_an_overflowing_fit_keeps_that_blocks_factors():
    """Two equal parameters fitted in one stack; one's factors are planted at
    1e18·I, so its fit overflows float32: its factors and Lipschitz estimates
    stay as planted, the other's are fitted."""
    params = [torch.nn.Parameter(torch.ones(4, 3)) for _ in range(2)]
    optimizer = Pro(params, lr=0.1)
    _run(optimizer, params, [(torch.ones(4, 3), torch.ones(4, 3))])
    planted = optimizer.state[params[0]]
    for Q in planted["factors"][0]:
        Q.copy_(1e18 * torch.eye(Q.shape[-1]))
    kept = [t.clone() for t in planted["factors"][0] + planted["lipschitz"][0]]
    other = [Q.clone() for Q in optimizer.state[params[1]]["factors"][0]]
    grads = _gradients((4, 3), 2, seed=3)
    _run(optimizer, params, [tuple(grads)])
    state = optimizer.state[params[0]]
    assert _same(state["factors"][0] + state["lipschitz"][0], kept)
    fitted = optimizer.state[params[1]]["factors"][0]
    assert not any(torch.equal(a, b) for a, b in zip(fitted, other, strict=True))
    assert all(torch.isfinite(Q).all() for Q in fitted)


BAD_ARGUMENTS = [
    ("lr", -1.0, ValueError, ">= 0.0"),
    ("lr_style", "sgd", ValueError, "one of 'adam', None"),
    ("b1", 1.0, ValueError, "in [0.0, 1.0)"),
    ("weight_decay", -0.1, ValueError, ">= 0.0"),
    ("normalize_grads", "yes", TypeError, "True or False"),
    ("max_size_dense", -1, ValueError, ">= 0"),
    ("preconditioner_lr", float("nan"), ValueError, "finite"),
    ("preconditioner_init_scale", 0.0, ValueError, "> 0.0"),
    ("preconditioner_update_style", "EQ", ValueError, "one of 'PRO', 'QUAD', 'QEQ'"),
    ("dtype", torch.float64, ValueError, "torch.float32 or torch.bfloat16"),
    ("block_size", 0, ValueError, ">= 1"),
    ("block_size", 2.0, TypeError, "a Python int"),
    ("noise_scale", -1e-9, ValueError, ">= 0.0"),
    ("preconditioner_update_probability", 0.0, ValueError, "in (0.0, 1.0]"),
    ("seed", "0", TypeError, "a Python int"),
]


@pytest.mark.parametrize(
    ("name", "value", "error", "rule"),
    BAD_ARGUMENTS,
    ids=[f"{name}={value!r}" for name, value, _, _ in BAD_ARGUMENTS],
)
def test_bad_arguments_raise_the_standard_message(name, value, error, rule):
    """Invalid <name>=<value!r>: must be <rule>, at construction and for a
    param group (every argument but the seed is per group)."""
    p = torch.nn.Parameter(torch.zeros(3))
    prefix = re.escape(f"Invalid {name}={value!r}: must be ")
    calls = [lambda: Pro([p], **{name: value})]
    if name != "seed":
        calls.append(lambda: Pro([{"params": [p], name: value}]))
    for call in calls:
        with pytest.raises(error, match=prefix) as caught:
            call()
        assert rule in str(caught.value)


# ------------------------------------------------------------------ (3) layout


def test_fitted_stacks_are_precond_jax_pros(monkeypatch):
    """The (block shape, diagonal sides, number of blocks) of every stack Pro
    fits in a step equal the stacks of precond.jax.pro's plan for the same
    shapes, one fit per stack (equal blocks of all parameters together)."""
    fits = []
    real_fit = tkm.update_factors_gen2

    def recording(Qs, lipschitz, G, *args, **kwargs):
        diagonal = tuple(tkm.is_diagonal(Q) for Q in Qs)
        fits.append((tuple(G.shape[1:]), diagonal, G.shape[0]))
        return real_fit(Qs, lipschitz, G, *args, **kwargs)

    shapes = [*list(SHAPES.values()), (40, 16), (3, 16, 16)]
    plan = jax_pro_plan(shapes, [False] * len(shapes), 45, 16, 1)
    expected = [(s.shape, s.diagonal, s.units) for s in plan.stacks]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    optimizer = Pro(params, **LAYOUT)
    for p in params:
        p.grad = torch.ones(p.shape)
    monkeypatch.setattr(tkm, "update_factors_gen2", recording)
    optimizer.step()
    assert sorted(fits) == sorted(expected)
    # The 16x16 blocks of three parameters (2 + 2 + 1) share one fit.
    assert ((16, 16), (False, False), 5) in fits


def test_a_zero_size_parameter_of_three_dims_beside_a_normal_one():
    # merged_shape used to divide by the zero size of a (2, 0, 3) parameter.
    assert merged_shape((2, 0, 3)) == (2, 0)  # the first split of least ratio
    empty = torch.nn.Parameter(torch.zeros(2, 0, 3))
    w = torch.nn.Parameter(torch.zeros(4, 3))
    optimizer = Pro([empty, w], lr=0.1)
    for step in range(2):
        empty.grad = torch.zeros(2, 0, 3)
        w.grad = torch.from_numpy(_fixed_normal((4, 3 + step))[:, :3].copy())
        before = w.detach().clone()
        optimizer.step()
        assert empty.shape == (2, 0, 3)
        assert torch.isfinite(w).all()
        assert not torch.equal(w, before)
    assert optimizer.state[w]["step"] == 2
