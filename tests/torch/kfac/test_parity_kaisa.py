"""precond.torch.kfac as a drop-in for KAISA 0.4 (seed 004): its signatures, its
trajectories and the seed's own snippets.

No KAISA release installs from the package index, so the oracles are (1) a table of
KAISA 0.4's public signatures written from the seed document (and the usage it
links), and (2) ``tests/reference/kfac_reference.KFACRun``: KAISA's step written
densely in float64 NumPy from the math (factor running averages from I, update
intervals, (G ⊗ A + λI)⁻¹ or per-factor damped inverses, the KL clip), fed the
activations and output gradients of a float64 torch copy of the model.
"""

from __future__ import annotations

import inspect
import logging
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precond.torch.kfac as kfac
from precond.torch.kfac import (
    KFAC,
    AssignmentStrategy,
    ComputeMethod,
    DistributedStrategy,
    KFACParamScheduler,
)
from tests.reference import kfac_reference as ref

EMPTY = inspect.Parameter.empty
POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
KEYWORD = inspect.Parameter.KEYWORD_ONLY

# KAISA 0.4's ``kfac.KFAC.__init__`` (after self), in order; every one positional.
KAISA_KFAC = [
    ("model", EMPTY),
    ("factor_update_steps", 1),
    ("inv_update_steps", 1),
    ("damping", 0.001),
    ("factor_decay", 0.95),
    ("kl_clip", 0.001),
    ("lr", 0.1),
    ("accumulation_steps", 1),
    ("allreduce_bucket_cap_mb", 25.0),
    ("assignment_strategy", AssignmentStrategy.COMPUTE),
    ("colocate_factors", True),
    ("compute_method", ComputeMethod.EIGEN),
    ("compute_eigenvalue_outer_product", True),
    ("grad_worker_fraction", DistributedStrategy.COMM_OPT),
    ("symmetry_aware", False),
    ("grad_scaler", None),
    ("factor_dtype", None),
    ("inv_dtype", torch.float32),
    ("skip_layers", []),
    ("update_factors_in_hook", True),
    ("verbose", False),
]
# Keyword-only after them: KAISA's later KFACPreconditioner's loglevel, and precond's.
NEWER_KEYWORDS = {
    "loglevel": logging.DEBUG,
    "layers": None,
    "world_size_invariant": True,
}

KAISA_PARAM_SCHEDULER = [
    ("kfac", EMPTY),
    ("damping_alpha", 1),
    ("damping_schedule", None),
    ("update_freq_alpha", 1),
    ("update_freq_schedule", None),
    ("start_step", 0),
]

KAISA_METHODS = {
    (KFAC, "state_dict"): [("include_factors", True)],
    (KFAC, "load_state_dict"): [("state_dict", EMPTY), ("compute_inverses", True)],
    (KFACParamScheduler, "step"): [("step", None)],
    (KFACParamScheduler, "state_dict"): [],
    (KFACParamScheduler, "load_state_dict"): [("state_dict", EMPTY)],
}

KAISA_ENUMS = {
    DistributedStrategy: {"COMM_OPT": 1, "MEM_OPT": 2, "HYBRID_OPT": 3},
    ComputeMethod: {"EIGEN": 1, "INVERSE": 2},
    AssignmentStrategy: {"COMPUTE": 1, "MEMORY": 2},
}


def parameters(function, skip_self=False):
    found = list(inspect.signature(function).parameters.values())
    return found[1:] if skip_self else found


def assert_positional_table(found, table):
    assert [p.name for p in found[: len(table)]] == [name for name, _ in table]
    for p, (name, default) in zip(found, table, strict=False):
        assert p.kind is POSITIONAL, name
        assert p.default == default, name
        assert type(p.default) is type(default), name


def test_kfac_signature_is_kaisas():
    found = parameters(KFAC.__init__, skip_self=True)
    assert_positional_table(found, KAISA_KFAC)
    newer = found[len(KAISA_KFAC) :]
    assert {p.name: p.default for p in newer} == NEWER_KEYWORDS
    assert all(p.kind is KEYWORD for p in newer)
    # Positional calls bind as KAISA's: the 2nd and 3rd are the update intervals.
    pre = KFAC(nn.Linear(3, 2), 2, 6, 0.01, 0.9, None, 0.5)
    assert (pre.factor_update_steps, pre.inv_update_steps) == (2, 6)
    assert (pre.damping, pre.factor_decay, pre.kl_clip, pre.lr) == (
        0.01,
        0.9,
        None,
        0.5,
    )


def test_scheduler_and_method_signatures_are_kaisas():
    assert_positional_table(
        parameters(KFACParamScheduler.__init__, True), KAISA_PARAM_SCHEDULER
    )
    assert len(parameters(KFACParamScheduler.__init__, True)) == len(
        KAISA_PARAM_SCHEDULER
    )
    for (cls, method), table in KAISA_METHODS.items():
        found = parameters(getattr(cls, method), skip_self=True)
        assert len(found) == len(table), method
        assert_positional_table(found, table)


def test_public_names_and_enums_are_kaisas():
    for name in (
        "KFAC",
        "KFACParamScheduler",
        "DistributedStrategy",
        "ComputeMethod",
        "AssignmentStrategy",
    ):
        assert hasattr(kfac, name), name
    for enum_type, members in KAISA_ENUMS.items():
        assert {m.name: m.value for m in enum_type} == members
    assert issubclass(KFAC, torch.optim.Optimizer)


# -- trajectories vs the float64 reference --------------------------------------


class ConvMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc1 = nn.Linear(3 * 4 * 4, 6)
        self.fc2 = nn.Linear(6, 3, bias=False)

    def forward(self, x):
        h = torch.tanh(self.conv(x)).flatten(1)
        return self.fc2(torch.tanh(self.fc1(h)))


STEPS = 20
SGD_LR = 0.1
CONV = ((3, 3), (1, 1), (1, 1, 1, 1), (1, 1))  # kernel, stride, padding, dilation


def batches(dtype):
    g = torch.Generator().manual_seed(5)
    return [
        (
            torch.randn(8, 2, 4, 4, generator=g, dtype=dtype),
            torch.randint(0, 3, (8,), generator=g),
        )
        for _ in range(STEPS)
    ]


CASES = {
    "eigen-prediv-f1-i1": dict(compute_method="eigen", damping=1e-3, kl_clip=1e-3),
    "eigen-f1-i3-decay0.9": dict(
        compute_method="eigen",
        compute_eigenvalue_outer_product=False,
        inv_update_steps=3,
        damping=3e-3,
        factor_decay=0.9,
        kl_clip=None,
    ),
    "eigen-prediv-f3-i3": dict(
        compute_method="eigen",
        factor_update_steps=3,
        inv_update_steps=3,
        damping=1e-2,
        factor_decay=0.8,
        kl_clip=1e-2,
    ),
    "eigen-f3-i1-damping-schedule": dict(
        compute_method="eigen",
        compute_eigenvalue_outer_product=False,
        factor_update_steps=3,
        damping=lambda step: 1e-2 * 0.8**step,
        kl_clip=1e-3,
    ),
    "inverse-f1-i3": dict(compute_method="inverse", inv_update_steps=3, kl_clip=1e-3),
    "inverse-f3-i1-decay0.5": dict(
        compute_method="inverse",
        factor_update_steps=3,
        damping=0.3,
        factor_decay=0.5,
        kl_clip=None,
    ),
}


def reference_trajectory(initial, options, data):
    """Parameters after each step of KFACRun + SGD (float64), and ν per step."""
    model = ConvMLP().double()
    model.load_state_dict(initial)
    layers = {"conv": model.conv, "fc1": model.fc1, "fc2": model.fc2}
    seen: dict[str, dict] = {}

    def hook(name, module, inputs, output):
        seen[name] = {"x": inputs[0].detach()}
        output.register_hook(lambda g: seen[name].__setitem__("g", g.detach()))

    for name, module in layers.items():
        module.register_forward_hook(partial(hook, name))
    method = options.get("compute_method", "eigen")
    run = ref.KFACRun(
        len(layers), method, options.get("compute_eigenvalue_outer_product", True)
    )
    trajectory = []
    for step, (x, y) in enumerate(data):
        model.zero_grad()
        F.cross_entropy(model(x.double()), y).backward()
        factors, grads = [], []
        for name, module in layers.items():
            kind = "conv" if name == "conv" else "linear"
            bias = module.bias is not None
            factors.append(
                ref.layer_factors(
                    kind,
                    seen[name]["x"].numpy(),
                    seen[name]["g"].numpy(),
                    bias,
                    CONV if kind == "conv" else None,
                )
            )
            grad = module.weight.grad.reshape(len(module.weight), -1).numpy()
            if bias:
                grad = np.concatenate([grad, module.bias.grad.numpy()[:, None]], 1)
            grads.append(grad)
        damping = options.get("damping", 1e-3)
        updates = run.step(
            factors,
            grads,
            factor_update_steps=options.get("factor_update_steps", 1),
            inv_update_steps=options.get("inv_update_steps", 1),
            damping=damping(step) if callable(damping) else damping,
            factor_decay=options.get("factor_decay", 0.95),
            kl_clip=options.get("kl_clip", 1e-3),
            lr=SGD_LR,
        )
        with torch.no_grad():
            for module, update in zip(layers.values(), updates, strict=True):
                update = torch.from_numpy(update)
                w = module.weight
                w -= SGD_LR * update[:, : w[0].numel()].reshape(w.shape)
                if module.bias is not None:
                    module.bias -= SGD_LR * update[:, -1]
        trajectory.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return trajectory, run.nus


def precond_trajectory(initial, options, data, dtype):
    model = ConvMLP().to(dtype)
    model.load_state_dict(initial)
    inv_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    pre = KFAC(model, lr=SGD_LR, inv_dtype=inv_dtype, **options)
    sgd = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    trajectory = []
    for x, y in data:
        sgd.zero_grad()
        F.cross_entropy(model(x.to(dtype)), y).backward()
        pre.step()
        sgd.step()
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        trajectory.append(params.double())
    return trajectory


def max_relative_difference(trajectory, reference):
    return max(
        float((p - q).norm() / q.norm())
        for p, q in zip(trajectory, reference, strict=True)
    )


# Measured (max over the 20 steps of ‖θ − θ_ref‖ / ‖θ_ref‖): float64 ≤ 3.6e-15 on
# every case; float32 (inverses in float32, the library default) ≤ 2.0e-6 (the
# unclipped eigen case, whose parameters grow 2.2x; ≤ 4.2e-7 on the others). The
# unclipped cases use dampings that keep the run stable: with λ = 3e-2 and no clip
# the inverse case's parameters grow 66x and float64 round-off doubles every step.
F64_TOLERANCE = 1e-12
F32_TOLERANCE = 1e-5


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_trajectory_equals_float64_reference(case):
    options = CASES[case]
    torch.manual_seed(0)
    initial = ConvMLP().double().state_dict()
    data = batches(torch.float64)
    reference, nus = reference_trajectory(initial, options, data)
    if options.get("kl_clip", 1e-3) is not None:
        assert min(nus) < 1.0, "the KL clip never acted: the case would not test it"
    f64 = precond_trajectory(initial, options, data, torch.float64)
    assert max_relative_difference(f64, reference) <= F64_TOLERANCE
    initial32 = {k: v.float() for k, v in initial.items()}
    f32 = precond_trajectory(initial32, options, data, torch.float32)
    assert max_relative_difference(f32, reference) <= F32_TOLERANCE


# -- the seed's snippets, unchanged but for the import ---------------------------
# ``import kfac`` / ``from kfac import KFAC`` became ``import precond.torch.kfac as
# kfac`` / ``from precond.torch.kfac import KFAC`` (above); the seed's ``...`` are
# filled with small sizes, and CUDA's GradScaler/autocast are their CPU versions.


def small_model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8, 3))


def loader(count=6):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(16, 1, 4, 4, generator=g), torch.arange(16) % 3)] * count


def test_snippet_usage(tmp_path):
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1
    )
    try:
        optim, criterion, train_loader = torch.optim, nn.CrossEntropyLoss(), loader()
        model = torch.nn.parallel.DistributedDataParallel(small_model())
        optimizer = optim.SGD(model.parameters(), lr=0.1)
        preconditioner = KFAC(model, lr=0.1)
        losses = []
        for data, target in train_loader:
            optimizer.zero_grad()
            output = model(data)
            loss = criterion(output, target)
            loss.backward()
            preconditioner.step()
            optimizer.step()
            losses.append(loss.item())
    finally:
        torch.distributed.destroy_process_group()
    assert [layer.name for layer in preconditioner.layers] == ["module.0", "module.3"]
    assert losses[-1] < losses[0]


def test_snippet_distribution_strategies():
    model = small_model()
    # Both are equivalent
    preconditioner = kfac.KFAC(model, grad_worker_fraction=1)
    first = (preconditioner.grad_worker_fraction, preconditioner.distributed_strategy)
    preconditioner.remove_hooks()
    preconditioner = kfac.KFAC(
        model, grad_worker_fraction=kfac.DistributedStrategy.COMM_OPT
    )
    second = (preconditioner.grad_worker_fraction, preconditioner.distributed_strategy)
    assert first == second == (1.0, DistributedStrategy.COMM_OPT)


def amp_run(use_scaler):
    GradScaler = partial(torch.amp.GradScaler, "cpu", init_scale=2.0**12)
    autocast = partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    criterion, train_loader = nn.CrossEntropyLoss(), loader(2)
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(enabled=use_scaler)
    preconditioner = kfac.KFAC(model, grad_scaler=scaler if use_scaler else None)
    for data, target in train_loader:
        optimizer.zero_grad()
        with autocast():
            output = model(data)
            loss = criterion(output, target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # Unscale gradients before KFAC.step()
        preconditioner.step()
        scaler.step(optimizer)
        scaler.update()
    return preconditioner


def test_snippet_mixed_precision():
    scaled, plain = amp_run(True), amp_run(False)
    for layer, other in zip(scaled.layers, plain.layers, strict=True):
        assert layer.G.dtype == torch.float32
        # Powers of two scale bfloat16 exactly: the scale is divided out exactly.
        torch.testing.assert_close(layer.G, other.G, rtol=0, atol=0)
        torch.testing.assert_close(layer.A, other.A, rtol=0, atol=0)


class ModelBasicBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.fc = nn.Linear(2, 2)


def test_snippet_skip_layers():
    module = nn.Sequential(
        nn.Conv2d(1, 2, 1), ModelBasicBlock(), nn.Linear(2, 2), nn.Conv2d(2, 2, 1)
    )
    preconditioner = kfac.KFAC(module, skip_layers=["Linear", "ModelBasicBlock"])
    assert [layer.name for layer in preconditioner.layers] == ["0", "3"]


def test_snippet_parameter_scheduling():
    model = small_model()
    kfac_preconditioner = kfac.KFAC(model, lr=0.2, damping=0.01)

    def func(epoch):
        return 0.5**epoch

    scheduler = torch.optim.lr_scheduler.LambdaLR(kfac_preconditioner, func)
    param_scheduler = kfac.KFACParamScheduler(
        kfac_preconditioner, damping_alpha=0.1, damping_schedule=[2]
    )
    seen = []
    for data, target in loader(3):
        model.zero_grad()
        F.cross_entropy(model(data), target).backward()
        kfac_preconditioner.step()
        scheduler.step()
        param_scheduler.step()
        seen += [kfac_preconditioner.lr, kfac_preconditioner.damping]
    assert seen == pytest.approx([0.1, 0.01, 0.05, 0.001, 0.025, 0.001])


def test_snippet_state_dict(tmp_path):
    filepath = tmp_path / "checkpoint.pt"
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kfac_preconditioner = kfac.KFAC(model, inv_update_steps=2)
    for data, target in loader(3):
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        kfac_preconditioner.step()
        optimizer.step()
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "preconditioner": kfac_preconditioner.state_dict(),
    }
    torch.save(state, filepath)

    preconditioner = kfac.KFAC(small_model(), inv_update_steps=2)
    checkpoint = torch.load(filepath)
    preconditioner.load_state_dict(checkpoint["preconditioner"])
    assert preconditioner.steps == 3
    for layer, saved in zip(preconditioner.layers, kfac_preconditioner.layers):
        assert torch.equal(layer.A, saved.A)
        assert torch.equal(layer.G, saved.G)
        for key, tensor in saved.second_order.items():
            assert torch.equal(layer.second_order[key], tensor)
