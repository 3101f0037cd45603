"""Framework-independent helpers shared by precond.jax and precond.torch.

Pure Python on shapes and hyperparameters: argument validation with one error
phrasing, the factor-structure plan (dense triangular vs diagonal per axis), and
PSGD Kron's planning layer (units, blocks, stacks), constants and shared checks.
"""
