"""precond.torch.Kron as a torch.optim.Optimizer: groups, schedulers, closures,
skipped and refused gradients, checkpoints, bad input, non-finite gradients, the
update-probability schedule and the factor structure.

Each test compares against an oracle rather than checking that code runs: a
second optimizer (one per param group, or one that never saw a skipped step),
the linearity of the parameter step in the learning rate, the saved state itself,
precond.jax's schedule, or precond._common.kron_plan's plan. The Optimizer
conventions every torch optimizer keeps (copies, tensor lr, schedulers, groups'
overrides, a state_dict round trip, closures, hooks, zero_grad, refused groups)
are tests/torch/test_optimizer_conventions.py's table.
"""

from __future__ import annotations

import copy
import inspect
import io
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from precond._common.kron_plan import plan_tensor
from precond.jax import precond_update_prob_schedule as jax_schedule
from precond.torch import Kron as _Kron
from precond.torch import precond_update_prob_schedule
from precond.torch._core.step_policy import finite_entries, gradients_are_usable
from precond.torch._core.tensors import working_dtype
from precond.torch.kron import _kron_randomness as kron_randomness
from precond.torch.kron import kron as kron_module

# The rules precond used before kron-torch 0.1.0's became Kron's defaults (issue
# 18): RMS update clipping with decoupled weight decay, damping noise in the fit,
# no skew rule, diagonal vectors, float32 factors. These tests were written for
# them (and compare with precond.jax.kron, which has them), so they pass them.
PRECOND_RULES = dict(
    update_clipping="rms",
    damping=True,
    max_skew_triangular=float("inf"),
    min_ndim_triangular=2,
    precond_dtype=torch.float32,
)


def Kron(params, **kwargs):
    return _Kron(params, **{**PRECOND_RULES, **kwargs})


STEP, UPDATE_COUNTER, MOMENTUM, FACTORS = (
    kron_module.STEP,
    kron_module.UPDATE_COUNTER,
    kron_module.MOMENTUM,
    kron_module.FACTORS,
)


@pytest.fixture
def noise_by_shape(monkeypatch):
    """Noise that depends on (shape, step) only and no balancing, so that one
    optimizer over several groups and one optimizer per group draw the same V
    (the real draws depend on the parameter's position in its optimizer)."""

    def unit_noise(shape, seed, step, index, dtype, device):
        generator = torch.Generator().manual_seed(1000 * step + math.prod(shape))
        return torch.randn(shape, generator=generator, dtype=dtype).to(device)

    monkeypatch.setattr(kron_randomness, "unit_noise", unit_noise)
    monkeypatch.setattr(kron_randomness, "balance_draw", lambda *args: 1.0)


def make_params(shapes, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(s, generator=generator, dtype=dtype))
        for s in shapes
    ]


def gradients(shapes, steps, dtype=torch.float64, seed=1):
    """A fixed list of gradients per step (not from a loss: the state then
    evolves independently of the learning rate)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(s, generator=generator, dtype=dtype) for s in shapes]
        for _ in range(steps)
    ]


def run(optimizer, params, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = None if g is None else g.clone()
        optimizer.step()


SHAPES = [(5, 4), (6,), (3, 2, 4), ()]


# --- param groups, schedulers, closures, zero_grad ---------------------------


def test_param_groups_equal_one_optimizer_per_group(noise_by_shape):
    grads = gradients(SHAPES * 2, steps=4)
    params = make_params(SHAPES * 2)
    hyper_a = dict(lr=0.1, b1=0.9, weight_decay=0.01)
    hyper_b = dict(lr=0.02, b1=0.5, weight_decay=0.0, precond_lr=0.3)
    optimizer = Kron(
        [
            {"params": params[:4], **hyper_a},
            {"params": params[4:], **hyper_b},
        ],
        preconditioner_update_probability=1.0,
        precond_dtype=torch.float64,
    )
    run(optimizer, params, grads)

    separate = make_params(SHAPES * 2)
    for group, hyper in ((slice(0, 4), hyper_a), (slice(4, 8), hyper_b)):
        opt = Kron(
            separate[group],
            preconditioner_update_probability=1.0,
            precond_dtype=torch.float64,
            **hyper,
        )
        run(opt, separate[group], [g[group] for g in grads])
    for p, q in zip(params, separate, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-14, atol=1e-14)

    # Not vacuous: group b's hyperparameters changed its result.
    swapped = make_params(SHAPES * 2)[4:]
    opt = Kron(
        swapped,
        preconditioner_update_probability=1.0,
        precond_dtype=torch.float64,
        **hyper_a,
    )
    run(opt, swapped, [g[4:] for g in grads])
    assert not torch.allclose(swapped[0], params[4], atol=1e-3)


def test_lr_scheduler_scales_each_step(noise_by_shape):
    """Without weight decay and with fixed gradients the state does not depend on
    the learning rate, so θ_T = θ_0 − Σ_t lr_t·U_t with U_t the steps of lr = 1."""
    steps = 6
    grads = gradients(SHAPES, steps)
    unit = make_params(SHAPES)
    unit_opt = Kron(unit, lr=1.0, preconditioner_update_probability=1.0)
    deltas = []
    for step_grads in grads:
        before = [p.detach().clone() for p in unit]
        run(unit_opt, unit, [step_grads])
        deltas.append([b - p.detach() for b, p in zip(before, unit, strict=True)])

    params = make_params(SHAPES)
    optimizer = Kron(params, lr=0.1, preconditioner_update_probability=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)
    lrs = []
    for step_grads in grads:
        lrs.append(optimizer.param_groups[0]["lr"])
        run(optimizer, params, [step_grads])
        scheduler.step()
    np.testing.assert_allclose(lrs, [0.1, 0.1, 0.01, 0.01, 0.001, 0.001])
    for i, (p, p0) in enumerate(zip(params, make_params(SHAPES), strict=True)):
        expected = p0.detach() - sum(lr * d[i] for lr, d in zip(lrs, deltas))
        torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-12)


def test_step_with_closure_returns_loss_and_equals_backward_then_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
    twin = copy.deepcopy(model)
    x = torch.randn(16, 4)
    opt_a = Kron(model.parameters(), lr=0.05)
    opt_b = Kron(twin.parameters(), lr=0.05)
    for _ in range(3):

        def closure():
            opt_a.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            return loss

        expected = twin(x).square().mean()
        opt_b.zero_grad()
        expected.backward()
        opt_b.step()
        loss = opt_a.step(closure)
        assert isinstance(loss, torch.Tensor)
        assert loss.item() == expected.item()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_zero_grad_then_step_changes_nothing():
    """After some steps, a step with every gradient None moves no parameter
    (not even by weight decay) and leaves the state as it was. zero_grad's
    set_to_none=False and steps on zero gradients are the conventions table's
    (test_zero_grad and test_zero_gradients_leave_the_parameters_in_place_and_
    repr_lists_the_groups in test_optimizer_conventions.py)."""
    params = make_params(SHAPES)
    optimizer = Kron(params, lr=0.1, weight_decay=0.1)
    run(optimizer, params, gradients(SHAPES, 2))
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(optimizer.state_dict())
    optimizer.zero_grad()
    assert all(p.grad is None for p in params)
    optimizer.step()
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p, b)
    _assert_state_equal(optimizer.state_dict(), state)


def test_none_gradients_are_skipped_with_state_untouched(noise_by_shape):
    """A parameter whose gradient is None is neither updated nor decayed and its
    state is untouched; the others step as if it did not exist."""
    params = make_params(SHAPES)
    optimizer = Kron(params, lr=0.1, weight_decay=0.1)
    grads = gradients(SHAPES, 4)
    grads[0][1] = None  # (6,) has no gradient at step 1: no state yet
    grads[2][0] = None  # (5, 4) has none at step 3: state kept as it was
    run(optimizer, params, grads[:1])
    assert set(optimizer.state) == {params[0], params[2], params[3]}
    assert torch.equal(params[1], make_params(SHAPES)[1])  # not even decayed
    run(optimizer, params, grads[1:2])
    kept = copy.deepcopy(optimizer.state[params[0]])
    frozen = params[0].detach().clone()
    run(optimizer, params, grads[2:3])
    assert torch.equal(params[0], frozen)
    _assert_entry_equal(optimizer.state[params[0]], kept)
    assert optimizer.state[params[1]][STEP] == 2  # steps 2 and 3
    run(optimizer, params, grads[3:])
    assert optimizer.state[params[0]][STEP] == 3

    # Each parameter equals a run of its own, over its own non-None gradients.
    for i in range(len(SHAPES)):
        alone = make_params(SHAPES)[i : i + 1]
        opt = Kron(alone, lr=0.1, weight_decay=0.1)
        run(opt, alone, [[g[i]] for g in grads if g[i] is not None])
        assert torch.equal(alone[0], params[i]), SHAPES[i]


def test_bucket_stacks_step_as_states_restacked_every_step():
    """Equal-shaped parameters keep their factors and momenta in shared stacks
    (``_kron_state.BucketStacks``) whose views are the states' tensors. Oracle:
    the same run with the stacks dropped before every step, so each step stacks
    the states afresh. Bit for bit, through buckets that split and merge (a
    missing gradient), a state tensor replaced by the user, and in-place edits."""
    shapes = [(4, 3), (4, 3), (4, 3), (5,)]
    grads = gradients(shapes, 8)
    # (4, 3) #1 misses step 3, and #0 step 6: the buckets of the (4, 3)s are
    # {0, 1, 2} for steps 1-2, {0, 2} and {1} for steps 3-5, then {0, 1} and {2}.
    grads[2][1] = None
    grads[5][0] = None

    def edit(optimizer, params, step):  # after a step, within one bucketing
        if step == 3:  # replaced: the next step must read the new tensor
            state = optimizer.state[params[2]]
            state[MOMENTUM] = torch.full_like(state[MOMENTUM], 0.5)
        if step == 6:  # edited in place: the stack must see it
            optimizer.state[params[0]][FACTORS][0].mul_(1.5)

    runs = []
    for restack in (False, True):
        params = make_params(shapes)
        optimizer = Kron(params, lr=0.1, weight_decay=0.1, seed=3)
        for step, step_grads in enumerate(grads):
            if restack:
                optimizer._stacks.clear()
            run(optimizer, params, [step_grads])
            edit(optimizer, params, step)
        runs.append((params, optimizer))
    (params, optimizer), (params_oracle, oracle) = runs
    first = optimizer.state[params[0]][FACTORS][0]
    assert first._base is not None  # a view of a stack, not a tensor of its own
    for p, q in zip(params, params_oracle, strict=True):
        assert torch.equal(p, q)
        _assert_entry_equal(optimizer.state[p], oracle.state[q])


def test_norm_and_value_clamps_entries_without_global_rescaling():
    """'norm_and_value' (kron-torch 0.1.0's default) moves θ by −lr·clamp(U + λθ,
    −1, 1) and nothing else, even when ‖U + λθ‖ is 3× the √(number of
    parameters) that kron-torch's ``clip_grad_norm_`` call names: that call
    scales ``.grad``, which updates lack (checked below), so kron-torch never
    rescales, and neither does precond. Oracle: the formula on the first step,
    which has no fit (P = I) and, with β₁ = 0, U = g exactly."""
    shapes = [(6, 5), (7,)]
    params = make_params(shapes, dtype=torch.float32)
    start = [p.detach().clone() for p in params]
    grads = [3 * g for g in gradients(shapes, 1, dtype=torch.float32)[0]]
    lr, decay = 0.1, 0.5
    optimizer = _Kron(
        params, lr=lr, b1=0.0, weight_decay=decay, preconditioner_update_probability=0.5
    )
    run(optimizer, params, [grads])
    steps = [g + decay * p for g, p in zip(grads, start, strict=True)]
    count = sum(p.numel() for p in params)
    assert torch.linalg.vector_norm(torch.cat([u.flatten() for u in steps])) > (
        2 * count**0.5
    )
    for p, p0, u in zip(params, start, steps, strict=True):
        torch.testing.assert_close(p, p0 - lr * u.clamp(-1, 1), rtol=0, atol=1e-7)
    # The premise: clip_grad_norm_ leaves tensors without a .grad as they are.
    update = steps[0].clone()
    torch.nn.utils.clip_grad_norm_([update], 1.0)
    assert torch.equal(update, steps[0])


def test_sparse_gradient_is_refused():
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    optimizer = Kron(embedding.parameters())
    embedding(torch.tensor([1, 2])).sum().backward()
    assert embedding.weight.grad.is_sparse
    with pytest.raises(RuntimeError, match="sparse gradients"):
        optimizer.step()
    # Nothing was changed before the refusal.
    assert not optimizer.state


def test_integer_parameters_are_refused():
    """Integer tensors cannot carry gradients: refused at construction rather
    than ignored. (Complex parameters are supported: test_kron_parity.)"""
    real = torch.nn.Parameter(torch.randn(3))
    for p in (
        torch.arange(3),
        torch.zeros(2, 2, dtype=torch.int32),
        torch.zeros(3, dtype=torch.bool),
    ):
        message = rf"Invalid parameter of dtype {p.dtype}: Kron supports floating"
        with pytest.raises(TypeError, match=message):
            Kron([real, p])
        optimizer = Kron([real])
        with pytest.raises(TypeError, match=message):
            optimizer.add_param_group({"params": [p]})
        assert len(optimizer.param_groups) == 1


# --- checkpoints ----------------------------------------------------------------


def _assert_entry_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, list):
            assert len(x) == len(y)
            for u, v in zip(x, y, strict=True):
                assert u.dtype == v.dtype, key
                assert torch.equal(u, v), key
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype, key
            assert torch.equal(x, y), key
        else:
            assert x == y, key


def _assert_state_equal(a, b):
    assert a["state"].keys() == b["state"].keys()
    for index in a["state"]:
        _assert_entry_equal(a["state"][index], b["state"][index])


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    ).to(dtype)


def _train(model, optimizer, steps, start):
    for step in range(start, start + steps):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(32, 6, generator=generator).to(next(model.parameters()).dtype)
        optimizer.zero_grad()
        model(x).float().square().mean().backward()
        optimizer.step()


# A schedule that drops below 1 within the first steps, so that the restored
# update counters decide which of the next steps fit the factors. Built from
# floats (not a closure), so that the state dict pickles.
CHECKPOINT_PROBABILITY = 0.4


@pytest.mark.parametrize(
    ("dtype", "kwargs"),
    [
        (torch.float32, {}),
        (torch.bfloat16, {}),
        (torch.bfloat16, {"mu_dtype": torch.float32}),
        (torch.float64, {"precond_dtype": torch.float64}),
        (torch.bfloat16, {"preconditioner_update_style": "QUAD"}),
        (torch.float32, {"preconditioner_update_style": "PRO"}),
    ],
    ids=["float32", "bfloat16", "bfloat16-mu_float32", "float64", "QUAD", "PRO"],
)
def test_state_dict_round_trip_continues_bit_identically(dtype, kwargs):
    """Train 5 steps, save (torch.save, weights_only load), restore into a fresh
    model and optimizer, then 5 more steps of both: bit-identical parameters, and
    the restored state keeps its dtypes (float32 factors of bfloat16 weights)."""
    hyper = dict(
        lr=0.01,
        weight_decay=0.01,
        preconditioner_update_probability=CHECKPOINT_PROBABILITY,
        **kwargs,
    )
    model = _model(dtype)
    optimizer = Kron(model.parameters(), **hyper)
    _train(model, optimizer, 5, start=0)

    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    restored = _model(dtype)
    restored.load_state_dict(checkpoint["model"])
    restored_opt = Kron(restored.parameters(), **hyper)
    restored_opt.load_state_dict(checkpoint["opt"])

    saved = optimizer.state_dict()
    _assert_state_equal(restored_opt.state_dict(), saved)
    for p in restored.parameters():
        state = restored_opt.state[p]
        factor_dtype = kwargs.get("precond_dtype", torch.float32)
        assert all(Q.dtype == factor_dtype for Q in state[FACTORS])
        assert state[MOMENTUM].dtype == kwargs.get("mu_dtype", dtype)
        if "preconditioner_update_style" in kwargs:
            assert all(L.dtype == torch.float32 for L in state["lipschitz"])

    _train(model, optimizer, 5, start=5)
    _train(restored, restored_opt, 5, start=5)
    for p, q in zip(model.parameters(), restored.parameters(), strict=True):
        assert torch.equal(p, q)
    _assert_state_equal(restored_opt.state_dict(), optimizer.state_dict())


def test_resume_at_every_step_of_a_cycle_is_bit_identical():
    """Save (torch.save, weights_only load) after each of steps 0..8 of a run
    whose factors are fitted at steps 3, 6 and 9 (update probability 0.4), so
    every position in the fit cycle is saved: before, on and after a fit. Each
    restored model and optimizer, continued to step 9, equals the uninterrupted
    run bit for bit, parameters and optimizer state."""
    hyper = dict(
        lr=0.01,
        weight_decay=0.01,
        seed=3,
        preconditioner_update_probability=CHECKPOINT_PROBABILITY,
        preconditioner_cache="packed",
    )
    total = 9
    model = _model(torch.float32)
    optimizer = Kron(model.parameters(), **hyper)
    checkpoints = []
    for step in range(total):
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": optimizer.state_dict()}, buffer)
        checkpoints.append(buffer.getvalue())
        _train(model, optimizer, 1, start=step)
    fits = _update_steps([CHECKPOINT_PROBABILITY] * total)
    assert fits == [3, 6, 9]
    for step, saved in enumerate(checkpoints):
        checkpoint = torch.load(io.BytesIO(saved), weights_only=True)
        restored = _model(torch.float32)
        restored.load_state_dict(checkpoint["model"])
        restored_opt = Kron(restored.parameters(), **hyper)
        restored_opt.load_state_dict(checkpoint["opt"])
        _train(restored, restored_opt, total - step, start=step)
        for p, q in zip(model.parameters(), restored.parameters(), strict=True):
            assert torch.equal(p, q), step
        _assert_state_equal(restored_opt.state_dict(), optimizer.state_dict())


def _edited(state_dict, edit):
    state_dict = copy.deepcopy(state_dict)
    edit(state_dict)
    return state_dict


def _set_group(key, value):
    def edit(state_dict):
        state_dict["param_groups"][0][key] = value

    return edit


def _drop(key):
    def edit(state_dict):
        del state_dict["state"][0][key]

    return edit


# (name, how the target differs or the saved state is edited, message).
MISMATCHED_LOADS = [
    (
        "other shapes",
        dict(hidden=8),
        None,
        r"parameter 0 \(group 0\) 'momentum' has shape \(16, 6\), expected \(8, 6\)",
    ),
    ("fewer parameters", dict(layers=1), None, r"group 0 has 4 parameters, expected 2"),
    ("more groups", dict(groups=2), None, r"1 param groups, expected 2"),
    (
        "complex for real",
        dict(dtype=torch.complex64),
        None,
        r"'momentum' has dtype torch.float32, expected a complex dtype",
    ),
    (
        "factor structure",
        {},
        _set_group("memory_save_mode", "all_diag"),
        r"parameter 0 \(group 0\) 'Q'\[0\] has shape \(16, 16\), expected \(16,\)",
    ),
    (
        "factor layout",
        {},
        _set_group("preconditioner_cache", "packed"),
        r"'Q'\[0\] has shape \(16, 16\), expected \(17, 16\)",
    ),
    (
        "missing Lipschitz estimates",
        {},
        _set_group("preconditioner_update_style", "QUAD"),
        r"parameter 0 \(group 0\) state lacks 'lipschitz'",
    ),
    ("missing momentum", {}, _drop(MOMENTUM), r"state lacks 'momentum'"),
    (
        "bad step count",
        {},
        lambda sd: sd["state"][0].update(step=-1),
        r"'step' is -1, expected an int >= 0",
    ),
    (
        "unknown parameter",
        {},
        lambda sd: sd["state"].update({99: sd["state"][0]}),
        r"state for parameter 99, which no group lists",
    ),
    (
        "too few factors",
        {},
        lambda sd: sd["state"][1][FACTORS].pop(),
        r"parameter 1 \(group 0\) 'Q' has 0 factors, expected 1",
    ),
]


def _mlp(hidden=16, layers=2, dtype=torch.float32):
    torch.manual_seed(0)
    modules = [torch.nn.Linear(6, hidden)]
    if layers == 2:
        modules += [torch.nn.Tanh(), torch.nn.Linear(hidden, 3)]
    return torch.nn.Sequential(*modules).to(dtype)


@pytest.mark.filterwarnings("ignore:Complex modules are a new feature")
@pytest.mark.parametrize(
    ("target", "edit", "message"),
    [case[1:] for case in MISMATCHED_LOADS],
    ids=[case[0] for case in MISMATCHED_LOADS],
)
def test_mismatched_state_dict_is_refused_at_load(target, edit, message):
    """Another model's (or an edited) state dict is refused by load_state_dict
    with a ValueError naming the first mismatching entry, and the target keeps
    its own state and hyperparameters; the unedited state loads (the oracle)."""
    source = _mlp()
    source_opt = Kron(source.parameters(), lr=0.01)
    _train(source, source_opt, 1, start=0)
    saved = source_opt.state_dict()
    if edit is not None:
        saved = _edited(saved, edit)
    groups = target.pop("groups", 1)
    model = _mlp(**target)
    params = list(model.parameters())
    if groups == 2:
        params = [{"params": params[:2]}, {"params": params[2:]}]
    optimizer = Kron(params, lr=0.5)
    if model[0].weight.is_complex():
        model[0].weight.grad = torch.ones_like(model[0].weight)
        optimizer.step()
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(ValueError, match="Invalid state_dict: .*" + message):
        optimizer.load_state_dict(saved)
    _assert_state_equal(optimizer.state_dict(), before)
    assert optimizer.param_groups[0]["lr"] == 0.5
    # The oracle: the same state, unedited, into the source's own layout loads.
    fresh = Kron(_mlp().parameters(), lr=0.5)
    fresh.load_state_dict(source_opt.state_dict())
    assert fresh.param_groups[0]["lr"] == 0.01


def test_every_argument_is_validated_and_has_a_bad_case():
    """The validation table names every constructor argument but the
    optimizer-wide ones, and BAD_ARGUMENTS exercises every argument."""
    names = set(inspect.signature(_Kron).parameters) - {"params"}
    table = {name for name, _ in kron_module.GROUP_ARGUMENTS}
    assert names == table | {"seed", "strategy", "compile_kernels"}
    covered = {name for kwargs, *_ in BAD_ARGUMENTS for name in kwargs}
    assert names == covered


# --- bad input ------------------------------------------------------------------

BAD_ARGUMENTS = [
    (dict(lr=-1), ValueError, r"Invalid lr=-1: must be >= 0"),
    (
        dict(lr=torch.tensor([1e-3, 1e-3])),
        ValueError,
        r"Invalid lr=tensor\(\[0.0010, 0.0010\]\): Tensor lr must be 1-element",
    ),
    (dict(lr=torch.tensor(-1.0)), ValueError, r"Invalid lr=-1.0: must be >= 0"),
    (dict(merge_dims=1), TypeError, r"Invalid merge_dims=1: must be True or False"),
    (
        dict(update_clipping="global"),
        ValueError,
        r"Invalid update_clipping='global': must be one of 'norm_and_value', 'rms'",
    ),
    (
        dict(store_debiased_momentum="yes"),
        TypeError,
        r"Invalid store_debiased_momentum='yes': must be True or False",
    ),
    (dict(damping=None), TypeError, r"Invalid damping=None: must be True or False"),
    (dict(lr=float("nan")), ValueError, r"Invalid lr=nan: must be finite"),
    (dict(b1=1.0), ValueError, r"Invalid b1=1.0: must be in \[0.0, 1.0\)"),
    (dict(b1=-0.1), ValueError, r"Invalid b1=-0.1: must be in \[0.0, 1.0\)"),
    (dict(weight_decay=-0.01), ValueError, r"Invalid weight_decay=-0.01: must be >="),
    (dict(precond_lr=-1), ValueError, r"Invalid precond_lr=-1: must be >= 0"),
    (
        dict(preconditioner_update_style="quad"),
        ValueError,
        r"Invalid preconditioner_update_style='quad': must be one of 'EQ', 'QUAD'",
    ),
    (
        dict(preconditioner_update_probability=0),
        ValueError,
        r"Invalid preconditioner_update_probability=0: must be in \(0.0, 1.0\]",
    ),
    (
        dict(preconditioner_update_probability=1.5),
        ValueError,
        r"Invalid preconditioner_update_probability=1.5: must be in \(0.0, 1.0\]",
    ),
    (
        dict(memory_save_mode="bad"),
        ValueError,
        r"Invalid memory_save_mode='bad': must be one of None, 'one_diag', 'all_diag'",
    ),
    (
        dict(max_size_triangular=-1),
        ValueError,
        r"Invalid max_size_triangular=-1: must be >= 0",
    ),
    (
        dict(max_size_triangular=2.5),
        TypeError,
        r"Invalid max_size_triangular=2.5: must be a Python int",
    ),
    (
        dict(min_ndim_triangular=-1),
        ValueError,
        r"Invalid min_ndim_triangular=-1: must be >= 0",
    ),
    (
        dict(mu_dtype=torch.int32),
        TypeError,
        r"Invalid mu_dtype=torch.int32: must be None or a floating torch.dtype",
    ),
    (
        dict(precond_dtype="float32"),
        TypeError,
        r"Invalid precond_dtype='float32': must be None or a floating torch.dtype",
    ),
    (
        dict(precond_init_scale=0.0),
        ValueError,
        r"Invalid precond_init_scale=0.0: must be > 0",
    ),
    (
        dict(max_skew_triangular=-1.0),
        ValueError,
        r"Invalid max_skew_triangular=-1.0: must be >= 0",
    ),
    (
        dict(target_merged_dim_size=0),
        ValueError,
        r"Invalid target_merged_dim_size=0: must be >= 1",
    ),
    (
        dict(merge_small_dims=1),
        TypeError,
        r"Invalid merge_small_dims=1: must be True or False",
    ),
    (
        dict(merge_small_dims="no"),
        TypeError,
        r"Invalid merge_small_dims='no': must be True or False",
    ),
    (
        dict(momentum_into_precond_update="no"),
        TypeError,
        r"Invalid momentum_into_precond_update='no': must be True or False",
    ),
    (
        dict(momentum_into_precond_update=None),
        TypeError,
        r"Invalid momentum_into_precond_update=None: must be True or False",
    ),
    (
        dict(compile_kernels="yes"),
        TypeError,
        r"Invalid compile_kernels='yes': must be True or False",
    ),
    (dict(lr="0.1"), TypeError, r"Invalid lr='0.1': must be a number"),
    (dict(lr=True), TypeError, r"Invalid lr=True: must be a number"),
    (dict(b1=float("inf")), ValueError, r"Invalid b1=inf: must be in \[0.0, 1.0\)"),
    (dict(weight_decay=None), TypeError, r"Invalid weight_decay=None: must be a"),
    (
        dict(preconditioner_update_probability="1"),
        TypeError,
        r"Invalid preconditioner_update_probability='1': must be a number",
    ),
    (
        dict(max_size_triangular=True),
        TypeError,
        r"Invalid max_size_triangular=True: must be a Python int",
    ),
    (
        dict(min_ndim_triangular=2.0),
        TypeError,
        r"Invalid min_ndim_triangular=2.0: must be a Python int",
    ),
    (
        dict(precond_lr=float("nan")),
        ValueError,
        r"Invalid precond_lr=nan: must be finite and >= 0",
    ),
    (
        dict(precond_init_scale=float("inf")),
        ValueError,
        r"Invalid precond_init_scale=inf: must be finite and > 0",
    ),
    (
        dict(max_skew_triangular=float("nan")),
        ValueError,
        r"Invalid max_skew_triangular=nan: must be finite and >= 0",
    ),
    (
        dict(target_merged_dim_size=8.0),
        TypeError,
        r"Invalid target_merged_dim_size=8.0: must be a Python int",
    ),
    (
        dict(preconditioner_cache="none"),
        ValueError,
        r"Invalid preconditioner_cache='none': must be one of 'packed', 'dense', None",
    ),
    (
        dict(memory_save_mode=0),
        ValueError,
        r"Invalid memory_save_mode=0: must be one of None",
    ),
    (
        dict(mu_dtype=torch.complex64),
        TypeError,
        r"Invalid mu_dtype=torch.complex64: must be None or a floating torch.dtype",
    ),
    (
        dict(seed=True),
        TypeError,
        r"Invalid seed=True: must be None \(torch's global generator\) or a Python int",
    ),
    (
        dict(seed=1.5),
        TypeError,
        r"Invalid seed=1.5: must be None \(torch's global generator\) or a Python int",
    ),
    (
        dict(strategy="ddp"),
        TypeError,
        r"Invalid strategy='ddp': must be None or a precond.torch.Strategy",
    ),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    BAD_ARGUMENTS,
    ids=[
        next(iter(kwargs)) + "=" + repr(v)
        for kwargs, *_ in BAD_ARGUMENTS
        for v in kwargs.values()
    ],
)
def test_bad_hyperparameters_name_argument_value_and_range(kwargs, error, message):
    params = make_params([(3,)])
    with pytest.raises(error, match=message):
        Kron(params, **kwargs)
    optimizer_wide = {"seed", "strategy", "compile_kernels"}
    if not kwargs.keys() & optimizer_wide:  # the rest are per group
        optimizer = Kron(params)
        with pytest.raises(error, match=message):
            optimizer.add_param_group({"params": make_params([(2,)]), **kwargs})


# --- non-finite gradients -----------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_gradient_skips_the_step_except_weight_decay(bad):
    """As precond.jax.kron: a step with any NaN/±Inf gradient entry changes no
    state (momentum, factors, counters) and moves the parameters only by the
    decoupled weight decay θ ← θ(1 − lr·λ); the next finite step proceeds as if
    the bad step had been that decay alone."""
    lr, decay = 0.05, 0.1
    hyper = dict(lr=lr, weight_decay=decay, preconditioner_update_probability=0.5)
    grads = gradients(SHAPES, 6)
    poisoned = [g.clone() for g in grads[3]]
    poisoned[2].view(-1)[5] = bad  # one entry of one parameter

    params = make_params(SHAPES)
    optimizer = Kron(params, **hyper)
    run(optimizer, params, grads[:3])
    state = copy.deepcopy(optimizer.state_dict())
    before = [p.detach().clone() for p in params]
    run(optimizer, params, [poisoned])
    _assert_state_equal(optimizer.state_dict(), state)
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p, b * (1 - lr * decay))
    run(optimizer, params, grads[4:])
    assert all(torch.isfinite(p).all() for p in params)
    for entry in optimizer.state.values():
        assert all(torch.isfinite(Q).all() for Q in entry[FACTORS])

    oracle = make_params(SHAPES)
    oracle_opt = Kron(oracle, **hyper)
    run(oracle_opt, oracle, grads[:3])
    with torch.no_grad():
        for p in oracle:
            p.mul_(1 - lr * decay)
    run(oracle_opt, oracle, grads[4:])
    for p, q in zip(params, oracle, strict=True):
        assert torch.equal(p, q)
    _assert_state_equal(optimizer.state_dict(), oracle_opt.state_dict())


def test_huge_finite_gradient_is_not_mistaken_for_a_non_finite_one():
    """A float64 gradient of 1e100 is finite although its float32 sum (the fast
    finiteness check) overflows: the step is taken, not skipped. (Its squares,
    1e200, still fit in float64, so the float64 fit and the RMS clip give a
    finite step.)"""
    p = make_params([(4, 3)])[0]
    optimizer = Kron([p], lr=0.1, precond_dtype=torch.float64)
    before = p.detach().clone()
    p.grad = torch.full_like(p, 1e100)
    assert not torch.isfinite(p.grad.sum(dtype=torch.float32))
    optimizer.step()
    assert optimizer.state[p][STEP] == 1
    assert not torch.equal(p, before)
    assert torch.isfinite(p).all()
    # The update is clipped to RMS 1.1: a step of RMS lr·1.1.
    rms = (before - p.detach()).square().mean().sqrt().item()
    assert rms == pytest.approx(0.11, rel=1e-12)


# (parameter dtype, the bad entry, whether the step is skipped). Skipped exactly
# when Σ|g|² overflows the working precision: float32 (bfloat16 and complex64
# included) from |g| ≈ 1.845e19, float64 far beyond.
HUGE_GRADIENTS = [
    (torch.float32, 1e20, True),  # the reproduction
    (torch.float32, 1.9e19, True),
    (torch.float32, 3.4e38, True),  # ~float32 max
    (torch.float32, -1e30, True),
    (torch.bfloat16, 1e20, True),
    (torch.complex64, 1e20j, True),
    (torch.float32, 1e19, False),  # squares to 1e38: usable
    (torch.float64, 1e20, False),
]


@pytest.mark.parametrize("shape", [(), (1,), (4, 3), (3000,)], ids=str)
@pytest.mark.parametrize(("dtype", "bad", "skipped"), HUGE_GRADIENTS, ids=str)
def test_usable_exactly_when_the_squared_norm_is_finite(shape, dtype, bad, skipped):
    """The guard alone, on gradients of one entry (whose norm is |g|, finite
    where its square is not) and of many, beside a gradient of another dtype:
    unusable exactly where Σ|g|², summed in float64 from the working-precision
    values, passes the working precision's largest value (HUGE_GRADIENTS'
    values lie far from that boundary)."""
    gradient = torch.ones(shape, dtype=dtype)
    gradient.view(-1)[0] = bad
    working = gradient.to(working_dtype(dtype))
    parts = torch.view_as_real(working) if working.is_complex() else working
    squared_norm = parts.to(torch.float64).square().sum().item()
    assert (squared_norm > torch.finfo(parts.dtype).max) == skipped
    other = torch.ones(2, dtype=torch.float64)
    assert gradients_are_usable([other, gradient]) == (not skipped)
    assert gradients_are_usable([other, gradient.clone().fill_(1)])


@pytest.mark.parametrize(("dtype", "bad", "skipped"), HUGE_GRADIENTS, ids=str)
def test_gradient_whose_square_overflows_is_skipped(dtype, bad, skipped):
    """The issue's case: one entry of 1e20 in a (4, 3) gradient used to turn the
    factors NaN for good. Now a step whose Σ|g|² overflows its working precision
    leaves the state bit-identical and the run equals one without that step;
    a usable huge step is taken and the state stays finite."""
    hyper = dict(lr=1e-3, preconditioner_update_probability=1.0)
    normal = [
        [torch.randn((4, 3), generator=torch.Generator().manual_seed(n)).to(dtype)]
        for n in range(4)
    ]
    huge = torch.ones((4, 3), dtype=dtype)
    huge[0, 0] = bad
    w = torch.nn.Parameter(torch.zeros((4, 3), dtype=dtype))
    optimizer = Kron([w], **hyper)
    run(optimizer, [w], normal[:2])
    state = copy.deepcopy(optimizer.state_dict())
    before = w.detach().clone()
    run(optimizer, [w], [[huge]])
    if skipped:
        _assert_state_equal(optimizer.state_dict(), state)
        assert torch.equal(w, before)
    else:
        assert optimizer.state[w][STEP] == 3
    run(optimizer, [w], normal[2:])
    entry = optimizer.state[w]
    for tensor in [w.detach(), entry[MOMENTUM], *entry[FACTORS]]:
        assert torch.isfinite(
            torch.view_as_real(tensor) if tensor.is_complex() else tensor
        ).all()
    if skipped:
        oracle = torch.nn.Parameter(torch.zeros((4, 3), dtype=dtype))
        oracle_opt = Kron([oracle], **hyper)
        run(oracle_opt, [oracle], normal)
        assert torch.equal(w, oracle)
        _assert_state_equal(optimizer.state_dict(), oracle_opt.state_dict())


@pytest.mark.parametrize("style", ["EQ", "QUAD", "PRO"])
def test_fit_that_overflows_keeps_the_old_factors(style):
    """A usable gradient (1e17: Σ|g|² ≈ 1e34 is finite) met by large factors
    (Q_i = 1e3·I) overflows the fit's grams (|A|² ≈ 1e46): that parameter keeps
    its old factors while its momentum and step count advance; a same-shaped
    parameter in the same stack fits as it would alone (the decision is per
    stack entry). The generation-2 styles keep their Lipschitz estimates too."""
    hyper = dict(
        lr=1e-3,
        precond_init_scale=1e6,
        preconditioner_update_probability=1,
        preconditioner_update_style=style,
    )
    fine, large = make_params([(4, 3), (4, 3)], dtype=torch.float32)
    alone = make_params([(4, 3)], dtype=torch.float32)
    optimizer = Kron([fine, large], **hyper)
    alone_opt = Kron(alone, **hyper)
    g = torch.randn((4, 3), generator=torch.Generator().manual_seed(3))
    huge = g.clone()
    huge[1, 2] = 1e17
    run(optimizer, [fine, large], [[g, g]])
    run(alone_opt, alone, [[g]])
    kept = [Q.clone() for Q in optimizer.state[large][FACTORS]]
    kept_lipschitz = [L.clone() for L in optimizer.state[large].get("lipschitz", [])]
    run(optimizer, [fine, large], [[g, huge]])
    run(alone_opt, alone, [[g]])
    entry = optimizer.state[large]
    assert entry[STEP] == 2
    assert all(torch.equal(Q, K) for Q, K in zip(entry[FACTORS], kept, strict=True))
    for L, K in zip(entry.get("lipschitz", []), kept_lipschitz, strict=True):
        assert torch.equal(L, K)
    assert torch.isfinite(entry[MOMENTUM]).all()
    assert torch.isfinite(large).all()
    assert entry[MOMENTUM].abs().max() > 1e15  # the step was taken
    for Q, R in zip(
        optimizer.state[fine][FACTORS], alone_opt.state[alone[0]][FACTORS], strict=True
    ):
        torch.testing.assert_close(Q, R, rtol=1e-6, atol=0)
        assert not torch.equal(Q, kept[0] if Q.shape == kept[0].shape else kept[1])
    torch.testing.assert_close(fine, alone[0], rtol=1e-6, atol=1e-9)


# Values placed in a stack of finite ones: three that are not finite, and finite
# ones whose sums overflow (float32's max, 3e38) or that are edge cases.
FINITENESS_VALUES = [math.nan, math.inf, -math.inf, 3.4e38, 3e38, -0.0, 1e-45]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.complex64], ids=str
)
@pytest.mark.parametrize("seed", range(8))
def test_finite_entries_is_isfinite_of_each_stack_entry(dtype, seed):
    """finite_entries (the fits' overflow check, Kron's and Pro's) against
    torch.isfinite: per stack entry of a (3, 4, 3) and a (3, 5) stack, with
    values of FINITENESS_VALUES placed at random (in a real or an imaginary
    part), every entry's verdict is that of all its values. The first entry
    of each stack starts with 3e38 twice: finite values whose sum overflows."""
    generator = torch.Generator().manual_seed(seed)
    stacks = [
        torch.randn(shape, dtype=dtype, generator=generator)
        for shape in [(3, 4, 3), (3, 5)]
    ]
    for x in stacks:
        x.reshape(3, -1)[0, :2] = 3e38
    for _ in range(3):
        x = stacks[int(torch.randint(2, (), generator=generator))]
        parts = torch.view_as_real(x) if x.is_complex() else x[..., None]
        flat = parts.reshape(-1)
        where = int(torch.randint(flat.numel(), (), generator=generator))
        flat[where] = FINITENESS_VALUES[
            int(torch.randint(len(FINITENESS_VALUES), (), generator=generator))
        ]
    expected = torch.stack(
        [torch.isfinite(x).reshape(3, -1).all(dim=1) for x in stacks]
    ).all(dim=0)
    assert torch.equal(finite_entries(stacks), expected)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex32,
        torch.complex64,
        torch.complex128,
    ],
    ids=str,
)
def test_working_dtype_is_torchs_promotion_with_float32(dtype):
    """The guard's and the kernels' working precision, computed without a
    dispatch, is what torch.promote_types(dtype, float32) returns."""
    assert working_dtype(dtype) == torch.promote_types(dtype, torch.float32)


# --- the update-probability schedule -------------------------------------------

# flat_start=500: precond.jax's default (torch's is kron-torch 0.1.0's 200).
SCHEDULES = [
    dict(flat_start=500),
    dict(max_prob=0.5, flat_start=500),
    dict(min_prob=0.05, decay=0.002, flat_start=1000),
    dict(max_prob=0.9, min_prob=0.1, decay=0.01, flat_start=0),
]


def _update_steps(probabilities):
    """The steps at which the counter fits the factors (both frameworks' rule)."""
    counter, steps = 0, []
    for n, p in enumerate(probabilities, start=1):
        counter += 1
        if np.float32(counter) >= np.float32(1.0) / np.float32(p):
            counter, steps = 0, [*steps, n]
    return steps


@pytest.mark.parametrize("kwargs", SCHEDULES, ids=str)
def test_schedule_matches_jax_and_fits_at_the_same_steps(kwargs):
    """float32 values within 2 ulp of precond.jax's at steps 1..5000 (with the
    same flat start), equal on the flat start and the floor, and the factor
    updates happen at the same steps.

    Not bit-equal: torch's and XLA's float32 exp round differently on some of
    these arguments. A step fits the factors when counter >= 1/p, which an ulp
    of p changes only if 1/p sits on an integer, so the decisions agree."""
    n = np.arange(1, 5001)
    with jax.enable_x64(False):
        want = np.asarray(jax.jit(jax.vmap(jax_schedule(**kwargs)))(jnp.asarray(n)))
    schedule = precond_update_prob_schedule(**kwargs)
    got = np.array([schedule(int(i)) for i in n], dtype=np.float32)
    assert want.dtype == np.float32
    np.testing.assert_array_max_ulp(got, want, maxulp=2)
    max_prob = np.float32(kwargs.get("max_prob", 1.0))
    min_prob = np.float32(kwargs.get("min_prob", 0.03))
    clipped = (want == max_prob) | (want == min_prob)
    assert clipped.any()
    np.testing.assert_array_equal(got[clipped], want[clipped])
    assert _update_steps(got) == _update_steps(want)


def test_optimizer_fits_the_factors_at_the_scheduled_steps():
    schedule = precond_update_prob_schedule(min_prob=0.1, decay=0.2, flat_start=3)
    p = make_params([(4, 3)])[0]
    optimizer = Kron([p], preconditioner_update_probability=schedule)
    fitted = []
    for n, (g,) in enumerate(gradients([(4, 3)], 40), start=1):
        before = [Q.clone() for Q in optimizer.state[p].get(FACTORS, [])]
        p.grad = g
        optimizer.step()
        after = optimizer.state[p][FACTORS]
        if not before or any(not torch.equal(a, b) for a, b in zip(after, before)):
            fitted.append(n)
    expected = _update_steps([schedule(n) for n in range(1, 41)])
    assert fitted == expected
    assert expected[:3] == [1, 2, 3]
    assert len(expected) < 20


# --- factor structure ---------------------------------------------------------

STRUCTURE_CASES = [
    ((7,), {}),
    ((), {}),
    ((5, 4), {}),
    ((5, 4), dict(max_size_triangular=4)),
    ((5, 4), dict(min_ndim_triangular=3)),
    ((3, 4, 2), dict(min_ndim_triangular=3)),
    ((5, 4), dict(memory_save_mode="one_diag")),
    ((4, 4), dict(memory_save_mode="one_diag")),
    ((3, 6, 2), dict(memory_save_mode="one_diag")),
    ((5, 4, 3), dict(memory_save_mode="all_diag")),
    ((1, 5), {}),
    ((8, 4, 3, 3), dict(merge_small_dims=True)),
    ((3, 3, 8, 4), dict(merge_small_dims=True)),
    ((2, 3, 4, 5, 6), dict(merge_small_dims=True, target_merged_dim_size=8)),
    ((8, 4, 3, 3), dict(merge_small_dims=True, memory_save_mode="one_diag")),
    ((8, 4, 3, 3), dict(merge_small_dims=True, max_size_triangular=20)),
]


@pytest.mark.parametrize(("shape", "kwargs"), STRUCTURE_CASES, ids=str)
def test_factor_structure_follows_the_shared_plan(shape, kwargs):
    """One factor per (merged) axis: a (d, d) matrix, or a (d,) vector where
    the plan precond.jax.kron uses (precond._common.kron_plan.plan_tensor,
    unblocked) makes the axis diagonal, when kron-torch's own rules (skew,
    'smart_one_diag', merge_dims) are off."""
    p = make_params([shape], dtype=torch.float32)[0]
    optimizer = Kron([p], **kwargs)
    p.grad = torch.ones_like(p)
    optimizer.step()
    factors = optimizer.state[p][FACTORS]

    plan = plan_tensor(
        shape,
        scanned=False,
        path="p",
        max_size_triangular=kwargs.get("max_size_triangular", 8192),
        min_ndim_triangular=kwargs.get("min_ndim_triangular", 2),
        memory_save_mode=kwargs.get("memory_save_mode"),
        merge_small_dims=kwargs.get("merge_small_dims", False),
        target_merged_dim_size=kwargs.get("target_merged_dim_size", 2048),
        block_size=None,
    )
    expected = [(d,) if diag else (d, d) for d, diag in zip(plan.shape, plan.diagonal)]
    assert [tuple(Q.shape) for Q in factors] == expected
    assert all(Q.dtype == torch.float32 for Q in factors)
    for Q in factors:
        if Q.ndim == 2:
            assert torch.equal(Q, torch.triu(Q))


def test_structure_examples_from_the_documentation():
    """Hand-written expectations, independent of factor_plan's code."""
    cases = [
        ((7,), {}, [(7,)]),  # 1-D: diagonal
        ((5, 4), {}, [(5, 5), (4, 4)]),
        ((5, 4), dict(max_size_triangular=4), [(5,), (4, 4)]),
        ((5, 4), dict(memory_save_mode="one_diag"), [(5,), (4, 4)]),
        ((5, 4), dict(memory_save_mode="all_diag"), [(5,), (4,)]),
        ((64, 32, 3, 3), dict(merge_small_dims=True), [(64, 64), (288, 288)]),
        ((8, 2), dict(max_skew_triangular=1.0), [(8,), (2, 2)]),  # kron-torch rule
    ]
    for shape, kwargs, expected in cases:
        p = make_params([shape], dtype=torch.float32)[0]
        optimizer = Kron([p], **kwargs)
        p.grad = torch.ones_like(p)
        optimizer.step()
        got = [tuple(Q.shape) for Q in optimizer.state[p][FACTORS]]
        assert got == expected, (shape, kwargs)


@pytest.mark.parametrize(
    ("param_dtype", "precond_dtype", "factor_dtype"),
    [
        # None: the parameter's dtype, as kron-torch 0.1.0.
        (torch.float32, None, torch.float32),
        (torch.bfloat16, None, torch.bfloat16),
        (torch.float64, None, torch.float64),
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float32, torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float64, torch.float64),
    ],
)
def test_factor_and_momentum_dtypes(param_dtype, precond_dtype, factor_dtype):
    p = make_params([(4, 3)], dtype=param_dtype)[0]
    optimizer = _Kron([p], precond_dtype=precond_dtype)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        optimizer.step()
    state = optimizer.state[p]
    assert [Q.dtype for Q in state[FACTORS]] == [factor_dtype] * 2
    assert state[MOMENTUM].dtype == param_dtype
    assert p.dtype == param_dtype
    assert torch.isfinite(p).all()


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0, 2)])
def test_parameters_with_no_entries_are_harmless(noise_by_shape, shape):
    """As precond.jax.kron (zero updates for empty parameters): an empty parameter
    beside a normal one neither fails nor changes the other's step."""
    params = make_params([shape, (4, 3)])
    alone = make_params([shape, (4, 3)])[1:]
    optimizer = Kron(params, lr=0.1)
    alone_opt = Kron(alone, lr=0.1)
    for g in gradients([shape, (4, 3)], 3):
        run(optimizer, params, [g])
        run(alone_opt, alone, [g[1:]])
    assert params[0].numel() == 0
    assert torch.equal(params[1], alone[0])


@pytest.mark.parametrize("style", ["EQ", "QUAD", "PRO", "QEQ"])
@pytest.mark.parametrize("cache", ["packed", "dense"])
def test_cached_layouts_give_the_updates_of_plain_factors(style, cache):
    """Caching P = QᵀQ (packed beside Q, or stacked with it) changes how the
    update is computed, not what it is: float64, 6 steps with fits every other
    step, equal to the uncached optimizer to 1e-12; the packed state holds Q in
    its upper triangle and QᵀQ below and in its last row."""
    shapes = [(5, 4), (6,), (3, 2, 4)]
    runs = {}
    for layout in (cache, None):
        params = make_params(shapes, dtype=torch.float64)
        optimizer = Kron(
            params,
            lr=0.05,
            preconditioner_update_probability=0.5,
            precond_dtype=torch.float64,
            preconditioner_update_style=style,
            preconditioner_cache=layout,
        )
        for grads in gradients(shapes, 6, dtype=torch.float64):
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            optimizer.step()
        runs[layout] = (params, optimizer)
    for got, want in zip(runs[cache][0], runs[None][0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if cache == "packed" and style not in ("PRO", "QEQ"):
        optimizer = runs["packed"][1]
        packed = optimizer.state[runs["packed"][0][0]][FACTORS][0]  # (5 + 1, 5)
        Q = torch.triu(packed[:-1])
        if style == "QUAD":
            Q = Q + torch.triu(Q, 1).T
        P = Q.T @ Q
        torch.testing.assert_close(torch.tril(packed[:-1], -1), torch.tril(P, -1))
        torch.testing.assert_close(packed[-1], torch.diagonal(P))


def test_compiled_kernels_step_as_the_eager_kernels():
    """``compile_kernels=True`` hands the factor fit to Inductor, one graph per
    shape of stack (here a (5, 4) matrix and a (6,) vector stack): 6 steps that
    all fit give the eager optimizer's parameters and factors to float32
    rounding (Inductor fuses and reorders the fit's elementwise work)."""
    from torch._dynamo.utils import counters

    shapes = [(5, 4), (5, 4), (6,)]
    runs = []
    torch._dynamo.reset()
    try:
        for compiled in (True, False):
            graphs = counters["stats"]["unique_graphs"]
            params = make_params(shapes, dtype=torch.float32)
            optimizer = Kron(
                params,
                lr=0.05,
                preconditioner_update_probability=1.0,
                compile_kernels=compiled,
            )
            run(optimizer, params, gradients(shapes, 6, dtype=torch.float32))
            runs.append((params, optimizer))
            if compiled:
                assert counters["stats"]["unique_graphs"] - graphs == 2
    finally:
        torch._dynamo.reset()
    (params, compiled), (twin, eager) = runs
    for p, q in zip(params, twin, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for F, G in zip(
            compiled.state[p][FACTORS], eager.state[q][FACTORS], strict=True
        ):
            torch.testing.assert_close(F, G, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("error::UserWarning")
def test_sharded_preconditioning_shares_complex_updates(tmp_path):
    """ShardedPreconditioning packs every update into one real all-gather
    buffer: complex updates travel as (real, imaginary) pairs and come back
    complex (a complex buffer would double the bytes of the real updates and
    warn when cast back to them). In a one-rank gloo group the sharded run
    equals the replicated run bit for bit, for complex64, float32 and bfloat16
    parameters together, without a warning."""
    import torch.distributed as dist

    from precond.torch import ShardedPreconditioning

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        runs = []
        for strategy in (None, ShardedPreconditioning()):
            generator = torch.Generator().manual_seed(0)
            params = [
                torch.nn.Parameter(
                    torch.randn((4, 3), dtype=dtype, generator=generator)
                )
                for dtype in (torch.complex64, torch.float32, torch.bfloat16)
            ]
            optimizer = Kron(params, lr=0.1, strategy=strategy)
            for step in range(3):
                generator = torch.Generator().manual_seed(10 + step)
                for p in params:
                    g = torch.randn(p.shape, dtype=torch.complex64, generator=generator)
                    p.grad = g if p.is_complex() else g.real.to(p.dtype)
                optimizer.step()
            runs.append(params)
        for p, q in zip(*runs, strict=True):
            assert p.dtype == q.dtype
            assert torch.equal(p, q)
        assert runs[0][0].imag.abs().sum() > 0
    finally:
        dist.destroy_process_group()
