"""precond.torch.kfac.KFAC in one process, against float64 references.

* Factors: Linear (with and without bias, with a sequence axis) and Conv2d (strides,
  paddings, dilations, padding modes) equal the references built from hooks-free
  forward/backward passes; the one-example identity A ⊗ G = vec∇ vec∇ᵀ.
* Preconditioned gradients: eigen = dense (G ⊗ A + λI)⁻¹ vec ∇ on a one-layer
  Gaussian-likelihood model; inverse = (G+λI)⁻¹ ∇ (A+λI)⁻¹; the two agree when λ is
  small; the KL clip.
* Accumulation, AMP, intervals, schedules, checkpoints, bad input, NaN gradients.

Factors are read back through the first fold F = α I + (1 − α) F_batch with
α = factor_decay = 0.5, so F_batch = (F − α I)/(1 − α) (exact in float64 up to
rounding).
"""

from __future__ import annotations

import copy
import io
import logging
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precond.torch.kfac import (
    KFAC,
    ComputeMethod,
    DistributedStrategy,
    KFACParamScheduler,
    registration,
)
from precond.torch.kfac.second_order import kl_clip_scale
from tests.reference import kfac_reference as ref

ALPHA = 0.5
F64 = torch.float64
# Reading F_batch back from α I + (1 − α) F_batch loses ~eps·α ≈ 1e-16 absolute to
# the identity term; the G entries compared are ~1e-7..1e-3, so this still checks
# them to ≥ 7 significant digits (measured differences ≤ 1.1e-16).
G_ATOL = 1e-15


def batch_factor(factor: torch.Tensor) -> np.ndarray:
    """F_batch from the first fold F = α I + (1 − α) F_batch."""
    f = factor.double().numpy()
    return (f - ALPHA * np.eye(len(f))) / (1 - ALPHA)


def kfac(model, **kwargs):
    options = dict(factor_decay=ALPHA, kl_clip=None, inv_dtype=F64, damping=1e-3)
    options.update(kwargs)
    return KFAC(model, **options)


# -- 1. factors ---------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 5), (3, 4, 5)])
def test_linear_factors_equal_reference(bias, shape):
    torch.manual_seed(0)
    layer = nn.Linear(5, 3, bias=bias).double()
    pre = kfac(layer)
    x = torch.randn(*shape, dtype=F64)
    target = torch.randn(*shape[:-1], 3, dtype=F64)
    loss = F.mse_loss(layer(x), target)
    loss.backward()
    pre.step()
    # Hooks-free reference: the output gradient of the mean-squared loss is
    # 2 (s − t) / numel, computed here from the forward pass alone.
    with torch.no_grad():
        s = F.linear(x, layer.weight, layer.bias)
    g = (2 * (s - target) / s.numel()).reshape(-1, 3).numpy()
    rows = ref.with_bias_column(x.reshape(-1, 5).numpy(), bias)
    (registered,) = pre.layers
    np.testing.assert_allclose(
        batch_factor(registered.A), ref.second_moment(rows), atol=1e-14
    )
    np.testing.assert_allclose(
        batch_factor(registered.G), ref.second_moment(g), atol=G_ATOL
    )


CONV_CASES = [
    # (kernel, stride, padding argument, dilation, padding_mode)
    ((3, 3), 1, 0, 1, "zeros"),
    ((3, 3), 2, 1, 1, "zeros"),
    ((3, 2), (2, 1), (1, 2), 1, "zeros"),
    ((3, 3), 1, 2, 2, "zeros"),
    ((2, 2), 1, "same", 1, "zeros"),
    ((3, 3), 1, 1, 1, "reflect"),
    ((3, 3), 2, 1, (1, 2), "circular"),
    ((3, 3), 1, "valid", 1, "replicate"),
]
NUMPY_PAD_MODE = {
    "zeros": "constant",
    "reflect": "reflect",
    "circular": "wrap",
    "replicate": "edge",
}


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_conv2d_factors_equal_reference(case, bias):
    kernel, stride, padding, dilation, mode = case
    torch.manual_seed(1)
    conv = nn.Conv2d(
        2,
        3,
        kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        bias=bias,
        padding_mode=mode,
    ).double()
    pre = kfac(conv)
    x = torch.randn(2, 2, 6, 7, dtype=F64)
    out = conv(x)
    target = torch.randn_like(out)
    F.mse_loss(out, target).backward()
    pre.step()
    # Hooks-free reference for the output gradient of the same loss.
    s = (
        torch.nn.functional.conv2d(
            F.pad(
                x,
                conv._reversed_padding_repeated_twice,
                mode="constant" if mode == "zeros" else mode,
            ),
            conv.weight,
            conv.bias,
            conv.stride,
            0,
            conv.dilation,
        )
        .detach()
        .requires_grad_()
    )
    (grad_out,) = torch.autograd.grad(F.mse_loss(s, target), s)
    left, right, top, bottom = conv._reversed_padding_repeated_twice
    A, G = ref.conv_factors(
        x.numpy(),
        grad_out.numpy(),
        conv.kernel_size,
        conv.stride,
        (top, bottom, left, right),
        conv.dilation,
        bias,
        NUMPY_PAD_MODE[mode],
    )
    (registered,) = pre.layers
    np.testing.assert_allclose(batch_factor(registered.A), A, atol=1e-14)
    np.testing.assert_allclose(batch_factor(registered.G), G, atol=G_ATOL)


def test_one_example_factors_are_the_gradient_outer_product():
    """For one example, A_batch ⊗ G_batch... in vec order G ⊗ A = vec∇ vec∇ᵀ."""
    torch.manual_seed(2)
    layer = nn.Linear(4, 3).double()
    pre = kfac(layer)
    x = torch.randn(1, 4, dtype=F64)
    (layer(x).sin().sum()).backward()
    grad = pre.layers[0].grad_matrix().numpy()
    pre.step()
    A = batch_factor(pre.layers[0].A)
    G = batch_factor(pre.layers[0].G)
    np.testing.assert_allclose(
        np.kron(G, A), np.outer(grad.ravel(), grad.ravel()), atol=1e-14
    )


# -- 2./3. preconditioned gradients ---------------------------------------------


def gaussian_step(method, damping, kl_clip=None, lr=0.1, seed=3, prediv=True):
    """One K-FAC step of a one-layer linear model with a Gaussian likelihood;
    returns (preconditioned ∇, raw ∇, A, G) as NumPy."""
    torch.manual_seed(seed)
    layer = nn.Linear(4, 3).double()
    pre = kfac(
        layer,
        compute_method=method,
        damping=damping,
        kl_clip=kl_clip,
        lr=lr,
        compute_eigenvalue_outer_product=prediv,
    )
    x = torch.randn(16, 4, dtype=F64) * torch.tensor([1.0, 3.0, 0.3, 1.0], dtype=F64)
    y = torch.randn(16, 3, dtype=F64)
    (0.5 * ((layer(x) - y) ** 2).sum(1).mean()).backward()
    raw = pre.layers[0].grad_matrix().numpy().copy()
    pre.step()
    out = pre.layers[0].grad_matrix().numpy()
    return out, raw, pre.layers[0].A.numpy(), pre.layers[0].G.numpy()


@pytest.mark.parametrize("damping", [1e-3, 0.1])
@pytest.mark.parametrize("prediv", [True, False])
def test_eigen_equals_dense_damped_fisher_inverse(damping, prediv):
    got, raw, A, G = gaussian_step("eigen", damping, prediv=prediv)
    np.testing.assert_allclose(
        got, ref.eigen_preconditioned(raw, A, G, damping), rtol=1e-11
    )


@pytest.mark.parametrize("damping", [1e-3, 0.1])
def test_inverse_equals_per_factor_damped_inverses(damping):
    got, raw, A, G = gaussian_step("inverse", damping)
    np.testing.assert_allclose(
        got, ref.inverse_preconditioned(raw, A, G, damping), rtol=1e-11
    )


def test_eigen_and_inverse_agree_for_small_damping():
    """They damp differently: 1/(d_G d_A + λ) vs 1/((d_G + λ)(d_A + λ)), relative
    gap ≈ λ (d_G + d_A)/(d_G d_A). With α = 0.5 every eigenvalue is ≥ 0.5 and ≤ ~6
    here, so λ = 1e-8 bounds the gap by ~1e-7 (rtol 1e-6); at λ = 0.1 they differ."""
    eig, *_ = gaussian_step("eigen", 1e-8)
    inv, *_ = gaussian_step("inverse", 1e-8)
    np.testing.assert_allclose(eig, inv, rtol=1e-6)
    eig, *_ = gaussian_step("eigen", 0.1)
    inv, *_ = gaussian_step("inverse", 0.1)
    assert np.abs(eig - inv).max() > 1e-3 * np.abs(eig).max()


@pytest.mark.parametrize("prediv", [True, False])
def test_kl_clip_scales_by_nu(prediv):
    unclipped, raw, *_ = gaussian_step("eigen", 1e-3, prediv=prediv)
    for kl_clip in (1e-6, 1e3):
        clipped, *_ = gaussian_step("eigen", 1e-3, kl_clip=kl_clip, prediv=prediv)
        nu = ref.kl_clip_scale([unclipped], [raw], 0.1, kl_clip)
        np.testing.assert_allclose(clipped, nu * unclipped, rtol=1e-12)
    assert ref.kl_clip_scale([unclipped], [raw], 0.1, 1e-6) < 1


def test_kl_clip_formula():
    rng = np.random.default_rng(0)
    ps = [rng.normal(size=(3, 4)), rng.normal(size=(2, 2))]
    gs = [rng.normal(size=(3, 4)), rng.normal(size=(2, 2))]
    for kl in (1e-4, 1e-1, 1e4):
        got = kl_clip_scale(
            [torch.tensor(p) for p in ps], [torch.tensor(g) for g in gs], 0.3, kl
        )
        assert got == pytest.approx(ref.kl_clip_scale(ps, gs, 0.3, kl), rel=1e-12)
    zero = [torch.zeros(2, 2)]
    assert kl_clip_scale(zero, zero, 0.1, 1e-3) == 1.0


# -- 5. accumulation, AMP, intervals, checkpoints ------------------------------------


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, stride=2, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


def cnn_data(n=8, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g, dtype=dtype), torch.randint(
        0, 5, (n,), generator=g
    )


def test_accumulation_equals_full_batch():
    torch.manual_seed(4)
    full_model = SmallCNN().double()
    micro_model = copy.deepcopy(full_model)
    x, y = cnn_data(12)
    full = kfac(full_model)
    F.cross_entropy(full_model(x), y).backward()
    full.step()
    micro = kfac(micro_model, accumulation_steps=3)
    for xs, ys in zip(x.chunk(3), y.chunk(3)):
        (F.cross_entropy(micro_model(xs), ys) / 3).backward()
    micro.step()
    for a, b in zip(full.layers, micro.layers):
        torch.testing.assert_close(a.A, b.A, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(a.G, b.G, rtol=1e-12, atol=1e-18)
    for p, q in zip(full_model.parameters(), micro_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-14)


def test_accumulation_mismatch_warns():
    model = SmallCNN().double()
    pre = kfac(model, accumulation_steps=2)
    x, y = cnn_data(4)
    F.cross_entropy(model(x), y).backward()
    with pytest.warns(UserWarning, match="accumulation_steps=2"):
        pre.step()


def test_grad_scaler_scale_is_divided_out():
    """G from scaled gradients / s equals G from unscaled ones (s a power of 2:
    exact)."""
    torch.manual_seed(5)
    model = SmallCNN()
    scaled_model = copy.deepcopy(model)
    x, y = cnn_data(8, dtype=torch.float32)
    plain = kfac(model, inv_dtype=torch.float32)
    F.cross_entropy(model(x), y).backward()
    plain.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    scaled = kfac(scaled_model, inv_dtype=torch.float32, grad_scaler=scaler)
    scaler.scale(F.cross_entropy(scaled_model(x), y)).backward()
    scaler.unscale_(torch.optim.SGD(scaled_model.parameters(), lr=0.1))
    scaled.step()
    for a, b in zip(plain.layers, scaled.layers):
        torch.testing.assert_close(a.G, b.G, rtol=0, atol=0)
        torch.testing.assert_close(a.A, b.A, rtol=0, atol=0)
    for p, q in zip(model.parameters(), scaled_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_autocast_with_grad_scaler_trains_with_float32_factors():
    torch.manual_seed(6)
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    pre = KFAC(model, grad_scaler=scaler, damping=0.01)
    x, y = cnn_data(32, dtype=torch.float32)
    with torch.no_grad():
        before = F.cross_entropy(model(x), y).item()
    for _ in range(10):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        pre.step()
        scaler.step(opt)
        scaler.update()
    held = [pre.layers[0].A, pre.layers[0].G, *pre.layers[0].second_order.values()]
    held += [pre.layers[1].A, pre.layers[1].G, *pre.layers[1].second_order.values()]
    assert pre.memory_bytes() == sum(t.numel() * 4 for t in held)
    for layer in pre.layers:
        assert layer.A.dtype == layer.G.dtype == torch.float32
        assert torch.isfinite(layer.A).all()
        assert torch.isfinite(layer.G).all()
        # Unscaled: G is ~1/s² of what it would be with the scale left in.
        assert layer.G.diagonal().max() < 2.0
    with torch.no_grad():
        assert F.cross_entropy(model(x), y).item() < before


def test_update_intervals():
    torch.manual_seed(7)
    model = SmallCNN().double()
    pre = kfac(model, factor_update_steps=2, inv_update_steps=4)
    x, y = cnn_data(8)
    history = []
    for _ in range(6):
        model.zero_grad()
        F.cross_entropy(model(x + 0.1 * torch.randn_like(x)), y).backward()
        pre.step()
        layer = pre.layers[0]
        history.append((layer.A.clone(), layer.second_order["q_a"].clone()))
    changed_factors = [
        not torch.equal(history[i][0], history[i - 1][0]) for i in range(1, 6)
    ]
    changed_second = [
        not torch.equal(history[i][1], history[i - 1][1]) for i in range(1, 6)
    ]
    assert changed_factors == [False, True, False, True, False]  # steps 1..5
    assert changed_second == [False, False, False, True, False]


def test_schedulable_hyperparameters_are_evaluated_at_the_step():
    model = SmallCNN().double()
    pre = kfac(model, damping=lambda step: 0.1 / (step + 1), kl_clip=lambda s: 1e-3)
    x, y = cnn_data(4)
    for step in range(3):
        assert pre.damping == pytest.approx(0.1 / (step + 1))
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
    assert "damping" not in pre.state_dict()


def test_param_scheduler_milestones():
    model = SmallCNN().double()
    pre = kfac(model, damping=0.1, factor_update_steps=4, inv_update_steps=8)
    scheduler = KFACParamScheduler(
        pre,
        damping_alpha=0.5,
        damping_schedule=[2, 4],
        update_freq_alpha=0.5,
        update_freq_schedule=[3],
    )
    seen = []
    for _ in range(5):
        scheduler.step()
        seen.append((pre.damping, pre.factor_update_steps, pre.inv_update_steps))
    assert seen == [
        (0.1, 4, 8),
        (0.05, 4, 8),
        (0.05, 2, 4),
        (0.025, 2, 4),
        (0.025, 2, 4),
    ]
    restored = KFACParamScheduler(
        kfac(SmallCNN().double(), damping=0.1),
        damping_alpha=0.5,
        damping_schedule=[2, 4],
    )
    restored.load_state_dict(scheduler.state_dict())
    assert restored.kfac.damping == pytest.approx(0.025)
    with pytest.raises(ValueError, match="damping is a callable"):
        KFACParamScheduler(
            kfac(SmallCNN().double(), damping=lambda s: 0.1), damping_schedule=[1]
        )


def train(model, pre, batches, opt_state=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
    return opt


@pytest.mark.parametrize(
    "options",
    [dict(), dict(compute_method="inverse", inv_update_steps=2, factor_update_steps=2)],
    ids=["eigen", "inverse-intervals"],
)
def test_state_dict_round_trip_continues_bit_identically(options):
    torch.manual_seed(8)
    batches = [cnn_data(8, seed=s) for s in range(8)]
    model = SmallCNN().double()
    resumed_model = copy.deepcopy(model)
    train(model, kfac(model, kl_clip=1e-2, **options), batches)

    pre = kfac(resumed_model, kl_clip=1e-2, **options)
    opt = train(resumed_model, pre, batches[:4])  # the checkpoint precedes step 4
    buffer = io.BytesIO()
    torch.save(
        {
            "model": resumed_model.state_dict(),
            "opt": opt.state_dict(),
            "kfac": pre.state_dict(),
        },
        buffer,
    )
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    fresh = SmallCNN().double()
    fresh.load_state_dict(checkpoint["model"])
    fresh_pre = kfac(fresh, kl_clip=1e-2, **options)
    fresh_pre.load_state_dict(checkpoint["kfac"])
    assert fresh_pre.steps == 4
    saved = copy.deepcopy(checkpoint["kfac"]["layers"])
    train(fresh, fresh_pre, batches[4:], checkpoint["opt"])
    for name, factors in saved.items():  # loading copied the factors
        for key, factor in factors.items():
            assert torch.equal(checkpoint["kfac"]["layers"][name][key], factor)
    for p, q in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_state_dict_of_other_layers_is_refused():
    pre = kfac(SmallCNN().double())
    other = kfac(nn.Sequential(nn.Linear(3, 3)).double())
    with pytest.raises(
        ValueError, match=r"missing \['conv', 'fc'\], unexpected \['0'\]"
    ):
        pre.load_state_dict(other.state_dict())


# -- 6. layers, bad input, non-finite gradients ----------------------------------------


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm2d(2)
        self.grouped = nn.Conv2d(2, 2, 3, groups=2)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
        self.head = nn.Linear(4, 2)


def test_registration_and_skip_layers(caplog):
    with caplog.at_level(logging.INFO, logger="precond.torch.kfac"):
        pre = KFAC(Mixed(), loglevel=logging.INFO)
    assert [l.name for l in pre.layers] == ["block.0", "block.1.0", "head"]
    assert "grouped" in caplog.text
    assert "groups=2" in caplog.text
    assert "Embedding is not nn.Linear or nn.Conv2d" in caplog.text
    by_class = KFAC(Mixed(), skip_layers=["Sequential"])
    assert [l.name for l in by_class.layers] == ["head"]
    by_name = KFAC(Mixed(), skip_layers=["block\\.1", "head"])
    assert [l.name for l in by_name.layers] == ["block.0"]
    explicit = KFAC(Mixed(), layers=["head"])
    assert [l.name for l in explicit.layers] == ["head"]


class Depthwise(nn.Module):
    """Two grouped (depthwise) convolutions, which K-FAC does not precondition,
    between a pointwise convolution and a linear head, which it does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.depthwise = nn.Conv2d(2, 2, 3, padding=1, groups=2)
        self.pointwise = nn.Conv2d(2, 4, 1)
        self.depthwise2 = nn.Conv2d(4, 4, 3, groups=4)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        x = self.depthwise2(self.pointwise(torch.tanh(self.depthwise(x))))
        return self.head(x.flatten(1))


def test_skipped_grouped_convolutions_are_logged_at_info_once(caplog):
    """A grouped convolution keeps its plain gradient: with the default loglevel
    one INFO line per model names every such layer (a user who asked for
    K-FAC learns which layers it leaves alone), and steps add none."""
    model = Depthwise()
    with caplog.at_level(logging.INFO, logger="precond.torch.kfac"):
        pre = KFAC(model)
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(4, 2, 4, 4)).square().sum().backward()
            pre.step()
    assert [l.name for l in pre.layers] == ["pointwise", "head"]
    grouped = [r for r in caplog.records if "group" in r.getMessage()]
    assert [r.levelno for r in grouped] == [logging.INFO]
    message = grouped[0].getMessage()
    assert "'depthwise' (groups=2)" in message
    assert "'depthwise2' (groups=4)" in message


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        (["grouped"], "groups=2"),
        (["norm"], "BatchNorm2d is not"),
        (["nope"], "not modules"),
    ],
)
def test_naming_an_unsupported_layer_is_refused(layers, message):
    with pytest.raises(ValueError, match=message):
        KFAC(Mixed(), layers=layers)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(damping=0.0), r"Invalid damping=0.0: must be > 0"),
        (dict(factor_decay=1.5), r"Invalid factor_decay=1.5: must be in \(0.0, 1.0\]"),
        (dict(kl_clip=-1.0), r"Invalid kl_clip=-1.0"),
        (dict(lr=-0.1), r"Invalid lr=-0.1"),
        (dict(factor_update_steps=0), r"Invalid factor_update_steps=0: must be >= 1"),
        (dict(inv_update_steps=1.5), r"Invalid inv_update_steps=1.5"),
        (dict(accumulation_steps=0), r"Invalid accumulation_steps=0"),
        (dict(allreduce_bucket_cap_mb=-1), r"Invalid allreduce_bucket_cap_mb=-1"),
        (dict(grad_worker_fraction=2.0), r"Invalid grad_worker_fraction=2.0"),
        (dict(compute_method="svd"), r"Invalid compute_method='svd': must be one of"),
        (dict(assignment_strategy=3), r"Invalid assignment_strategy=3"),
        (dict(inv_dtype=torch.bfloat16), r"Invalid inv_dtype"),
        (dict(factor_dtype=torch.int32), r"Invalid factor_dtype"),
        (dict(grad_scaler=3.0), r"Invalid grad_scaler=3.0"),
        (dict(colocate_factors=False), r"Invalid colocate_factors=False"),
        (
            dict(skip_layers=["fc", 3]),
            r"Invalid skip_layers=\['fc', 3\]: must be a str or a list of str",
        ),
        (dict(unknown=1), r"unexpected keyword argument 'unknown'"),
    ],
)
def test_invalid_arguments_are_refused(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        KFAC(SmallCNN(), **kwargs)


def test_fsdp1_and_dtensors_of_an_old_torch_are_refused(monkeypatch):
    class FullyShardedDataParallel(nn.Module):  # FSDP1's flat parameters
        def __init__(self):
            super().__init__()
            self.module = SmallCNN()

    with pytest.raises(NotImplementedError, match="not FSDP1"):
        KFAC(FullyShardedDataParallel())
    # DTensor weights where torch cannot cut a local shard (before 2.6).
    monkeypatch.setattr(registration, "looks_like_dtensor", lambda t: True)
    monkeypatch.setattr(registration, "dtensors_supported", lambda: False)
    with pytest.raises(NotImplementedError, match=r"torch >= 2\.6"):
        KFAC(SmallCNN())


def test_strategies_in_one_process():
    for strategy in DistributedStrategy:
        pre = KFAC(SmallCNN(), grad_worker_fraction=strategy)
        assert pre.grid.world_size == 1
        assert pre.grid.grad_workers == 1
    assert KFAC(SmallCNN(), grad_worker_fraction=0).grad_worker_fraction == 1.0
    assert (
        KFAC(SmallCNN(), compute_method=ComputeMethod.INVERSE).compute_method
        is ComputeMethod.INVERSE
    )


def test_non_finite_gradient_never_reaches_the_factors(caplog):
    torch.manual_seed(9)
    model = SmallCNN().double()
    pre = kfac(model)
    x, y = cnn_data(8)
    F.cross_entropy(model(x), y).backward()
    pre.step()
    saved = [
        (l.A.clone(), l.G.clone(), {k: v.clone() for k, v in l.second_order.items()})
        for l in pre.layers
    ]
    model.zero_grad()
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    with caplog.at_level(logging.WARNING, logger="precond.torch.kfac"):
        F.cross_entropy(model(bad), y).backward()
        pre.step()
    assert "non-finite" in caplog.text
    for layer, (A, G, second) in zip(pre.layers, saved):
        torch.testing.assert_close(layer.A, A, rtol=0, atol=0)
        torch.testing.assert_close(layer.G, G, rtol=0, atol=0)
        for key, value in second.items():
            torch.testing.assert_close(layer.second_order[key], value, rtol=0, atol=0)
    # The next finite step preconditions as if the bad step never happened.
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    pre.step()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_evaluation_passes_do_not_touch_the_factors():
    model = SmallCNN().double()
    pre = kfac(model)
    x, y = cnn_data(8)
    model.eval()
    F.cross_entropy(model(x), y).backward()  # eval mode: no contributions
    model.train()
    with torch.no_grad():
        model(x)
    assert all(l.a_count == 0 and l.g_count == 0 for l in pre.layers)


# -- 7. odd layers, extreme values, argument table ----------------------------------


class OddLayers(nn.Module):
    """Size-1 and scalar-output layers; with ``empty``, also 0-feature Linears whose
    outputs add exact zeros (so the other layers see the same numbers)."""

    def __init__(self, empty):
        super().__init__()
        torch.manual_seed(4)
        self.body = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)
        self.scalar = nn.Linear(6, 1)
        self.unit = nn.Linear(1, 1, bias=False)
        self.empty = empty
        if empty:
            self.no_outputs = nn.Linear(4, 0)
            self.no_inputs = nn.Linear(0, 3)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        out = self.head(h) + self.unit(self.scalar(h))
        if self.empty:
            out = out + self.no_outputs(x).sum(-1, keepdim=True)
            out = out + 0.0 * self.no_inputs(x[:, :0])
        return out


def test_empty_and_size_one_layers_train_like_the_model_without_them():
    params = []
    for empty in (False, True):
        model = OddLayers(empty)
        pre = KFAC(model, kl_clip=1e-2)
        assert [l.name for l in pre.layers] == ["body", "head", "scalar", "unit"]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            F.cross_entropy(model(x), torch.arange(8) % 3).backward()
            pre.step()
            opt.step()
        assert all(l.second_order for l in pre.layers)
        params.append([p for n, p in model.named_parameters() if "no_" not in n])
    for p, q in zip(*params, strict=True):
        assert torch.equal(p, q)


def bad_input(value):
    def bad(x):
        x[0, 0] = value
        return x, 1.0

    return bad


def mixed_input(x):
    x[0] = torch.tensor([1e-30, 1e-10, 1e10, 1e30])
    return x, 1.0


EXTREME = {
    "1e30 input": bad_input(1e30),
    "float32 max input": bad_input(torch.finfo(torch.float32).max),
    "1e-30..1e30 input": mixed_input,
    "nan input": bad_input(float("nan")),
    "1e30 gradient": lambda x: (x, 1e30),
}


def test_extreme_values_leave_the_state_finite():
    """Policy: a factor contribution that is not finite or whose squared norm
    overflows is dropped; a huge finite gradient is preconditioned scale-safely
    and KL-clipped; a non-finite gradient is left to the optimizer (skipped here,
    as GradScaler does). Oracle: the run without the bad step. A huge finite
    gradient (clipped) ends within 1% of it; the skipped steps end where skipping
    that batch leads (measured: up to ~7% on this short, path-sensitive run), and
    still train."""
    torch.manual_seed(0)
    initial = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 3, generator=g)
    data = [torch.randn(16, 4, generator=g) for _ in range(50)]
    data = [(x, (x @ w).argmax(1)) for x in data]
    x_eval = torch.randn(256, 4, generator=g)
    y_eval = (x_eval @ w).argmax(1)

    def run(bad=None, at=20):
        model = copy.deepcopy(initial)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        pre = KFAC(model, lr=0.1, inv_update_steps=2)
        for step, (x, y) in enumerate(data):
            opt.zero_grad()
            x, scale = bad(x.clone()) if step == at and bad else (x, 1.0)
            (F.cross_entropy(model(x), y) * scale).backward()
            pre.step()
            for layer in pre.layers:
                for t in (layer.A, layer.G, *layer.second_order.values()):
                    assert torch.isfinite(t).all(), (step, layer.name)
            if all(torch.isfinite(p.grad).all() for p in model.parameters()):
                opt.step()
        with torch.no_grad():
            return F.cross_entropy(model(x_eval), y_eval).item()

    with torch.no_grad():
        start = F.cross_entropy(initial(x_eval), y_eval).item()
    clean = run()
    for name, bad in EXTREME.items():
        loss = run(bad)
        assert loss < 0.5 * start, name
        if name == "1e30 gradient":
            assert loss == pytest.approx(clean, rel=0.01), name


def test_kl_clip_still_clips_where_its_sum_overflows():
    rng = np.random.default_rng(1)
    ps = [rng.normal(size=(3, 4)), rng.normal(size=(2, 2))]
    gs = [rng.normal(size=(3, 4)), rng.normal(size=(2, 2))]
    for magnitude, dtype in ((1e25, torch.float32), (1e200, F64)):
        p32 = [torch.tensor(p * magnitude, dtype=dtype) for p in ps]
        g32 = [torch.tensor(g * magnitude, dtype=dtype) for g in gs]
        assert not torch.isfinite(sum((p * g).sum() for p, g in zip(p32, g32)))
        inner = abs(sum(float(np.sum(p * g)) for p, g in zip(ps, gs)))
        want = np.sqrt(1e-3 / (0.1**2 * inner)) / magnitude  # ν of s·P, s·∇
        got = kl_clip_scale(p32, g32, 0.1, 1e-3)
        assert 0 < got < 1
        assert got == pytest.approx(want, rel=1e-6)
    # Through the preconditioner: a float32 gradient ~1e25 is clipped by the ν of
    # the unclipped (finite) update P, computed in float64: ν² lr² ⟨P, ∇⟩ = κ.
    updates = []
    for kl_clip in (None, 1e-3):
        torch.manual_seed(2)
        layer = nn.Linear(4, 3)
        pre = KFAC(layer, kl_clip=kl_clip, lr=0.1)
        x = torch.randn(16, 4)
        layer(x).square().mean().backward()
        pre.step()  # factors from a normal step: the huge step's G overflows
        layer.zero_grad()
        (1e25 * layer(x).square().mean()).backward()
        raw = pre.layers[0].grad_matrix().double()
        pre.step()
        updates.append(pre.layers[0].grad_matrix().double())
    unclipped, clipped = updates
    assert torch.isfinite(unclipped).all()
    nu = math.sqrt(1e-3 / (0.1**2 * (unclipped * raw).sum().item()))
    assert nu < 1e-20
    torch.testing.assert_close(clipped, nu * unclipped, rtol=1e-5, atol=0)


BAD_ARGUMENTS = [
    ("factor_update_steps", True),
    ("inv_update_steps", 2.0),
    ("damping", "0.1"),
    ("factor_decay", 0.0),
    ("kl_clip", float("inf")),
    ("lr", float("nan")),
    ("accumulation_steps", 1.0),
    ("allreduce_bucket_cap_mb", "25"),
    ("assignment_strategy", "fast"),
    ("colocate_factors", 1),
    ("compute_method", ComputeMethod),
    ("compute_eigenvalue_outer_product", "no"),
    ("grad_worker_fraction", True),
    ("grad_worker_fraction", -0.5),
    ("grad_worker_fraction", ComputeMethod.EIGEN),
    ("symmetry_aware", "yes"),
    ("grad_scaler", "scaler"),
    ("factor_dtype", "float32"),
    ("inv_dtype", torch.float16),
    ("skip_layers", 3),
    ("verbose", "yes"),
    ("world_size_invariant", 1.0),
    ("skip_layers", ["("]),
    ("update_factors_in_hook", 0),
    ("loglevel", True),
    ("loglevel", -1),
    ("layers", [1]),
]


def test_every_argument_is_checked_at_construction():
    for name, value in BAD_ARGUMENTS:
        with pytest.raises((TypeError, ValueError)) as error:
            KFAC(SmallCNN(), **{name: value})
        assert str(error.value).startswith(f"Invalid {name}={value!r}: must be "), (
            name,
            str(error.value),
        )
    # What KAISA 0.4 accepts is accepted.
    for options in (
        dict(assignment_strategy="memory", compute_method="INVERSE"),
        dict(grad_worker_fraction=1, compute_method="inverse", colocate_factors=False),
        dict(grad_worker_fraction=DistributedStrategy.MEM_OPT),
        dict(damping=lambda step: 0.1, lr=lambda step: 0.1, kl_clip=None),
        dict(factor_update_steps=lambda step: 2, inv_update_steps=np.int64(3)),
        dict(symmetry_aware=np.bool_(True), compute_eigenvalue_outer_product=False),
        dict(skip_layers=("conv",), layers=["fc"], loglevel=logging.INFO),
    ):
        KFAC(SmallCNN(), **options)
