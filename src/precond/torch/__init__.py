"""precond's PyTorch optimizers.

``Kron`` (PSGD Kron, a ``torch.optim.Optimizer``) with its update-probability
schedule, ``Pro`` (the PSGD 'pro' recipe of ``precond.jax.pro``), ``ProAdamW``
(Pro on the hidden weight matrices and AdamW on the rest, as
``precond.jax.pro_adamw``), and the strategies that spread Kron's work over
``torch.distributed`` ranks.
K-FAC (KAISA) lives in :mod:`precond.torch.kfac`.
"""

from precond.torch.kron import Kron, precond_update_prob_schedule
from precond.torch.pro import Pro
from precond.torch.pro_adamw import ProAdamW
from precond.torch.strategies import Replicated, ShardedPreconditioning, Strategy

__all__ = [
    "Kron",
    "Pro",
    "ProAdamW",
    "Replicated",
    "ShardedPreconditioning",
    "Strategy",
    "precond_update_prob_schedule",
]
