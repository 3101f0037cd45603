"""SOAP (Vyas et al. 2024): Adam run in the eigenbasis of Shampoo's Kronecker
factors, as a ``torch.optim.Optimizer``, with its argument checks, its layout of
merged dims and blocks, and the batched kernels that project and refresh bases."""

from precond.torch.soap.soap import SOAP

__all__ = ["SOAP"]
