"""Distributed Shampoo with grafting for PyTorch: ``Shampoo``, the twin of
``precond.jax.distributed_shampoo`` (same arguments, defaults and arithmetic),
its grafting and preconditioner types, batched inverse-root kernels and layout."""

from precond.torch.shampoo._arguments import GraftingType, PreconditionerType
from precond.torch.shampoo.shampoo import Shampoo

__all__ = ["GraftingType", "PreconditionerType", "Shampoo"]
