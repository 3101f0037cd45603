"""Benchmark optimizers: name ↦ default learning rate and an optax factory.

Every entry builds an ``optax.GradientTransformation`` from a learning rate (a
number or an optax schedule of the step count) and a decoupled weight decay, so the
runner treats all optimizers alike. Factories import JAX, optax and precond.jax when
called, never at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Decoupled weight decay λ shared by every optimizer (optax.adamw's default), applied
# as θ ← θ − lr·(u + λθ) by AdamW, Kron and Shampoo.
DEFAULT_WEIGHT_DECAY = 1e-4


@dataclass(frozen=True)
class OptimizerSpec:
    """One benchmark optimizer.

    Attributes:
        name: registry key, used on the command line.
        description: one line for ``precond bench --list``.
        default_lr: peak learning rate used unless overridden (``--lr name=value``).
        make: (learning_rate or schedule, weight_decay) ↦ optax transformation.
    """

    name: str
    description: str
    default_lr: float
    make: Callable[[Any, float], Any]


def _make_kron(learning_rate, weight_decay: float):
    from precond.jax import kron

    return kron(learning_rate=learning_rate, weight_decay=weight_decay)


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


def _make_adamw(learning_rate, weight_decay: float):
    import optax

    return optax.adamw(learning_rate=learning_rate, weight_decay=weight_decay)


OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        OptimizerSpec(
            name="kron",
            description="PSGD Kron (precond.jax.kron), default arguments",
            default_lr=1e-3,
            make=_make_kron,
        ),
        OptimizerSpec(
            name="adamw",
            description="AdamW (optax.adamw), β=(0.9, 0.999), ε=1e-8",
            default_lr=3e-3,
            make=_make_adamw,
        ),
        OptimizerSpec(
            name="shampoo",
            description="Distributed Shampoo (precond.jax.distributed_shampoo), "
            "block 128, RMSProp-normalized grafting, decoupled weight decay",
            default_lr=1e-3,
            make=make_shampoo,
        ),
    )
}

# The baseline every ratio in the report is taken against.
BASELINE = "adamw"


def get_optimizer(name: str) -> OptimizerSpec:
    """The registered optimizer called ``name``; ``KeyError`` naming the valid ones."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise KeyError(
            f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}"
        ) from None
