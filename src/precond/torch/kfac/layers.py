"""The layers K-FAC preconditions: their Kronecker factors and gradient layout.

For a layer computing ``s = W ā`` on rows ``ā = [a, 1]`` (the bias column when the
layer has a bias), K-FAC approximates the Fisher block of ``vec(W)`` by ``A ⊗ G``
with ``A = E[ā āᵀ]`` over the rows and ``G = E[g gᵀ]``, g the gradient of the loss
with respect to ``s`` as autograd sees it (so it already holds the 1/N of a mean
loss). A ``Conv2d`` is a linear layer applied at every output position to the
unfolded input patch; both its patch rows and its output-gradient rows are divided
by the number of positions S = oh·ow (KAISA's convention), so A = āᵀā/(N·S).

:class:`KFACLayer` holds one registered module's factors and second-order data; the
functions here are the math, shared by the hooks and the tests' references.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

from precond.torch._core.dtensor import full_gradients, local_part, local_value

__all__ = [
    "KFACLayer",
    "input_covariance",
    "is_trained_grouped_convolution",
    "module_class",
    "output_grad_covariance",
    "second_moment",
    "unsupported_reason",
]


def module_class(module: nn.Module) -> type:
    """The module's own class: FSDP2's ``fully_shard`` replaces it with a subclass
    FSDP<class> whose method resolution order is (FSDP<class>, FSDPModule,
    class, ...)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    order = type(module).__mro__
    if fsdp_module is not None and isinstance(module, fsdp_module):
        return order[order.index(fsdp_module) + 1]
    return type(module)


def unsupported_reason(module: nn.Module) -> str | None:
    """Why K-FAC cannot precondition ``module`` (``None`` if it can)."""
    if module_class(module) not in (nn.Linear, nn.Conv2d):
        return f"{module_class(module).__name__} is not nn.Linear or nn.Conv2d"
    assert isinstance(module, nn.Linear | nn.Conv2d)  # FSDP<class> is one too
    if not module.weight.requires_grad:
        return "its weight does not require a gradient"
    if module.weight.is_complex():
        return "its weight is complex"
    if isinstance(module, nn.Conv2d) and module.groups != 1:
        return (
            f"groups={module.groups}: a grouped convolution has one factor pair "
            "per group, which is not supported"
        )
    return None


def is_trained_grouped_convolution(module: nn.Module) -> bool:
    """A grouped ``nn.Conv2d`` whose weight is trained: a layer a user may expect
    K-FAC to precondition, which it does not (:func:`unsupported_reason`)."""
    return (
        isinstance(module, nn.Conv2d)
        and module.groups != 1
        and module.weight.requires_grad
    )


def _has_bias(module: nn.Module) -> bool:
    return getattr(module, "bias", None) is not None


def input_covariance(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A_batch = E[ā āᵀ] over the rows ā of the layer input: (in [+1], in [+1]).

    Linear: every leading dim of ``x`` is a row. Conv2d: one row per output position
    per example, the patch the kernel sees (``F.unfold`` with the layer's kernel,
    dilation and stride, after the layer's own padding), divided by S = oh·ow.
    """
    if isinstance(module, nn.Conv2d):
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
            padding = 0
        else:
            padding = module.padding
        patches = F.unfold(
            x,
            module.kernel_size,
            dilation=module.dilation,
            padding=padding,
            stride=module.stride,
        )  # (N, C·kh·kw, S)
        positions = patches.shape[-1]
        rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
    else:
        positions = 1
        rows = x.reshape(-1, x.shape[-1])
    if _has_bias(module):
        rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    return second_moment(rows, 1.0 / positions**2)


def output_grad_covariance(
    module: nn.Module, g: torch.Tensor, divisor: float = 1.0
) -> torch.Tensor:
    """G_batch = E[g gᵀ] over the rows of ``g / divisor``: (out, out).

    Conv2d: (N, C_out, oh, ow) → rows (N·oh·ow, C_out), divided by S = oh·ow.
    """
    if isinstance(module, nn.Conv2d):
        positions = g.shape[2] * g.shape[3]
        rows = g.permute(0, 2, 3, 1).reshape(-1, g.shape[1])
    else:
        positions = 1
        rows = g.reshape(-1, g.shape[-1])
    return second_moment(rows, 1.0 / (positions * divisor) ** 2)


def second_moment(rows: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale · rowsᵀ rows / n_rows``, one matmul and one in-place scaling.

    Not symmetrised: ``eigh`` reads one triangle, and the symmetry-aware all-reduce
    sends one.
    """
    return (rows.T @ rows).mul_(scale / rows.shape[0])


class KFACLayer:
    """One registered module: its running factors A and G, the contributions the
    hooks collected since the last fold, and its second-order data.

    ``grad_matrix`` / ``set_grad`` convert between the module's ``.grad`` tensors and
    the (out, in [+1]) matrix ∇ = [∇W_flat | ∇b] that A and G act on. For DTensor
    parameters (FSDP2's ``fully_shard``) ∇ is gathered whole (G⁻¹∇A⁻¹ mixes all
    its rows) and each rank writes back its shard's rows
    (:mod:`precond.torch._core.dtensor`).
    """

    def __init__(self, name: str, module: nn.Linear | nn.Conv2d):
        self.name = name
        self.module = module
        self.has_bias = _has_bias(module)
        weight = module.weight
        self.g_dim = weight.shape[0]
        self.a_dim = math.prod(weight.shape[1:]) + int(self.has_bias)
        # Sums of per-pass contributions since the last fold, and their counts.
        self.a_sum: torch.Tensor | None = None
        self.g_sum: torch.Tensor | None = None
        self.a_count = 0
        self.g_count = 0
        # Running factors (None until the first fold).
        self.A: torch.Tensor | None = None
        self.G: torch.Tensor | None = None
        # Second-order data by name (eigenvectors, eigenvalues, inverses), held on
        # the layer's gradient workers only.
        self.second_order: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return (
            f"KFACLayer({self.name!r}, {type(self.module).__name__}, "
            f"A {self.a_dim}×{self.a_dim}, G {self.g_dim}×{self.g_dim})"
        )

    def add_a(self, contribution: torch.Tensor) -> None:
        self.a_sum = contribution if self.a_sum is None else self.a_sum + contribution
        self.a_count += 1

    def add_g(self, contribution: torch.Tensor) -> None:
        self.g_sum = contribution if self.g_sum is None else self.g_sum + contribution
        self.g_count += 1

    def clear_contributions(self) -> None:
        self.a_sum = self.g_sum = None
        self.a_count = self.g_count = 0

    def has_grad(self) -> bool:
        return self.module.weight.grad is not None

    def grad_matrix(self) -> torch.Tensor:
        """∇ = [∇W reshaped to (out, rest) | ∇b]: shape (g_dim, a_dim)."""
        (weight_grad,) = full_gradients([self.module.weight])
        grad = weight_grad.reshape(self.g_dim, -1)
        if self.has_bias:
            bias = self.module.bias
            assert bias is not None  # has_bias
            if bias.grad is None:
                bias_grad = grad.new_zeros(bias.shape)
            else:
                (bias_grad,) = full_gradients([bias])
            grad = torch.cat([grad, bias_grad.reshape(-1, 1)], dim=1)
        return grad

    def set_grad(self, matrix: torch.Tensor) -> None:
        """Writes ``matrix`` (g_dim, a_dim) back into the weight and bias grads."""
        weight = self.module.weight
        assert weight.grad is not None  # called for layers with has_grad() only
        columns = math.prod(weight.shape[1:])
        whole = matrix[:, :columns].reshape(weight.shape)
        local_value(weight.grad).copy_(local_part(weight.grad, whole))
        if self.has_bias:
            bias = self.module.bias
            assert bias is not None  # has_bias
            if bias.grad is None:
                bias.grad = torch.zeros_like(bias)
            local_value(bias.grad).copy_(local_part(bias.grad, matrix[:, -1]))
