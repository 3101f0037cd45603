"""docs/arguments.md is generated from the argument tables that validate every
optimizer (docs/make_arguments.py): it must match what the code checks now."""

from __future__ import annotations

import pathlib

import pytest

from tests.bench.helpers import script_module

pytest.importorskip("jax")
pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _generator():
    return script_module("docs/make_arguments.py")


def test_arguments_doc_is_generated_from_the_current_tables():
    generator = _generator()
    committed = (ROOT / "docs" / "arguments.md").read_text(encoding="utf-8")
    assert committed == generator.render(), (
        "docs/arguments.md is stale: run python docs/make_arguments.py"
    )


def test_every_public_argument_is_checked_at_construction():
    """No row of the generated tables says an argument goes unchecked."""
    unchecked = [
        line
        for line in _generator().render().splitlines()
        if "not checked at construction" in line
    ]
    assert not unchecked, "\n".join(unchecked)
