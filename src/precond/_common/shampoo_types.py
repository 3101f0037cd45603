"""Shampoo's enumerations, one definition for both frameworks
(``precond.jax.GraftingType is precond.torch.GraftingType``)."""

from __future__ import annotations

import enum


class GraftingType(enum.IntEnum):
    """The first-order method whose step size per parameter Shampoo borrows."""

    SGD = 1
    ADAGRAD = 2
    RMSPROP = 3
    RMSPROP_NORMALIZED = 4
    SQRT_N = 5  # sign(G): every entry moves by 1 (norm √n)
    ADAGRAD_NORMALIZED = 6


class PreconditionerType(enum.IntEnum):
    """Which axes of each (merged) block get a preconditioner (Google's newer
    ``precondtioner_type`` argument); rank-1 blocks always get one."""

    ALL = 1  # every axis
    INPUT = 2  # every axis but the last (the last is taken as the output axis)
    OUTPUT = 3  # the last axis only
