"""The checks of the PSGD Kron arguments that both frameworks take under the same
name and rule; each raises ``Invalid <name>=<value!r>: must be <rule>``.

``precond.jax.scale_by_kron`` and ``precond.torch.Kron`` add their own
(dtypes, precisions, meshes, strategies) around these.
"""

from __future__ import annotations

import functools

from precond._common.kron_constants import PRECONDITIONER_CACHES, UPDATE_STYLES
from precond._common.validation import check_bool, check_choice, check_int, check_real

KRON_SHARED_ARGUMENT_CHECKS = {
    "b1": functools.partial(check_real, low=0.0, high=1.0, high_inclusive=False),
    "max_size_triangular": functools.partial(check_int, low=0),
    "min_ndim_triangular": functools.partial(check_int, low=0),
    "momentum_into_precond_update": check_bool,
    "merge_small_dims": check_bool,
    "target_merged_dim_size": functools.partial(check_int, low=1),
    "preconditioner_update_style": functools.partial(
        check_choice, choices=UPDATE_STYLES
    ),
    "preconditioner_cache": functools.partial(
        check_choice, choices=PRECONDITIONER_CACHES
    ),
}
