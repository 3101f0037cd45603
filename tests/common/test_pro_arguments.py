"""PSGD 'pro''s argument checks shared by both frameworks
(precond._common.pro_arguments): each names the argument, its value and the rule,
accepts the documented defaults, and is the check both frameworks run. No jax,
no torch (the frameworks' tables are read only where they are installed)."""

from __future__ import annotations

import re

import pytest

from precond._common.kron_arguments import KRON_SHARED_ARGUMENT_CHECKS
from precond._common.pro_arguments import (
    LR_STYLES,
    PRO_SHARED_ARGUMENT_CHECKS,
    PRO_UPDATE_STYLES,
)

# distributed-kron 2.0's defaults (precond.jax.pro's and precond.torch.Pro's).
DEFAULTS = {
    "lr_style": "adam",
    "b1": 0.95,
    "normalize_grads": False,
    "max_size_dense": 16384,
    "preconditioner_lr": 0.5,
    "preconditioner_init_scale": 1.0,
    "preconditioner_update_style": "PRO",
    "block_size": 256,
    "noise_scale": 1e-9,
    "preconditioner_update_probability": 1.0,
}


def test_every_shared_argument_accepts_its_default_and_its_edges():
    assert set(DEFAULTS) == set(PRO_SHARED_ARGUMENT_CHECKS)
    accepted = [
        *DEFAULTS.items(),
        *(("lr_style", style) for style in LR_STYLES),
        *(("preconditioner_update_style", s) for s in PRO_UPDATE_STYLES),
        ("b1", 0.0),
        ("max_size_dense", 0),
        ("preconditioner_lr", 0.0),
        ("block_size", 1),
        ("noise_scale", 0.0),
        ("preconditioner_update_probability", lambda step: 0.5),
    ]
    for name, value in accepted:
        PRO_SHARED_ARGUMENT_CHECKS[name](name, value)


@pytest.mark.parametrize(
    ("name", "bad", "error", "rule"),
    [
        ("lr_style", "sgd", ValueError, "one of 'adam', None"),
        ("b1", 1.0, ValueError, "in [0.0, 1.0)"),
        ("normalize_grads", 1, TypeError, "True or False"),
        ("max_size_dense", -1, ValueError, ">= 0"),
        ("preconditioner_lr", -0.1, ValueError, ">= 0.0"),
        ("preconditioner_init_scale", 0.0, ValueError, "> 0.0"),
        (
            "preconditioner_update_style",
            "EQ",
            ValueError,
            "one of 'PRO', 'QUAD', 'QEQ'",
        ),
        ("block_size", 0, ValueError, ">= 1"),
        ("noise_scale", float("nan"), ValueError, "finite and >= 0.0"),
        ("preconditioner_update_probability", 0.0, ValueError, "in (0.0, 1.0]"),
    ],
)
def test_a_bad_value_names_the_argument_its_value_and_the_rule(name, bad, error, rule):
    message = re.escape(f"Invalid {name}={bad!r}: must be {rule}")
    with pytest.raises(error, match=f"^{message}$"):
        PRO_SHARED_ARGUMENT_CHECKS[name](name, bad)


def test_b1_is_krons_momentum_rule():
    assert PRO_SHARED_ARGUMENT_CHECKS["b1"] is KRON_SHARED_ARGUMENT_CHECKS["b1"]


def test_both_frameworks_run_the_shared_checks():
    """Every shared argument is checked by the shared function in JAX's table and
    in torch's (where installed), not by a copy of its rule."""
    tables = {}
    try:
        from precond.jax.kron._pro_config import PRO_ARGUMENT_CHECKS

        tables["jax"] = PRO_ARGUMENT_CHECKS
    except ModuleNotFoundError:
        pass
    try:
        from precond.torch.kron.pro import GROUP_ARGUMENTS

        tables["torch"] = dict(GROUP_ARGUMENTS)
    except ModuleNotFoundError:
        pass
    if not tables:
        pytest.skip("neither jax nor torch is installed")
    for table in tables.values():
        for name, check in PRO_SHARED_ARGUMENT_CHECKS.items():
            assert table[name] is check, name
