"""PyTorch's optimizer conventions: one table run over every torch optimizer.

What torch's own optimizers promise their users, written here as properties
(in the spirit of torch's optimizer test-suite): copies step like the
original, the learning rate may be a tensor and is driven by
``torch.optim.lr_scheduler``, the momentum too (under the name ``momentum``
the schedulers set), bad input fails with the exception type (and, where
torch's suite matches it, the words) torch's optimizers raise, a state dict
saved, loaded and saved again is the same, and the Optimizer API (zero_grad,
add_param_group, state_dict, closures, hooks) behaves as documented. Skipped
steps (unusable gradients) are counted, checkpointed and logged once. Every row runs on
precond.torch.Kron, Pro and ProAdamW (``OPTIMIZERS``); each stage of a step
is a ``torch.profiler.record_function`` range; ``torch.compile`` of the step
runs it eagerly.

precond.torch.kfac.KFAC (a ``torch.optim.Optimizer`` as KAISA's is) gets the
rows that apply to a gradient preconditioner, which changes ``.grad`` of a
model's layers rather than parameters of its own: schedulers drive its ``lr``
(used by its KL clip), hooks, copies, a bad ``lr``. They skip if it is not an
Optimizer.
"""

from __future__ import annotations

import copy
import io
import logging
import pickle
import warnings

import pytest
import torch

from precond.torch import SOAP as _SOAP
from precond.torch import Kron, Pro, ProAdamW
from precond.torch import Shampoo as _Shampoo

LR = 0.05

# Every torch.optim.Optimizer precond ships, with what its copies must keep
# besides torch's state, and the profiler ranges one step opens.
OPTIMIZERS = {
    "Kron": (Kron, {"seed", "strategy", "compile_kernels"}, "precond/kron"),
    "Pro": (Pro, {"seed"}, "precond/pro"),
    # Pro on the (4, 3) matrix, AdamW on the vector and the scalar.
    "ProAdamW": (ProAdamW, {"seed"}, "precond/pro"),
}
STAGES = ("momentum", "update_factors", "precondition", "apply_updates")
# Shampoo: precond.jax.distributed_shampoo's names (its momentum is beta1, it
# draws nothing, so takes no seed) and the JAX side's stages.
OPTIMIZERS["Shampoo"] = (_Shampoo, {"strategy"}, "precond/shampoo")
MOMENTUM_NAMES = {"Shampoo": "beta1"}
STAGES_OF = {
    "Shampoo": (
        "statistics",
        "inverse_roots",
        "precondition",
        "momentum",
        "apply_updates",
    )
}
# Bad constructions an optimizer accepts, and why.
ACCEPTED = {"Shampoo": {"b1_of_one": "beta1 = 1 is allowed, as in precond.jax"}}
# SOAP: the paper's names; it draws nothing; its momentum is betas[0], which
# torch's schedulers set as they do Adam's (no ``momentum`` key; tested in
# tests/torch/soap); its first call only takes statistics and bases, so a
# parameter moves from the second call on.
OPTIMIZERS["SOAP"] = (_SOAP, {"strategy"}, "precond/soap")
STAGES_OF["SOAP"] = ("update_factors", "momentum", "precondition", "apply_updates")
ACCEPTED["SOAP"] = {"unknown_keyword": "betas is SOAP's own argument, as Adam's"}
WITHOUT_MOMENTUM_ALIAS = {"SOAP"}


def _warm_up(optimizer, params) -> None:
    """SOAP's first call, which moves no parameter (without weight decay)."""
    if type(optimizer).__name__ == "SOAP":
        _step(optimizer, params, _grads(1, seed=9)[0])


def _skip_without_momentum_alias(optimizer_class) -> None:
    if optimizer_class.__name__ in WITHOUT_MOMENTUM_ALIAS:
        pytest.skip("its momentum is betas[0], set by torch's schedulers as Adam's")


def _b1(optimizer_class) -> str:
    """The momentum's argument and group key: ``b1``, or Shampoo's ``beta1``."""
    return MOMENTUM_NAMES.get(optimizer_class.__name__, "b1")


@pytest.fixture(params=list(OPTIMIZERS))
def optimizer_class(request):
    return OPTIMIZERS[request.param][0]


def _make(optimizer_class, params, **kwargs):
    """The optimizer with no weight decay unless asked (Pro's default is 0.1);
    ``b1`` under the optimizer's name for it, ``seed`` only where it draws."""
    if "b1" in kwargs and optimizer_class.__name__ == "SOAP":
        kwargs["betas"] = (kwargs.pop("b1"), 0.95)
    if "b1" in kwargs:
        kwargs[_b1(optimizer_class)] = kwargs.pop("b1")
    if "seed" not in OPTIMIZERS[optimizer_class.__name__][1]:
        kwargs.pop("seed", None)
    return optimizer_class(params, **{"weight_decay": 0.0, **kwargs})


def _params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(s, generator=generator))
        for s in [(4, 3), (3,), ()]
    ]


def _grads(steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(s, generator=generator) for s in [(4, 3), (3,), ()]]
        for _ in range(steps)
    ]


def _step(optimizer, params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    optimizer.step()


def _values(params):
    return [p.detach().clone() for p in params]


def _assert_equal(a, b):
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


# --- copies ----------------------------------------------------------------------


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_every_public_attribute_and_step_identically(optimizer_class, how):
    params = _params()
    optimizer = _make(optimizer_class, params, lr=LR, weight_decay=0.1, seed=3)
    optimizer.note = "set by the user"
    grads = _grads(6)
    for g in grads[:3]:
        _step(optimizer, params, g)
    if how == "deepcopy":
        params_copy, copied = copy.deepcopy((params, optimizer))
    else:
        params_copy, copied = pickle.loads(pickle.dumps((params, optimizer)))
    kept = OPTIMIZERS[optimizer_class.__name__][1] | {"note"}
    public = {k for k in vars(optimizer) if not k.startswith("_")}
    assert kept | {"defaults"} <= public
    assert public == {k for k in vars(copied) if not k.startswith("_")}
    for name in kept:
        ours, theirs = getattr(optimizer, name), getattr(copied, name)
        assert type(theirs) is type(ours), name
        assert name == "strategy" or theirs == ours, name
    # torch's __setstate__ adds 'differentiable' to defaults; ours stay as built.
    assert copied.defaults == optimizer.defaults
    for g in grads[3:]:
        _step(optimizer, params, g)
        _step(copied, params_copy, g)
    _assert_equal(_values(params_copy), _values(params))
    assert not torch.equal(params[0], _params()[0])


# --- the learning rate -------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (1,)])
def test_tensor_lr_steps_as_the_same_float_lr(optimizer_class, shape):
    """As torch.optim.Adam accepts ``lr=torch.tensor(...)`` of one element."""
    runs = []
    for lr in (LR, torch.full(shape, LR)):
        params = _params()
        optimizer = _make(optimizer_class, params, lr=lr, weight_decay=0.1)
        for g in _grads(3):
            _step(optimizer, params, g)
        runs.append(_values(params))
    _assert_equal(*runs)


@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
def test_lambda_lr_scheduler_drives_the_steps(optimizer_class, lr_kind):
    """LambdaLR with factor 0 on odd epochs: those steps leave the parameters
    (no weight decay) where they were, the others move them; the scheduler's
    and the optimizer's lr agree, and both round-trip through state_dict."""
    params = _params()
    lr = LR if lr_kind == "float" else torch.tensor(LR)
    optimizer = _make(optimizer_class, params, lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda epoch: 0.0 if epoch % 2 else 1.0
    )
    for epoch, g in enumerate(_grads(4)):
        before = _values(params)
        _step(optimizer, params, g)
        moved = any(not torch.equal(a, b) for a, b in zip(_values(params), before))
        first_still = epoch == 0 and optimizer_class.__name__ == "SOAP"
        assert moved == (epoch % 2 == 0 and not first_still), epoch
        scheduler.step()
        assert float(optimizer.param_groups[0]["lr"]) == scheduler.get_last_lr()[0]
    restored = _make(optimizer_class, _params(), lr=lr)
    restored_scheduler = torch.optim.lr_scheduler.LambdaLR(
        restored, lambda epoch: 0.0 if epoch % 2 else 1.0
    )
    restored.load_state_dict(optimizer.state_dict())
    restored_scheduler.load_state_dict(scheduler.state_dict())
    assert restored_scheduler.last_epoch == scheduler.last_epoch


@pytest.mark.parametrize(
    "make_scheduler",
    [
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=0.1, total_steps=6, cycle_momentum=False
        ),
        lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5),
    ],
    ids=["StepLR", "CosineAnnealingLR", "OneCycleLR", "LinearLR"],
)
def test_schedulers_set_the_lr_each_step_uses(optimizer_class, make_scheduler):
    """The run with a scheduler equals a run given the same lr by hand."""
    params, manual = _params(), _params()
    optimizer = _make(optimizer_class, params, lr=LR)
    by_hand = _make(optimizer_class, manual, lr=LR)
    scheduler = make_scheduler(optimizer)
    lrs = set()
    for g in _grads(5):
        by_hand.param_groups[0]["lr"] = optimizer.param_groups[0]["lr"]
        lrs.add(optimizer.param_groups[0]["lr"])
        _step(optimizer, params, g)
        _step(by_hand, manual, g)
        scheduler.step()
    assert len(lrs) > 1
    _assert_equal(_values(params), _values(manual))


def test_reduce_lr_on_plateau_lowers_the_lr(optimizer_class):
    params = _params()
    optimizer = _make(optimizer_class, params, lr=LR)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, patience=0, factor=0.5
    )
    for g in _grads(3):
        _step(optimizer, params, g)
        scheduler.step(1.0)  # no improvement
    assert optimizer.param_groups[0]["lr"] < LR


# --- the momentum, under the name torch's schedulers read -----------------------


@pytest.mark.parametrize(
    ("make_scheduler", "momentum_range"),
    [
        (
            lambda o: torch.optim.lr_scheduler.OneCycleLR(
                o, max_lr=0.1, total_steps=20
            ),
            (0.85, 0.95),
        ),
        (
            lambda o: torch.optim.lr_scheduler.CyclicLR(
                o, base_lr=0.01, max_lr=0.1, step_size_up=5
            ),
            (0.8, 0.9),
        ),
    ],
    ids=["OneCycleLR", "CyclicLR"],
)
def test_schedulers_cycle_the_momentum_each_step_uses(
    optimizer_class, make_scheduler, momentum_range
):
    """With their defaults (cycle_momentum=True) OneCycleLR and CyclicLR cycle
    each group's ``momentum`` (an alias of ``b1``) over their default range: the
    run equals one given the same lr and ``b1`` (the seed's name) by hand, and
    differs from one that keeps the momentum fixed."""
    _skip_without_momentum_alias(optimizer_class)
    params, manual, fixed = _params(), _params(), _params()
    optimizer = _make(optimizer_class, params, lr=LR)
    by_hand = _make(optimizer_class, manual, lr=LR)
    fixed_momentum = _make(optimizer_class, fixed, lr=LR)
    scheduler = make_scheduler(optimizer)
    momenta = []
    for g in _grads(20):
        group = optimizer.param_groups[0]
        momenta.append(group["momentum"])
        by_hand.param_groups[0]["lr"] = group["lr"]
        by_hand.param_groups[0][_b1(optimizer_class)] = group["momentum"]
        fixed_momentum.param_groups[0]["lr"] = group["lr"]
        _step(optimizer, params, g)
        _step(by_hand, manual, g)
        _step(fixed_momentum, fixed, g)
        assert group[_b1(optimizer_class)] == momenta[-1]
        scheduler.step()
    assert len(set(momenta)) > 5
    assert (min(momenta), max(momenta)) == pytest.approx(momentum_range)
    _assert_equal(_values(params), _values(manual))
    assert not torch.equal(params[0], fixed[0])


def test_momentum_is_an_alias_of_b1_in_arguments_and_groups(optimizer_class):
    """``momentum`` and ``b1`` are one hyperparameter: either may be given in a
    group (both, only if equal), and a change to either is what the next step
    uses and what both then read."""
    _skip_without_momentum_alias(optimizer_class)
    b1 = _b1(optimizer_class)
    optimizer = _make(optimizer_class, [_leaf()], b1=0.5)
    assert optimizer.defaults[b1] == optimizer.defaults["momentum"] == 0.5
    optimizer.add_param_group({"params": [_leaf()], "momentum": 0.3})
    optimizer.add_param_group({"params": [_leaf()], b1: 0.2})
    assert [(g[b1], g["momentum"]) for g in optimizer.param_groups] == [
        (0.5, 0.5),
        (0.3, 0.3),
        (0.2, 0.2),
    ]
    with pytest.raises(ValueError, match=rf"{b1}=0.2 and momentum=0.3 differ"):
        optimizer.add_param_group({"params": [_leaf()], b1: 0.2, "momentum": 0.3})
    with pytest.raises(ValueError, match=r"Invalid momentum=1.5: must be in"):
        optimizer.add_param_group({"params": [_leaf()], "momentum": 1.5})
    groups = optimizer.param_groups
    groups[0][b1], groups[1]["momentum"] = 0.1, 0.7
    for group in groups:
        for p in group["params"]:
            p.grad = torch.ones(3)
    optimizer.step()
    assert [(g[b1], g["momentum"]) for g in groups] == [
        (0.1, 0.1),
        (0.7, 0.7),
        (0.2, 0.2),
    ]


def test_a_state_dict_without_the_momentum_alias_loads_its_b1(optimizer_class):
    """A state dict saved before groups carried ``momentum`` (only ``b1``) loads
    with its ``b1``, not the new optimizer's default, and steps as the original."""
    _skip_without_momentum_alias(optimizer_class)
    params, twin = _params(), _params()
    optimizer = _make(optimizer_class, params, lr=LR, b1=0.5)
    grads = _grads(3)
    _step(optimizer, params, grads[0])
    saved = copy.deepcopy(optimizer.state_dict())
    for group in saved["param_groups"]:
        del group["momentum"]
    with torch.no_grad():
        for p, q in zip(twin, params, strict=True):
            p.copy_(q)
    restored = _make(optimizer_class, twin, lr=LR)
    restored.load_state_dict(saved)
    b1 = _b1(optimizer_class)
    assert restored.param_groups[0][b1] == restored.param_groups[0]["momentum"]
    assert restored.param_groups[0]["momentum"] == 0.5
    for g in grads[1:]:
        _step(optimizer, params, g)
        _step(restored, twin, g)
    _assert_equal(_values(twin), _values(params))


# --- bad input: the exception types torch's own optimizers raise -------------------


def _leaf():
    return torch.nn.Parameter(torch.ones(3))


def _non_leaf():
    return torch.ones(3, requires_grad=True) * 2


BAD_CONSTRUCTIONS = {
    # name: (our arguments, torch.optim.Adam's equivalent)
    "negative_lr": (lambda: ([_leaf()], dict(lr=-0.01)), dict(lr=-0.01)),
    "string_lr": (lambda: ([_leaf()], dict(lr="0.1")), dict(lr="0.1")),
    "two_element_tensor_lr": (
        lambda: ([_leaf()], dict(lr=torch.tensor([0.1, 0.1]))),
        dict(lr=torch.tensor([0.1, 0.1])),
    ),
    "b1_of_one": (lambda: ([_leaf()], dict(b1=1.0)), dict(betas=(1.0, 0.999))),
    "negative_b1": (lambda: ([_leaf()], dict(b1=-0.5)), dict(betas=(-0.5, 0.999))),
    "negative_weight_decay": (
        lambda: ([_leaf()], dict(weight_decay=-1.0)),
        dict(weight_decay=-1.0),
    ),
    "unknown_keyword": (lambda: ([_leaf()], dict(betas=(0.9, 0.99))), dict(b1=0.9)),
    "non_leaf_tensor": (lambda: ([_non_leaf()], {}), {}),
    "a_bare_tensor": (lambda: (_leaf(), {}), {}),
    "no_parameters": (lambda: ([], {}), {}),
}


@pytest.mark.parametrize("case", list(BAD_CONSTRUCTIONS))
def test_bad_construction_raises_as_torch_optimizers_do(optimizer_class, case):
    make, adam_kwargs = BAD_CONSTRUCTIONS[case]
    reason = ACCEPTED.get(optimizer_class.__name__, {}).get(case)
    if reason:
        pytest.skip(reason)
    params, kwargs = make()
    errors = (TypeError, ValueError, RuntimeError)
    with pytest.raises(errors) as ours:
        _make(optimizer_class, params, **kwargs)
    params, _ = make()
    with pytest.raises(errors) as adams:
        torch.optim.Adam(params, **adam_kwargs)
    assert type(ours.value) is type(adams.value), (ours.value, adams.value)
    assert str(ours.value)


def test_a_two_element_tensor_lr_raises_torchs_error(optimizer_class):
    """torch's optimizers refuse it with ValueError('Tensor lr must be 1-element'),
    at construction and in an added group alike."""
    two = torch.tensor([0.1, 0.1])
    for make in (optimizer_class, torch.optim.Adam):
        with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
            make([_leaf()], lr=two)
    optimizer = _make(optimizer_class, [_leaf()])
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        optimizer.add_param_group({"params": [_leaf()], "lr": two})


def test_a_parameter_in_two_groups_is_refused_as_torch_does(optimizer_class):
    p, q = _leaf(), _leaf()
    groups = [{"params": [p]}, {"params": [p, q]}]
    with pytest.raises(ValueError, match="more than one parameter group"):
        _make(optimizer_class, groups)
    with pytest.raises(ValueError, match="more than one parameter group"):
        torch.optim.Adam(groups)


def test_a_duplicate_parameter_in_one_group_warns_as_torch_does(optimizer_class):
    p = _leaf()
    for make in (optimizer_class, torch.optim.Adam):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make([p, p])
        assert any("duplicate parameters" in str(w.message) for w in caught), make


def test_sparse_gradient_raises_runtime_error_as_adam_does(optimizer_class):
    for make in (optimizer_class, torch.optim.Adam):
        embedding = torch.nn.Embedding(5, 2, sparse=True)
        optimizer = make(embedding.parameters())
        embedding(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(RuntimeError, match="sparse"):
            optimizer.step()


@pytest.mark.parametrize("wrong", ["another_group_count", "another_group_size"])
def test_loading_a_wrong_state_dict_raises_value_error_as_torch_does(
    optimizer_class, wrong
):
    def source(make):
        if wrong == "another_group_count":
            optimizer = make([{"params": [_leaf()]}, {"params": [_leaf()]}])
        else:
            optimizer = make([_leaf(), _leaf()])
        return optimizer.state_dict()

    for make in (optimizer_class, torch.optim.Adam):
        target = make([_leaf()])
        before = copy.deepcopy(target.state_dict())
        with pytest.raises(ValueError, match="group"):
            target.load_state_dict(source(make))
        assert target.state_dict()["param_groups"] == before["param_groups"]


# --- the Optimizer API ---------------------------------------------------------------


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(optimizer_class, set_to_none):
    params = _params()
    optimizer = _make(optimizer_class, params)
    for p, g in zip(params, _grads(1)[0], strict=True):
        p.grad = g
    optimizer.zero_grad(set_to_none=set_to_none)
    for p in params:
        if set_to_none:
            assert p.grad is None
        else:
            assert torch.equal(p.grad, torch.zeros_like(p))


def test_add_param_group_fills_defaults_steps_the_new_group_and_refuses_bad_values(
    optimizer_class,
):
    params = _params()
    optimizer = _make(optimizer_class, params[:2], lr=LR, weight_decay=0.1)
    optimizer.add_param_group({"params": [params[2]], "lr": 0.5})
    group = optimizer.param_groups[1]
    assert group["lr"] == 0.5
    assert group["weight_decay"] == 0.1
    before = params[2].detach().clone()
    _step(optimizer, params, _grads(1)[0])
    assert not torch.equal(params[2], before)
    with pytest.raises(ValueError, match=r"Invalid lr=-1.0: must be >= 0"):
        optimizer.add_param_group({"params": [_leaf()], "lr": -1.0})
    assert len(optimizer.param_groups) == 2


class _Holder(torch.nn.Module):
    """A module whose parameters are ``params`` (named params.0, params.1, ...)."""

    def __init__(self, params):
        super().__init__()
        self.params = torch.nn.ParameterList(params)


def _load_through(how, optimizer, params, restored, twin):
    """``optimizer``'s state into ``restored``: saved and loaded with
    ``torch.save``, or keyed by parameter names with
    ``torch.distributed.checkpoint``'s get/set_optimizer_state_dict (FSDP2's
    way; without a process group it needs none)."""
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)
        buffer.seek(0)
        restored.load_state_dict(torch.load(buffer, weights_only=True))
        return
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    saved = get_optimizer_state_dict(_Holder(params), optimizer)
    named = {f"params.{i}" for i, p in enumerate(params) if p in optimizer.state}
    assert set(saved["state"]) == named
    set_optimizer_state_dict(_Holder(twin), restored, saved)


@pytest.mark.parametrize("how", ["torch.save", "distributed.checkpoint"])
def test_state_dict_round_trip_continues_bit_identically(optimizer_class, how):
    params, twin = _params(), _params()
    optimizer = _make(optimizer_class, params, lr=LR, weight_decay=0.1)
    grads = _grads(6)
    for g in grads[:3]:
        _step(optimizer, params, g)
    with torch.no_grad():
        for p, q in zip(twin, params, strict=True):
            p.copy_(q)
    restored = _make(optimizer_class, twin, lr=LR, weight_decay=0.1)
    _load_through(how, optimizer, params, restored, twin)
    for g in grads[3:]:
        _step(optimizer, params, g)
        _step(restored, twin, g)
    _assert_equal(_values(twin), _values(params))


def _assert_same(a, b, where="state_dict"):
    """Equal nested state: the same keys, tensors equal in value and dtype, other
    values equal."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict), where
        assert set(a) == set(b), (where, sorted(map(str, set(a) ^ set(b))))
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b), where
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("into", ["itself", "a fresh optimizer"])
@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
def test_state_dict_is_the_same_after_a_load(optimizer_class, into, lr_kind):
    """Saving, loading and saving again gives the first state dict (every
    param-group key and value, every state entry), and the loaded optimizer
    then steps as the original: the property torch's
    ``test_state_dict_deterministic`` checks."""
    params, twin = _params(), _params()
    lr = LR if lr_kind == "float" else torch.tensor(LR)
    optimizer = _make(optimizer_class, params, lr=lr, weight_decay=0.1)
    grads = _grads(4)
    for g in grads[:2]:
        _step(optimizer, params, g)
    saved = copy.deepcopy(optimizer.state_dict())
    if into == "itself":
        target, target_params = optimizer, params
    else:
        with torch.no_grad():
            for p, q in zip(twin, params, strict=True):
                p.copy_(q)
        target, target_params = _make(optimizer_class, twin, lr=LR), twin
    defaults = dict(target.defaults)
    target.load_state_dict(copy.deepcopy(saved))
    _assert_same(saved, target.state_dict())
    assert target.defaults == defaults
    for g in grads[2:]:
        _step(target, target_params, g)
        if target is not optimizer:
            _step(optimizer, params, g)
    _assert_same(optimizer.state_dict(), target.state_dict())
    _assert_equal(_values(target_params), _values(params))


def test_groups_added_after_a_copy_or_a_load_have_the_original_keys(
    optimizer_class,
):
    """torch's ``__setstate__`` (run by copies, pickles and loads) must not add
    keys to the defaults that later groups would inherit."""
    params = _params()
    optimizer = _make(optimizer_class, params[:2])
    copied = copy.deepcopy(optimizer)
    pickled = pickle.loads(pickle.dumps(optimizer))
    loaded = _make(optimizer_class, _params()[:2])
    loaded.load_state_dict(optimizer.state_dict())
    keys = []
    for each in (optimizer, copied, pickled, loaded):
        each.add_param_group({"params": [_leaf()]})
        keys.append(sorted(each.param_groups[-1]))
    assert keys == [keys[0]] * 4


def test_parameters_without_gradients_are_left_alone(optimizer_class):
    """As torch's optimizers: a frozen parameter (requires_grad=False) and one
    whose gradient is None neither move (not even by weight decay) nor get
    state; the others step."""
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    idle, moving = _leaf(), _leaf()
    optimizer = _make(optimizer_class, [frozen, idle, moving], weight_decay=0.1)
    for _ in range(2):
        moving.grad = torch.ones(3)
        optimizer.step()
    assert torch.equal(frozen, torch.ones(3))
    assert torch.equal(idle, torch.ones(3))
    assert not torch.equal(moving, torch.ones(3))
    assert frozen not in optimizer.state
    assert idle not in optimizer.state


def test_closure_is_evaluated_with_gradients_and_its_loss_returned(optimizer_class):
    params = _params()
    optimizer = _make(optimizer_class, params, lr=LR)

    def closure():
        optimizer.zero_grad()
        loss = sum(p.square().sum() for p in params)
        loss.backward()
        return loss

    _warm_up(optimizer, params)
    before = _values(params)
    loss = optimizer.step(closure)
    assert loss.requires_grad
    assert float(loss.detach()) == pytest.approx(
        float(sum(b.square().sum() for b in before))
    )
    assert not torch.equal(params[0], before[0])


def test_a_step_without_gradients_changes_nothing(optimizer_class):
    params = _params()
    optimizer = _make(optimizer_class, params, lr=LR, weight_decay=0.1)
    before = _values(params)
    optimizer.step()
    _assert_equal(_values(params), before)
    assert not optimizer.state


def test_step_hooks_run_around_each_step_until_removed(optimizer_class):
    params = _params()
    optimizer = _make(optimizer_class, params, lr=LR)
    calls = []
    pre = optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: calls.append(("pre", opt is optimizer))
    )
    post = optimizer.register_step_post_hook(
        lambda opt, args, kwargs: calls.append(("post", opt is optimizer))
    )
    grads = _grads(2)
    _step(optimizer, params, grads[0])
    assert calls == [("pre", True), ("post", True)]
    pre.remove()
    post.remove()
    _step(optimizer, params, grads[1])
    assert len(calls) == 2


def test_state_dict_hooks_run(optimizer_class):
    params = _params()
    optimizer = _make(optimizer_class, params, lr=LR)
    seen = []
    optimizer.register_state_dict_pre_hook(lambda opt: seen.append("save"))
    optimizer.register_load_state_dict_post_hook(lambda opt: seen.append("load"))
    _step(optimizer, params, _grads(1)[0])
    optimizer.load_state_dict(optimizer.state_dict())
    assert seen == ["save", "load"]


def test_per_group_overrides_are_kept_and_used(optimizer_class):
    """A group's own lr (0: its parameters stay) and weight decay override the
    defaults, and survive a state_dict round trip into a fresh optimizer."""
    params = _params()
    groups = [
        {"params": params[:1], "lr": 0.0},
        {"params": params[1:], "weight_decay": 0.1},
    ]
    optimizer = _make(optimizer_class, groups, lr=LR)
    before = _values(params)
    for g in _grads(2):
        _step(optimizer, params, g)
    after = _values(params)
    assert torch.equal(after[0], before[0])
    assert not torch.equal(after[1], before[1])
    fresh = _make(optimizer_class, [{"params": params[:1]}, {"params": params[1:]}])
    fresh.load_state_dict(optimizer.state_dict())
    assert [g["lr"] for g in fresh.param_groups] == [0.0, LR]
    assert [g["weight_decay"] for g in fresh.param_groups] == [0.0, 0.1]


def test_each_stage_of_a_step_is_a_profiler_range(optimizer_class):
    """``torch.profiler`` shows where a step's time goes, under the names of
    the JAX side's ``jax.named_scope``s (precond/<optimizer>/<stage>)."""
    params = _params()
    optimizer = _make(optimizer_class, params, lr=LR)
    _warm_up(optimizer, params)
    prefix = OPTIMIZERS[optimizer_class.__name__][2]
    for p, g in zip(params, _grads(1)[0], strict=True):
        p.grad = g
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        optimizer.step()
    names = {event.name for event in prof.events()}
    stages = STAGES_OF.get(optimizer_class.__name__, STAGES)
    assert {f"{prefix}/{stage}" for stage in stages} <= names


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def test_torch_compile_of_the_step_runs_it_eagerly(optimizer_class):
    """``torch.compile(optimizer.step)`` runs the step as written
    (``eager_step``): bit for bit the eager step's values, and no graph of it,
    on nine buckets over three steps. Traced, the step broke into graphs at its
    host syncs and re-specialised per bucket, past dynamo's recompile limit (8),
    and ran slower than eagerly. Dynamo's eager
    backend keeps this test's CPU time low if it traces."""
    shapes = [(n, 2) for n in range(2, 11)]
    params = [torch.nn.Parameter(torch.ones(s)) for s in shapes]
    twin = [torch.nn.Parameter(torch.ones(s)) for s in shapes]
    compiled = _make(optimizer_class, params, lr=LR, weight_decay=0.1)
    eager = _make(optimizer_class, twin, lr=LR, weight_decay=0.1)
    torch._dynamo.reset()
    step = torch.compile(compiled.step, backend="eager")
    generator = torch.Generator().manual_seed(1)
    graphs = _compiled_graphs()  # dynamo's count is per process, never reset
    try:
        for _ in range(3):
            for p, q in zip(params, twin, strict=True):
                p.grad = torch.randn(p.shape, generator=generator)
                q.grad = p.grad.clone()
            step()
            eager.step()
        graphs = _compiled_graphs() - graphs
    finally:
        torch._dynamo.reset()
    assert graphs == 0
    _assert_equal(_values(params), _values(twin))


# --- skipped steps ------------------------------------------------------------------


def _bad(grads, value=float("nan")):
    """``grads`` with one entry of the first made ``value``."""
    grads = [g.clone() for g in grads]
    grads[0].view(-1)[0] = value
    return grads


def test_a_skipped_step_is_counted_and_logged_once(optimizer_class, caplog):
    """A step with a NaN or Inf gradient is skipped: ``skipped_steps`` counts it
    (not the good ones), the parameters' step counts stay, and one WARNING on
    the ``precond.torch`` logger says so, however many steps are skipped."""
    params = _params()
    optimizer = _make(optimizer_class, params, lr=LR)
    grads = _grads(4)
    with caplog.at_level(logging.WARNING, logger="precond"):
        _step(optimizer, params, grads[0])
        assert optimizer.skipped_steps == 0
        _step(optimizer, params, _bad(grads[1]))
        assert optimizer.skipped_steps == 1
        _step(optimizer, params, grads[2])
        _step(optimizer, params, _bad(grads[3], float("inf")))
        assert optimizer.skipped_steps == 2
    assert all(optimizer.state[p]["step"] == 2 for p in params)
    warnings_logged = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.name for r in warnings_logged] == ["precond.torch"]
    assert "skipped" in warnings_logged[0].getMessage()
    assert "skipped_steps" in warnings_logged[0].getMessage()


@pytest.mark.parametrize("how", ["torch.save", "distributed.checkpoint", "deepcopy"])
@pytest.mark.parametrize("first_step", ["good", "skipped"])
def test_the_skipped_step_count_is_checkpointed(optimizer_class, how, first_step):
    """The count survives a state-dict round trip (also when the very first
    step was skipped, before any other state) and a copy, and the restored run
    continues as the original."""
    params, twin = _params(), _params()
    optimizer = _make(optimizer_class, params, lr=LR)
    grads = _grads(5)
    if first_step == "skipped":
        _step(optimizer, params, _bad(grads[0]))
    else:
        _step(optimizer, params, grads[0])
        _step(optimizer, params, _bad(grads[1]))
    expected = optimizer.skipped_steps
    assert expected == 1
    if how == "deepcopy":
        twin, restored = copy.deepcopy((params, optimizer))
    else:
        with torch.no_grad():
            for p, q in zip(twin, params, strict=True):
                p.copy_(q)
        restored = _make(optimizer_class, twin, lr=LR)
        _load_through(how, optimizer, params, restored, twin)
    assert restored.skipped_steps == expected
    for g in grads[2:]:
        _step(optimizer, params, g)
        _step(restored, twin, g)
    _step(restored, twin, _bad(grads[2]))
    assert restored.skipped_steps == expected + 1
    _assert_equal(_values(twin), _values(params))


# --- K-FAC: the rows that apply to a gradient preconditioner --------------------------


@pytest.fixture
def kfac_setup():
    from precond.torch.kfac import KFAC

    if not issubclass(KFAC, torch.optim.Optimizer):
        pytest.skip("precond.torch.kfac.KFAC is not a torch.optim.Optimizer")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)
    )
    inputs = torch.randn(8, 4)

    def make(net, **kwargs):
        return KFAC(net, factor_update_steps=1, inv_update_steps=1, **kwargs)

    def step(net, preconditioner):
        net.zero_grad()
        net(inputs).square().sum().backward()
        preconditioner.step()
        return [p.grad.clone() for p in net.parameters()]

    return model, make, step


def test_kfac_lr_follows_torch_schedulers_and_hooks_run(kfac_setup):
    model, make, step = kfac_setup
    preconditioner = make(model, lr=0.2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(preconditioner, lambda e: 0.5**e)
    calls = []
    preconditioner.register_step_pre_hook(lambda *_: calls.append("pre"))
    preconditioner.register_step_post_hook(lambda *_: calls.append("post"))
    for epoch in range(3):
        step(model, preconditioner)
        scheduler.step()
        assert preconditioner.param_groups[0]["lr"] == pytest.approx(
            0.2 * 0.5 ** (epoch + 1)
        )
    assert calls == ["pre", "post"] * 3


def test_kfac_copy_keeps_public_attributes_and_preconditions_identically(
    kfac_setup,
):
    model, make, step = kfac_setup
    preconditioner = make(model)
    step(model, preconditioner)
    model_copy, copied = copy.deepcopy((model, preconditioner))
    public = {k for k in vars(preconditioner) if not k.startswith("_")}
    assert public == {k for k in vars(copied) if not k.startswith("_")}
    _assert_equal(step(model_copy, copied), step(model, preconditioner))


def test_kfac_each_stage_is_a_profiler_range(kfac_setup):
    model, make, step = kfac_setup
    preconditioner = make(model)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        step(model, preconditioner)
    names = {event.name for event in prof.events()}
    stages = ("update_factors", "update_second_order", "precondition")
    assert {f"precond/kfac/{stage}" for stage in stages} <= names


def test_kfac_under_torch_compile_preconditions_eagerly(kfac_setup):
    """``torch.compile(preconditioner.step)`` runs K-FAC's step as written: the
    eager step's gradients bit for bit, and no graph of it."""
    model, make, step = kfac_setup
    twin = copy.deepcopy(model)
    compiled, eager = make(model), make(twin)
    torch._dynamo.reset()
    compiled.step = torch.compile(compiled.step, backend="eager")
    graphs = _compiled_graphs()  # dynamo's count is per process, never reset
    try:
        for _ in range(3):
            _assert_equal(step(model, compiled), step(twin, eager))
        graphs = _compiled_graphs() - graphs
    finally:
        torch._dynamo.reset()
    assert graphs == 0


def test_kfac_bad_lr_raises_value_error_as_torch_optimizers_do(kfac_setup):
    model, make, _ = kfac_setup
    with pytest.raises(ValueError, match="Invalid lr=-1"):
        make(model, lr=-1)


def test_zero_gradients_leave_the_parameters_in_place_and_repr_lists_the_groups(
    optimizer_class,
):
    """As torch's optimizers without weight decay: zero gradients move nothing
    (U = P·0 = 0), though the step is counted; ``repr`` shows each group."""
    params = _params()
    optimizer = _make(optimizer_class, params, lr=LR)
    before = _values(params)
    for _ in range(3):
        _step(optimizer, params, [torch.zeros_like(p) for p in params])
    _assert_equal(_values(params), before)
    assert all(optimizer.state[p]["step"] == 3 for p in params)
    text = repr(optimizer)
    assert text.startswith(f"{optimizer_class.__name__} (")
    assert f"lr: {LR}" in text
