"""PNG plots of the validation loss vs steps and vs training time.

One figure per (framework, workload): every optimizer at its selected learning rate,
one line per seed, with the baseline's final loss as a dotted line. The loss axis
is logarithmic and spans every point, so every curve is visible from its start
(ln 10 or ln 256) to its end, however far apart the optimizers finish. Uses
matplotlib's non-interactive Agg backend; imports matplotlib when called.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from precond.bench.analysis import Summary, group_runs
from precond.bench.runner import RunResult


def plot_curves(
    results: Sequence[RunResult],
    rows: Sequence[Summary],
    folder: str,
    baseline: str = "adamw",
) -> list[str]:
    """Writes ``{workload}-{framework}.png`` into ``folder`` for each pair that was
    run; returns the file names (relative to ``folder``)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    groups = group_runs(results)
    chosen = {(r.framework, r.workload, r.optimizer): r for r in rows}
    pairs = list(dict.fromkeys((r.framework, r.workload) for r in rows))
    names = []
    for framework, workload in pairs:
        fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        target = None
        members = [
            r for r in rows if (r.framework, r.workload) == (framework, workload)
        ]
        for i, row in enumerate(members):
            key = (framework, workload, row.optimizer)
            runs = groups[key][chosen[key].learning_rate]
            for j, run in enumerate(runs):
                steps = [h["step"] for h in run.history]
                times = [h["time_s"] for h in run.history]
                losses = [h["val_loss"] for h in run.history]
                label = (
                    f"{row.optimizer} (lr {row.learning_rate:g})" if j == 0 else None
                )
                style = {"color": colors[i % len(colors)], "lw": 1.4, "label": label}
                by_step.plot(steps, losses, **style)
                by_time.plot(times, losses, **style)
            if row.optimizer == baseline:
                target = row.val_loss
        if target is not None and target == target:
            for ax in (by_step, by_time):
                ax.axhline(target, color="gray", ls=":", lw=1)
        by_step.set_xlabel("step")
        by_time.set_xlabel("training time (s)")
        by_step.set_ylabel("validation loss (log scale)")
        by_step.set_title(f"{workload} ({framework})", fontsize=10)
        by_time.set_title(f"dotted: {baseline}'s final loss", fontsize=9)
        by_step.legend(fontsize=8)
        for ax in (by_step, by_time):
            ax.set_yscale("log")
            ax.grid(alpha=0.3, which="both")
        fig.tight_layout()
        name = f"{workload}-{framework}.png"
        fig.savefig(os.path.join(folder, name), dpi=80)
        plt.close(fig)
        names.append(name)
    return names
