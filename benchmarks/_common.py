"""Helpers shared by the benchmark scripts: machine description and timing."""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import optax


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    """CPU model, usable cores, library versions, date and load average."""
    cpu_model = "unknown"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            models = [ln.split(":", 1)[1] for ln in f if ln.startswith("model name")]
        cpu_model = models[0].strip() if models else cpu_model
    return {
        "cpu_model": cpu_model,
        "usable_cpus": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "jax_device": str(jax.devices()[0]),
        "jax": jax.__version__,
        "jaxlib": __import__("jaxlib").__version__,
        "optax": optax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "loadavg_start": loadavg(),
    }


def tree_bytes(tree: Any) -> int:
    """Bytes of every array of ``tree`` (all its shards together)."""
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def device0_bytes(tree: Any) -> int:
    """Bytes of the shard of every leaf held by the first device of its mesh."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def median_time(fn: Callable[[], Any], runs: int, warmup: int = 1) -> float:
    """Median wall seconds of ``runs`` calls of ``fn``, each blocked on."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def progress_log(t0: float) -> Callable[[str], None]:
    """``log(msg)``: prints msg on stderr after the seconds since ``t0``."""

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", file=sys.stderr)

    return log


def jax_stepper(tx, params, grads) -> Callable[[int], None]:
    """``run(n)``: n jitted, donated updates of ``tx`` fed back their state."""
    compiled = jax.jit(tx.update, donate_argnums=1)
    box = [tx.init(params)]

    def run(n: int) -> None:
        state = box[0]
        for _ in range(n):
            updates, state = compiled(grads, state, params)
        jax.block_until_ready((updates, state))
        box[0] = state

    run(2)  # compile, and the first (always fitting) step
    return run
