"""Prints the pip pins of the JAX floor that pyproject.toml's jax extra declares.

Each requirement of the extra must read ``name>=X``; prints ``name==X`` for each,
with ``jaxlib==X`` beside ``jax==X`` (jax needs the jaxlib of its own version).
CI installs exactly these in a throwaway venv and runs JAX tests on them. Needs
Python >= 3.11 (tomllib).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def floor_pins(pyproject: Path = PYPROJECT) -> list[str]:
    """``name==X`` for every ``name>=X`` of the jax extra (and jaxlib beside jax)."""
    with pyproject.open("rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["jax"]
    pins = []
    for requirement in extra:
        match = re.fullmatch(r"([A-Za-z0-9_-]+)>=([0-9.]+)", requirement)
        if match is None:
            sys.exit(f"jax_floor: {requirement!r} in the jax extra is not name>=X")
        name, floor = match.groups()
        pins.append(f"{name}=={floor}")
        if name == "jax":
            pins.append(f"jaxlib=={floor}")
    return pins


if __name__ == "__main__":
    print(" ".join(floor_pins()))
