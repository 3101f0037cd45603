"""precond.torch.Shampoo's own properties: a state_dict round trip resumes as
the uninterrupted run, a step with a NaN/Inf gradient changes nothing but the
count of skipped steps, bad arguments are refused naming the argument, the
roots are computed in one batched call per stack, and param groups keep their
own settings."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from precond.torch import GraftingType, Shampoo
from precond.torch.shampoo import _math

SHAPES = [(6, 10), (7,), (3, 4, 5), (), (3, 50)]


def _params(dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(s, generator=generator, dtype=dtype))
        for s in SHAPES
    ]


def _grads(steps, dtype=torch.float32):
    generator = torch.Generator().manual_seed(1)
    return [
        [torch.randn(s, generator=generator, dtype=dtype) for s in SHAPES]
        for _ in range(steps)
    ]


def _step(optimizer, params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    optimizer.step()


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


OPTIONS = [
    dict(block_size=4, graft_type=GraftingType.ADAGRAD, weight_decay=0.01),
    dict(
        block_size=4,
        graft_type=GraftingType.RMSPROP,
        eigh=True,
        preconditioning_compute_steps=3,
        statistics_compute_steps=2,
        start_preconditioning_step=2,
    ),
    dict(block_size=8, graft_type=GraftingType.SQRT_N, decoupled_weight_decay=True),
]


@pytest.mark.parametrize("options", OPTIONS, ids=["adagrad", "rmsprop", "sqrt_n"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_state_dict_round_trip_resumes_as_the_uninterrupted_run(options, dtype):
    params, twin = _params(dtype), _params(dtype)
    optimizer = Shampoo(params, lr=0.05, **options)
    grads = _grads(10, dtype)
    for g in grads[:4]:
        _step(optimizer, params, g)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    with torch.no_grad():
        for p, q in zip(twin, params, strict=True):
            p.copy_(q)
    restored = Shampoo(twin, lr=0.05, **options)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    state = restored.state[twin[0]]
    assert state["momentum"].dtype == torch.float32
    assert state["statistics"][0].dtype == torch.float32
    for g in grads[4:]:
        _step(optimizer, params, g)
        _step(restored, twin, g)
    _same(twin, params)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e30])
def test_a_step_with_an_unusable_gradient_changes_nothing(bad):
    params = _params()
    optimizer = Shampoo(params, lr=0.05, block_size=4, weight_decay=0.1)
    grads = _grads(3)
    _step(optimizer, params, grads[0])
    before_params = [p.detach().clone() for p in params]
    before_state = copy.deepcopy(optimizer.state_dict()["state"])
    broken = [g.clone() for g in grads[1]]
    broken[2].view(-1)[3] = bad
    _step(optimizer, params, broken)
    assert optimizer.skipped_steps == 1
    _same(params, before_params)  # weight decay included: JAX returns zeros
    after = optimizer.state_dict()["state"]
    for key, entry in before_state.items():
        for name, value in entry.items():
            if isinstance(value, list):
                _same(after[key][name], value)
            elif isinstance(value, torch.Tensor):
                assert torch.equal(after[key][name], value)
            else:
                assert after[key][name] == value
    _step(optimizer, params, grads[2])
    assert all(optimizer.state[p]["step"] == 2 for p in params)


BAD_ARGUMENTS = [
    ("lr", -1.0, ValueError),
    ("block_size", -1, ValueError),
    ("block_size", 2.5, TypeError),
    ("beta1", 1.5, ValueError),
    ("beta2", -0.1, ValueError),
    ("diagonal_epsilon", -1.0, ValueError),
    ("matrix_epsilon", float("nan"), ValueError),
    ("weight_decay", -0.1, ValueError),
    ("start_preconditioning_step", -1, ValueError),
    ("preconditioning_compute_steps", 0, ValueError),
    ("statistics_compute_steps", 0, ValueError),
    ("best_effort_shape_interpretation", "yes", TypeError),
    ("graft_type", 7, ValueError),
    ("graft_type", "sgd", ValueError),
    ("nesterov", 1, TypeError),
    ("exponent_override", -2, ValueError),
    ("inverse_failure_threshold", 0.0, ValueError),
    ("moving_average_for_momentum", None, TypeError),
    ("skip_preconditioning_dim_size_gt", 0, ValueError),
    ("clip_by_scaled_gradient_norm", -1.0, ValueError),
    ("relative_matrix_epsilon", "no", TypeError),
    ("merge_small_dims_block_size", 0, ValueError),
    ("precondtioner_type", 4, ValueError),
    ("skip_preconditioning_rank_lt", -1, ValueError),
    ("decoupled_learning_rate", 0, TypeError),
    ("decoupled_weight_decay", 0, TypeError),
    ("eigh", "true", TypeError),
    ("separate_grafting_momentum", 1.0, TypeError),
    ("precondition_with_previous_roots", 1, TypeError),
]


@pytest.mark.parametrize(
    ("name", "value", "error"),
    BAD_ARGUMENTS,
    ids=[f"{n}={v!r}" for n, v, _ in BAD_ARGUMENTS],
)
def test_a_bad_argument_is_refused_naming_it(name, value, error):
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(error, match=f"Invalid {name}="):
        Shampoo([p], **{name: value})
    optimizer = Shampoo([p])
    with pytest.raises(error, match=f"Invalid {name}="):
        optimizer.add_param_group(
            {"params": [torch.nn.Parameter(torch.ones(2))], name: value}
        )
    assert len(optimizer.param_groups) == 1


def test_integer_and_complex_parameters_are_refused():
    for dtype in (torch.int64, torch.complex64):
        with pytest.raises(TypeError, match=str(dtype)):
            Shampoo([torch.zeros(3, 2, dtype=dtype)])


def test_precond_jax_enums_are_taken_by_value():
    jax_shampoo = pytest.importorskip("precond.jax.shampoo._config")
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = Shampoo([p], graft_type=jax_shampoo.GraftingType.ADAGRAD)
    assert optimizer.defaults["graft_type"] == 2


def test_equal_statistics_are_rooted_in_one_batched_call(monkeypatch):
    """An (8, 6) parameter in blocks of 4 has six (4, 4) statistics and two
    (2, 2) ones (its (4, 2) edge blocks), a (4, 4) one two more (4, 4): one
    kernel call per (size, exponent) stack, not one per statistic."""
    calls = []
    kernel = _math.inverse_pth_roots_newton

    def counted(stack, *args):
        calls.append(tuple(stack.shape))
        return kernel(stack, *args)

    monkeypatch.setattr("precond.torch.shampoo._step.inverse_pth_roots_newton", counted)
    params = [
        torch.nn.Parameter(torch.ones(8, 6)),
        torch.nn.Parameter(torch.ones(4, 4)),
    ]
    optimizer = Shampoo(params, block_size=4)
    for p in params:
        p.grad = torch.randn(p.shape)
    optimizer.step()
    assert sorted(calls) == [(2, 2, 2), (8, 4, 4)]


def test_param_groups_keep_their_own_settings():
    """A group with SGD grafting and one with AdaGrad: each its own buffers and
    each steps as an optimizer of that group alone."""
    params, alone = _params(), _params()
    groups = [
        {"params": params[:2], "graft_type": GraftingType.ADAGRAD},
        {"params": params[2:], "block_size": 2, "beta1": 0.5},
    ]
    optimizer = Shampoo(groups, lr=0.05, block_size=4)
    first = Shampoo(alone[:2], lr=0.05, block_size=4, graft_type=GraftingType.ADAGRAD)
    second = Shampoo(alone[2:], lr=0.05, block_size=2, beta1=0.5)
    for g in _grads(4):
        _step(optimizer, params, g)
        _step(first, alone[:2], g[:2])
        _step(second, alone[2:], g[2:])
    _same(params, alone)
    assert "diagonal_statistics" in optimizer.state[params[0]]
    assert "diagonal_statistics" not in optimizer.state[params[2]]


@pytest.mark.parametrize(
    "shape", [(0, 3), (), (1, 5, 1), (1, 100_000), (3, 20_000), (2, 3, 4, 5)]
)
def test_unusual_shapes_are_fitted_and_keep_the_state_finite(shape):
    """A bare parameter fitted to a target by L = |θ − t|²/2 (grafting alone
    for scalars, empty tensors and dims above 4096): L falls (an empty one stays
    0) and the state stays finite."""
    generator = torch.Generator().manual_seed(2)
    target = torch.randn(shape, generator=generator)
    p = torch.nn.Parameter(torch.zeros(shape))
    optimizer = Shampoo([p], lr=0.1, block_size=4, graft_type=GraftingType.ADAGRAD)

    def loss():
        return (p - target).square().sum() / 2

    initial = loss().item()
    for _ in range(20):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
        entry = optimizer.state.get(p, {})
        tensors = [v for v in entry.values() if isinstance(v, torch.Tensor)]
        tensors += entry.get("statistics", []) + entry.get("preconditioners", [])
        assert all(torch.isfinite(t).all() for t in [*tensors, p.detach()])
    if p.numel() == 0:
        assert initial == loss().item() == 0.0
    else:
        assert loss().item() < 0.5 * initial
