"""Benchmark optimizers: name ↦ learning rates and a factory per framework
(:mod:`precond.bench.jax_optimizers`, :mod:`precond.bench.torch_optimizers`).

A JAX factory builds an ``optax.GradientTransformation`` from a (constant) learning
rate and a decoupled weight decay; a PyTorch factory builds a
:class:`TorchOptimizer` from a model, a learning rate and a weight decay. The runners
treat all optimizers alike: the learning-rate schedule multiplies the whole update
(JAX) or sets ``param_groups[i]["lr"]`` (PyTorch) every step.

To add an optimizer, write its factories and register an :class:`OptimizerSpec`
with them in :data:`OPTIMIZERS`. An optimizer that trains part of the model with
a second rule (Muon: AdamW for embeddings, the output head, biases and norms)
lists that part's rates in ``part_learning_rates`` and, with ``partitioned``,
gets the workload's split of its parameters (see
:func:`precond.bench.jax_optimizers.make_muon`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from precond.bench import jax_optimizers, torch_optimizers
from precond.bench.learning_rates import LEARNING_RATES, MUON_ADAM_LEARNING_RATES
from precond.bench.torch_optimizers import TorchOptimizer

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


OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        OptimizerSpec(
            name="kron",
            description="PSGD Kron (precond.jax.kron / precond.torch.Kron), "
            "preconditioner_update_style='QUAD', other arguments default",
            make=jax_optimizers.make_kron,
            make_torch=torch_optimizers.make_kron,
            learning_rates=LEARNING_RATES["kron"],
        ),
        OptimizerSpec(
            name="pro",
            description="PSGD pro (precond.jax.pro / precond.torch.Pro: "
            "distributed-kron 2.0's generation-2 recipe, its defaults)",
            make=jax_optimizers.make_pro,
            make_torch=torch_optimizers.make_pro,
            learning_rates=LEARNING_RATES["pro"],
            default=False,
        ),
        OptimizerSpec(
            name="pro-adamw",
            description="pro on the weight matrices, AdamW on the rest "
            "(precond.jax.pro_adamw / precond.torch.ProAdamW called with the rate "
            "alone: their defaults and their own split, pro at 2 times the AdamW "
            "rate, b1 0.7, 'QEQ' fits on a schedule)",
            make=jax_optimizers.make_pro_adamw,
            make_torch=torch_optimizers.make_pro_adamw,
            learning_rates=LEARNING_RATES["pro-adamw"],
        ),
        *(
            OptimizerSpec(
                name=name,
                description=f"PSGD {title} (precond.jax.{alias}, psgd-jax's "
                "defaults: whitening, a fit every step); JAX only, not in the "
                "default suite",
                make=jax_optimizers.make_psgd(alias),
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
            make=jax_optimizers.make_bench_shampoo,
            make_torch=torch_optimizers.make_shampoo,
            learning_rates=LEARNING_RATES["shampoo"],
        ),
        OptimizerSpec(
            name="soap",
            description="SOAP (precond.jax.soap / precond.torch.SOAP): Adam in the "
            "eigenbasis of Shampoo's factors, the paper's defaults (betas 0.95, "
            "bases refreshed every 10 steps)",
            make=jax_optimizers.make_soap,
            make_torch=torch_optimizers.make_soap,
            learning_rates=LEARNING_RATES["soap"],
        ),
        OptimizerSpec(
            name="kfac",
            description="K-FAC (precond.torch.kfac.KFAC, damping "
            f"{torch_optimizers.KFAC_DAMPING:g}, inverses every 10 steps) "
            "preconditioning SGD-momentum; PyTorch only",
            make_torch=torch_optimizers.make_kfac,
            learning_rates=LEARNING_RATES["kfac"],
            requires=("torch",),
        ),
        OptimizerSpec(
            name="adamw",
            description="AdamW (optax.adamw / torch.optim.AdamW), β=(0.9, 0.999), "
            "ε=1e-8",
            make=jax_optimizers.make_adamw,
            make_torch=torch_optimizers.make_adamw,
            learning_rates=LEARNING_RATES["adamw"],
            reference=True,
        ),
        OptimizerSpec(
            name="muon",
            description="Muon (optax.contrib.muon / torch.optim.Muon, momentum "
            "0.95, 5 Newton-Schulz steps) on hidden weight matrices; AdamW at "
            "adam_learning_rate on embeddings, output layer, conv kernels, biases, "
            "norms",
            make=jax_optimizers.make_muon,
            make_torch=torch_optimizers.make_muon,
            learning_rates=LEARNING_RATES["muon"],
            reference=True,
            part_learning_rates={"adam_learning_rate": MUON_ADAM_LEARNING_RATES},
            partitioned=True,
        ),
        OptimizerSpec(
            name="sgd",
            description="SGD, Nesterov momentum 0.9, decoupled weight decay",
            make=jax_optimizers.make_sgd,
            make_torch=torch_optimizers.make_sgd,
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
