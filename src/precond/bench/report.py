"""Reports of benchmark results: a terminal table, a Markdown report and a JSON
document.

All take :class:`precond.bench.analysis.Summary` rows (and the raw runs) and return
strings or dicts; :func:`write_report` writes them to an output folder.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from precond.bench.analysis import (
    Fastest,
    Summary,
    Verdict,
    Winner,
    fastest,
    ranked,
    verdicts,
    winners,
)
from precond.bench.runner import RunResult

JSON_SCHEMA_VERSION = 2

NOT_REACHED = "not reached"

# (header, right-aligned)
COLUMNS = (
    ("framework", False),
    ("workload", False),
    ("optimizer", False),
    ("rank", True),
    ("lr", True),
    ("val loss", True),
    ("val acc", True),
    ("steps to base", True),
    ("time to base", True),
    ("step ms", True),
    ("step ×base", True),
    ("state bytes", True),
    ("state ×base", True),
    ("compile s", True),
)


def _number(value: float | None, spec: str) -> str:
    if value is None:
        return "-"
    return format(value, spec) if math.isfinite(value) else str(value)


def _accuracy(value: float) -> str:
    """ "93.1%", or "-" where there is none (a regression workload)."""
    return f"{100 * value:.1f}%" if math.isfinite(value) else "-"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _reach(value: float | None, ratio: float | None, row: Summary, unit: str) -> str:
    """ "123 (0.62)", "not reached", or "-" without a baseline."""
    if row.target is None:
        return "-"
    if value is None:
        return NOT_REACHED
    number = f"{value:.0f}" if unit == "steps" else f"{value:.3g}s"
    return f"{number} ({ratio:.2f})" if ratio is not None else number


def _loss(row: Summary) -> str:
    text = _number(row.val_loss, ".4g")
    if len(row.seeds) > 1 and math.isfinite(row.val_loss):
        text += f"±{row.val_loss_std:.2g}"
    if row.diverged:
        text += " (diverged)"
    if row.skipped_steps:
        text += f" ({row.skipped_steps} skipped)"
    return text


def skipped_steps_line(rows: Sequence[Summary]) -> str:
    """One sentence on the steps whose gradient the step guard refused (NaN or
    ±Inf entries, or a squared norm that overflows): none on a sound workload."""
    runs = [
        f"{r.optimizer} on {r.workload} ({r.framework}) {r.skipped_steps}"
        for r in rows
        if r.skipped_steps
    ]
    return (
        "Steps skipped by the step guard (non-finite or overflowing gradients): "
        + ("; ".join(runs) if runs else "none")
        + "."
    )


def table_cells(row: Summary, rank: int, baseline: str) -> list[str]:
    """The cells of one row of :data:`COLUMNS`; ``rank`` 1 is the lowest final
    validation loss of its (framework, workload), and the baseline is marked."""
    name = f"{row.optimizer} (baseline)" if row.optimizer == baseline else row.optimizer
    return [
        row.framework,
        row.workload,
        name,
        str(rank),
        f"{row.learning_rate:g}",
        _loss(row),
        _accuracy(row.val_accuracy),
        _reach(row.steps_to_target, row.steps_ratio, row, "steps"),
        _reach(row.time_to_target, row.time_ratio, row, "time"),
        _number(row.median_step_ms, ".2f"),
        _ratio(row.step_ratio),
        f"{row.state_bytes:,}",
        _ratio(row.state_ratio),
        _number(row.compile_s, ".1f"),
    ]


def _headers(baseline: str) -> list[str]:
    return [h.replace("base", baseline) for h, _ in COLUMNS]


def _table_rows(rows: Sequence[Summary], baseline: str) -> list[list[str]]:
    """The cells of every row, in the order of ``rows``."""
    rank = {
        id(row): i + 1 for group in ranked(rows).values() for i, row in enumerate(group)
    }
    return [table_cells(row, rank[id(row)], baseline) for row in rows]


def _loss_with_spread(row: Summary) -> str:
    text = _number(row.val_loss, ".4g")
    if len(row.seeds) > 1 and math.isfinite(row.val_loss):
        text += f" ± {row.val_loss_std:.2g}"
    return text


def winner_line(winner: Winner) -> str:
    """One sentence naming the optimizer with the lowest mean final validation
    loss of a (framework, workload) and the runner-up."""
    best, runner_up = winner.best, winner.runner_up
    text = (
        f"{winner.workload} ({winner.framework}): {best.optimizer} has the lowest "
        f"final validation loss, {_loss_with_spread(best)}"
    )
    if len(best.seeds) > 1:
        text = text.replace("final validation loss,", "mean final validation loss,")
    if runner_up is not None:
        text += f"; runner-up {runner_up.optimizer}, {_loss_with_spread(runner_up)}"
        if winner.within_spread:
            text += " (within the seeds' spread: not a settled order)"
    return text + "."


def format_winners(rows: Sequence[Summary]) -> str:
    """One :func:`winner_line` per (framework, workload)."""
    return "\n".join(winner_line(w) for w in winners(rows))


def fastest_line(found: Fastest, baseline: str = "adamw") -> str:
    """One sentence naming the optimizer that reaches ``baseline``'s final
    validation loss of a (framework, workload) in the least training time and
    the one that does in the fewest steps, or that none reached it."""
    head = (
        f"{found.workload} ({found.framework}): to {baseline}'s final validation "
        f"loss {_number(found.target, '.4g')}, "
    )
    if found.by_time is None or found.by_steps is None:
        return head + "none reached it."
    by_time, by_steps = found.by_time, found.by_steps
    time_text = f"{by_time.time_to_target:.3g} s"
    if by_time.time_ratio is not None:
        time_text += f", {by_time.time_ratio:.2f} of {baseline}'s"
    steps_text = f"{by_steps.steps_to_target:.0f} steps"
    if by_steps.steps_ratio is not None:
        steps_text += f", {by_steps.steps_ratio:.2f} of {baseline}'s"
    return (
        head + f"fastest in time {by_time.optimizer} ({time_text}); fewest steps "
        f"{by_steps.optimizer} ({steps_text})."
    )


def format_fastest(rows: Sequence[Summary], baseline: str = "adamw") -> str:
    """One :func:`fastest_line` per (framework, workload) with a baseline."""
    return "\n".join(fastest_line(f, baseline) for f in fastest(rows))


DECISIVE_METRIC = (
    "the training time to reach {baseline}'s final validation loss and stay "
    "below it (mean over seeds, each optimizer at its selected learning rate)"
)


def verdict_line(verdict: Verdict, baseline: str = "adamw") -> str:
    """One plain sentence: does precond's fastest optimizer reach ``baseline``'s
    final validation loss sooner than the fastest of the other libraries'?"""
    head = f"{verdict.workload} ({verdict.framework}): "
    ours, theirs = verdict.ours, verdict.theirs
    if ours is None and theirs is None:
        return head + f"no optimizer reached {baseline}'s final validation loss."
    if ours is None:
        assert theirs is not None
        return head + (
            f"precond does not win: {theirs.optimizer} reaches {baseline}'s final "
            f"validation loss in {theirs.time_to_target:.3g} s; none of precond's "
            "optimizers reaches it."
        )
    if theirs is None:
        return head + (
            f"precond wins: {ours.optimizer} reaches {baseline}'s final validation "
            f"loss in {ours.time_to_target:.3g} s; no other library's optimizer "
            "reaches it."
        )
    times = (
        f"{ours.optimizer} {ours.time_to_target:.3g} s, {theirs.optimizer} "
        f"{theirs.time_to_target:.3g} s"
    )
    if verdict.ratio is not None:  # None where theirs reached it at once (0 s)
        times += f" ({verdict.ratio:.2f}×)"
    if (ours.time_to_target or 0.0) < (theirs.time_to_target or 0.0):
        return head + f"precond wins: {times}."
    return head + f"precond does not win: {times}."


def format_verdicts(
    rows: Sequence[Summary], references: Sequence[str], baseline: str = "adamw"
) -> str:
    """The decisive metric in words, then one :func:`verdict_line` per
    (framework, workload) with a baseline."""
    found = verdicts(rows, references)
    if not found:
        return ""
    head = "Decisive metric: " + DECISIVE_METRIC.format(baseline=baseline) + "."
    return "\n".join([head, *(verdict_line(v, baseline) for v in found)])


def format_table(rows: Sequence[Summary], baseline: str = "adamw") -> str:
    """A plain-text table, one row per optimizer at its selected rate.

    Columns: final validation loss (mean ± std over seeds), validation accuracy,
    steps and seconds to reach the baseline's final validation loss (ratio to the
    baseline's steps and seconds in parentheses; see
    :mod:`precond.bench.analysis`), median step time and its ratio to the
    baseline, optimizer-state bytes and their ratio, JAX compile time.
    """
    headers = _headers(baseline)
    cells = _table_rows(rows, baseline)
    widths = [
        max([len(headers[i])] + [len(c[i]) for c in cells]) for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if right else v.ljust(w)
            for v, w, (_, right) in zip(values, widths, COLUMNS, strict=True)
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(c) for c in cells)])


def _markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |"]
    lines.append("|" + "|".join("---" for _ in headers) + "|")
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def format_markdown(
    rows: Sequence[Summary],
    *,
    command: str,
    config: dict[str, Any],
    environment: dict[str, Any],
    plots: Sequence[str],
    baseline: str = "adamw",
    interrupted: bool = False,
    date: str = "",
    references: Sequence[str] = (),
) -> str:
    """The Markdown report: how it was made, the verdict (precond against the
    ``references``, by :data:`DECISIVE_METRIC`), the summary table, the loss of each
    optimizer at the baseline's steps and time, the learning-rate sweep and the
    plots (paths relative to the report)."""
    env = ", ".join(f"{k} {v}" for k, v in environment.items())
    out = [
        "# precond bench report",
        "",
        f"- command: `{command}`",
        f"- date (UTC): {date}",
        f"- environment: {env}",
        "- config: "
        + ", ".join(f"{k} {v}" for k, v in config.items() if k != "learning_rates"),
    ]
    if interrupted:
        out += ["", "**Interrupted**: only the runs that finished are reported."]
    verdict = format_verdicts(rows, references, baseline).splitlines()
    if verdict:
        out += ["", "## Verdict", "", verdict[0], "", *(f"- {v}" for v in verdict[1:])]
    out += [
        "",
        "## Winners",
        "",
        "Lowest final validation loss of each workload (mean ± standard deviation "
        "over seeds where there are several):",
        "",
        *(f"- {winner_line(w)}" for w in winners(rows)),
        "",
        f"Fastest to {baseline}'s final validation loss (mean over seeds, at each "
        f"optimizer's selected learning rate; {baseline} itself counts), in "
        "training time and in steps:",
        "",
        *(f"- {fastest_line(f, baseline)}" for f in fastest(rows)),
        "",
        skipped_steps_line(rows),
        "",
        "## Summary",
        "",
        f"Each optimizer at its selected learning rate (lowest mean final "
        f"validation loss over the seeds of its sweep); rank 1 has the lowest "
        f"final validation loss of its workload. 'steps/time to {baseline}': the "
        f"first step (training second) from which the validation loss, evaluated "
        f"on the whole validation split and joined linearly between evaluations, "
        f"stays ≤ {baseline}'s final validation loss to the end of the run (a "
        f"transient dip below it does not count), and in parentheses its ratio to "
        f"{baseline}'s steps (seconds); 'not reached' if the run does not end "
        f"at or below it.",
        "",
        _markdown_table(_headers(baseline), _table_rows(rows, baseline)),
        "",
        f"## Equal steps and equal time vs {baseline}",
        "",
        f"Validation loss of each optimizer after {baseline}'s number of steps and "
        f"after {baseline}'s training time ('-' where the run was shorter).",
        "",
    ]
    equal = [
        [
            r.framework,
            r.workload,
            r.optimizer,
            _number(r.target, ".4g"),
            _number(r.val_loss_at_baseline_steps, ".4g"),
            _number(r.val_loss_at_baseline_time, ".4g"),
            _number(r.train_s, ".1f"),
        ]
        for r in rows
    ]
    headers = ["framework", "workload", "optimizer", f"{baseline} final loss"]
    headers += [f"loss at {baseline}'s steps", f"loss at {baseline}'s time"]
    headers += ["train s"]
    out += [_markdown_table(headers, equal), ""]
    if any(len(r.swept) > 1 for r in rows):
        out += [
            "## Learning-rate sweep",
            "",
            "Mean final validation loss over seeds at each learning rate "
            "(selected in bold).",
            "",
        ]
        sweep = []
        for r in rows:
            cells = []
            for lr, v in r.swept.items():
                cell = f"{lr:g}: {_number(v, '.4g')}"
                cells.append(f"**{cell}**" if lr == r.learning_rate else cell)
            sweep.append([r.framework, r.workload, r.optimizer, " · ".join(cells)])
        out += [
            _markdown_table(["framework", "workload", "optimizer", "lr: loss"], sweep),
            "",
        ]
    if plots:
        out += ["## Plots", ""]
        out += [f"![{os.path.basename(p)}]({p})" for p in plots]
        out.append("")
    return "\n".join(out)


RESULTS_BEGIN = "<!-- bench-results:begin -->"
RESULTS_END = "<!-- bench-results:end -->"


def results_table(
    rows: Sequence[Summary],
    *,
    command: str,
    environment: dict[str, Any],
    date: str,
    baseline: str = "adamw",
) -> str:
    """The small Markdown table of a README: a header line naming the command,
    the machine, the commit and the date, then one row per optimizer (final
    validation loss, time and steps to ``baseline``'s final validation loss,
    step time and state size as ratios to ``baseline``'s)."""
    cores = environment.get("available_cores", environment.get("cpu_count"))
    seeds = max((len(r.seeds) for r in rows), default=1)
    header = (
        f"`{command}`: {environment.get('cpu', 'unknown CPU')}, {cores} cores, "
        f"commit `{environment.get('commit', 'unknown')}`, {date[:10]}; mean of "
        f"{seeds} seed{'s' if seeds > 1 else ''}. Time and steps to {baseline}'s "
        f"final validation loss, and in parentheses their ratio to {baseline}'s."
    )
    headers = ["workload", "optimizer", "val loss", f"time to {baseline}"]
    headers += [f"steps to {baseline}", f"step ×{baseline}", f"state ×{baseline}"]
    cells = [
        [
            r.workload if r.framework == "jax" else f"{r.workload} ({r.framework})",
            r.optimizer,
            _loss_with_spread(r).replace(" ± ", "±"),
            _reach(r.time_to_target, r.time_ratio, r, "time"),
            _reach(r.steps_to_target, r.steps_ratio, r, "steps"),
            _ratio(r.step_ratio),
            _ratio(r.state_ratio),
        ]
        for r in rows
    ]
    return header + "\n\n" + _markdown_table(headers, cells) + "\n"


def block_markers(block: str = "bench-results") -> tuple[str, str]:
    """The lines that open and close the generated block ``block`` of a Markdown
    file: ``<!-- block:begin -->`` and ``<!-- block:end -->``."""
    return f"<!-- {block}:begin -->", f"<!-- {block}:end -->"


def replace_results_block(
    text: str, table: str, name: str = "the file", block: str = "bench-results"
) -> str:
    """``text`` with what lies between the markers of ``block``
    (:func:`block_markers`; by default :data:`RESULTS_BEGIN` and
    :data:`RESULTS_END`) replaced by ``table``; ValueError naming ``name`` when
    the markers are missing or out of order."""
    opening, closing = block_markers(block)
    begin, end = text.find(opening), text.find(closing)
    if begin < 0 or end < begin:
        raise ValueError(
            f"{name} has no results block: put the lines {opening} and "
            f"{closing} where the table goes"
        )
    start = begin + len(opening)
    return text[:start] + "\n" + table + text[end:]


def json_safe(value: Any) -> Any:
    """``value`` with NaN/±Inf (not valid JSON) replaced by None, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _fastest_entry(found: Fastest) -> dict[str, Any]:
    def reached(row: Summary | None) -> dict[str, Any] | None:
        if row is None:
            return None
        return {
            "optimizer": row.optimizer,
            "steps_to_target": row.steps_to_target,
            "time_to_target": row.time_to_target,
        }

    return {
        "framework": found.framework,
        "workload": found.workload,
        "target": found.target,
        "by_time": reached(found.by_time),
        "by_steps": reached(found.by_steps),
    }


def json_document(
    results: Sequence[RunResult],
    rows: Sequence[Summary],
    *,
    config: dict[str, Any],
    environment: dict[str, Any],
    baseline: str = "adamw",
    interrupted: bool = False,
) -> dict[str, Any]:
    """A JSON-ready dict: schema version, the command's config, the environment,
    the baseline, whether the suite was interrupted, one summary per optimizer,
    the fastest optimizers to the baseline's final loss per (framework,
    workload) and one dict per run (non-finite numbers become null)."""
    summaries = []
    for row in rows:
        d = asdict(row)
        d["swept"] = [{"learning_rate": k, "val_loss": v} for k, v in row.swept.items()]
        summaries.append(d)
    return json_safe(
        {
            "schema_version": JSON_SCHEMA_VERSION,
            "config": dict(config),
            "environment": dict(environment),
            "baseline": baseline,
            "interrupted": interrupted,
            "summary": summaries,
            "fastest": [_fastest_entry(f) for f in fastest(rows)],
            "runs": [r.to_dict() for r in results],
        }
    )


def write_json(document: Any, path: str) -> None:
    """Writes ``document`` to ``path`` as strict JSON, indented: NaN/±Inf become
    null (:func:`json_safe`), other objects JSON has no type for their ``str``."""
    with open(path, "w", encoding="utf-8") as file:
        json.dump(json_safe(document), file, indent=2, allow_nan=False, default=str)
        file.write("\n")


def run_from_json(entry: dict[str, Any]) -> RunResult:
    """The :class:`RunResult` whose ``to_dict()`` :func:`write_json` wrote as
    ``entry``: the nulls it wrote for NaN/±Inf floats read back as NaN, except
    ``compile_s``, where null means no separate compilation."""

    def number(value: Any) -> Any:
        return math.nan if value is None else value

    fields: dict[str, Any] = {
        key: value if key == "compile_s" else number(value)
        for key, value in entry.items()
    }
    fields["history"] = [
        {key: number(value) for key, value in point.items()}
        for point in entry["history"]
    ]
    fields["minibatch_loss"] = [number(x) for x in entry["minibatch_loss"]]
    fields["step_ms"] = [number(x) for x in entry["step_ms"]]
    return RunResult(**fields)
