"""Benchmark optimizers: name ↦ default learning rate and a factory per framework.

A JAX factory builds an ``optax.GradientTransformation`` from a (constant) learning
rate and a decoupled weight decay; a PyTorch factory builds a
:class:`TorchOptimizer` from a model, a learning rate and a weight decay. The runners
treat all optimizers alike: the learning-rate schedule multiplies the whole update
(JAX) or sets ``param_groups[i]["lr"]`` (PyTorch) every step. Factories import JAX,
optax, torch and precond when called, never at import time.

To add a PyTorch optimizer, write a factory ``(model, lr, weight_decay) ↦
TorchOptimizer`` and register an :class:`OptimizerSpec` with it in
:data:`OPTIMIZERS` (see ``_make_torch_kfac``: a gradient preconditioner stepped
before an SGD step). An optimizer that trains part of the model with a second
rule (Muon: AdamW for embeddings, the output head, biases and norms) lists that
part's rates in ``part_learning_rates`` and, with ``partitioned``, gets the
workload's split of its parameters (see ``_make_muon``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from precond.bench.learning_rates import LEARNING_RATES, MUON_ADAM_LEARNING_RATES

# Decoupled weight decay λ shared by every optimizer (optax.adamw's default), applied
# as θ ← θ − lr·(u + λθ) by AdamW, Kron, Shampoo and SGD.
DEFAULT_WEIGHT_DECAY = 1e-4

FRAMEWORKS = ("jax", "torch")

# The baseline every ratio in the report is taken against.
BASELINE = "adamw"


def module_installed(name: str) -> bool:
    """Whether module ``name`` can be imported, found without importing it (for
    a submodule, its parent packages are imported: name top-level modules)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class OptimizerSpec:
    """One benchmark optimizer.

    Attributes:
        name: registry key, used on the command line.
        description: one line for ``precond bench --list``.
        make: (learning_rate, weight_decay) ↦ optax transformation, or None when
            there is no JAX version.
        make_torch: (model, learning_rate, weight_decay) ↦ :class:`TorchOptimizer`,
            or None when there is no PyTorch version.
        learning_rates: framework ↦ workload ↦ peak learning rate, from
            :data:`precond.bench.learning_rates.LEARNING_RATES` (``--lr
            name=value`` overrides it).
        requires: modules that must be importable for the PyTorch factory.
        default: run by a bare ``precond bench`` (others only when named).
        part_learning_rates: keyword ↦ framework ↦ workload ↦ the peak rate of a
            part of the model that a second rule trains (Muon's AdamW part:
            ``adam_learning_rate``), given to both factories as that keyword
            argument. ``--lr`` and ``--lr-sweep`` change ``learning_rates`` only;
            the bench's schedule multiplies both rates alike.
        partitioned: the factories split the parameters into hidden-layer weight
            matrices and the rest: the JAX factory gets the workload's
            ``hidden_matrices`` rule as a keyword argument, the PyTorch factory
            calls the model's ``hidden_matrices()``.
        reference: another library's optimizer (AdamW, Muon, SGD), which
            precond's are compared with; False for precond's own.
    """

    name: str
    description: str
    make: Callable[..., Any] | None = None
    make_torch: Callable[..., TorchOptimizer] | None = None
    learning_rates: dict[str, dict[str, float]] = field(default_factory=dict)
    requires: tuple[str, ...] = ()
    default: bool = True
    part_learning_rates: dict[str, dict[str, dict[str, float]]] = field(
        default_factory=dict
    )
    partitioned: bool = False
    reference: bool = False

    def frameworks(self) -> tuple[str, ...]:
        """The frameworks this optimizer has a factory for."""
        found = []
        if self.make is not None:
            found.append("jax")
        if self.make_torch is not None:
            found.append("torch")
        return tuple(found)

    def learning_rate(self, workload: str, framework: str) -> float:
        """The tuned peak learning rate on ``workload`` in ``framework``."""
        return self.learning_rates[framework][workload]

    def available(self) -> bool:
        """Whether the modules of ``requires`` are installed."""
        return all(module_installed(m) for m in self.requires)

    def factory_arguments(self, framework: str, workload: Any) -> dict[str, Any]:
        """The keyword arguments a factory gets besides the rate and the weight
        decay on ``workload`` (a :class:`precond.bench.workloads.Workload`)."""
        arguments: dict[str, Any] = {
            keyword: rates[framework][workload.name]
            for keyword, rates in self.part_learning_rates.items()
        }
        if self.partitioned and framework == "jax":
            arguments["hidden_matrices"] = workload.hidden_matrices
        return arguments

    def build(
        self,
        framework: str,
        workload: Any,
        learning_rate: Any,
        weight_decay: float,
        model: Any = None,
    ) -> Any:
        """This optimizer in ``framework`` for ``workload``: an optax
        transformation (JAX), or a :class:`TorchOptimizer` for ``model``."""
        arguments = self.factory_arguments(framework, workload)
        if framework == "jax" and self.make is not None:
            return self.make(learning_rate, weight_decay, **arguments)
        if framework == "torch" and self.make_torch is not None:
            return self.make_torch(model, learning_rate, weight_decay, **arguments)
        raise ValueError(
            f"Invalid framework={framework!r}: {self.name} runs in "
            + (", ".join(self.frameworks()) or "no framework")
        )


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


# --------------------------------------------------------------------------- JAX


def _make_kron(learning_rate, weight_decay: float):
    from precond.jax import kron

    # No merging or blocking: the layout the recorded figures were measured with
    # (before kron took distributed-kron 1.0.0's defaults, which merge and block).
    return kron(
        learning_rate=learning_rate,
        weight_decay=weight_decay,
        merge_small_dims=False,
        partition_grads_into_blocks=False,
        preconditioner_update_style="QUAD",
    )


def _make_pro(learning_rate, weight_decay: float):
    from precond.jax import pro

    # distributed-kron 2.0's defaults but the bench's decay (pro's own is 0.1).
    return pro(learning_rate=learning_rate, weight_decay=weight_decay)


def _make_pro_adamw(learning_rate, weight_decay: float):
    """``precond.jax.pro_adamw`` called as a user calls it: its defaults (pro at
    2 times AdamW's rate, b1 0.7, 'QEQ' fits on its schedule) and its own rule
    for which parameters pro takes (every weight matrix but embeddings and
    named heads: on the MLPs the output layer too, unlike Muon's split)."""
    from precond.jax import pro_adamw

    return pro_adamw(learning_rate, weight_decay=weight_decay)


def _make_psgd_jax(alias: str) -> Callable:
    """A factory of psgd-jax's ``alias`` (``xmat``, ``low_rank_approximation``,
    ``affine``) with its defaults: whitening, a fit every step."""

    def make(learning_rate, weight_decay: float):
        import precond.jax as pj

        return getattr(pj, alias)(
            learning_rate=learning_rate, weight_decay=weight_decay
        )

    return make


def make_shampoo(learning_rate, weight_decay: float, **kwargs):
    """``precond.jax.distributed_shampoo`` with decoupled weight decay.

    Block size 128 and RMSProp-normalized grafting unless ``kwargs`` say otherwise
    (any other ``distributed_shampoo`` argument may be given too). Shampoo's own
    ``weight_decay`` is coupled (added to the direction before momentum), so it is
    left at 0 and the decay is applied as Kron and AdamW apply it: Shampoo runs at
    learning rate 1 (its update is then −v), and ``chain(scale(−1),
    add_decayed_weights(λ), scale_by_learning_rate(lr))`` turns −v into
    −lr·(v + λθ).
    """
    import optax

    from precond.jax import GraftingType, distributed_shampoo

    options = {"block_size": 128, "graft_type": GraftingType.RMSPROP_NORMALIZED}
    shampoo = distributed_shampoo(learning_rate=1.0, **(options | kwargs))
    return optax.chain(
        shampoo,
        optax.scale(-1.0),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )


# The bench's Shampoo: β2 0.95 (0.999, the default, gave spiky digits curves) and
# inverse roots by eigh every 10 steps (faster and more accurate than Newton on a
# CPU; see BENCHMARKS.md).
BENCH_SHAMPOO_OPTIONS = {
    "beta2": 0.95,
    "eigh": True,
    "preconditioning_compute_steps": 10,
}


def _make_bench_shampoo(learning_rate, weight_decay: float):
    return make_shampoo(learning_rate, weight_decay, **BENCH_SHAMPOO_OPTIONS)


def _make_soap(learning_rate, weight_decay: float):
    """``precond.jax.soap`` with the paper's defaults (betas 0.95, bases
    refreshed every 10 steps by a QR power step) and the bench's decay."""
    from precond.jax import soap

    return soap(learning_rate, weight_decay=weight_decay)


def _make_adamw(learning_rate, weight_decay: float):
    import optax

    return optax.adamw(learning_rate=learning_rate, weight_decay=weight_decay)


SGD_MOMENTUM = 0.9


def _make_sgd(learning_rate, weight_decay: float):
    import optax

    return optax.chain(
        optax.trace(decay=SGD_MOMENTUM, nesterov=True),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )


def _make_muon(
    learning_rate,
    weight_decay: float,
    *,
    adam_learning_rate,
    hidden_matrices: Callable[[Any], Any],
):
    """``optax.contrib.muon`` (its defaults: Nesterov momentum 0.95, 5
    Newton-Schulz steps, the update scaled by sqrt(max(1, fan_out/fan_in))) on
    the parameters ``hidden_matrices(params)`` marks True, and the AdamW that
    ``optax.contrib.muon`` ships for the rest (β=(0.9, 0.999), Nesterov) at
    ``adam_learning_rate``. Both parts decay weights as θ ← θ − lr·(u + λθ).

    Without ``muon_weight_dimension_numbers``, optax would give Muon every 2-D
    parameter, the embedding tables and the output head included; Muon's
    documentation prescribes AdamW for those, so the workload's rule decides.
    """
    import inspect

    import jax
    import optax
    from optax.contrib import MuonDimensionNumbers, muon

    needed = {
        "adam_learning_rate",
        "adam_weight_decay",
        "muon_weight_dimension_numbers",
    }
    missing = needed - set(inspect.signature(muon).parameters)
    if missing:
        raise RuntimeError(
            f"the bench's muon needs an optax.contrib.muon that takes "
            f"{', '.join(sorted(missing))}; optax {optax.__version__} does not"
        )

    def dimension_numbers(params):
        # (in, out) matrices, as the bench's models store them: the default
        # reduction axis 0 and output axis 1; None leaves go to AdamW.
        return jax.tree.map(
            lambda hidden: MuonDimensionNumbers() if hidden else None,
            hidden_matrices(params),
        )

    return muon(
        learning_rate,
        weight_decay=weight_decay,
        adam_weight_decay=weight_decay,
        adam_learning_rate=adam_learning_rate,
        muon_weight_dimension_numbers=dimension_numbers,
    )


# ------------------------------------------------------------------------- torch


def _make_torch_kron(model, lr: float, weight_decay: float) -> TorchOptimizer:
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


def _make_torch_pro(model, lr: float, weight_decay: float) -> TorchOptimizer:
    from precond.torch import Pro

    return TorchOptimizer(Pro(model.parameters(), lr=lr, weight_decay=weight_decay))


def _make_torch_pro_adamw(model, lr: float, weight_decay: float) -> TorchOptimizer:
    """``precond.torch.ProAdamW`` called as a user calls it: its defaults, and
    its rule on the names of ``model.named_parameters()`` (the JAX alias's)."""
    from precond.torch import ProAdamW

    return TorchOptimizer(
        ProAdamW(model.named_parameters(), lr=lr, weight_decay=weight_decay)
    )


def _make_torch_shampoo(model, lr: float, weight_decay: float) -> TorchOptimizer:
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


def _make_torch_soap(model, lr: float, weight_decay: float) -> TorchOptimizer:
    """``precond.torch.SOAP`` with the paper's defaults and the bench's decay."""
    from precond.torch import SOAP

    return TorchOptimizer(SOAP(model.parameters(), lr=lr, weight_decay=weight_decay))


def _make_torch_adamw(model, lr: float, weight_decay: float) -> TorchOptimizer:
    import torch

    return TorchOptimizer(
        torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    )


def _make_torch_muon(
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


def _make_torch_sgd(model, lr: float, weight_decay: float) -> TorchOptimizer:
    return TorchOptimizer(_torch_sgd(model, lr, weight_decay))


def _make_torch_kfac(model, lr: float, weight_decay: float) -> TorchOptimizer:
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


OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        OptimizerSpec(
            name="kron",
            description="PSGD Kron (precond.jax.kron / precond.torch.Kron), "
            "preconditioner_update_style='QUAD', other arguments default",
            make=_make_kron,
            make_torch=_make_torch_kron,
            learning_rates=LEARNING_RATES["kron"],
        ),
        OptimizerSpec(
            name="pro",
            description="PSGD pro (precond.jax.pro / precond.torch.Pro: "
            "distributed-kron 2.0's generation-2 recipe, its defaults)",
            make=_make_pro,
            make_torch=_make_torch_pro,
            learning_rates=LEARNING_RATES["pro"],
            default=False,
        ),
        OptimizerSpec(
            name="pro-adamw",
            description="pro on the weight matrices, AdamW on the rest "
            "(precond.jax.pro_adamw / precond.torch.ProAdamW called with the rate "
            "alone: their defaults and their own split, pro at 2 times the AdamW "
            "rate, b1 0.7, 'QEQ' fits on a schedule)",
            make=_make_pro_adamw,
            make_torch=_make_torch_pro_adamw,
            learning_rates=LEARNING_RATES["pro-adamw"],
        ),
        *(
            OptimizerSpec(
                name=name,
                description=f"PSGD {title} (precond.jax.{alias}, psgd-jax's "
                "defaults: whitening, a fit every step); JAX only, not in the "
                "default suite",
                make=_make_psgd_jax(alias),
                learning_rates=LEARNING_RATES[name],
                default=False,
            )
            for name, title, alias in (
                ("xmat", "XMat", "xmat"),
                ("lra", "LRA", "low_rank_approximation"),
                ("affine", "Affine", "affine"),
            )
        ),
        OptimizerSpec(
            name="shampoo",
            description="Distributed Shampoo (precond.jax.distributed_shampoo / "
            "precond.torch.Shampoo), block 128, RMSProp-normalized grafting, β2 "
            "0.95, eigh roots every 10 steps, decoupled weight decay",
            make=_make_bench_shampoo,
            make_torch=_make_torch_shampoo,
            learning_rates=LEARNING_RATES["shampoo"],
        ),
        OptimizerSpec(
            name="soap",
            description="SOAP (precond.jax.soap / precond.torch.SOAP): Adam in the "
            "eigenbasis of Shampoo's factors, the paper's defaults (betas 0.95, "
            "bases refreshed every 10 steps)",
            make=_make_soap,
            make_torch=_make_torch_soap,
            learning_rates=LEARNING_RATES["soap"],
        ),
        OptimizerSpec(
            name="kfac",
            description="K-FAC (precond.torch.kfac.KFAC, damping "
            f"{KFAC_DAMPING:g}, inverses every 10 steps) preconditioning "
            "SGD-momentum; PyTorch only",
            make_torch=_make_torch_kfac,
            learning_rates=LEARNING_RATES["kfac"],
            requires=("torch",),
        ),
        OptimizerSpec(
            name="adamw",
            description="AdamW (optax.adamw / torch.optim.AdamW), β=(0.9, 0.999), "
            "ε=1e-8",
            make=_make_adamw,
            make_torch=_make_torch_adamw,
            learning_rates=LEARNING_RATES["adamw"],
            reference=True,
        ),
        OptimizerSpec(
            name="muon",
            description="Muon (optax.contrib.muon / torch.optim.Muon, momentum "
            "0.95, 5 Newton-Schulz steps) on hidden weight matrices; AdamW at "
            "adam_learning_rate on embeddings, output layer, conv kernels, biases, "
            "norms",
            make=_make_muon,
            make_torch=_make_torch_muon,
            learning_rates=LEARNING_RATES["muon"],
            reference=True,
            part_learning_rates={"adam_learning_rate": MUON_ADAM_LEARNING_RATES},
            partitioned=True,
        ),
        OptimizerSpec(
            name="sgd",
            description="SGD, Nesterov momentum 0.9, decoupled weight decay",
            make=_make_sgd,
            make_torch=_make_torch_sgd,
            learning_rates=LEARNING_RATES["sgd"],
            reference=True,
            default=False,
        ),
    )
}


def get_optimizer(name: str) -> OptimizerSpec:
    """The registered optimizer called ``name``; ``KeyError`` naming the valid ones."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise KeyError(
            f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}"
        ) from None
