"""The alias layer shared by precond's JAX optimizers (DESIGN.md §4.3)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from precond._common.validation import check_real, is_concrete_number


def with_decay_and_learning_rate(
    core: optax.GradientTransformation,
    learning_rate: float | Callable,
    weight_decay: float,
    weight_decay_mask: Any | Callable | None,
) -> optax.GradientTransformationExtraArgs:
    """``chain(core, add_decayed_weights, scale_by_learning_rate)``: θ ← θ −
    lr·(U + λ·mask⊙θ). The decay is left out when λ is a concrete 0."""
    check_real("learning_rate", learning_rate, low=0.0, allow_schedule=True)
    check_real("weight_decay", weight_decay, low=0.0)
    transforms = [core]
    if not (is_concrete_number(weight_decay) and weight_decay == 0):
        transforms.append(optax.add_decayed_weights(weight_decay, weight_decay_mask))
    transforms.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*transforms)
