"""Reports of benchmark results: a plain-text table and a JSON document.

Both take :class:`precond.bench.runner.RunResult` objects and return strings or
dicts; writing them anywhere is the caller's business.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from precond.bench.runner import RunResult

JSON_SCHEMA_VERSION = 1

COLUMNS = (
    # (header, right-aligned)
    ("workload", False),
    ("optimizer", False),
    ("lr", True),
    ("train loss", True),
    ("test loss", True),
    ("test acc", True),
    ("step ms", True),
    ("step ×base", True),
    ("compile s", True),
    ("state bytes", True),
    ("state ×base", True),
)


def _ratio(value: float, base: float | None) -> str:
    if base is None or base == 0 or not math.isfinite(value):
        return "-"
    return f"{value / base:.2f}"


def _number(value: float, spec: str) -> str:
    return format(value, spec) if math.isfinite(value) else str(value)


def format_table(results: Sequence[RunResult], baseline: str = "adamw") -> str:
    """One row per run; ratios are to the ``baseline`` optimizer's run of the same
    workload ("-" where it was not run).

    Columns: final loss on the full train and test sets (a float32 cross-entropy
    that underflows prints as 0), test accuracy (%), median step time
    (ms), its ratio to the baseline, train-step compile time (s), optimizer-state
    bytes and their ratio to the baseline.
    """
    base = {r.workload: r for r in results if r.optimizer == baseline}
    headers = [h.replace("base", baseline) if "×" in h else h for h, _ in COLUMNS]
    rows = []
    for r in results:
        b = base.get(r.workload)
        rows.append(
            [
                r.workload,
                r.optimizer,
                f"{r.learning_rate:g}",
                _number(r.final_train_loss, ".3g"),
                _number(r.test_loss, ".3g"),
                _number(100 * r.test_accuracy, ".2f") + "%",
                f"{r.median_step_ms:.3f}",
                _ratio(r.median_step_ms, b.median_step_ms if b else None),
                f"{r.compile_s:.2f}",
                f"{r.state_bytes:,}",
                _ratio(r.state_bytes, b.state_bytes if b else None),
            ]
        )
    widths = [
        max(len(headers[i]), *(len(row[i]) for row in rows)) if rows else len(h)
        for i, h in enumerate(headers)
    ]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(width) if right else cell.ljust(width)
            for cell, width, (_, right) in zip(cells, widths, COLUMNS, strict=True)
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def _finite_or_none(value: Any) -> Any:
    """Replaces NaN/±Inf (not valid JSON) by None, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_none(v) for v in value]
    return value


def json_document(
    results: Sequence[RunResult],
    *,
    config: dict[str, Any],
    environment: dict[str, Any],
    baseline: str = "adamw",
) -> dict[str, Any]:
    """A JSON-ready dict: schema version, the command's config, the environment,
    the baseline name and one dict per run (non-finite numbers become null)."""
    return _finite_or_none(
        {
            "schema_version": JSON_SCHEMA_VERSION,
            "config": dict(config),
            "environment": dict(environment),
            "baseline": baseline,
            "runs": [r.to_dict() for r in results],
        }
    )
