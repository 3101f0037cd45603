"""Checks the contents of a built precond wheel (standard library only).

Usage::

    python .ci/check_wheel.py dist/precond-X-py3-none-any.whl [--source src/precond]

Checks that the wheel holds every file of the source package (every ``.py``
module and ``py.typed`` if the source has one; caches and byte code aside) under
``precond/``, nothing outside ``precond/`` and its ``.dist-info`` (in particular no
``tests/``), a ``precond`` console script pointing at ``precond.bench.cli:main``,
and the extras ``jax``, ``torch``, ``bench``, ``dev`` and ``docs`` in its metadata.
Exits 1 with one line per problem, 0 (and a one-line summary) when all is well.
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from pathlib import Path

EXTRAS = ("jax", "torch", "bench", "dev", "docs")
ENTRY_POINT = re.compile(r"^precond\s*=\s*precond\.bench\.cli:main\s*$", flags=re.M)


def _source_files(source: Path) -> set[str]:
    return {
        "precond/" + path.relative_to(source).as_posix()
        for path in source.rglob("*")
        if path.is_file()
        and "__pycache__" not in path.parts
        and path.suffix not in (".pyc", ".pyo")
    }


def check_wheel(wheel: Path, source: Path) -> tuple[list[str], int]:
    """Problems with ``wheel``; the number of package files it holds."""
    with zipfile.ZipFile(wheel) as archive:
        names = {n for n in archive.namelist() if not n.endswith("/")}  # no folders
        dist_info = sorted({n.split("/")[0] for n in names if ".dist-info/" in n})
        problems = []
        if len(dist_info) != 1:
            return [f"{wheel}: {len(dist_info)} .dist-info folders"], 0
        entry_points = metadata = ""
        if f"{dist_info[0]}/entry_points.txt" in names:
            entry_points = archive.read(f"{dist_info[0]}/entry_points.txt").decode()
        if f"{dist_info[0]}/METADATA" in names:
            metadata = archive.read(f"{dist_info[0]}/METADATA").decode()
    package = {n for n in names if n.startswith("precond/")}
    want = _source_files(source)
    problems += [f"{wheel}: lacks {n}" for n in sorted(want - package)]
    problems += [f"{wheel}: holds {n}, not in {source}" for n in sorted(package - want)]
    for name in ("precond/__init__.py", "precond/bench/cli.py"):
        if name not in package:
            problems.append(f"{wheel}: lacks {name}")
    stray = sorted(n for n in names - package if not n.startswith(f"{dist_info[0]}/"))
    problems += [f"{wheel}: holds {n}, outside precond/" for n in stray]
    problems += [f"{wheel}: holds test file {n}" for n in names if "tests/" in n]
    if not ENTRY_POINT.search(entry_points):
        problems.append(f"{wheel}: no console script precond = precond.bench.cli:main")
    extras = set(re.findall(r"^Provides-Extra:\s*(\S+)", metadata, flags=re.M))
    problems += [
        f"{wheel}: METADATA has no extra {e!r}" for e in EXTRAS if e not in extras
    ]
    return problems, len(package)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument(
        "--source",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "src" / "precond",
        help="the source package the wheel is built from (default: src/precond)",
    )
    args = parser.parse_args(argv)
    problems, n_files = check_wheel(args.wheel, args.source)
    for problem in problems:
        print(f"check_wheel: {problem}", file=sys.stderr)
    if problems:
        return 1
    typed = " and py.typed" if (args.source / "py.typed").exists() else ""
    print(
        f"check_wheel: {args.wheel.name}: {n_files} package files (every source "
        f"module{typed}), no tests, console script, extras {', '.join(EXTRAS)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
