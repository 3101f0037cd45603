"""The engine under precond's PyTorch optimizers, shared by every family: the
optimizer base (checked param groups, the step's preamble), the step policy (seeded
draws, skipping unusable gradients), Kronecker-factor kernels, DTensor helpers."""
