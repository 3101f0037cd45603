"""precond: scalable second-order optimizers for JAX and PyTorch.

Importing ``precond`` imports neither JAX nor PyTorch; use ``precond.jax``.
"""

__version__ = "0.1.0"
