"""precond's JAX optimizers, as optax gradient transformations.

``kron`` / ``scale_by_kron`` (PSGD Kron), its update-probability schedule and
``get_opt_state_partition_specs``; ``xmat``, ``low_rank_approximation`` (alias
``lra``) and ``affine`` (PSGD XMat, LRA and Affine, with their ``scale_by_*``
cores and ``PSGDState``); ``hessian_helper`` for Newton-mode fitting;
``pro`` / ``scale_by_pro`` (distributed-kron 2.0's generation-2 PSGD recipe)
and ``pro_opt_state_partition_specs``; ``pro_adamw`` (pro on the hidden
weight matrices, AdamW on the rest: the recipe measured best) with its split
``pro_adamw_hidden_matrices``; ``distributed_shampoo`` (Google's
Distributed Shampoo, with its state helpers and the matrix functions
``matrix_inverse_pth_root``, ``_eigh`` and ``power_iteration``);
``soap`` / ``scale_by_soap`` (SOAP: Adam in the eigenbasis of Shampoo's
factors) with ``SoapState``; ``skipped_steps``, the count of steps skipped
for unusable gradients in any of their states. Kernels of one tensor live in
``precond.jax._core.factor_kernels``.
"""

from precond.jax._core.skipped_steps import skipped_steps
from precond.jax.kron._pro_config import PRO_STATIC_ARGS, ProState
from precond.jax.kron.distributed_kron_state import (
    kron_state_from_distributed_kron,
    kron_state_to_distributed_kron,
)
from precond.jax.kron.pro import pro, pro_opt_state_partition_specs, scale_by_pro
from precond.jax.kron.pro_adamw import (
    PRO_ADAMW_STATIC_ARGS,
    pro_adamw,
    pro_adamw_hidden_matrices,
)
from precond.jax.kron.transform import (
    KRON_STATIC_ARGS,
    KronState,
    get_opt_state_partition_specs,
    kron,
    precond_update_prob_schedule,
    scale_by_kron,
)
from precond.jax.psgd._transform import PSGDState
from precond.jax.psgd.affine import AFFINE_STATIC_ARGS, affine, scale_by_affine
from precond.jax.psgd.hessian import hessian_helper
from precond.jax.psgd.lra import (
    LRA_STATIC_ARGS,
    low_rank_approximation,
    lra,
    scale_by_lra,
)
from precond.jax.psgd.xmat import scale_by_xmat, xmat
from precond.jax.shampoo._math import (
    QuantizedArray,
    matrix_inverse_pth_root,
    matrix_inverse_pth_root_eigh,
    power_iteration,
)
from precond.jax.shampoo.state_views import (
    distributed_shampoo_partition_specs,
    distributed_shampoo_state_shapes,
    seed_parameter_stats,
    shampoo_state_from_seed,
)
from precond.jax.shampoo.transform import (
    SCALE_BY_SHAMPOO_STATIC_ARGS,
    SHAMPOO_STATIC_ARGS,
    GraftingType,
    InitFnState,
    ParameterStats,
    PreconditionerType,
    SeedShampooState,
    ShampooState,
    TrainingMetrics,
    distributed_shampoo,
    scale_by_shampoo,
)
from precond.jax.soap.transform import (
    SCALE_BY_SOAP_STATIC_ARGS,
    SOAP_STATIC_ARGS,
    SoapState,
    scale_by_soap,
    soap,
)

__all__ = [
    "AFFINE_STATIC_ARGS",
    "KRON_STATIC_ARGS",
    "LRA_STATIC_ARGS",
    "PRO_ADAMW_STATIC_ARGS",
    "PRO_STATIC_ARGS",
    "SCALE_BY_SHAMPOO_STATIC_ARGS",
    "SCALE_BY_SOAP_STATIC_ARGS",
    "SHAMPOO_STATIC_ARGS",
    "SOAP_STATIC_ARGS",
    "GraftingType",
    "InitFnState",
    "KronState",
    "PSGDState",
    "ParameterStats",
    "PreconditionerType",
    "ProState",
    "QuantizedArray",
    "SeedShampooState",
    "ShampooState",
    "SoapState",
    "TrainingMetrics",
    "affine",
    "distributed_shampoo",
    "distributed_shampoo_partition_specs",
    "distributed_shampoo_state_shapes",
    "get_opt_state_partition_specs",
    "hessian_helper",
    "kron",
    "kron_state_from_distributed_kron",
    "kron_state_to_distributed_kron",
    "low_rank_approximation",
    "lra",
    "matrix_inverse_pth_root",
    "matrix_inverse_pth_root_eigh",
    "power_iteration",
    "precond_update_prob_schedule",
    "pro",
    "pro_adamw",
    "pro_adamw_hidden_matrices",
    "pro_opt_state_partition_specs",
    "scale_by_affine",
    "scale_by_kron",
    "scale_by_lra",
    "scale_by_pro",
    "scale_by_shampoo",
    "scale_by_soap",
    "scale_by_xmat",
    "seed_parameter_stats",
    "shampoo_state_from_seed",
    "skipped_steps",
    "soap",
    "xmat",
]
