"""scale_by_kron's arguments become one frozen KronConfig, checked once, and the
argument checks both frameworks share come from precond._common."""

from __future__ import annotations

import dataclasses
import inspect

import jax.numpy as jnp
import pytest

import precond.jax as pj
from precond._common.kron_arguments import KRON_SHARED_ARGUMENT_CHECKS
from precond.jax.kron._arguments import KRON_ARGUMENT_CHECKS
from precond.jax.kron._config import KronConfig, kron_config


def _arguments(**overrides):
    parameters = inspect.signature(pj.scale_by_kron).parameters
    bound = inspect.signature(pj.scale_by_kron).bind(**overrides)
    bound.apply_defaults()
    assert set(bound.arguments) == set(parameters)
    return bound.arguments


def test_the_config_has_a_field_per_argument_in_signature_order():
    names = [f.name for f in dataclasses.fields(KronConfig)]
    expected = [n for n in inspect.signature(pj.scale_by_kron).parameters]
    assert names == [n for n in expected if n != "kwargs"]
    assert names == list(KRON_ARGUMENT_CHECKS)


def test_the_config_is_frozen_and_normalises_dtypes_once():
    config = kron_config(_arguments(precond_dtype="bfloat16"))
    assert config.precond_dtype == jnp.bfloat16
    assert config.mu_dtype is None
    assert config.compute_dtype == jnp.float32
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.b1 = 0.5


@pytest.mark.parametrize(
    ("style", "cache", "stored", "generation_2"),
    [
        ("EQ", "packed", "packed", False),
        ("QUAD", "packed", "packed", True),
        ("PRO", "packed", "dense", True),
        ("PRO", None, None, True),
        ("QEQ", "packed", "dense", True),
    ],
)
def test_derived_settings(style, cache, stored, generation_2):
    config = kron_config(
        _arguments(preconditioner_update_style=style, preconditioner_cache=cache)
    )
    assert config.cache == stored
    assert config.generation_2 is generation_2


def test_momentum_is_dropped_only_for_a_python_zero_b1():
    """An array b1 (as optax.inject_hyperparams passes it) may change, so the
    state keeps momentum."""
    assert not kron_config(_arguments(b1=0.0)).keep_momentum
    assert kron_config(_arguments(b1=jnp.asarray(0.0))).keep_momentum
    assert kron_config(_arguments(b1=0.9)).keep_momentum


def test_kron_alias_arguments_are_ignored_and_others_refused():
    arguments = _arguments(learning_rate=0.1, weight_decay=0.0)
    assert isinstance(kron_config(arguments), KronConfig)
    with pytest.raises(TypeError, match="unexpected keyword argument 'lr'"):
        pj.scale_by_kron(lr=0.1)


def test_the_jax_table_uses_the_shared_checks():
    for name, check in KRON_SHARED_ARGUMENT_CHECKS.items():
        assert KRON_ARGUMENT_CHECKS[name] is check
