"""The JAX factories of ``precond bench``'s optimizers: each builds an
``optax.GradientTransformation`` from a (constant) learning rate and a
decoupled weight decay (the runner's schedule multiplies the whole update), and
imports JAX, optax and precond when called, never at import time. The settings
the PyTorch factories share (Shampoo's options, SGD's momentum) are here too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def make_kron(learning_rate, weight_decay: float):
    from precond.jax import kron

    # No merging or blocking: the layout the recorded figures were measured with
    # (before kron took distributed-kron 1.0.0's defaults, which merge and block).
    return kron(
        learning_rate=learning_rate,
        weight_decay=weight_decay,
        merge_small_dims=False,
        partition_grads_into_blocks=False,
        preconditioner_update_style="QUAD",
    )


def make_pro(learning_rate, weight_decay: float):
    from precond.jax import pro

    # distributed-kron 2.0's defaults but the bench's decay (pro's own is 0.1).
    return pro(learning_rate=learning_rate, weight_decay=weight_decay)


def make_pro_adamw(learning_rate, weight_decay: float):
    """``precond.jax.pro_adamw`` called as a user calls it: its defaults (pro at
    2 times AdamW's rate, b1 0.7, 'QEQ' fits on its schedule) and its own rule
    for which parameters pro takes (every weight matrix but embeddings and
    named heads: on the MLPs the output layer too, unlike Muon's split)."""
    from precond.jax import pro_adamw

    return pro_adamw(learning_rate, weight_decay=weight_decay)


def make_psgd(alias: str) -> Callable:
    """A factory of psgd-jax's ``alias`` (``xmat``, ``low_rank_approximation``,
    ``affine``) with its defaults: whitening, a fit every step."""

    def make(learning_rate, weight_decay: float):
        import precond.jax as pj

        return getattr(pj, alias)(
            learning_rate=learning_rate, weight_decay=weight_decay
        )

    return make


def make_shampoo(learning_rate, weight_decay: float, **kwargs):
    """``precond.jax.distributed_shampoo`` with decoupled weight decay.

    Block size 128 and RMSProp-normalized grafting unless ``kwargs`` say otherwise
    (any other ``distributed_shampoo`` argument may be given too). Shampoo's own
    ``weight_decay`` is coupled (added to the direction before momentum), so it is
    left at 0 and the decay is applied as Kron and AdamW apply it: Shampoo runs at
    learning rate 1 (its update is then −v), and ``chain(scale(−1),
    add_decayed_weights(λ), scale_by_learning_rate(lr))`` turns −v into
    −lr·(v + λθ).
    """
    import optax

    from precond.jax import GraftingType, distributed_shampoo

    options = {"block_size": 128, "graft_type": GraftingType.RMSPROP_NORMALIZED}
    shampoo = distributed_shampoo(learning_rate=1.0, **(options | kwargs))
    return optax.chain(
        shampoo,
        optax.scale(-1.0),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )


# The bench's Shampoo: β2 0.95 (0.999, the default, gave spiky digits curves) and
# inverse roots by eigh every 10 steps (faster and more accurate than Newton on a
# CPU; see BENCHMARKS.md).
BENCH_SHAMPOO_OPTIONS = {
    "beta2": 0.95,
    "eigh": True,
    "preconditioning_compute_steps": 10,
}


def make_bench_shampoo(learning_rate, weight_decay: float):
    return make_shampoo(learning_rate, weight_decay, **BENCH_SHAMPOO_OPTIONS)


def make_soap(learning_rate, weight_decay: float):
    """``precond.jax.soap`` with the paper's defaults (betas 0.95, bases
    refreshed every 10 steps by a QR power step) and the bench's decay."""
    from precond.jax import soap

    return soap(learning_rate, weight_decay=weight_decay)


def make_adamw(learning_rate, weight_decay: float):
    import optax

    return optax.adamw(learning_rate=learning_rate, weight_decay=weight_decay)


SGD_MOMENTUM = 0.9


def make_sgd(learning_rate, weight_decay: float):
    import optax

    return optax.chain(
        optax.trace(decay=SGD_MOMENTUM, nesterov=True),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )


def make_muon(
    learning_rate,
    weight_decay: float,
    *,
    adam_learning_rate,
    hidden_matrices: Callable[[Any], Any],
):
    """``optax.contrib.muon`` (its defaults: Nesterov momentum 0.95, 5
    Newton-Schulz steps, the update scaled by sqrt(max(1, fan_out/fan_in))) on
    the parameters ``hidden_matrices(params)`` marks True, and the AdamW that
    ``optax.contrib.muon`` ships for the rest (β=(0.9, 0.999), Nesterov) at
    ``adam_learning_rate``. Both parts decay weights as θ ← θ − lr·(u + λθ).

    Without ``muon_weight_dimension_numbers``, optax would give Muon every 2-D
    parameter, the embedding tables and the output head included; Muon's
    documentation prescribes AdamW for those, so the workload's rule decides.
    """
    import inspect

    import jax
    import optax
    from optax.contrib import MuonDimensionNumbers, muon

    needed = {
        "adam_learning_rate",
        "adam_weight_decay",
        "muon_weight_dimension_numbers",
    }
    missing = needed - set(inspect.signature(muon).parameters)
    if missing:
        raise RuntimeError(
            f"the bench's muon needs an optax.contrib.muon that takes "
            f"{', '.join(sorted(missing))}; optax {optax.__version__} does not"
        )

    def dimension_numbers(params):
        # (in, out) matrices, as the bench's models store them: the default
        # reduction axis 0 and output axis 1; None leaves go to AdamW.
        return jax.tree.map(
            lambda hidden: MuonDimensionNumbers() if hidden else None,
            hidden_matrices(params),
        )

    return muon(
        learning_rate,
        weight_decay=weight_decay,
        adam_weight_decay=weight_decay,
        adam_learning_rate=adam_learning_rate,
        muon_weight_dimension_numbers=dimension_numbers,
    )
