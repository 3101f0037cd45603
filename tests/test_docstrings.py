"""Every public function and class of ``precond.jax`` documents its arguments on
itself (optax's style), so that ``help()`` and the docs site list them.

A function's docstring has an ``Args:`` section with one entry per parameter of
its signature (``*args`` and ``**kwargs`` by those names) and a ``Returns:``
section; a class (a state ``NamedTuple``) has an ``Args:`` or ``Attributes:``
entry per field of its constructor. Enums document their members instead.
"""

from __future__ import annotations

import enum
import inspect
import re

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

import precond.jax as pj

SECTION = re.compile(r"^(\s*)(Args|Arguments|Attributes|Returns|Yields):\s*$")
ENTRY = re.compile(r"^(\*{0,2}\w+)(\s*\([^)]*\))?:")


def _sections(doc: str) -> dict[str, list[str]]:
    """Google-style sections of ``doc``: each title and its entries' names
    (the lines one indent below the title that start ``name:``)."""
    sections: dict[str, list[str]] = {}
    title, indent, entry_indent = None, 0, None
    for line in doc.splitlines():
        match = SECTION.match(line)
        if match:
            title, indent, entry_indent = match.group(2), len(match.group(1)), None
            sections.setdefault(title, [])
            continue
        if title is None or not line.strip():
            continue
        line_indent = len(line) - len(line.lstrip())
        if line_indent <= indent:
            title = None
            continue
        if entry_indent is None:
            entry_indent = line_indent
        if line_indent == entry_indent:
            entry = ENTRY.match(line.strip())
            if entry:
                sections[title].append(entry.group(1))
    return sections


def _parameter_names(obj) -> list[str]:
    names = []
    for name, parameter in inspect.signature(obj).parameters.items():
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            name = f"*{name}"
        elif parameter.kind is inspect.Parameter.VAR_KEYWORD:
            name = f"**{name}"
        names.append(name)
    return names


def _public_objects() -> list[tuple[str, object]]:
    objects = [(name, getattr(pj, name)) for name in pj.__all__]
    return [
        (name, obj)
        for name, obj in objects
        if inspect.isfunction(obj)
        or (inspect.isclass(obj) and not issubclass(obj, enum.Enum))
    ]


def _missing(name: str, obj) -> list[str]:
    """What ``obj``'s docstring lacks: Args entries for parameters, Returns."""
    sections = _sections(inspect.getdoc(obj) or "")
    documented = set(sections.get("Args", [])) | set(sections.get("Arguments", []))
    if inspect.isclass(obj):
        documented |= set(sections.get("Attributes", []))
    problems = [
        f"{name}: no Args entry for {parameter}"
        for parameter in _parameter_names(obj)
        if parameter not in documented
    ]
    if inspect.isfunction(obj) and "Returns" not in sections:
        problems.append(f"{name}: no Returns section")
    return problems


def test_the_section_parser_reads_google_style():
    doc = """Summary.

    Args:
        a: the first,
            over two lines.
        b (int): the second.
        **kwargs: the rest.

    Returns:
        Something.
    """
    sections = _sections(inspect.cleandoc(doc))
    assert sections == {"Args": ["a", "b", "**kwargs"], "Returns": []}


def test_every_public_name_is_checked():
    names = [name for name, _ in _public_objects()]
    assert {"kron", "scale_by_kron", "distributed_shampoo", "KronState"} <= set(names)


@pytest.mark.parametrize("name", [name for name, _ in _public_objects()])
def test_public_function_documents_every_argument(name):
    assert _missing(name, getattr(pj, name)) == []
