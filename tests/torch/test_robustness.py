"""The torch robustness table: ONE table of hostile gradients and parameters, run
against every public torch optimizer (PSGD Kron in three factor layouts; ProAdamW,
pro on the weight and AdamW on the bias; K-FAC with each distributed strategy,
preconditioning the gradients of an SGD step).

Properties, each against an oracle:

* ``stream`` cases (a gradient pattern at every step): the optimizer state stays
  finite after every step, and an all-zero gradient moves no parameter.
* ``bad step`` cases (one hostile gradient at step 25 of 50 on a small
  regression problem): the state stays finite after every step and the final
  loss is within 1% of the same run without the bad step.
* ``shape`` cases (a bare parameter of an unusual shape or dtype, fitted to a
  target by L = mean|θ − t|²): the state stays finite after every step and L
  falls, or the optimizer refuses the parameter at construction with a clear
  error. K-FAC preconditions Linear/Conv2d layers, not bare parameters: it has
  no shape rows here (its empty and size-1 layers: tests/torch/kfac/test_kfac.py);
  nor has ProAdamW (its bare parameters are Pro's or AdamW's: the JAX table
  runs pro_adamw's, tests/jax/test_robustness.py).

Policy (DESIGN.md §5, precond.jax's): Kron skips a step whose gradient's squared
norm is not finite in its working precision (NaN, ±Inf, entries ≳ 1.8e19 in
float32); integer parameters are refused. K-FAC drops a factor contribution
whose squared norm overflows, preconditions a huge finite gradient scale-safely
(its KL clip bounds the step), and hands a NaN/±Inf gradient on unchanged, so
that the loop's skip (GradScaler's, or the explicit check here) drops the step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from precond.torch import SOAP as _SOAP
from precond.torch import GraftingType, Kron, ProAdamW, Shampoo
from precond.torch.kfac import KFAC, DistributedStrategy

FLOAT32_MAX = torch.finfo(torch.float32).max
BF16_MAX = torch.finfo(torch.bfloat16).max
STEPS, BAD_STEP = 50, 25


# --- the optimizers -------------------------------------------------------------


@dataclasses.dataclass
class Built:
    step: Callable[[], None]
    state: Callable[[], list[torch.Tensor]]


def _tensors(value) -> list[torch.Tensor]:
    """The tensors of a state entry: a tensor, or lists of them, nested."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for item in value for t in _tensors(item)]


def _scheduled(optimizer: torch.optim.Optimizer, state_keys: tuple[str, ...]) -> Built:
    """``optimizer`` under the rate schedule of every row, lr·0.92ⁿ; its state
    is the tensors under ``state_keys`` of each parameter's state (a key a
    parameter lacks is passed over; none found at all fails)."""
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 0.92**n)

    def step():
        optimizer.step()
        schedule.step()

    def state():
        tensors = [
            t
            for entry in optimizer.state.values()
            for key in state_keys
            for t in _tensors(entry.get(key, []))
        ]
        assert tensors or not optimizer.state, f"no state under {state_keys}"
        return tensors

    return Built(step, state)


def _kron(**kwargs):
    def build(model: nn.Module) -> Built:
        # Tuned to reach the least-squares floor within ~40 steps (a run that is
        # still descending at step 50 would differ by more than 1% for one step
        # less): b1 = 0.5, lr 0.3·0.92^n.
        optimizer = Kron(model.parameters(), lr=0.3, b1=0.5, **kwargs)
        return _scheduled(optimizer, ("momentum", "Q"))

    return build


def _pro_adamw(model: nn.Module) -> Built:
    # Tuned, as Kron's rows, to reach the least-squares floor within 30 steps (a
    # run still descending at step 50 differs by more than 1% for one step
    # less; the defaults, 2 times and momentum 0.7, are still descending):
    # AdamW's rate 0.3·0.92^n on the bias, 4 times it on the weight (pro) with
    # momentum 0.5; no weight decay, so that zero gradients move nothing.
    optimizer = ProAdamW(
        model.named_parameters(),
        lr=0.3,
        b1=0.5,
        pro_lr_multiplier=4.0,
        weight_decay=0.0,
    )
    keys = ("momentum", "exp_avg", "exp_avg_sq", "factors", "lipschitz")
    return _scheduled(optimizer, keys)


def _soap(model: nn.Module) -> Built:
    # Tuned, as Kron's rows, to reach the least-squares floor within ~40 steps
    # (one step less then costs 0.2% of the loss): lr 0.5·0.92^n, β₁ = 0.5,
    # bases refreshed every 5 steps; no weight decay, so that zero gradients
    # move nothing.
    optimizer = _SOAP(
        model.parameters(),
        lr=0.5,
        betas=(0.5, 0.95),
        weight_decay=0.0,
        precondition_frequency=5,
    )
    return _scheduled(optimizer, ("exp_avg", "exp_avg_sq", "statistics", "bases"))


def _kfac(strategy: DistributedStrategy):
    def build(model: nn.Module) -> Built:
        # Reaches the least-squares floor within 30 steps.
        preconditioner = KFAC(model, grad_worker_fraction=strategy, lr=0.3, kl_clip=0.1)
        sgd = torch.optim.SGD(model.parameters(), lr=0.3)

        def step():
            preconditioner.step()
            # K-FAC hands a non-finite gradient on (so that a GradScaler sees it
            # and skips the step) and keeps its factors; the loop skips the step
            # as GradScaler.step does.
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if all(bool(torch.isfinite(g).all()) for g in grads):
                sgd.step()

        def state():
            tensors = []
            for layer in preconditioner.layers:
                tensors += [layer.A, layer.G, *layer.second_order.values()]
            return [t for t in tensors if t is not None]

        return Built(step, state)

    return build


def _shampoo(model: nn.Module) -> Built:
    # Tuned, as Kron's rows, to reach the least-squares floor within 30 steps:
    # AdaGrad grafting, lr 0.5·0.92^n, momentum 0.5, blocks of 4.
    optimizer = Shampoo(
        model.parameters(),
        lr=0.5,
        beta1=0.5,
        block_size=4,
        graft_type=GraftingType.ADAGRAD,
    )
    keys = ("momentum", "diagonal_momentum", "diagonal_statistics")
    return _scheduled(optimizer, (*keys, "statistics", "preconditioners"))


OPTIMIZERS = {
    "kron": _kron(),
    "kron-one_diag": _kron(memory_save_mode="one_diag"),
    "kron-all_diag": _kron(memory_save_mode="all_diag"),
    "pro-adamw": _pro_adamw,
    "soap": _soap,
    "shampoo": _shampoo,
    **{f"kfac-{s.name}": _kfac(s) for s in DistributedStrategy},
}
KFAC_ROWS = [name for name in OPTIMIZERS if name.startswith("kfac")]
# The rows whose shape cases run (on bare parameters, with Kron).
SHAPE_ROWS = [name for name in OPTIMIZERS if name.startswith("kron")]


# --- the cases ------------------------------------------------------------------


def _one_entry(value):
    def pattern(g):
        g = g.clone()
        g.view(-1)[g.numel() // 2] = value
        return g

    return pattern


def _mixed(g):
    """Entries spread log-uniformly over 1e-30..1e30 with random signs."""
    generator = torch.Generator().manual_seed(0)
    exponents = torch.empty(g.shape).uniform_(-30, 30, generator=generator)
    signs = torch.randint(0, 2, g.shape, generator=generator) * 2 - 1
    return (signs * 10.0**exponents).to(g.dtype)


@dataclasses.dataclass
class Case:
    kind: str  # "stream", "bad step" or "shape"
    pattern: Callable[[torch.Tensor], torch.Tensor] | None = None
    dtype: torch.dtype = torch.float32
    shape: tuple[int, ...] | None = None
    refused: str | None = None  # the error message of a refused parameter


CASES = {
    "zero gradients": Case("stream", torch.zeros_like),
    "subnormal gradients": Case("stream", lambda g: torch.full_like(g, 1e-40)),
    "bf16 subnormal gradients": Case(
        "stream", lambda g: torch.full_like(g, 1e-40), dtype=torch.bfloat16
    ),
    "float32 max in one entry": Case("bad step", _one_entry(FLOAT32_MAX)),
    "1e30 in one entry": Case("bad step", _one_entry(1e30)),
    "-1e30 in one entry": Case("bad step", _one_entry(-1e30)),
    "mixed 1e-30..1e30": Case("bad step", _mixed),
    "NaN": Case("bad step", _one_entry(float("nan"))),
    "+Inf": Case("bad step", _one_entry(float("inf"))),
    "-Inf": Case("bad step", _one_entry(-float("inf"))),
    "bf16 max in one entry": Case(
        "bad step", _one_entry(BF16_MAX), dtype=torch.bfloat16
    ),
    "bf16 NaN": Case("bad step", _one_entry(float("nan")), dtype=torch.bfloat16),
    "0-size": Case("shape", shape=(0, 3)),
    "scalar": Case("shape", shape=()),
    "size-1 dims": Case("shape", shape=(1, 5, 1)),
    "one long dim (1, 100000)": Case("shape", shape=(1, 100_000)),
    "one long dim (3, 20000)": Case("shape", shape=(3, 20_000)),
    "complex64": Case("shape", shape=(4, 3), dtype=torch.complex64),
    "complex128 vector": Case("shape", shape=(6,), dtype=torch.complex128),
    "int64": Case("shape", shape=(4, 3), dtype=torch.int64, refused="torch.int64"),
}


def _params():
    """Every (optimizer, case), except the shape cases for K-FAC (it
    preconditions Linear/Conv2d layers, not bare tensors: its empty and size-1
    layers are in tests/torch/kfac/test_kfac.py) and ProAdamW."""
    return [
        pytest.param(name, case, id=f"{name}-{case}")
        for case in CASES
        for name in OPTIMIZERS
        if name in SHAPE_ROWS or CASES[case].kind != "shape"
    ]


# --- the problems ---------------------------------------------------------------


def _regression(dtype):
    """A linear least-squares problem, y = X W* + noise, and its model (the
    noise puts the floor near 1, far above bfloat16's resolution of it)."""
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(64, 6, generator=generator)
    W = torch.randn(6, 3, generator=generator)
    Y = X @ W + torch.randn(64, 3, generator=generator)
    torch.manual_seed(1)
    model = nn.Linear(6, 3).to(dtype)
    return model, X.to(dtype), Y.to(dtype)


def _assert_finite(tensors, where):
    for t in tensors:
        t = torch.view_as_real(t) if t.is_complex() else t
        assert torch.isfinite(t).all(), where


def _train(build, dtype, pattern=None, bad_steps=(), steps=STEPS, everywhere=False):
    """Trains the regression model; at ``bad_steps`` the weight's gradient (every
    gradient if ``everywhere``) is replaced by ``pattern`` of it. Returns (final
    loss, params before, model)."""
    model, X, Y = _regression(dtype)
    start = [p.detach().clone() for p in model.parameters()]
    built = build(model)
    for step in range(steps):
        model.zero_grad()
        (model(X) - Y).float().square().mean().backward()
        if step in bad_steps:
            for p in model.parameters() if everywhere else [model.weight]:
                p.grad = pattern(p.grad)
        built.step()
        _assert_finite(built.state(), f"state after step {step}")
    with torch.no_grad():
        loss = (model(X) - Y).float().square().mean().item()
    return loss, start, model


def _fit_bare_parameter(case):
    generator = torch.Generator().manual_seed(2)
    real = torch.float64 if case.dtype.is_complex else torch.float32
    target = torch.randn(case.shape, generator=generator, dtype=real).to(case.dtype)
    p = nn.Parameter(torch.zeros(case.shape, dtype=case.dtype))
    optimizer = Kron([p], lr=0.05)

    def loss():
        return (p - target).abs().square().sum() / 2 if p.numel() else p.sum().real

    initial = loss().item()
    for step in range(20):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
        entry = optimizer.state.get(p, {})
        _assert_finite([*entry.get("Q", []), p.detach()], f"step {step}")
    return initial, loss().item()


@functools.cache
def _clean_loss(optimizer: str, dtype: torch.dtype) -> float:
    """The final loss of the run without a bad step (shared by the cases)."""
    return _train(OPTIMIZERS[optimizer], dtype)[0]


@pytest.mark.parametrize(("optimizer", "case"), _params())
def test_robustness(optimizer, case):
    spec, build = CASES[case], OPTIMIZERS[optimizer]
    if spec.kind == "shape":
        if spec.refused:
            with pytest.raises(TypeError, match=spec.refused):
                Kron([torch.zeros(spec.shape, dtype=spec.dtype)])
            return
        initial, final = _fit_bare_parameter(spec)
        if spec.shape == (0, 3):
            assert initial == final == 0.0
        else:
            assert final < 0.5 * initial, (initial, final)
        return
    if spec.kind == "stream":
        steps = 20
        _, start, model = _train(
            build, spec.dtype, spec.pattern, range(steps), steps, everywhere=True
        )
        if spec.pattern is torch.zeros_like:  # zero gradients move nothing
            for p, p0 in zip(model.parameters(), start, strict=True):
                assert torch.equal(p, p0)
        return
    clean = _clean_loss(optimizer, spec.dtype)
    bad, _, _ = _train(build, spec.dtype, spec.pattern, (BAD_STEP,))
    assert abs(bad - clean) <= 0.01 * clean, (bad, clean)


# --- hypothesis: generated shapes and gradient scales ------------------------------


@pytest.mark.parametrize("memory_save_mode", [None, "one_diag", "all_diag"])
@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    shape=st.lists(st.sampled_from([0, 1, 2, 3, 5, 17, 64]), max_size=3).map(tuple),
    exponent=st.integers(-30, 25),
)
def test_generated_shapes_and_scales_keep_kron_finite(
    memory_save_mode, shape, exponent
):
    """Any shape (0-size, scalar, size-1 and long dims) with gradients of any
    magnitude from 1e-30 to 1e25 (skipped above the float32 overflow of Σg²):
    the parameter and Kron's state stay finite over three steps."""
    x = nn.Parameter(torch.ones(shape))
    optimizer = Kron([x], lr=0.01, memory_save_mode=memory_save_mode)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        x.grad = 10.0**exponent * torch.randn(shape, generator=generator)
        optimizer.step()
        state = optimizer.state[x]  # empty for a 0-size parameter: nothing to keep
        tensors = [state["momentum"], *state["Q"]] if state else []
        _assert_finite([x.detach(), *tensors], (shape, exponent))
