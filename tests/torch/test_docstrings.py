"""Every public class and function of ``precond.torch`` and ``precond.torch.kfac``
documents each of its parameters in an ``Args:`` section of its docstring (a
class on the class docstring, as ``torch.optim.AdamW``), so ``help()`` and the
docs site show them. Parameters are read from ``inspect.signature``; an entry is
a line ``name: ...`` (or ``name (type): ...``) one indent under ``Args:``.
Enums take no arguments of their own and are left out."""

from __future__ import annotations

import enum
import inspect
import re

import pytest

pytest.importorskip("torch")

import precond.torch
import precond.torch.kfac

MODULES = (precond.torch, precond.torch.kfac)
_ENTRY = re.compile(r"^\*{0,2}(\w+)(?: \([^)]*\))?:")


def _public_objects() -> list[tuple[str, object]]:
    found = []
    for module in MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, type) and issubclass(obj, enum.Enum):
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                found.append((f"{module.__name__}.{name}", obj))
    return found


def _parameters(obj) -> list[str]:
    signature = inspect.signature(obj)
    return [
        name
        for name, parameter in signature.parameters.items()
        if name not in ("self", "cls")
    ]


def documented_arguments(docstring: str | None) -> set[str] | None:
    """The names an ``Args:`` section lists, or None without one."""
    lines = inspect.cleandoc(docstring or "").splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == "Args:"]
    if not starts:
        return None
    start = starts[0]
    indent = len(lines[start]) - len(lines[start].lstrip())
    names: set[str] = set()
    entry_indent = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth <= indent:
            break
        if entry_indent is None:
            entry_indent = depth
        match = _ENTRY.match(line.strip())
        if depth == entry_indent and match:
            names.add(match.group(1))
    return names


def test_the_parser_reads_an_args_section():
    doc = """Summary.

    Args:
        params: parameters.
        lr (float): the rate, which
            continues: here (not an entry).
        *args: more.

    Example:
        >>> x: int = 1
    """
    assert documented_arguments(doc) == {"params", "lr", "args"}
    assert documented_arguments("No section.") is None


@pytest.mark.parametrize(
    ("name", "obj"), _public_objects(), ids=[n for n, _ in _public_objects()]
)
def test_every_parameter_has_an_args_entry(name, obj):
    parameters = _parameters(obj)
    documented = documented_arguments(obj.__doc__)
    if not parameters:
        return
    assert documented is not None, f"{name} has parameters {parameters} but no Args:"
    missing = [p for p in parameters if p not in documented]
    assert not missing, f"{name}'s Args: lacks {missing}"
    unknown = sorted(documented - set(parameters))
    assert not unknown, f"{name}'s Args: lists {unknown}, which it does not take"


def test_the_public_objects_are_found():
    names = {name for name, _ in _public_objects()}
    assert {"precond.torch.Kron", "precond.torch.kfac.KFAC"} <= names
