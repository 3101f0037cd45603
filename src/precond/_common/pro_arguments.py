"""The checks of the PSGD 'pro' arguments that both frameworks take under the same
name and rule; each raises ``Invalid <name>=<value!r>: must be <rule>``.

``precond.jax.scale_by_pro`` and ``precond.torch.Pro`` add their own (dtypes,
meshes, pipelines, draws, seeds, the learning rate and weight decay) around these.
"""

from __future__ import annotations

import functools

from precond._common.kron_arguments import KRON_SHARED_ARGUMENT_CHECKS
from precond._common.validation import check_bool, check_choice, check_int, check_real

# ``lr_style``: 'adam' divides the update by ADAM_STYLE_DIVISOR (AdamW's scale).
LR_STYLES = ("adam", None)
# ``preconditioner_update_style``: pro's generation-2 factor-update rules
# (distributed-kron 2.0's 'PRO' and 'QUAD', and precond's 'QEQ').
PRO_UPDATE_STYLES = ("PRO", "QUAD", "QEQ")

PRO_SHARED_ARGUMENT_CHECKS = {
    "lr_style": functools.partial(check_choice, choices=LR_STYLES),
    "b1": KRON_SHARED_ARGUMENT_CHECKS["b1"],  # Kron's momentum rule: [0, 1)
    "normalize_grads": check_bool,
    "max_size_dense": functools.partial(check_int, low=0),
    "preconditioner_lr": functools.partial(check_real, low=0.0),
    "preconditioner_init_scale": functools.partial(
        check_real, low=0.0, low_inclusive=False
    ),
    "preconditioner_update_style": functools.partial(
        check_choice, choices=PRO_UPDATE_STYLES
    ),
    "block_size": functools.partial(check_int, low=1),
    "noise_scale": functools.partial(check_real, low=0.0),
    "preconditioner_update_probability": functools.partial(
        check_real, low=0.0, high=1.0, low_inclusive=False, allow_schedule=True
    ),
}
