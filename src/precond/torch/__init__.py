"""precond's PyTorch optimizers.

``Kron`` (PSGD Kron, a ``torch.optim.Optimizer``) with its update-probability
schedule, ``Pro`` (the PSGD 'pro' recipe of ``precond.jax.pro``), ``ProAdamW``
(Pro on the hidden weight matrices and AdamW on the rest, as
``precond.jax.pro_adamw``), and the strategies that spread Kron's work over
``torch.distributed`` ranks: :mod:`precond.torch.kron`.
K-FAC (KAISA) lives in :mod:`precond.torch.kfac`; the engine they share, in
``precond.torch._core``.
"""

from precond.torch.kron import (
    Kron,
    Pro,
    ProAdamW,
    Replicated,
    ShardedPreconditioning,
    Strategy,
    precond_update_prob_schedule,
)
from precond.torch.shampoo import GraftingType, PreconditionerType, Shampoo
from precond.torch.soap import SOAP

__all__ = [
    "SOAP",
    "GraftingType",
    "Kron",
    "PreconditionerType",
    "Pro",
    "ProAdamW",
    "Replicated",
    "Shampoo",
    "ShardedPreconditioning",
    "Strategy",
    "precond_update_prob_schedule",
]
