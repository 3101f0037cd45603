"""The PyTorch factories of ``precond bench``'s optimizers: each builds a
:class:`TorchOptimizer` from a model, a learning rate and a decoupled weight
decay, and imports torch and precond when called, never at import time.

To add one, write a factory ``(model, lr, weight_decay) ↦ TorchOptimizer`` and
register it in :data:`precond.bench.optimizers.OPTIMIZERS` (see
:func:`make_kfac`: a gradient preconditioner stepped before an SGD step).
"""

from __future__ import annotations

from typing import Any

from precond.bench.jax_optimizers import BENCH_SHAMPOO_OPTIONS, SGD_MOMENTUM


class TorchOptimizer:
    """A PyTorch optimizer as the runner drives it: an optional gradient
    preconditioner (``preconditioner.step()`` rewrites the ``.grad`` fields, as
    K-FAC does) followed by the steps of one or more ``torch.optim.Optimizer``
    over disjoint parameters (Muon for the hidden matrices, AdamW for the rest).

    Args:
        optimizer: the ``torch.optim.Optimizer`` that applies the update, or a
            sequence of them; the first one's first param group holds the peak
            rate the factory was given.
        preconditioner: an object with ``step()``, stepped before ``optimizer``,
            and ``memory_bytes()`` (its state), or None.
    """

    def __init__(self, optimizer: Any, preconditioner: Any = None):
        optimizers = (
            list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]
        )
        self.optimizers = optimizers
        self.optimizer = optimizers[0]
        self.preconditioner = preconditioner
        self.lr = self.optimizer.param_groups[0]["lr"]
        # Each group's peak rate relative to the first: set_lr keeps the ratios.
        self._relative = [
            [group["lr"] / self.lr for group in o.param_groups] for o in optimizers
        ]

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        """Sets the learning rate of the first param group to ``lr`` and every
        other group's to ``lr`` times its peak rate's ratio to the first's (and
        the preconditioner's, through ``self.lr``, if it reads it)."""
        self.lr = lr
        for optimizer, ratios in zip(self.optimizers, self._relative, strict=True):
            for group, ratio in zip(optimizer.param_groups, ratios, strict=True):
                group["lr"] = lr if ratio == 1.0 else lr * ratio

    def step(self) -> None:
        if self.preconditioner is not None:
            self.preconditioner.step()
        for optimizer in self.optimizers:
            optimizer.step()

    def state_bytes(self) -> int:
        """Bytes of the optimizer's state tensors and the preconditioner's."""
        import torch

        def nbytes(value: Any) -> int:
            if isinstance(value, torch.Tensor):
                return value.numel() * value.element_size()
            if isinstance(value, dict):
                return sum(nbytes(v) for v in value.values())
            if isinstance(value, list | tuple):
                return sum(nbytes(v) for v in value)
            return 0

        total = sum(nbytes(dict(o.state)) for o in self.optimizers)
        if self.preconditioner is not None:
            total += self.preconditioner.memory_bytes()
        return total


def make_kron(model, lr: float, weight_decay: float) -> TorchOptimizer:
    import torch

    from precond.torch import Kron
    from precond.torch.kron import precond_update_prob_schedule

    # The rules the recorded figures were measured with (precond's, before torch
    # Kron took kron-torch 0.1.0's defaults): RMS clipping, no skew rule, float32
    # factors, triangular factors from 2-D, the schedule flat for 500 steps (as
    # precond.jax.kron's).
    return TorchOptimizer(
        Kron(
            model.parameters(),
            lr=lr,
            weight_decay=weight_decay,
            preconditioner_update_probability=precond_update_prob_schedule(
                flat_start=500
            ),
            max_skew_triangular=float("inf"),
            min_ndim_triangular=2,
            precond_dtype=torch.float32,
            update_clipping="rms",
            preconditioner_update_style="QUAD",
        )
    )


def make_pro(model, lr: float, weight_decay: float) -> TorchOptimizer:
    from precond.torch import Pro

    return TorchOptimizer(Pro(model.parameters(), lr=lr, weight_decay=weight_decay))


def make_pro_adamw(model, lr: float, weight_decay: float) -> TorchOptimizer:
    """``precond.torch.ProAdamW`` called as a user calls it: its defaults, and
    its rule on the names of ``model.named_parameters()`` (the JAX alias's)."""
    from precond.torch import ProAdamW

    return TorchOptimizer(
        ProAdamW(model.named_parameters(), lr=lr, weight_decay=weight_decay)
    )


def make_shampoo(model, lr: float, weight_decay: float) -> TorchOptimizer:
    """``precond.torch.Shampoo`` with the bench's Shampoo options (those of
    :func:`make_shampoo` and :data:`BENCH_SHAMPOO_OPTIONS`), its weight decay
    decoupled (−lr·λθ, as AdamW's)."""
    from precond.torch import GraftingType, Shampoo

    return TorchOptimizer(
        Shampoo(
            model.parameters(),
            lr=lr,
            block_size=128,
            graft_type=GraftingType.RMSPROP_NORMALIZED,
            weight_decay=weight_decay,
            decoupled_weight_decay=True,
            **BENCH_SHAMPOO_OPTIONS,
        )
    )


def make_soap(model, lr: float, weight_decay: float) -> TorchOptimizer:
    """``precond.torch.SOAP`` with the paper's defaults and the bench's decay."""
    from precond.torch import SOAP

    return TorchOptimizer(SOAP(model.parameters(), lr=lr, weight_decay=weight_decay))


def make_adamw(model, lr: float, weight_decay: float) -> TorchOptimizer:
    import torch

    return TorchOptimizer(
        torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    )


def make_muon(
    model, lr: float, weight_decay: float, *, adam_learning_rate: float
) -> TorchOptimizer:
    """``torch.optim.Muon`` (its defaults: Nesterov momentum 0.95, 5
    Newton-Schulz steps in bfloat16, the "original" rate adjustment
    sqrt(max(1, out/in))) on ``model.hidden_matrices()``, and
    ``torch.optim.AdamW`` (β=(0.9, 0.999), ε=1e-8) at ``adam_learning_rate`` on
    every other parameter (embeddings, output head, biases, norms), as torch's
    documentation of Muon prescribes. Both decay weights as θ ← θ(1 − lr·λ)."""
    import torch

    if not hasattr(torch.optim, "Muon"):
        raise RuntimeError(
            f"the bench's muon needs torch.optim.Muon (torch >= 2.9); torch "
            f"{torch.__version__} does not have it"
        )
    hidden = {id(p) for p in model.hidden_matrices()}
    matrices = [p for p in model.parameters() if id(p) in hidden]
    rest = [p for p in model.parameters() if id(p) not in hidden]
    return TorchOptimizer(
        [
            torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay),
            torch.optim.AdamW(rest, lr=adam_learning_rate, weight_decay=weight_decay),
        ]
    )


def _torch_sgd(model, lr: float, weight_decay: float):
    """SGD with Nesterov momentum 0.9 and decoupled weight decay θ ← θ(1 − lr·λ)
    (torch's SGD couples it; it is applied here after the step instead)."""
    import torch

    class DecoupledSGD(torch.optim.SGD):
        def __init__(self, params, lr, weight_decay):
            super().__init__(params, lr=lr, momentum=SGD_MOMENTUM, nesterov=True)
            self.decoupled_weight_decay = weight_decay

        @torch.no_grad()
        def step(self, closure=None):
            loss = super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    p.mul_(1 - group["lr"] * self.decoupled_weight_decay)
            return loss

    return DecoupledSGD(model.parameters(), lr=lr, weight_decay=weight_decay)


def make_sgd(model, lr: float, weight_decay: float) -> TorchOptimizer:
    return TorchOptimizer(_torch_sgd(model, lr, weight_decay))


def make_kfac(model, lr: float, weight_decay: float) -> TorchOptimizer:
    """SGD-momentum whose gradients K-FAC preconditions (KAISA's usage:
    ``loss.backward(); kfac.step(); sgd.step()``). K-FAC's own ``lr`` (its KL
    clip) follows the scheduled learning rate."""
    from precond.torch.kfac import KFAC

    optimizer = TorchOptimizer(_torch_sgd(model, lr, weight_decay))
    optimizer.preconditioner = KFAC(
        model,
        lr=lambda step: optimizer.lr,
        damping=KFAC_DAMPING,
        factor_update_steps=1,
        inv_update_steps=10,
    )
    return optimizer


KFAC_DAMPING = 0.003
