"""The pro + AdamW recipe that ``precond.jax.pro_adamw`` and
``precond.torch.ProAdamW`` share: its defaults, the rule that picks the hidden
weight matrices pro preconditions (AdamW takes the rest), and its own checks.

The defaults are the setting measured best on ``precond bench``'s workloads
(the teacher-student regression, the char-lm and the larger char-lm, each at
its best swept rate; BENCHMARKS.md): pro at 2 times AdamW's rate with momentum
0.7 and 'QEQ' fits at the steps of the probability schedule (min_prob=0.2,
decay=0.005, flat_start=200), AdamW at its own rate on the rest.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from precond._common.validation import check_real, is_concrete_number

# pro's rate is this times the AdamW rate the user gives.
PRO_LR_MULTIPLIER = 2.0
PRO_B1 = 0.7
PRO_UPDATE_STYLE = "QEQ"
# precond_update_prob_schedule's arguments: a fit every step for 200 steps, then
# exp(−0.005·(n − 200)), never below 0.2.
PRO_UPDATE_PROBABILITY_SCHEDULE = {"min_prob": 0.2, "decay": 0.005, "flat_start": 200}
# Decoupled weight decay of both parts (optax.adamw's default; the bench's).
WEIGHT_DECAY = 1e-4
ADAM_B1, ADAM_B2, ADAM_EPS = 0.9, 0.999, 1e-8

# A word of a parameter's path is a name lowercased and cut at every character
# that is not a letter or digit (camelCase is not cut, so that flax's
# "MultiHeadDotProductAttention_0" is one word and never reads as a head).
# A word starting with one of these, in any name of the path, marks an
# embedding table (embed, embedding, embeddings, embedder, tok_emb, unembed).
EMBEDDING_PREFIXES = ("emb", "unemb")
# One of these words in the path's first name or its last two (the leaf's own
# name and the module holding it) marks a position table (GPT-2's wte and wpe
# too) or an output head. Only there: BERT's "attention.output.dense.weight"
# and a "pos_ffn.w_1.weight" are hidden matrices.
END_WORDS = frozenset(
    {"wte", "wpe", "pos", "position", "positional"}
    | {"head", "logits", "output", "classifier", "readout"}
)

_WORD_SEPARATOR = re.compile(r"[^a-z0-9]+")


def _words(name: str) -> set[str]:
    return {w for w in _WORD_SEPARATOR.split(name.lower()) if w}


def is_hidden_matrix(names: Iterable[str], ndim: int) -> bool:
    """Whether a parameter of ``ndim`` dimensions, at the path of ``names``
    (dict keys, attribute names, or a torch name cut at its dots), is a
    hidden-layer weight matrix: at least 2-D, no word of any name starting
    with 'emb' or 'unemb' (an embedding), and none of the words 'wte', 'wpe',
    'pos', 'position', 'positional', 'head', 'logits', 'output',
    'classifier', 'readout' (a position table or an output head) in the first
    name or the last two. Names that are numbers (list indices, layer
    numbers) are left out first; a word is a run of letters and digits.

    Example:
        >>> is_hidden_matrix(["layers", "0", "mlp", "weight"], 2)
        True
        >>> is_hidden_matrix(["lm_head", "weight"], 2)
        False
    """
    if ndim < 2:
        return False
    named = [str(n) for n in names if not str(n).isdigit()]
    for name in named:
        if any(w.startswith(EMBEDDING_PREFIXES) for w in _words(name)):
            return False
    ends = named[:1] + named[-2:]
    return not any(_words(name) & END_WORDS for name in ends)


def torch_name_parts(name: str) -> Sequence[str]:
    """The names of a torch parameter's path: ``'layers.0.mlp.weight'`` →
    ``['layers', '0', 'mlp', 'weight']``."""
    return name.split(".")


def check_probability_or_none(
    name: str, value: Any, check: Callable[[str, Any], None]
) -> None:
    """None (the recipe's schedule), or a probability or schedule that
    ``check`` (pro's rule) accepts."""
    if value is None:
        return
    if not (callable(value) or is_concrete_number(value) or hasattr(value, "dtype")):
        raise TypeError(
            f"Invalid {name}={value!r}: must be None, a number or a schedule (callable)"
        )
    check(name, value)


def check_bool_or_none(name: str, value: Any) -> None:
    """None (the rule decides), True or False."""
    if value is not None and not isinstance(value, bool | np.bool_):
        raise TypeError(f"Invalid {name}={value!r}: must be None, True or False")


# The recipe's own arguments (those it shares with pro or AdamW are checked by
# their tables), each raising ``Invalid <name>=<value!r>: must be <rule>``.
PRO_ADAMW_ARGUMENT_CHECKS = {
    "pro_lr_multiplier": functools.partial(check_real, low=0.0, low_inclusive=False),
    "adam_b1": functools.partial(check_real, low=0.0, high=1.0, high_inclusive=False),
    "adam_b2": functools.partial(check_real, low=0.0, high=1.0, high_inclusive=False),
    "adam_eps": functools.partial(check_real, low=0.0),
}
