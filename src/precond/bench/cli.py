"""The ``precond`` command: ``precond bench`` trains workloads with each optimizer.

Argument errors print one line on stderr and exit with status 2. JAX, optax, torch,
scikit-learn, matplotlib and tqdm are imported only when a benchmark actually runs,
so ``precond --help`` and ``precond bench --list`` are fast. Ctrl-C during a suite
writes the report of the runs already finished and exits with status 130.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Sequence

from precond._common.cpu_devices import simulate_cpu_devices
from precond.bench.machine import configure_threads, environment
from precond.bench.optimizers import (
    BASELINE,
    FRAMEWORKS,
    OPTIMIZERS,
    module_installed,
)
from precond.bench.parser import (
    DEFAULT_OUTPUT,
    UsageError,
    _error,
    build_parser,
)
from precond.bench.workloads import WORKLOADS

USAGE_ERROR = 2
INTERRUPTED = 130

# The optimizers of other libraries that the verdict compares precond's with.
REFERENCES = tuple(name for name, spec in OPTIMIZERS.items() if spec.reference)

# Modules each framework needs, and the extra that installs them.
FRAMEWORK_MODULES = {
    "jax": (("jax", "jax"), ("optax", "jax")),
    "torch": (("torch", "torch"),),
}
# Modules every run needs.
BENCH_MODULES = (("sklearn", "bench"), ("tqdm", "bench"), ("matplotlib", "bench"))


def _rates_text(rates: dict[str, float]) -> str:
    """ "teacher-student 0.027, char-lm 0.01, ...", in the order of WORKLOADS."""
    return ", ".join(f"{w} {rates[w]:g}" for w in WORKLOADS if w in rates)


def _format_list() -> str:
    width = max(len(name) for name in (*WORKLOADS, *OPTIMIZERS))
    lines = ["workloads:"]
    for w in WORKLOADS.values():
        lines.append(
            f"  {w.name:<{width}}  {w.steps} steps, batch {w.batch_size}: "
            f"{w.description}"
        )
    lines.append("optimizers:")
    for s in OPTIMIZERS.values():
        installed = "" if s.available() else " (not installed)"
        lines.append(f"  {s.name:<{width}}  {s.description}{installed}")
        for framework in s.frameworks():
            per_workload = _rates_text(s.learning_rates[framework])
            lines.append(f"  {'':<{width}}  {framework} lr: {per_workload}")
        for keyword, by_framework in s.part_learning_rates.items():
            for framework in s.frameworks():
                per_workload = _rates_text(by_framework[framework])
                lines.append(f"  {'':<{width}}  {framework} {keyword}: {per_workload}")
    return "\n".join(lines)


def _missing(modules) -> tuple[str, str] | None:
    for module, extra in modules:
        if not module_installed(module):
            return module, extra
    return None


def _resolve_frameworks(requested: list[str] | None) -> tuple[list[str], list[str]]:
    """(frameworks to run, notes about frameworks skipped)."""
    if requested is not None:
        for framework in requested:
            missing = _missing(FRAMEWORK_MODULES[framework])
            if missing:
                raise _error(
                    f"--frameworks {framework}: {missing[0]} is not installed; "
                    f"install it with: pip install 'precond[{missing[1]}]'"
                )
        return requested, []
    frameworks, notes = [], []
    for framework in FRAMEWORKS:
        missing = _missing(FRAMEWORK_MODULES[framework])
        if missing is None:
            frameworks.append(framework)
        else:
            notes.append(
                f"precond bench: {missing[0]} is not installed: skipping the "
                f"{framework} workloads (pip install 'precond[{missing[1]}]' to run "
                "them)"
            )
    if not frameworks:
        raise _error(
            "neither jax nor torch is installed; install one with: "
            "pip install 'precond[jax]' (or 'precond[torch]')"
        )
    return frameworks, notes


def _resolve_optimizers(requested: list[str] | None, frameworks: list[str]):
    if requested is None:
        names = [
            n
            for n, s in OPTIMIZERS.items()
            if (s.default or n == "kfac") and s.available()
        ]
    else:
        names = requested
    specs = []
    for name in names:
        spec = OPTIMIZERS[name]
        if not spec.available():
            raise _error(
                f"optimizer {name!r} needs {', '.join(spec.requires)}, which is not "
                "installed"
            )
        if set(spec.frameworks()) & set(frameworks):
            specs.append(spec)
        elif requested is not None:
            raise _error(
                f"optimizer {name!r} exists in {', '.join(spec.frameworks())} only, "
                f"not in the selected frameworks ({','.join(frameworks)})"
            )
    return specs


def _check_output(args: argparse.Namespace) -> str:
    if args.output is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        return os.path.join(DEFAULT_OUTPUT, stamp)
    path = os.path.abspath(args.output)
    if os.path.exists(path) and not os.path.isdir(path):
        raise _error(f"--output {args.output!r} is a file, not a folder")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise _error(f"--output {args.output!r}: folder {parent!r} does not exist")
    return args.output


def _check_json(args: argparse.Namespace) -> None:
    if args.json is None:
        return
    path = os.path.abspath(args.json)
    if os.path.isdir(path):
        raise _error(f"--json {args.json!r} is a folder")
    if not os.path.isdir(os.path.dirname(path)):
        raise _error(
            f"--json {args.json!r}: folder {os.path.dirname(path)!r} does not exist"
        )


def _read_readme(args: argparse.Namespace) -> str | None:
    """The text of ``--readme``'s file, checked before the runs: it exists and has
    the results block's markers."""
    if args.readme is None:
        return None
    from precond.bench.report import replace_results_block

    try:
        with open(args.readme, encoding="utf-8") as file:
            text = file.read()
        replace_results_block(text, "", args.readme)
    except (OSError, ValueError) as error:
        raise _error(f"--readme {args.readme!r}: {error}") from None
    return text


def _check_lr(args: argparse.Namespace, specs) -> dict[str, float]:
    overrides: dict[str, float] = {}
    names = [s.name for s in specs]
    for name, value in args.lr:
        if name in overrides:
            raise _error(f"--lr {name}= given more than once")
        optimizer = name.partition(".")[0]
        if optimizer not in names:
            raise _error(
                f"--lr {name}= given but {optimizer!r} is not among the optimizers "
                f"to run ({','.join(names)})"
            )
        overrides[name] = value
    return overrides


def _check_batch_size(args: argparse.Namespace, workloads, devices: int) -> None:
    for workload in workloads:
        batch = args.batch_size or workload.batch_size
        n_train = len(workload.load_split(workload.split_seed).x_train)
        if batch > n_train:
            raise _error(
                f"--batch-size {batch} exceeds the {n_train} training rows of "
                f"workload {workload.name!r}"
            )
        if batch % devices:
            raise _error(
                f"batch size {batch} of workload {workload.name!r} is not divisible "
                f"by --devices {devices}"
            )


def _prepare_jax(devices: int) -> None:
    """The simulated device count before jax starts; then checks it."""
    if devices > 1 and "jax" not in sys.modules:
        simulate_cpu_devices(devices)
    import jax

    if jax.device_count() < devices:
        raise _error(
            f"--devices {devices}: jax sees {jax.device_count()} device(s) "
            f"(set XLA_FLAGS=--xla_force_host_platform_device_count={devices} "
            "before jax starts)"
        )


def _run_bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.list:
        print(_format_list())
        return 0
    frameworks, notes = _resolve_frameworks(args.frameworks)
    missing = _missing(BENCH_MODULES)
    if missing:
        raise _error(
            f"{missing[0]} is not installed; install it with: "
            f"pip install 'precond[{missing[1]}]'"
        )
    specs = _resolve_optimizers(args.optimizers, frameworks)
    overrides = _check_lr(args, specs)
    if args.devices > 1 and "jax" not in frameworks:
        raise _error(f"--devices {args.devices} applies to jax, which is not selected")
    output = _check_output(args)
    _check_json(args)
    readme = _read_readme(args)
    workloads = [WORKLOADS[name] for name in args.workloads]
    _check_batch_size(args, workloads, args.devices if "jax" in frameworks else 1)
    threads = configure_threads(args.threads, tuple(frameworks), args.devices)
    if "jax" in frameworks:
        _prepare_jax(args.devices)
    env = environment(tuple(frameworks), threads)
    for note in notes:
        print(note, file=sys.stderr)

    from precond.bench.analysis import summarize
    from precond.bench.report import (
        format_fastest,
        format_markdown,
        format_table,
        format_verdicts,
        format_winners,
        json_document,
        replace_results_block,
        results_table,
        skipped_steps_line,
        write_json,
    )
    from precond.bench.suite import plan, run_suite

    seeds = list(range(args.seed, args.seed + args.seeds))
    jobs = plan(
        frameworks,
        workloads,
        specs,
        seeds=seeds,
        lr_multipliers=args.lr_sweep or [1.0],
        lr_overrides=overrides,
        steps=args.steps,
        time_budget_s=args.time_budget,
        batch_size=args.batch_size,
        schedule=args.schedule,
        devices=args.devices,
    )
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    started = time.perf_counter()
    outcome = run_suite(jobs, args.weight_decay, progress=not args.no_progress)
    wall_s = time.perf_counter() - started
    results = outcome.results

    rows = summarize(results, baseline=BASELINE)
    config = {
        "frameworks": ",".join(frameworks),
        "workloads": ",".join(args.workloads),
        "optimizers": ",".join(s.name for s in specs),
        "budget": (
            f"{args.time_budget:g} s per run"
            if args.time_budget
            else (f"{args.steps} steps" if args.steps else "each workload's steps")
        ),
        "batch_size": args.batch_size or "each workload's",
        "seeds": ",".join(map(str, seeds)),
        "lr_sweep": ",".join(f"{m:g}" for m in args.lr_sweep or [1.0]),
        "weight_decay": args.weight_decay,
        "schedule": args.schedule,
        "devices": args.devices,
        "runs": f"{len(results)} of {len(jobs)}",
        "wall_s": round(wall_s, 1),
    }
    print(
        f"precond bench: {len(results)} runs in {wall_s:.0f} s; "
        + ", ".join(f"{k} {env[k]}" for k in ("jax", "torch") if k in env)
        + f", {env['cpu_count']} CPUs"
    )
    if rows:
        print(format_table(rows, baseline=BASELINE))
        print(format_winners(rows))
        fastest = format_fastest(rows, baseline=BASELINE)
        if fastest:
            print(fastest)
        print(skipped_steps_line(rows))
        verdict = format_verdicts(rows, REFERENCES, baseline=BASELINE)
        if verdict:
            print(verdict)

    os.makedirs(output, exist_ok=True)
    plots = []
    if rows and not args.no_plots:
        from precond.bench.plots import plot_curves

        plots = plot_curves(results, rows, output, baseline=BASELINE)
    command = "precond " + shlex.join(argv)
    markdown = format_markdown(
        rows,
        command=command,
        config=config,
        environment=env,
        plots=plots,
        baseline=BASELINE,
        interrupted=outcome.interrupted,
        date=date,
        references=REFERENCES,
    )
    with open(os.path.join(output, "report.md"), "w", encoding="utf-8") as file:
        file.write(markdown)
    table = results_table(
        rows, command=command, environment=env, date=date, baseline=BASELINE
    )
    with open(os.path.join(output, "results-table.md"), "w", encoding="utf-8") as file:
        file.write(table)
    if readme is not None and not outcome.interrupted:
        with open(args.readme, "w", encoding="utf-8") as file:
            file.write(replace_results_block(readme, table, args.readme))
    document = json_document(
        results,
        rows,
        config=config | {"command": command, "date": date},
        environment=env,
        baseline=BASELINE,
        interrupted=outcome.interrupted,
    )
    write_json(document, os.path.join(output, "results.json"))
    if args.json is not None:
        write_json(document, args.json)
    report = os.path.join(output, "report.md")
    if outcome.interrupted:
        print(
            f"precond bench: interrupted after {len(results)} of {len(jobs)} runs; "
            f"the report of the finished runs is in {report}",
            file=sys.stderr,
        )
        return INTERRUPTED
    print(f"precond bench: report written to {report}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``precond`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            prog = parser.prog if args.command is None else f"precond {args.command}"
            raise UsageError(
                f"{prog}: error: unrecognized arguments: {' '.join(unknown)} "
                f"(see '{prog} --help')"
            )
        if args.command is None:
            parser.print_help(sys.stderr)
            return USAGE_ERROR
        return _run_bench(args, argv)
    except UsageError as error:
        print(error, file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as exit_:  # --help and --version exit through argparse
        return exit_.code if isinstance(exit_.code, int) else 0
    except KeyboardInterrupt:
        print("precond: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
