"""PyTorch's optimizer conventions: one table run over every torch optimizer.

What torch's own optimizers promise their users, written here as properties
(in the spirit of torch's optimizer test-suite): copies step like the
original, the learning rate may be a tensor and is driven by
``torch.optim.lr_scheduler``, bad input fails with the exception type torch's
optimizers raise, and the Optimizer API (zero_grad, add_param_group,
state_dict, closures, hooks) behaves as documented. Every row runs on
precond.torch.Kron and precond.torch.Pro (``OPTIMIZERS``); each stage of a step
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
import pickle
import warnings

import pytest
import torch

from precond.torch import Kron, Pro

LR = 0.05

# Every torch.optim.Optimizer precond ships, with what its copies must keep
# besides torch's state, and the profiler ranges one step opens.
OPTIMIZERS = {
    "Kron": (Kron, {"seed", "strategy", "compile_kernels"}, "precond/kron"),
    "Pro": (Pro, {"seed"}, "precond/pro"),
}
STAGES = ("momentum", "update_factors", "precondition", "apply_updates")


@pytest.fixture(params=list(OPTIMIZERS))
def optimizer_class(request):
    return OPTIMIZERS[request.param][0]


def _make(optimizer_class, params, **kwargs):
    """The optimizer with no weight decay unless asked (Pro's default is 0.1)."""
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
    # (torch's __setstate__ may add keys, e.g. 'differentiable', to defaults)
    assert copied.defaults.items() >= optimizer.defaults.items()
    for g in grads[3:]:
        _step(optimizer, params, g)
        _step(copied, params_copy, g)
    _assert_equal(_values(params_copy), _values(params))
    assert not torch.equal(params[0], _params()[0])


# --- the learning rate -------------------------------------------------------------


def test_tensor_lr_steps_as_the_same_float_lr(optimizer_class):
    """As torch.optim.Adam accepts ``lr=torch.tensor(...)``."""
    runs = []
    for lr in (LR, torch.tensor(LR)):
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
        assert moved == (epoch % 2 == 0), epoch
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
    params, kwargs = make()
    errors = (TypeError, ValueError, RuntimeError)
    with pytest.raises(errors) as ours:
        _make(optimizer_class, params, **kwargs)
    params, _ = make()
    with pytest.raises(errors) as adams:
        torch.optim.Adam(params, **adam_kwargs)
    assert type(ours.value) is type(adams.value), (ours.value, adams.value)
    assert str(ours.value)


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
    assert set(saved["state"]) == {f"params.{i}" for i in range(len(params))}
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


def test_closure_is_evaluated_with_gradients_and_its_loss_returned(optimizer_class):
    params = _params()
    optimizer = _make(optimizer_class, params, lr=LR)

    def closure():
        optimizer.zero_grad()
        loss = sum(p.square().sum() for p in params)
        loss.backward()
        return loss

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
    prefix = OPTIMIZERS[optimizer_class.__name__][2]
    for p, g in zip(params, _grads(1)[0], strict=True):
        p.grad = g
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        optimizer.step()
    names = {event.name for event in prof.events()}
    assert {f"{prefix}/{stage}" for stage in STAGES} <= names


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def test_torch_compile_of_the_step_runs_it_eagerly(optimizer_class):
    """``torch.compile(optimizer.step)`` runs the step as written
    (``eager_step``): bit for bit the eager step's values, and no graph of it,
    on nine buckets over three steps. Traced, the step broke into graphs at its
    host syncs and re-specialised per bucket, past dynamo's recompile limit (8),
    and ran slower than eagerly (benchmarks/compiled_step.py). Dynamo's eager
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
