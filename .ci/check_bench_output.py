"""Checks the output of a short ``precond bench`` run (standard library only).

Usage::

    python .ci/check_bench_output.py OUTPUT_DIR [--list LIST_OUTPUT]
        [--frameworks jax] [--workloads A,B] [--optimizers A,B]

``OUTPUT_DIR`` is the folder given to ``precond bench --output``. Checks:

- ``results.json`` parses (strict JSON: no NaN) and its ``runs`` list holds, for
  every framework × workload × optimizer asked for, at least one run whose
  ``final_val_loss`` is a finite number, no run whose ``skipped_steps`` (steps the
  optimizers' step guard refused) is not 0, and no run of another framework (a
  venv without torch must not produce torch runs);
- ``report.md`` exists and names every workload, and for every framework ×
  workload has a line naming the optimizers fastest to AdamW's final validation
  loss in time and in steps, or saying none reached it, and a verdict line
  saying whether precond wins (after the decisive metric named);
- every plot that ``report.md`` links (``![...](name.png)``) exists and is a valid
  PNG: signature, IHDR first with a non-zero size, IEND last, every chunk's CRC
  right, and more than a trivial number of bytes; at least one plot is linked.

With ``--list``, the file holding the output of ``precond bench --list`` must name
every workload and optimizer asked for.

Only the basic structure is relied on (``runs`` with ``framework``, ``workload``,
``optimizer``, ``final_val_loss``), so new fields in the report do not break it.
Exits 1 with one line per problem, 0 (and a one-line summary) when all is well.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import struct
import sys
import zlib
from pathlib import Path

# The JAX workloads and the optimizers a bare `precond bench` runs in JAX.
WORKLOADS = ("teacher-student", "char-lm")
OPTIMIZERS = ("kron", "pro-adamw", "shampoo", "soap", "adamw", "muon")
FRAMEWORKS = ("jax",)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MIN_PNG_BYTES = 2000  # a real loss plot is tens of kB; an empty figure is ~1 kB
PLOT_LINK = re.compile(r"!\[[^\]]*\]\(([^)\s]+\.png)\)")
# "- char-lm (jax): to adamw's final validation loss 2.2, fastest in time muon
# (...); fewest steps kron (...)." or "..., none reached it."
FASTEST_LINE = re.compile(
    r"^- (?P<workload>\S+) \((?P<framework>\w+)\): to adamw's final validation "
    r"loss \S+, (?:fastest in time (?P<by_time>\S+) \(.*\); fewest steps "
    r"(?P<by_steps>\S+) \(.*\)|none reached it)\.$",
    flags=re.M,
)


# "- char-lm (jax): precond wins: pro-adamw 5.1 s, muon 6.4 s (0.80×)." and the
# other plain outcomes of report.py's verdict_line.
VERDICT_LINE = re.compile(
    r"^- (?P<workload>\S+) \((?P<framework>\w+)\): (?:precond wins|precond does "
    r"not win|no optimizer reached)",
    flags=re.M,
)


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-JSON number {name}")


def check_results(path: Path, frameworks, workloads, optimizers) -> list[str]:
    try:
        document = json.loads(
            path.read_text(encoding="utf-8"), parse_constant=_reject_constant
        )
    except (OSError, ValueError) as error:
        return [f"{path}: does not parse: {error}"]
    runs = document.get("runs") if isinstance(document, dict) else None
    if not isinstance(runs, list) or not runs:
        return [f"{path}: no 'runs' list, or it is empty"]
    problems = []
    found: dict[tuple[str, str, str], list[object]] = {}
    for i, run in enumerate(runs):
        keys = ("framework", "workload", "optimizer", "final_val_loss")
        if not isinstance(run, dict) or any(k not in run for k in keys):
            problems.append(f"{path}: runs[{i}] lacks one of {', '.join(keys)}")
            continue
        key = (run["framework"], run["workload"], run["optimizer"])
        found.setdefault(key, []).append(run["final_val_loss"])
        if run.get("skipped_steps", 0) != 0:
            problems.append(
                f"{path}: {'/'.join(key)}: the step guard skipped "
                f"{run['skipped_steps']} steps (a sound workload has none)"
            )
        if run["framework"] not in frameworks:
            problems.append(
                f"{path}: runs[{i}] is a {run['framework']!r} run; expected only "
                f"{', '.join(frameworks)}"
            )
    for key in ((f, w, o) for f in frameworks for w in workloads for o in optimizers):
        losses = found.get(key)
        name = "/".join(key)
        if not losses:
            problems.append(f"{path}: no run of {name}")
            continue
        for loss in losses:
            finite = isinstance(loss, int | float) and not isinstance(loss, bool)
            if not (finite and math.isfinite(loss)):
                problems.append(f"{path}: {name}: final_val_loss is {loss!r}")
    return problems


def check_png(path: Path) -> list[str]:
    """Problems with the PNG at ``path`` (none when it is a valid PNG)."""
    try:
        data = path.read_bytes()
    except OSError as error:
        return [f"{path}: cannot be read: {error}"]
    if len(data) < MIN_PNG_BYTES:
        return [f"{path}: only {len(data)} bytes"]
    if not data.startswith(PNG_SIGNATURE):
        return [f"{path}: no PNG signature"]
    chunks, offset = [], len(PNG_SIGNATURE)
    while offset + 12 <= len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind = data[offset + 4 : offset + 8]
        body = data[offset + 8 : offset + 8 + length]
        crc_bytes = data[offset + 8 + length : offset + 12 + length]
        if len(body) != length or len(crc_bytes) != 4:
            return [f"{path}: chunk {kind!r} is truncated"]
        if zlib.crc32(kind + body) != struct.unpack(">I", crc_bytes)[0]:
            return [f"{path}: chunk {kind!r} has a bad CRC"]
        chunks.append((kind, body))
        offset += 12 + length
    if not chunks or chunks[0][0] != b"IHDR" or len(chunks[0][1]) != 13:
        return [f"{path}: the first chunk is not an IHDR"]
    width, height = struct.unpack(">II", chunks[0][1][:8])
    if width == 0 or height == 0:
        return [f"{path}: empty image ({width}×{height})"]
    if chunks[-1][0] != b"IEND" or offset != len(data):
        return [f"{path}: does not end with an IEND chunk"]
    if not any(kind == b"IDAT" for kind, _ in chunks):
        return [f"{path}: no image data"]
    return []


def check_fastest(path: Path, text: str, frameworks, workloads, optimizers):
    """Problems with report.md's lines naming the fastest to AdamW's loss."""
    found = {(m["framework"], m["workload"]): m for m in FASTEST_LINE.finditer(text)}
    problems = []
    for framework in frameworks:
        for workload in workloads:
            match = found.get((framework, workload))
            if match is None:
                problems.append(
                    f"{path}: no line naming the fastest to adamw's final "
                    f"validation loss on {workload} ({framework})"
                )
                continue
            for kind in ("by_time", "by_steps"):
                name = match[kind]
                if name is not None and name not in optimizers:
                    problems.append(
                        f"{path}: {workload} ({framework}): the fastest "
                        f"({kind.replace('_', ' ')}) is {name!r}, not a run optimizer"
                    )
    return problems


def check_verdict(path: Path, text: str, frameworks, workloads) -> list[str]:
    """Problems with report.md's verdict: the decisive metric named, and one
    line per workload saying whether precond wins."""
    problems = []
    if "Decisive metric: " not in text:
        problems.append(f"{path}: names no decisive metric")
    found = {(m["framework"], m["workload"]) for m in VERDICT_LINE.finditer(text)}
    for framework in frameworks:
        for workload in workloads:
            if (framework, workload) not in found:
                problems.append(f"{path}: no verdict line for {workload} ({framework})")
    return problems


def check_report(
    folder: Path, workloads, frameworks=FRAMEWORKS, optimizers=OPTIMIZERS
) -> tuple[list[str], int]:
    """Problems with report.md and the plots it links; the number of plots."""
    path = folder / "report.md"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        return [f"{path}: cannot be read: {error}"], 0
    problems = [f"{path}: does not name {w!r}" for w in workloads if w not in text]
    if "adamw" in optimizers:
        problems += check_fastest(path, text, frameworks, workloads, optimizers)
        problems += check_verdict(path, text, frameworks, workloads)
    plots = list(dict.fromkeys(PLOT_LINK.findall(text)))
    if not plots:
        problems.append(f"{path}: links no PNG plot")
    for plot in plots:
        problems += check_png(folder / plot)
    return problems, len(plots)


def check_list(path: Path, workloads, optimizers) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        return [f"{path}: cannot be read: {error}"]
    names = set(re.findall(r"^\s+(\S+)\s", text, flags=re.M))
    return [
        f"{path}: `precond bench --list` does not list {name!r}"
        for name in (*workloads, *optimizers)
        if name not in names
    ]


def _names(text: str) -> tuple[str, ...]:
    return tuple(n for n in text.split(",") if n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="the precond bench --output folder")
    parser.add_argument("--list", type=Path, help="saved `precond bench --list`")
    parser.add_argument("--frameworks", type=_names, default=FRAMEWORKS)
    parser.add_argument("--workloads", type=_names, default=WORKLOADS)
    parser.add_argument("--optimizers", type=_names, default=OPTIMIZERS)
    args = parser.parse_args(argv)

    problems = check_results(
        args.output / "results.json", args.frameworks, args.workloads, args.optimizers
    )
    report_problems, n_plots = check_report(
        args.output, args.workloads, args.frameworks, args.optimizers
    )
    problems += report_problems
    if args.list is not None:
        problems += check_list(args.list, args.workloads, args.optimizers)
    for problem in problems:
        print(f"check_bench_output: {problem}", file=sys.stderr)
    if problems:
        return 1
    n_runs = len(args.frameworks) * len(args.workloads) * len(args.optimizers)
    print(
        f"check_bench_output: {args.output}: {n_runs} runs "
        f"({','.join(args.frameworks)} × {','.join(args.workloads)} × "
        f"{','.join(args.optimizers)}) with finite losses, report.md (with the "
        f"fastest to adamw's loss), {n_plots} valid PNG plots"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
