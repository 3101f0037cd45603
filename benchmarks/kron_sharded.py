"""PSGD Kron on a mesh: per-device state memory and communication per update.

For the transformer of ``examples/jax_sharded_lm.py`` (d_model 1024 by default,
scanned layers, FSDP × tensor-parallel parameter specs) and ``precond.jax.kron``
with blocks (``partition_grads_into_blocks``, ``block_size`` 256) whose stacks are
split over every device, on meshes of 1, 2, 4 and 8 simulated CPU devices:

1. Per-device optimizer-state bytes (factors, momentum), from the shardings of the
   state that ``init`` returns (the addressable shard of device 0), next to the
   per-device parameter bytes.
2. Communication of one jitted update step at preconditioner update probability
   1.0 (both branches: fit and apply), read from the compiled HLO as the bytes one
   device receives (``precond.bench.hlo``), as a ratio to the parameter bytes.

Then, on one device, the update time of the blocked path against the unblocked
one (whole-dimension factors, up to 4096×4096) and against ``optax.adamw``, with
the factor bytes of each.

Targets (issue "Kron for large-scale sharded JAX training"): factor bytes per
device at 8 devices <= 1/6 of the 1-device figure; received bytes per update step
<= 2× the parameter bytes.

Usage::

    python benchmarks/kron_sharded.py               # ~5 min on 2 CPU cores
    python benchmarks/kron_sharded.py --quick       # d_model 256, 2 layers
    python benchmarks/kron_sharded.py --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from precond._common.cpu_devices import simulate_cpu_devices

# The timing runs in a child process with one plain CPU device: simulated devices
# share a thread pool enlarged against hangs, which oversubscribes the cores.
TIMING_ONLY = "--timing-only" in sys.argv
if not TIMING_ONLY:
    simulate_cpu_devices(8)

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding

from _common import device0_bytes, loadavg, machine_info, median_time, tree_bytes
from precond.bench.hlo import collectives
from precond.bench.report import write_json
from precond.jax import kron

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "jax_sharded_lm.py"
MESHES = {1: (1, 1), 2: (2, 1), 4: (2, 2), 8: (2, 4)}  # devices -> (fsdp, tp)
LEARNING_RATE = 1e-3


def load_example() -> Any:
    """The example script as a module (for its model and parameter specs)."""
    spec = importlib.util.spec_from_file_location("jax_sharded_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # flax's dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def kron_for(example: Any, params: Any, args: argparse.Namespace, **overrides):
    kwargs = dict(
        learning_rate=LEARNING_RATE,
        preconditioner_update_probability=1.0,
        scanned_layers=example.scanned_flags_for(params),
        partition_grads_into_blocks=True,
        block_size=args.block_size,
        params_partition_specs=example.param_specs_for(params),
        # As when BENCHMARKS.md's figures were recorded (before kron took
        # distributed-kron 1.0.0's defaults): no merging, scanned layers clipped
        # and damped each on its own.
        merge_small_dims=False,
        independent_scanned_layers=True,
    )
    return kron(**{**kwargs, **overrides})


def measure_mesh(example: Any, abstract: Any, devices: int, args) -> dict[str, Any]:
    """State bytes per device and HLO communication of one update on ``devices``."""
    mesh = jax.make_mesh(
        MESHES[devices],
        ("fsdp", "tp"),
        axis_types=(AxisType.Auto,) * 2,
        devices=jax.devices()[:devices],
    )
    specs = example.param_specs_for(abstract)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    tx = kron_for(example, abstract, args)
    with jax.set_mesh(mesh):
        params = jax.jit(
            lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract),
            out_shardings=shardings,
        )()
        state = tx.init(params)
        compiled = jax.jit(tx.update).lower(params, state, params).compile()
    kron_state = state[0]
    found = collectives(compiled.as_text(), devices)
    by_op: dict[str, float] = {}
    for c in found:
        by_op[c.op] = by_op.get(c.op, 0.0) + c.received_bytes
    memory = compiled.memory_analysis()
    return {
        "devices": devices,
        "mesh": MESHES[devices],
        "param_bytes": tree_bytes(params),
        "param_bytes_per_device": device0_bytes(params),
        "factor_bytes": tree_bytes(kron_state.preconditioners),
        "factor_bytes_per_device": device0_bytes(kron_state.preconditioners),
        "momentum_bytes_per_device": device0_bytes(kron_state.mu),
        "received_bytes": sum(by_op.values()),
        "received_by_op": by_op,
        "collectives": len(found),
        "temp_bytes_per_device": getattr(memory, "temp_size_in_bytes", None),
    }


def time_one_device(example: Any, abstract: Any, args) -> list[dict[str, Any]]:
    """Median update time on one device: adamw, kron blocked, kron unblocked."""
    params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
    grads = jax.tree.map(
        lambda a, k: jax.random.normal(k, a.shape, a.dtype),
        abstract,
        jax.tree.unflatten(
            jax.tree.structure(abstract),
            list(
                jax.random.split(jax.random.PRNGKey(0), len(jax.tree.leaves(abstract)))
            ),
        ),
    )
    one = dict(params_partition_specs=None)
    candidates = [
        ("adamw", optax.adamw(LEARNING_RATE), 10 * args.repeats),
        ("kron, blocks", kron_for(example, params, args, **one), args.repeats),
        (
            "kron, no blocks",
            kron_for(example, params, args, partition_grads_into_blocks=False, **one),
            args.repeats,
        ),
    ]
    rows = []
    for name, tx, runs in candidates:
        print(f"  timing {name}", file=sys.stderr)
        state = tx.init(params)
        update = jax.jit(tx.update, donate_argnums=1)
        holder = {"state": state}

        def step(update=update, holder=holder):
            updates, holder["state"] = update(grads, holder["state"], params)
            return updates

        seconds = median_time(step, runs, warmup=1)
        kron_state = holder["state"][0]
        factors = getattr(kron_state, "preconditioners", None)
        rows.append(
            {
                "optimizer": name,
                "runs": runs,
                "median_s": seconds,
                "state_bytes": tree_bytes(holder["state"]),
                "factor_bytes": None if factors is None else tree_bytes(factors),
            }
        )
    return rows


def time_in_child(args: argparse.Namespace) -> list[dict[str, Any]]:
    """:func:`time_one_device` in a new process with one unsimulated CPU device."""
    env = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"}
    env["XLA_FLAGS"] = " ".join(
        flag
        for flag in env.get("XLA_FLAGS", "").split()
        if "xla_force_host_platform_device_count" not in flag
    )
    options = {
        "--d-model": args.d_model,
        "--layers": args.layers,
        "--heads": args.heads,
        "--seq-len": args.seq_len,
        "--block-size": args.block_size,
        "--repeats": args.repeats,
    }
    command = [sys.executable, __file__, "--timing-only"]
    command += [str(x) for item in options.items() for x in item]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    sys.stderr.write(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


def _cell_mb(x: float | None) -> str:
    return "n/a" if x is None else _mb(x)


def report(res: dict[str, Any]) -> str:
    info, cfg = res["machine"], res["config"]
    out = [
        f"- CPU: {info['cpu_model']}, {info['usable_cpus']} usable cores; "
        f"jax {info['jax']}, jaxlib {info['jaxlib']}, optax {info['optax']}; "
        f"XLA_FLAGS `{info['xla_flags']}`",
        f"- date (UTC) {info['date_utc']}; load average at start "
        f"{info['loadavg_start']}, at end {info['loadavg_end']}; "
        f"wall {res['wall_s']:.0f} s",
        f"- model: examples/jax_sharded_lm.py, d_model {cfg['d_model']}, "
        f"{cfg['layers']} scanned layers, {cfg['heads']} heads, seq_len "
        f"{cfg['seq_len']}: {cfg['num_params']:,} parameters (float32); kron "
        f"block_size {cfg['block_size']}, update probability 1.0, factor stacks "
        "split over all devices (inferred from the parameter specs)",
        "",
        "### Per device, per update step",
        "",
        "| devices | mesh (fsdp, tp) | params MB/device | factors MB/device | "
        "factors 1-device / this | momentum MB/device | received MB/step | "
        "received / param bytes | collectives | XLA temp MB/device |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    one = res["meshes"][0]["factor_bytes_per_device"]
    for r in res["meshes"]:
        out.append(
            f"| {r['devices']} | {r['mesh']} | {_mb(r['param_bytes_per_device'])} | "
            f"{_mb(r['factor_bytes_per_device'])} | "
            f"{one / r['factor_bytes_per_device']:.2f} | "
            f"{_mb(r['momentum_bytes_per_device'])} | {_mb(r['received_bytes'])} | "
            f"{r['received_bytes'] / r['param_bytes']:.2f} | {r['collectives']} | "
            f"{_cell_mb(r['temp_bytes_per_device'])} |"
        )
    last = res["meshes"][-1]
    out += [
        "",
        "Received bytes by collective at "
        f"{last['devices']} devices (MB): "
        + ", ".join(
            f"{op} {_mb(b)}" for op, b in sorted(last["received_by_op"].items())
        ),
    ]
    if res["timing"]:
        out += [
            "",
            "### One device: update time",
            "",
            "| optimizer | runs | median ms | / adamw | state MB | factors MB |",
            "|---|---:|---:|---:|---:|---:|",
        ]
    for r in res["timing"]:
        adamw = res["timing"][0]["median_s"]
        factors = _cell_mb(r["factor_bytes"])
        out.append(
            f"| {r['optimizer']} | {r['runs']} | {1e3 * r['median_s']:.1f} | "
            f"{r['median_s'] / adamw:.2f} | {_mb(r['state_bytes'])} | {factors} |"
        )
    eight = [r for r in res["meshes"] if r["devices"] == 8]
    if eight:
        e = eight[0]
        shrink = one / e["factor_bytes_per_device"]
        ratio = e["received_bytes"] / e["param_bytes"]
        out += [
            "",
            "### Targets",
            "",
            f"- factor bytes per device, 1 device / 8 devices = {shrink:.2f} "
            f"(target >= 6): {'met' if shrink >= 6 else 'NOT met'}",
            f"- received bytes per update step / parameter bytes at 8 devices = "
            f"{ratio:.2f} (target <= 2): {'met' if ratio <= 2 else 'NOT met'}",
        ]
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, help="default 1024 (256 with --quick)")
    parser.add_argument("--layers", type=int, help="default 4 (2 with --quick)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed kron steps")
    parser.add_argument("--no-timing", action="store_true", help="skip the timing")
    parser.add_argument(
        "--timing-only",
        action="store_true",
        help="internal: only the one-device timing, printed as JSON",
    )
    parser.add_argument("--quick", action="store_true", help="a small model")
    parser.add_argument("--json", metavar="PATH", help="also write results as JSON")
    args = parser.parse_args(argv)
    args.d_model = args.d_model or (256 if args.quick else 1024)
    args.layers = args.layers or (2 if args.quick else 4)
    if min(args.d_model, args.layers, args.heads, args.repeats, args.block_size) < 1:
        parser.error("sizes and --repeats must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if args.timing_only:
        example = load_example()
        model = example.build_model(
            args.d_model, args.layers, args.heads, seq_len=args.seq_len
        )
        abstract = jax.eval_shape(
            lambda key: example.init_params(model, key), jax.random.PRNGKey(0)
        )
        print(json.dumps(time_one_device(example, abstract, args)))
        return {}
    info = machine_info()
    if jax.device_count() < 8:
        raise SystemExit(f"needs 8 devices, found {jax.device_count()}")
    example = load_example()
    model = example.build_model(
        args.d_model, args.layers, args.heads, seq_len=args.seq_len
    )
    abstract = jax.eval_shape(
        lambda key: example.init_params(model, key), jax.random.PRNGKey(0)
    )
    meshes = []
    for devices in MESHES:
        print(f"[{time.perf_counter() - t0:6.1f} s] {devices} devices", file=sys.stderr)
        meshes.append(measure_mesh(example, abstract, devices, args))
    timing = [] if args.no_timing else time_in_child(args)
    info["loadavg_end"] = loadavg()
    result = {
        "machine": info,
        "config": {
            "d_model": args.d_model,
            "layers": args.layers,
            "heads": args.heads,
            "seq_len": args.seq_len,
            "block_size": args.block_size,
            "num_params": int(
                sum(math.prod(a.shape) for a in jax.tree.leaves(abstract))
            ),
        },
        "meshes": meshes,
        "timing": timing,
        "wall_s": time.perf_counter() - t0,
    }
    print(report(result))
    if args.json:
        write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
