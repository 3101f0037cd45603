"""PSGD Kron's constants and option names, shared by ``precond.jax.kron`` and
``precond.torch.Kron`` so that both frameworks run the same algorithm.
"""

from __future__ import annotations

# Updates are scaled down so that their per-tensor RMS is at most this:
# U ← U / max(1, RMS(U) / MAX_UPDATE_RMS). PSGD 'pro' clips its update by the
# same rule (precond._common.pro_layout).
MAX_UPDATE_RMS = 1.1
# Probability that a preconditioner update first rebalances the factors' norms.
# PSGD's one rule for factors whose product is invariant to rescaling them:
# affine's two Kronecker factors and LRA's ‖U‖, ‖V‖ are rebalanced by it too
# (pro instead rebalances every pro_layout.BALANCE_EVERY steps).
BALANCE_PROBABILITY = 0.01

# The factor-update rules (``preconditioner_update_style``): generation 1 ('EQ',
# triangular Q with triangular solves) and generation 2 ('QUAD', 'PRO', 'QEQ').
UPDATE_STYLES = ("EQ", "QUAD", "PRO", "QEQ")
# The style whose factors are fitted by the generation-1 rule.
GENERATION_1_STYLE = "EQ"
# The styles whose Q is neither triangular nor symmetric (a full matrix).
FULL_FACTOR_STYLES = ("PRO", "QEQ")
# How a triangular factor keeps P = QᵀQ (``preconditioner_cache``): packed into
# Q's unused lower triangle plus one row (d + 1, d), Q and P stacked (2, d, d),
# or Q alone (d, d).
PRECONDITIONER_CACHES = ("packed", "dense", None)
# Where a factor update's random draws come from (``noise_draws``).
NOISE_DRAWS = ("per_block", "distributed_kron")
# How ``merge_small_dims`` groups axes (``merge_rule``).
MERGE_RULES = ("balanced", "distributed_kron")
# How blocking pads (``block_padding``).
BLOCK_PADDINGS = ("inert", "distributed_kron")


def stored_cache(preconditioner_cache: str | None, update_style: str) -> str | None:
    """The cache layout a triangular factor is actually stored in.

    Packing needs Q triangular ('EQ') or symmetric ('QUAD'); 'PRO' and 'QEQ'
    keep a full Q, so their 'packed' cache is stored 'dense'.
    """
    if update_style in FULL_FACTOR_STYLES and preconditioner_cache == "packed":
        return "dense"
    return preconditioner_cache
