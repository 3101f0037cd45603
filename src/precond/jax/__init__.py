"""precond's JAX optimizers, as optax gradient transformations.

``kron`` / ``scale_by_kron`` (PSGD Kron), its update-probability schedule and
``get_opt_state_partition_specs``; ``hessian_helper`` for Newton-mode fitting;
``xmat`` / ``scale_by_xmat`` (PSGD XMat).
Kernels of one tensor live in ``precond.jax._kron_math``.
"""

from precond.jax._psgd_transform import PSGDState
from precond.jax.hessian import hessian_helper
from precond.jax.kron import (
    KRON_STATIC_ARGS,
    KronState,
    get_opt_state_partition_specs,
    kron,
    precond_update_prob_schedule,
    scale_by_kron,
)
from precond.jax.xmat import scale_by_xmat, xmat

__all__ = [
    "KRON_STATIC_ARGS",
    "KronState",
    "PSGDState",
    "get_opt_state_partition_specs",
    "hessian_helper",
    "kron",
    "precond_update_prob_schedule",
    "scale_by_kron",
    "scale_by_xmat",
    "xmat",
]
