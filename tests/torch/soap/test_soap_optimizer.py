"""precond.torch.SOAP as an optimizer: a state_dict round trip resumes bit for
bit, a step with an unusable gradient changes no state, bad arguments are
refused at construction with their name, value and rule, state dtypes."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from precond.torch import SOAP

SHAPES = [(6, 5), (3, 4, 2), (7,), (), (20, 3)]


def _params(dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(s, generator=generator, dtype=dtype))
        for s in SHAPES
    ]


def _grads(steps, dtype=torch.float32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(s, generator=generator, dtype=dtype) for s in SHAPES]
        for _ in range(steps)
    ]


def _step(optimizer, params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    optimizer.step()


KWARGS = dict(
    lr=0.01,
    precondition_frequency=3,
    max_precond_dim=16,
    precondition_1d=True,
    block_size=4,
)


def _groups(params):
    return [
        {"params": params[:2]},
        {"params": params[2:], "refresh": "eigh", "merge_dims": True},
    ]


@pytest.mark.parametrize("split", [1, 4, 7])
def test_state_dict_round_trip_resumes_bit_identically(split):
    """Saved after ``split`` calls (the first call, before and after a
    refresh), loaded into a fresh optimizer, the run continues as the
    uninterrupted one, bit for bit."""
    params, twin = _params(), _params()
    optimizer = SOAP(_groups(params), **KWARGS)
    grads = _grads(12)
    for g in grads[:split]:
        _step(optimizer, params, g)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    with torch.no_grad():
        for p, q in zip(twin, params, strict=True):
            p.copy_(q)
    restored = SOAP(_groups(twin), **KWARGS)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    for g in grads[split:]:
        _step(optimizer, params, g)
        _step(restored, twin, g)
    for p, q in zip(params, twin, strict=True):
        assert torch.equal(p, q)


def test_a_skipped_step_changes_no_state_and_decays_the_parameters():
    params = _params()
    optimizer = SOAP(params, **{**KWARGS, "weight_decay": 0.1})
    grads = _grads(3)
    for g in grads[:2]:
        _step(optimizer, params, g)
    state = copy.deepcopy(optimizer.state_dict()["state"])
    before = [p.detach().clone() for p in params]
    bad = [g.clone() for g in grads[2]]
    bad[1].view(-1)[0] = float("nan")
    _step(optimizer, params, bad)
    assert optimizer.skipped_steps == 1
    after = optimizer.state_dict()["state"]
    for key, entries in state.items():
        for name, value in entries.items():
            if isinstance(value, list):
                for x, y in zip(value, after[key][name], strict=True):
                    assert torch.equal(x, y), name
            else:
                assert value == after[key][name], name
    lr_decay = 1 - KWARGS["lr"] * 0.1
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p, b * lr_decay)


def test_state_is_kept_in_the_working_precision():
    """float32 statistics and bases for float32 and bfloat16 parameters,
    float64 for float64 ones; the parameters keep their dtype."""
    for dtype, working in [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float64),
    ]:
        params = [torch.nn.Parameter(torch.ones(4, 3, dtype=dtype))]
        optimizer = SOAP(params, lr=0.01)
        for g in _grads(3, seed=2):
            params[0].grad = g[0][:4, :3].to(dtype)
            optimizer.step()
        state = optimizer.state[params[0]]
        for name in ("exp_avg", "exp_avg_sq", "statistics", "bases"):
            assert all(t.dtype == working for t in state[name]), (dtype, name)
        assert params[0].dtype == dtype
        assert torch.isfinite(params[0]).all()


def test_the_first_call_takes_no_preconditioned_step():
    """The first call only accumulates statistics and takes bases: the
    parameter moves by weight decay alone."""
    p = torch.nn.Parameter(torch.ones(3, 3))
    optimizer = SOAP([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.randn(3, 3)
    optimizer.step()
    assert torch.equal(p.detach(), torch.full((3, 3), 1 - 0.1 * 0.5))
    assert optimizer.state[p]["step"] == 1


def _leaf():
    return torch.nn.Parameter(torch.ones(3))


BAD = {
    "lr": (-0.1, ValueError, r"Invalid lr=-0.1: must be >= 0"),
    "betas": ((0.9, 1.0), ValueError, r"Invalid betas\[1\]=1.0: must be in \[0"),
    "betas_one": (0.9, TypeError, r"Invalid betas=0.9: must be a pair"),
    "shampoo_beta": (1.0, ValueError, r"Invalid shampoo_beta=1.0: must be < 1"),
    "eps": (-1e-8, ValueError, r"Invalid eps=-1e-08: must be >= 0"),
    "weight_decay": (-0.01, ValueError, r"Invalid weight_decay=-0.01"),
    "precondition_frequency": (
        0,
        ValueError,
        r"precondition_frequency=0: must be >= 1",
    ),
    "precondition_frequency_float": (2.0, TypeError, r"must be a Python int"),
    "max_precond_dim": (-1, ValueError, r"Invalid max_precond_dim=-1: must be >= 0"),
    "merge_dims": ("yes", TypeError, r"Invalid merge_dims='yes': must be True or"),
    "precondition_1d": (1, TypeError, r"Invalid precondition_1d=1"),
    "normalize_grads": (None, TypeError, r"Invalid normalize_grads=None"),
    "correct_bias": ("no", TypeError, r"Invalid correct_bias='no'"),
    "refresh": ("svd", ValueError, r"Invalid refresh='svd': must be one of 'qr'"),
    "block_size": (0, ValueError, r"Invalid block_size=0: must be >= 1"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_are_refused_at_construction_and_in_groups(case):
    value, error, message = BAD[case]
    name = case.removesuffix("_one").removesuffix("_float")
    with pytest.raises(error, match=message):
        SOAP([_leaf()], **{name: value})
    optimizer = SOAP([_leaf()])
    with pytest.raises(error, match=message):
        optimizer.add_param_group({"params": [_leaf()], name: value})
    assert len(optimizer.param_groups) == 1


def test_unknown_keywords_and_integer_parameters_are_refused():
    with pytest.raises(TypeError):
        SOAP([_leaf()], b1=0.9)  # the paper's name is betas
    with pytest.raises(TypeError, match="real floating"):
        SOAP([torch.ones(3, dtype=torch.int64)])


def test_schedulers_cycle_betas_as_for_adam():
    """OneCycleLR's momentum cycling sets ``betas[0]`` (as for torch's Adam),
    and the step uses it."""
    params, manual = _params(), _params()
    optimizer = SOAP(params, lr=0.01)
    by_hand = SOAP(manual, lr=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=10)
    seen = set()
    for g in _grads(8):
        group = optimizer.param_groups[0]
        seen.add(group["betas"][0])
        by_hand.param_groups[0]["lr"] = group["lr"]
        by_hand.param_groups[0]["betas"] = group["betas"]
        _step(optimizer, params, g)
        _step(by_hand, manual, g)
        scheduler.step()
    assert len(seen) > 3
    for p, q in zip(params, manual, strict=True):
        assert torch.equal(p, q)
