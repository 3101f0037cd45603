"""PSGD's Kronecker-factored family for PyTorch: Kron, Pro and ProAdamW, each with
its argument checks, state and checkpoint handling, and the strategies that spread
Kron's work over ``torch.distributed`` ranks."""

from precond.torch.kron.kron import Kron
from precond.torch.kron.pro import Pro
from precond.torch.kron.pro_adamw import ProAdamW
from precond.torch.kron.schedule import precond_update_prob_schedule
from precond.torch.kron.strategies import Replicated, ShardedPreconditioning, Strategy

__all__ = [
    "Kron",
    "Pro",
    "ProAdamW",
    "Replicated",
    "ShardedPreconditioning",
    "Strategy",
    "precond_update_prob_schedule",
]
