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
# as θ ← θ − lr·(u + λθ) by both AdamW and Kron.
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
