"""precond's speed harness: every case of ``benchmarks/cases.py`` (and the memory
per device of ``benchmarks/memory.py``) measured, and the tables of
``BENCHMARKS.md`` rewritten between their markers.

Protocol: a case's two optimizers each run ``steps`` steps per round on the same
fixed gradients, alternating round by round (the first one alternating too); the
time per step is the median over ``--rounds`` of each round's mean, and the row's
ratio is the subject's over the reference's: precond/original for a pair,
× AdamW for the others. Times compare only within one run; ratios across runs
only on the same machine. JAX runs on its default device, torch on CUDA when
there is one (``--torch-device``). With the JAX pairs, XLA:CPU's pool has at
least :data:`ORIGINALS_XLA_POOL` threads, which the header records.

Usage::

    python benchmarks/speed.py --write BENCHMARKS.md        # every table
    python benchmarks/speed.py --quick --tables jax-pairs    # smoke run, stdout
    python benchmarks/speed.py --tables torch-pairs --models digits-mlp --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# table name -> (title, subject column, reference column, ratio column)
TABLES = {
    "jax-pairs": ("precond", "original", "precond / original"),
    "jax-adamw": ("optimizer", "AdamW", "× AdamW"),
    "memory": (),
    "torch-pairs": ("precond", "original", "precond / original"),
    "torch-adamw": ("optimizer", "AdamW", "× AdamW"),
}
# XLA:CPU's intra-op pool while the JAX pairs run. distributed-kron's updates
# make batched LAPACK calls that block a pool thread each until the pool runs
# their pieces; with a pool of 2 (the CI machine's cores) they block all of it and
# the process hangs (src/precond/jax/_core/pool_safe_linalg.py says how; precond's
# own programs make no such call). Both sides of every JAX case run on this pool.
ORIGINALS_XLA_POOL = 8


def measure(steppers: Sequence[Callable[[int], None]], steps: int, rounds: int):
    """Median over ``rounds`` of each round's mean seconds per step, per stepper,
    the steppers taking turns to go first."""
    per_round: list[list[float]] = [[] for _ in steppers]
    order = list(range(len(steppers)))
    for r in range(rounds):
        for i in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            steppers[i](steps)
            per_round[i].append((time.perf_counter() - start) / steps)
    return [statistics.median(times) for times in per_round]


def settle_allocator() -> None:
    """Allocates and frees 16 MiB, as a backward pass frees its activations, so
    that glibc's malloc keeps a step's temporaries on its heap whatever ran before
    (else a fresh process may page-fault on every step of a large one)."""
    import torch

    torch.ones(4 * 2**20)


def run_case(case, rounds: int, quick: bool, missing: dict[str, str | None]) -> dict:
    """One row: the case's fields and its times, or why it did not run."""
    from cases import available

    row = {k: getattr(case, k) for k in ("model", "subject", "reference", "setting")}
    if case.reference != "adamw":
        if case.reference not in missing:
            missing[case.reference] = available(case.reference)
        if missing[case.reference]:
            return row | {"skipped": missing[case.reference]}
    steps = min(case.steps, 2) if quick else case.steps
    try:
        subject, reference = case.make()
        ours, theirs = measure([subject, reference], steps, rounds)
    except Exception as error:  # a case that fails is a row that says so
        return row | {"skipped": f"{type(error).__name__}: {str(error)[:160]}"}
    return row | {
        "ms": 1e3 * ours,
        "reference_ms": 1e3 * theirs,
        "ratio": ours / theirs,
        "steps": steps,
    }


def memory_rows(quick: bool) -> list[dict]:
    """memory.py's rows, run in a process of its own (it simulates 8 CPU
    devices, which must not share a process with the timed cases)."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "memory.json")
        command = [sys.executable, str(HERE / "memory.py"), "--json", out]
        env = os.environ | {"JAX_PLATFORMS": "cpu"}
        subprocess.run(command + ["--quick"] * quick, check=True, env=env)
        return json.loads(pathlib.Path(out).read_text())


# ------------------------------------------------------------------ tables


def _ms(x: float) -> str:
    return f"{x:.3g}" if x < 10 else f"{x:.1f}"


def header(command: str, env: dict[str, Any], date: str, quick: bool, rounds: int):
    """The line above every table: its command, the machine, commit and date."""
    cores = env.get("available_cores", env.get("cpu_count"))
    device = env.get("device", "cpu")
    torch_device = env.get("torch_device")
    pool = env.get("xla_pool_threads")
    device += f" (XLA pool {pool})" if pool not in (None, "cores", str(cores)) else ""
    devices = f"JAX on {device}" + (
        f", torch on {torch_device}" if torch_device else ""
    )
    protocol = (
        "smoke run (`--quick`): 2 steps a round, times not meaningful"
        if quick
        else f"medians of {rounds} interleaved rounds"
    )
    return (
        f"`{command}` — {env.get('cpu', 'unknown CPU')}, {cores} cores, {devices}, "
        f"commit `{env.get('commit', 'unknown')}`, {date[:10]}; {protocol}:"
    )


def markdown(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    aligns = [
        "---"
        if h in ("model", "precond", "original", "optimizer", "setting", "source")
        else "---:"
        for h in headers
    ]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(aligns) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def speed_table(table: str, rows: Sequence[dict]) -> str:
    subject, reference, ratio = TABLES[table]
    headers = ["model", subject]
    headers += [reference] * (reference == "original")
    headers += ["setting", f"{subject} ms", f"{reference} ms", ratio]
    cells = []
    for row in rows:
        names = [row["model"], row["subject"]]
        names += [row["reference"]] * (reference == "original")
        if "skipped" in row:
            cells.append(
                [*names, row["setting"], "–", "–", f"not run: {row['skipped']}"]
            )
        else:
            times = [_ms(row["ms"]), _ms(row["reference_ms"]), f"{row['ratio']:.2f}"]
            cells.append([*names, row["setting"], *times])
    return markdown(headers, cells)


def memory_table(rows: Sequence[dict]) -> str:
    headers = ["model", "optimizer", "devices", "source", "params MB/device"]
    headers += ["state MB/device", "state / 1 device", "received / param bytes"]
    cells = []
    for r in rows:
        cells.append([r["model"], r["optimizer"], str(r["devices"])])
        if "skipped" in r:
            cells[-1] += [f"not run: {r['skipped']}", "–", "–", "–", "–"]
            continue
        state = r["state_bytes_per_device"]
        received = r.get("received_bytes")
        cells[-1] += [
            r["source"],
            f"{r['param_bytes_per_device'] / 1e6:.2f}",
            f"{state / 1e6:.2f}" + (" !" if r.get("off") else ""),
            f"{state / r['one_device_state_bytes']:.3f}",
            "–" if received is None else f"{received / r['param_bytes']:.2f}",
        ]
    return markdown(headers, cells)


def block(table: str, rows: Sequence[dict], head: str) -> str:
    body = memory_table(rows) if table == "memory" else speed_table(table, rows)
    return f"{head}\n\n{body}\n"


def write(path: str, blocks: dict[str, str]) -> None:
    """Each table's block of ``path`` (between ``<!-- speed:TABLE:begin -->`` and
    ``<!-- speed:TABLE:end -->``) replaced; other text left as it is."""
    from precond.bench.report import replace_results_block

    text = pathlib.Path(path).read_text(encoding="utf-8")
    for table, content in blocks.items():
        text = replace_results_block(text, content, path, block=f"speed:{table}")
    pathlib.Path(path).write_text(text, encoding="utf-8")


# -------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from cases import MODELS
    from precond.bench.arguments import names
    from precond.bench.machine import available_cores

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tables",
        type=names(TABLES, "table"),
        default=list(TABLES),
        help=f"comma-separated, of {', '.join(TABLES)} (default all)",
    )
    parser.add_argument("--models", type=names(MODELS, "model"), default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2 rounds of 2 steps, small memory shapes",
    )
    parser.add_argument("--threads", type=int, default=available_cores())
    parser.add_argument("--torch-device", help="default: cuda when present, else cpu")
    parser.add_argument(
        "--write",
        metavar="PATH",
        help="rewrite these tables' blocks of the Markdown file PATH",
    )
    parser.add_argument("--json", metavar="PATH", help="also write every row as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, list[dict]]:
    args = parse_args(argv)
    from precond.bench.machine import configure_threads, environment

    xla_pool = None
    if "jax-pairs" in args.tables:
        xla_pool = max(args.threads, ORIGINALS_XLA_POOL)
    threads = configure_threads(args.threads, ("jax", "torch"), xla_pool=xla_pool)
    if args.torch_device:
        os.environ["PRECOND_TORCH_DEVICE"] = args.torch_device
    import jax  # noqa: F401  (after the threads are set)
    import torch

    from cases import CASES, torch_device

    settle_allocator()
    rounds = 2 if args.quick else args.rounds
    env = environment(("jax", "torch"), threads)
    if any(t.startswith("torch") for t in args.tables):
        device = torch_device()
        env["torch_device"] = (
            torch.cuda.get_device_name(device) if device.startswith("cuda") else device
        )
    command = "python benchmarks/speed.py " + " ".join(argv or sys.argv[1:])
    date = datetime.datetime.now(datetime.timezone.utc).isoformat()
    head = header(command.strip(), env, date, args.quick, rounds)
    results, blocks, missing = {}, {}, {}
    for table in args.tables:
        if table == "memory":
            rows = memory_rows(args.quick)
        else:
            rows = []
            for case in CASES[table](args.models):
                print(
                    f"{table}: {case.model} {case.subject} vs {case.reference}, "
                    f"{case.setting}",
                    file=sys.stderr,
                    flush=True,
                )
                rows.append(run_case(case, rounds, args.quick, missing))
        results[table] = rows
        blocks[table] = block(table, rows, head)
        print(f"\n### {table}\n\n{blocks[table]}", flush=True)
        if args.write:  # table by table: a run cut short keeps what it measured
            write(args.write, {table: blocks[table]})
    if args.json:
        from precond.bench.report import write_json

        write_json({"environment": env, "date": date, "tables": results}, args.json)
    return results


if __name__ == "__main__":
    main()
