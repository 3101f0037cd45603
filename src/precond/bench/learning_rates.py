"""The peak learning rate of every optimizer of ``precond bench``, per framework
and workload, and how each was found (a sweep, or a rule from AdamW's rate)."""

from __future__ import annotations

# The larger transformer's rates: the better of half and all of char-lm's
# (BENCHMARKS.md, "Models the defaults were not chosen on"). Each is at the edge
# of those two, so the sweep leaves room on AdamW's and pro_adamw's side below
# and on Muon's above.
CHAR_LM_LARGE_ADAMW = 5e-3
CHAR_LM_LARGE_MUON = 0.04
CHAR_LM_LARGE_PRO_ADAMW = 5e-3  # pro_adamw's: its lowest measured, an edge


def _rates(**by_workload: float) -> dict[str, float]:
    """workload ↦ rate, from keyword arguments named after the workloads (with
    underscores for their hyphens)."""
    return {name.replace("_", "-"): rate for name, rate in by_workload.items()}


# Peak learning rate of each optimizer, per framework and workload: the lowest
# final validation loss (seed 0, each workload's own budget, cosine schedule,
# weight decay 1e-4) of
#   precond bench --frameworks jax --optimizers adamw,muon,pro-adamw,kron,shampoo
#       --lr NAME=RATE ... --lr-sweep 0.33,1,3
# around the previous best, extended past an edge where the best rate was one
# (BENCHMARKS.md, "Learning rates"). The default workloads were swept in JAX;
# PyTorch uses JAX's rates on them (same architectures, other random weights),
# except on char-lm, swept in PyTorch too at 200 steps. Optimizers outside the
# default suite take a rule on the default workloads (pro: twice AdamW's rate;
# XMat, LRA: AdamW's; Affine: half AdamW's; SGD: ten times AdamW's; K-FAC: a
# tenth of AdamW's), swept only on the digits workloads and on char-lm at its
# former budget of 200 steps.
_ADAMW = _rates(
    teacher_student=0.027,
    char_lm=0.01,
    char_lm_large=CHAR_LM_LARGE_ADAMW,
    digits_mlp=3e-3,
    digits_cnn=3e-3,
)


def _times(factor: float, rates: dict[str, float], **swept: float) -> dict[str, float]:
    """``factor`` times each rate of ``rates``, but the rates ``swept`` (keywords
    as :func:`_rates`')."""
    return {name: factor * rate for name, rate in rates.items()} | _rates(**swept)


_KRON = _rates(
    teacher_student=3e-3,
    char_lm=9e-3,
    char_lm_large=4.5e-3,
    digits_mlp=3e-3,
    digits_cnn=3e-3,
)
_MUON = _rates(
    teacher_student=0.018,
    char_lm=0.04,
    char_lm_large=CHAR_LM_LARGE_MUON,
    digits_mlp=6e-3,
    digits_cnn=0.01,
)
_MUON_ADAM = _rates(
    teacher_student=9e-3,
    char_lm=0.1,
    char_lm_large=0.1,
    digits_mlp=3e-3,
    digits_cnn=3e-3,
)

LEARNING_RATES: dict[str, dict[str, dict[str, float]]] = {
    "kron": {
        "jax": _KRON,
        "torch": _times(1.0, _KRON, digits_mlp=9e-4, digits_cnn=9e-4),
    },
    "pro": {
        "jax": _times(2.0, _ADAMW, digits_mlp=3e-3, digits_cnn=6e-3, char_lm=0.04),
        "torch": _times(2.0, _ADAMW, digits_mlp=3e-3, digits_cnn=3e-3, char_lm=0.04),
    },
    # pro_adamw's defaults (pro at 2 times the rate, b1 0.7) measured at
    # teacher-student 9e-3, 0.013, 0.018, 0.027 (its own split: the output layer
    # is pro's); char-lm 0.02, 0.04; char-lm-large 5e-3, 0.01, 0.02 (seed 0);
    # digits-cnn 3e-3, 6e-3, 0.012 (Muon's split); digits-mlp not swept.
    "pro-adamw": {
        f: _rates(
            teacher_student=0.013,
            char_lm=0.04,
            char_lm_large=CHAR_LM_LARGE_PRO_ADAMW,
            digits_mlp=3e-3,
            digits_cnn=3e-3,
        )
        for f in ("jax", "torch")
    },
    "shampoo": {
        f: _rates(
            teacher_student=3e-4,
            char_lm=1e-3,
            char_lm_large=5e-4,
            digits_mlp=3e-4,
            digits_cnn=1e-4,
        )
        for f in ("jax", "torch")
    },
    # SOAP: swept on the default workloads (JAX, seed 0: teacher-student 0.0089,
    # 0.027, 0.081; char-lm 0.0033, 0.01, 0.03, 0.06, 0.1) and on the larger
    # transformer (3.75e-3, 7.5e-3, 0.015, 0.03); AdamW's rate elsewhere.
    "soap": {
        f: _times(1.0, _ADAMW, char_lm=0.03, char_lm_large=7.5e-3)
        for f in ("jax", "torch")
    },
    "xmat": {"jax": _times(1.0, _ADAMW, digits_cnn=6e-3, char_lm=5e-3)},
    "lra": {
        "jax": _times(1.0, _ADAMW, digits_mlp=0.012, digits_cnn=6e-3, char_lm=5e-3)
    },
    "affine": {
        "jax": _times(0.5, _ADAMW, digits_mlp=7.5e-4, digits_cnn=1.5e-3, char_lm=0.01)
    },
    "kfac": {
        "torch": _times(0.1, _ADAMW, digits_mlp=1e-3, digits_cnn=1e-3, char_lm=0.09)
    },
    "adamw": {f: _ADAMW for f in ("jax", "torch")},
    "sgd": {f: _times(10.0, _ADAMW, char_lm=0.3) for f in ("jax", "torch")},
    "muon": {"jax": _MUON, "torch": _times(1.0, _MUON, char_lm=0.06)},
}

# The rate of Muon's AdamW part (embeddings, output layer, convolution kernels,
# biases, norms): AdamW's own rate on the MLPs in JAX, 3 times it in PyTorch's
# digits workloads (optax.contrib.muon's AdamW part uses Nesterov momentum,
# torch.optim.AdamW does not), and 0.1 on the transformers (their embeddings and
# output head), each swept at 1/3, 1 and 3 times (10 and 30 times on char-lm).
MUON_ADAM_LEARNING_RATES: dict[str, dict[str, float]] = {
    "jax": _MUON_ADAM,
    "torch": _times(1.0, _MUON_ADAM, digits_mlp=9e-3, digits_cnn=9e-3),
}

# Workloads that take another workload's rates, unswept: the deeper transformer,
# a model no default was chosen on, takes the larger one's (BENCHMARKS.md,
# "Models the defaults were not chosen on").
RATES_TAKEN_FROM = {"char-lm-deep": "char-lm-large"}


def _take_rates(by_workload: dict[str, float]) -> None:
    """Give each workload of :data:`RATES_TAKEN_FROM` its source's rate in
    ``by_workload`` (workload ↦ rate), where the source has one."""
    for workload, source in RATES_TAKEN_FROM.items():
        if source in by_workload:
            by_workload.setdefault(workload, by_workload[source])


for _tables in (*LEARNING_RATES.values(), MUON_ADAM_LEARNING_RATES):
    for _by_workload in _tables.values():
        _take_rates(_by_workload)
