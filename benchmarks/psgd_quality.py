"""Quality against the best: precond's PSGD beside distributed-kron 2.0's ``pro``,
Muon and AdamW on the bench's char-lm, at equal steps and equal time.

Every optimizer runs the same protocol, through the bench's own runner
(``precond.bench``): the char-lm workload (2-layer transformer, d 64, context
64, next byte of Python's help topics; ``--model 256x4`` gives it width 256 and
4 layers, as issue [4 of 6]'s larger transformer), validation every
``--eval-every`` steps (the bench's 25), minibatch ``--batch-size`` (16), the
bench's schedule (linear warm-up over 5% of the steps, cosine to 0; or the
warm-up of ``--lr-warmup-steps`` and a decay to ``--lr-final-fraction`` of the
peak: issue [4 of 6]'s protocol is 20 and 0.1), its weight decay (1e-4,
decoupled), for each step budget of ``--steps`` (300 and 2000), at each rate of
its learning-rate sweep (its bench rate times ``--lr-multipliers``), with
``--seeds`` seeds (3; the first ``--first-seed``, 0). Per budget, each
optimizer's rate is the one with the lowest mean final validation loss, and the
table gives at that rate: the validation loss (mean ± std over seeds), the steps
and the training seconds until the validation curve reaches AdamW's final
validation loss and stays (ratios to AdamW's whole run), and the median step
time; a second table counts steps and seconds to AdamW's final *training* loss,
as issue [4 of 6]'s "What was seen" table did (:func:`train_loss_to_target`),
and a third both seed by seed (:func:`per_seed_to_targets`). With several
budgets, a last table gives each optimizer's smallest budget whose whole runs
end at or below AdamW's final loss at the largest budget
(:func:`budget_to_target`). ``--merge FILE…`` runs nothing and reports on the
union of earlier runs' ``results-STEPS.json`` (:func:`recorded`): seeds run by
separate invocations of one protocol, e.g. ``--seeds 1`` then ``--seeds 2
--first-seed 1``.

Optimizers (``--optimizers``):

- ``adamw``, ``muon``, ``kron``: the bench's (``precond bench --list``);
- ``pro``: ``precond.jax.pro`` with its defaults (``lr_style='adam'``: AdamW's
  rate), from the bench too;
- ``pro-compact``: the same with ``draws='compact'`` (draws sized to the blocks);
- ``pro-p<p>`` (e.g. ``pro-p0.5``): ``pro`` fitting its factors with
  probability p at each step (``preconditioner_update_probability=p``);
- ``pro-s<flat>-<decay>-<min>`` (e.g. ``pro-s200-0.005-0.1``): ``pro`` with the
  update-probability schedule ``precond_update_prob_schedule(min_prob=min,
  decay=decay, flat_start=flat)``: every step for ``flat`` steps, then
  exp(−decay·(n − flat)), never below ``min``;
- any of the ``pro`` names above followed by ``:KEY=VALUE`` items (e.g.
  ``pro:b1=0.9``, ``pro-s100-0.01-0.05:block_size=128``): with those keyword
  arguments of ``pro`` too, each value a Python literal; ``:adam_part=R`` is
  not pro's: pro then trains the hidden-layer weight matrices only, and AdamW
  at rate R the rest (embeddings, head, biases, norms), as the bench's Muon;
- ``adamw:weight_decay=X``, ``muon:weight_decay=X``: the bench's optimizer
  with weight decay X instead of the bench's 1e-4 (a pro name's own
  ``:weight_decay=X`` item replaces it there too), the controls of a pro
  variant's decay;
- ``dk2-pro``: distributed-kron 2.0.0's ``pro`` (the test oracle, loaded from
  ``.oracles/`` as tests/oracles.py does; see the README's test command), at
  ``pro``'s rate, given the params as a flat dict (it fails on the model's lists);
  ``dk2-pro:KEY=VALUE...`` (e.g. ``dk2-pro:b1=0.8``) with those keyword
  arguments, the control for a ``pro:KEY=VALUE`` variant.

Timings are only comparable within one run on a quiet machine: the script runs
everything one after another, with the bench's threads (``--threads``), in rounds
(one per seed and rate multiplier) that each run every optimizer once, the order
reversed every other round, so that a machine slowing down or speeding up during
the run weighs on every optimizer alike (:func:`interleaved`; BENCHMARKS.md shows
the drift of a sequential run).

Usage::

    python benchmarks/psgd_quality.py --out /tmp/quality            # everything
    python benchmarks/psgd_quality.py --steps 300 --seeds 1 --lr-multipliers 1
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import pathlib
import statistics
import sys
import time

from precond.bench import arguments

REPO = pathlib.Path(__file__).resolve().parents[1]


def _rate(text: str) -> tuple[str, float]:
    """``NAME=RATE``: the bench rate of optimizer NAME replaced by RATE."""
    name, sep, value = text.rpartition("=")
    try:
        rate = arguments.positive_float(value)
    except argparse.ArgumentTypeError:
        rate = None
    if not sep or not name or rate is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not of the form NAME=RATE > 0")
    return name, rate


def _with_baseline(text: str) -> list[str]:
    """Comma-separated optimizer names, ``adamw`` (the tables' baseline) among them."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if "adamw" not in names:
        raise argparse.ArgumentTypeError(
            f"{text!r} lacks adamw, the baseline every table is measured against"
        )
    return names


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=arguments.positive_ints, default="300,2000")
    parser.add_argument("--seeds", type=arguments.positive_int, default=3)
    parser.add_argument(
        "--first-seed",
        type=arguments.number(int, 0),
        default=0,
        help="run seeds first-seed, …, first-seed + seeds − 1 (default 0)",
    )
    parser.add_argument(
        "--lr-multipliers", type=arguments.multipliers, default="0.3,1,3"
    )
    parser.add_argument(
        "--lr",
        type=_rate,
        action="append",
        default=[],
        metavar="NAME=RATE",
        help="an optimizer's rate before the multipliers (default: its bench rate)",
    )
    parser.add_argument(
        "--optimizers",
        type=_with_baseline,
        default="adamw,muon,kron,pro,pro-compact,pro-p0.5,dk2-pro",
        help="comma-separated names, adamw (every table's baseline) among them",
    )
    parser.add_argument("--batch-size", type=arguments.positive_int, default=16)
    parser.add_argument(
        "--model",
        type=arguments.transformer_shape,
        default=None,
        metavar="WIDTHxLAYERS",
        help="the char-lm transformer's width and depth (default: the bench's, 64x2)",
    )
    parser.add_argument(
        "--eval-every",
        type=arguments.positive_int,
        default=None,
        help="steps between validation scores (default: the bench's, 25)",
    )
    parser.add_argument(
        "--lr-warmup-steps",
        type=arguments.positive_int,
        default=None,
        help="the cosine schedule's warm-up (default: the bench's, 5%% of the steps)",
    )
    parser.add_argument(
        "--lr-final-fraction",
        type=float,
        default=0.0,
        help="the cosine schedule decays to this fraction of the peak (default 0)",
    )
    parser.add_argument(
        "--threads",
        type=arguments.positive_int,
        default=None,
        help="default: the bench's (every core)",
    )
    parser.add_argument("--out", default="psgd-quality")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="RESULTS_JSON",
        help="run nothing: report on the union of these results-STEPS.json files "
        "(earlier runs of this script, e.g. different --first-seed)",
    )
    return parser.parse_args(argv)


def _dict_keyed(optimizer):
    """``optimizer`` on the params' leaves as a flat dict: distributed-kron 2.0.0's
    ``pro`` fails on trees with list or tuple nodes (its ``init`` reads a
    ``.key`` from every path entry), as the char-lm model's layers are."""
    import jax
    import optax

    def keyed(tree):
        return {f"{i:05d}": x for i, x in enumerate(jax.tree.leaves(tree))}

    def init(params):
        return optimizer.init(keyed(params))

    def update(updates, state, params=None):
        treedef = jax.tree.structure(updates)
        keyed_params = None if params is None else keyed(params)
        out, state = optimizer.update(keyed(updates), state, keyed_params)
        return treedef.unflatten([out[k] for k in sorted(out)]), state

    return optax.GradientTransformation(init, update)


def _adam_on_the_rest(optimizer, adam_rate: float, weight_decay: float, hidden):
    """``optimizer`` on the hidden-layer weight matrices (the workload's
    ``hidden`` rule, Muon's split) and AdamW at ``adam_rate`` on the rest
    (embeddings, output head, biases, norms), as the bench's Muon is built."""
    import jax
    import optax

    def labels(params):
        return jax.tree.map(lambda h: "hidden" if h else "rest", hidden(params))

    rest = optax.adamw(adam_rate, weight_decay=weight_decay)
    return optax.multi_transform({"hidden": optimizer, "rest": rest}, labels)


def _specs(names):
    """The optimizer specs by name: the bench's, and this script's variants."""
    import precond.jax as pj
    from precond.bench.optimizers import OPTIMIZERS

    def variant(name, description, adam_part=None, **kwargs):
        def make(learning_rate, weight_decay, **partition):
            # A ``weight_decay`` item of the name replaces the bench's.
            optimizer = pj.pro(
                learning_rate, **({"weight_decay": weight_decay} | kwargs)
            )
            if adam_part is None:
                return optimizer
            return _adam_on_the_rest(
                optimizer, adam_part, weight_decay, partition["hidden_matrices"]
            )

        return dataclasses.replace(
            OPTIMIZERS["pro"],
            name=name,
            description=description,
            make=make,
            partitioned=adam_part is not None,
        )

    def split_name(name):
        """``BASE[:KEY=VALUE...]`` as (BASE, the items as keyword arguments,
        each value a Python literal)."""
        base, *items = name.split(":")
        pairs = [item.partition("=") for item in items]
        if not all(key and sep for key, sep, _ in pairs):
            raise SystemExit(f"{name!r} is not of the form BASE[:KEY=VALUE...]")
        return base, {key: ast.literal_eval(value) for key, _, value in pairs}

    def distributed_kron_pro(name):
        """``dk2-pro``: distributed-kron 2.0.0's pro at its defaults;
        ``dk2-pro:KEY=VALUE...``: with these keyword arguments."""
        sys.path.insert(0, str(REPO))
        from tests import oracles

        module = oracles.distributed_kron_pro()
        _, kwargs = split_name(name)

        def make(learning_rate, weight_decay):
            return _dict_keyed(
                module.pro(learning_rate, weight_decay=weight_decay, **kwargs)
            )

        return dataclasses.replace(
            OPTIMIZERS["pro"],
            name=name,
            description=f"distributed-kron 2.0.0's pro, {name}",
            make=make,
            make_torch=None,
        )

    def schedule_arguments(base):
        """``pro-p<p>``: a constant update probability p; ``pro-s<flat>-<decay>-<min>``:
        p = 1 for ``flat`` steps, then exp(−decay·(n − flat)) down to ``min``;
        ``pro-compact``: draws='compact'; ``pro``: none."""
        if base == "pro":
            return {}
        if base == "pro-compact":
            return {"draws": "compact"}
        if base.startswith("pro-p"):
            return {"preconditioner_update_probability": float(base[len("pro-p") :])}
        flat, decay, floor = (float(x) for x in base[len("pro-s") :].split("-"))
        schedule = pj.precond_update_prob_schedule(
            min_prob=floor, decay=decay, flat_start=flat
        )
        return {"preconditioner_update_probability": schedule}

    def pro_variant(name):
        """A base name (above), then ``:KEY=VALUE`` keyword arguments of pro
        (Python literals, e.g. ``pro-s100-0.01-0.05:block_size=128``)."""
        base, kwargs = split_name(name)
        kwargs = schedule_arguments(base) | kwargs
        return variant(name, f"precond.jax.pro, {name}", **kwargs)

    def bench_variant(name):
        """``adamw:weight_decay=X``, ``muon:weight_decay=X``: a bench optimizer
        with weight decay X in place of the bench's (the control for a pro
        variant's own ``weight_decay``)."""
        base, kwargs = split_name(name)
        if set(kwargs) != {"weight_decay"} or base not in OPTIMIZERS:
            raise SystemExit(f"{name!r}: only weight_decay can be set on {base!r}")
        spec, decay = OPTIMIZERS[base], kwargs["weight_decay"]
        return dataclasses.replace(
            spec,
            name=name,
            description=f"{spec.description}, weight decay {decay}",
            make=lambda learning_rate, _, **parts: spec.make(
                learning_rate, decay, **parts
            ),
            make_torch=None,
        )

    def spec(name):
        if name == "dk2-pro" or name.startswith("dk2-pro:"):
            return distributed_kron_pro(name)
        if name.startswith(("pro-p", "pro-s", "pro-compact", "pro:")):
            return pro_variant(name)
        if ":" in name:
            return bench_variant(name)
        return OPTIMIZERS[name]

    return [spec(n) for n in names]


def char_lm(shape: tuple[int, int] | None, eval_every: int | None):
    """The bench's char-lm workload, with the transformer of ``shape`` (width,
    layers) and validation every ``eval_every`` steps where given. It keeps the
    name ``char-lm``, so that the bench's rates on it are the sweep's centres."""
    import functools

    from precond.bench.jax_models import init_char_lm
    from precond.bench.workloads import get_workload

    workload = get_workload("char-lm")
    if shape is not None:
        width, layers = shape
        workload = dataclasses.replace(
            workload,
            description=f"{workload.description}; here d {width}, {layers} layers",
            init_params=functools.partial(init_char_lm, d_model=width, layers=layers),
        )
    if eval_every is not None:
        workload = dataclasses.replace(workload, eval_every=eval_every)
    return workload


def interleaved(jobs: list) -> list:
    """``jobs`` in suite.plan's order (optimizer by optimizer, each over the same
    rate multipliers and seeds) as rounds of one job per optimizer, a round per
    (multiplier, seed), the optimizers' order reversed every other round."""
    per_optimizer: dict[str, list] = {}
    for job in jobs:
        per_optimizer.setdefault(job.spec.name, []).append(job)
    out = []
    for i, round_ in enumerate(zip(*per_optimizer.values(), strict=True)):
        out.extend(round_ if i % 2 == 0 else reversed(round_))
    return out


def budget_to_target(rows_by_budget: dict, baseline: str = "adamw") -> str:
    """The smallest budget at which each optimizer matches ``baseline``'s longest run.

    ``rows_by_budget`` maps a step budget to its summary rows (each optimizer at
    its best rate for that budget). The target is the baseline's mean final
    validation loss at the largest budget B; an optimizer reaches it at budget b
    when its mean final validation loss after a whole run of b steps (its
    schedule sized to b) is no higher. The table gives b, b / B, and the mean
    training seconds of those b-step runs against the baseline's B-step runs:
    steps and time to the target when every run decays its rate by its end, as
    a user training for a fixed budget would, rather than the point where a
    longer run's curve crosses the target (the tables above)."""
    largest = max(rows_by_budget)
    base = next(r for r in rows_by_budget[largest] if r.optimizer == baseline)
    lines = [
        f"Budget to {baseline}'s final validation loss at {largest} steps "
        f"({base.val_loss:.4f}, {base.train_s:.1f} s): the smallest budget whose "
        "runs end at or below it",
        "",
        f"| optimizer | budget | ×{largest} | lr | val loss | train s "
        f"| ×{baseline}'s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows_by_budget[largest]:
        budget, reached = next(
            (
                (b, r)
                for b in sorted(rows_by_budget)
                for r in rows_by_budget[b]
                if r.optimizer == row.optimizer and r.val_loss <= base.val_loss
            ),
            (None, None),
        )
        if budget is None or reached is None:
            lines.append(f"| {row.optimizer} | not within {largest} | | | | | |")
            continue
        lines.append(
            f"| {row.optimizer} | {budget} | {budget / largest:.2f} "
            f"| {reached.learning_rate:g} | {reached.val_loss:.4f} "
            f"| {reached.train_s:.1f} | {reached.train_s / base.train_s:.2f} |"
        )
    return "\n".join(lines)


def _chosen_runs(results: list) -> dict[str, list]:
    """Each optimizer's runs (one a seed) at its rate chosen by mean final
    validation loss (:func:`precond.bench.analysis.select_learning_rates`)."""
    from precond.bench import analysis

    groups = analysis.group_runs(results)
    chosen = analysis.select_learning_rates(results)
    return {key[2]: groups[key][chosen[key]] for key in groups}


def _reached(run, axis: str, loss: str, target: float) -> float | None:
    """Where ``run``'s ``loss`` curve against ``axis`` reaches ``target`` and stays."""
    from precond.bench import analysis

    return analysis.reached_and_stayed(*analysis.loss_curve(run, axis, loss), target)


def train_loss_to_target(results: list, baseline: str = "adamw") -> str:
    """Steps and training seconds to ``baseline``'s final *training* loss.

    Issue [4 of 6]'s "What was seen" table counts steps and time to AdamW's final
    training loss; the tables above count them to its validation loss. Here the
    target is ``baseline``'s mean final training loss (at its best rate by
    validation loss, as everywhere), each run's curve is its training loss (the
    mean minibatch loss over the ``eval_every`` steps before each evaluation),
    and the step and time are where that curve reaches the target and stays
    (:func:`precond.bench.analysis.reached_and_stayed`), meaned over seeds when
    every seed reaches it."""
    runs = _chosen_runs(results)
    base = runs[baseline]
    target = statistics.fmean(r.final_train_loss for r in base)
    base_steps = statistics.fmean(r.steps for r in base)
    base_s = statistics.fmean(r.train_s for r in base)
    lines = [
        f"Steps and training seconds to {baseline}'s final training loss "
        f"({target:.4f}, mean over seeds), reached and stayed",
        "",
        "| optimizer | lr | final train loss | steps to it | time to it |",
        "|---|---|---|---|---|",
    ]

    def reached(group, axis: str) -> float | None:
        """The mean over ``group``'s seeds, or None unless every seed reaches."""
        points = [_reached(r, axis, "train_loss", target) for r in group]
        found = [x for x in points if x is not None]
        return statistics.fmean(found) if len(found) == len(points) else None

    for name, group in runs.items():
        s, t = reached(group, "step"), reached(group, "time_s")
        if s is None or t is None:
            cells = "not reached | not reached"
        else:
            cells = f"{s:.0f} ({s / base_steps:.2f}) | {t:.1f} s ({t / base_s:.2f})"
        final = statistics.fmean(r.final_train_loss for r in group)
        lines.append(f"| {name} | {group[0].learning_rate:g} | {final:.4f} | {cells} |")
    return "\n".join(lines)


def per_seed_to_targets(results: list, baseline: str = "adamw") -> str:
    """Each seed's steps and training seconds to ``baseline``'s mean final
    validation and training losses, every optimizer at its chosen rate.

    The tables above mean over seeds; this one shows whether a mean hides a
    seed far from the others, and which optimizer is ahead seed by seed."""
    runs = _chosen_runs(results)
    targets = {
        loss: statistics.fmean(getattr(r, f"final_{loss}") for r in runs[baseline])
        for loss in ("val_loss", "train_loss")
    }
    lines = [
        f"Per seed, steps and training seconds to {baseline}'s mean final "
        f"validation loss ({targets['val_loss']:.4f}) and training loss "
        f"({targets['train_loss']:.4f}), reached and stayed",
        "",
        "| optimizer | seed | to the validation loss | to the training loss |",
        "|---|---|---|---|",
    ]
    for name, group in runs.items():
        for run in sorted(group, key=lambda r: r.seed):
            cells = []
            for loss, target in targets.items():
                steps = _reached(run, "step", loss, target)
                seconds = _reached(run, "time_s", loss, target)
                reached = steps is not None and seconds is not None
                cells.append(
                    f"{steps:.0f}, {seconds:.1f} s" if reached else "not reached"
                )
            lines.append(f"| {name} | {run.seed} | {' | '.join(cells)} |")
    return "\n".join(lines)


def budget_sections(heading: str, results: list) -> tuple[list, list[str]]:
    """One budget's summary rows, and its report sections under ``heading``: the
    table at each optimizer's best rate with the fastest to AdamW's loss, then
    :func:`train_loss_to_target`'s and :func:`per_seed_to_targets`' tables."""
    from precond.bench import analysis, report

    rows = analysis.summarize(results)
    table = report.format_table(rows)
    fastest = report.format_fastest(rows)
    sections = [
        f"## {heading}\n\n```\n{table}\n{fastest}\n```\n",
        train_loss_to_target(results) + "\n",
        per_seed_to_targets(results) + "\n",
    ]
    return rows, sections


def recorded(paths: list[str]) -> dict[int, list]:
    """The runs of ``results-STEPS.json`` files written by this script, by step
    budget; a run (optimizer, rate, seed, budget) found twice is an error."""
    from precond.bench.report import run_from_json

    by_budget: dict[int, list] = {}
    seen: dict[tuple, str] = {}
    for path in paths:
        for entry in json.loads(pathlib.Path(path).read_text()):
            run = run_from_json(entry)
            key = (run.optimizer, run.learning_rate, run.seed, run.budget)
            if key in seen:
                raise SystemExit(f"--merge: the run {key} is in {seen[key]} and {path}")
            seen[key] = path
            by_budget.setdefault(int(run.budget.split()[0]), []).append(run)
    return by_budget


def _run_budgets(args, threads: int, out: pathlib.Path, sections: list) -> dict:
    """Runs every budget of ``args.steps``, writing ``results-STEPS.json`` and
    adding each budget's sections; the summary rows by budget."""
    from precond.bench import report, suite
    from precond.bench.jax_models import CHAR_LM_D_MODEL, CHAR_LM_LAYERS
    from precond.bench.optimizers import DEFAULT_WEIGHT_DECAY
    from precond.bench.runner import WARMUP_FRACTION

    workload = char_lm(args.model, args.eval_every)
    specs = _specs(args.optimizers)
    width, layers = args.model or (CHAR_LM_D_MODEL, CHAR_LM_LAYERS)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    rows_by_budget = {}
    for steps in args.steps:
        jobs = suite.plan(
            ["jax"],
            [workload],
            specs,
            seeds=seeds,
            lr_multipliers=args.lr_multipliers,
            lr_overrides=dict(args.lr),
            steps=steps,
            batch_size=args.batch_size,
            lr_warmup_fraction=(
                WARMUP_FRACTION
                if args.lr_warmup_steps is None
                else args.lr_warmup_steps / steps
            ),
            lr_final_fraction=args.lr_final_fraction,
        )
        start = time.time()
        outcome = suite.run_suite(
            interleaved(jobs), DEFAULT_WEIGHT_DECAY, not args.no_progress
        )
        rates = ",".join(f"{m:g}" for m in args.lr_multipliers)
        heading = (
            f"{steps} steps, d {width}, {layers} layers, batch {args.batch_size}, "
            f"seeds {seeds.start}–{seeds.stop - 1}, rates x {rates} "
            f"({time.time() - start:.0f} s)"
        )
        rows_by_budget[steps], budget = budget_sections(heading, outcome.results)
        for section in budget:
            print(section, flush=True)
        sections.extend(budget)
        report.write_json(
            [r.to_dict() for r in outcome.results], str(out / f"results-{steps}.json")
        )
        if outcome.interrupted:
            break
    return rows_by_budget


def _merge_budgets(paths: list[str], sections: list) -> dict:
    """:func:`recorded`'s runs reported as one run's would be; the summary rows
    by budget."""
    rows_by_budget = {}
    for steps, results in sorted(recorded(paths).items()):
        seeds = sorted({r.seed for r in results})
        heading = f"{steps} steps, seeds {seeds}, merged from {len(paths)} files"
        rows_by_budget[steps], budget = budget_sections(heading, results)
        sections.extend(budget)
    return rows_by_budget


def main(argv=None) -> int:
    args = _parse(argv)
    from precond.bench.machine import available_cores, configure_threads, environment

    threads = configure_threads(args.threads or available_cores(), ("jax",))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections: list[str] = []
    if args.merge:
        rows_by_budget = _merge_budgets(args.merge, sections)
        print("\n".join(sections), flush=True)
    else:
        rows_by_budget = _run_budgets(args, threads, out, sections)
    if len(rows_by_budget) > 1:
        section = budget_to_target(rows_by_budget) + "\n"
        sections.append(section)
        print(section, flush=True)
    command = " ".join(["python benchmarks/psgd_quality.py", *(argv or sys.argv[1:])])
    machine = json.dumps(environment(("jax",), threads), indent=1)
    (out / "report.md").write_text(
        f"# psgd_quality\n\n`{command}`\n\n```\n{machine}\n```\n\n"
        + "\n".join(sections)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
