"""Sharded optimizer state: per-device bytes and communication on 1 to 256 devices.

For precond's JAX optimizers (``kron``, ``pro``, ``distributed_shampoo``,
``xmat``, ``lra``, ``affine``) on three model shapes, with FSDP-style parameter
specs (the largest dim of each weight, after the layer axis of a scanned one,
split over a 1-D mesh axis ``fsdp``):

* ``many-small``: an MLP of 11 different widths, each layer twice (Kron's stacks
  hold 2 units);
* ``few-huge``: two 4096×4096 layers and a 32000×1024 embedding;
* ``transformer``: 12 scanned layers of d_model 768 (qkv, attention-out, MLP
  768→3072→768, two norms, stacked on a leading layer axis and marked by
  ``scanned_layers``), a 32000×768 embedding and a final norm.

Each optimizer shards what it can: Kron splits its factor stacks over the mesh
(``params_partition_specs``; unit axes inferred), pro along
``pipeline_axis_name``, Shampoo its statistics with ``shard_optimizer_states``
(``statistics_partition_spec`` = ``preconditioner_partition_spec`` =
P('fsdp', None, None), ``num_devices_for_pjit`` = devices) and its momenta like
the params (``params_partition_specs``), XMat, LRA and Affine
their momentum like the params and every factor along its first axis
(``params_partition_specs``, ``preconditioner_partition_spec`` = P('fsdp')).
Nothing is trained: update probability 1.

On 1, 2, 4 and 8 simulated CPU devices (``jax.jit(init)`` and
``jax.jit(update)`` compiled on the sharded parameters' shapes):

1. Per-device state bytes. Where the state of all devices fits in
   ``--allocate-mb`` (source ``arrays``), ``init`` runs and the bytes are those
   of the shards device 0 holds; otherwise (``compiled``) they come from the
   shardings XLA gives init's outputs, with nothing allocated.
2. The bytes one device receives per update step (collectives of the compiled
   HLO, ``precond.bench.hlo``; both branches of a conditional counted), as a
   ratio to the parameter bytes of the whole model.

For 64 and 256 devices (and, as a check, 1 to 8), a shapes-only prediction: the
state's shapes from ``jax.eval_shape(init)`` on a ``jax.sharding.AbstractMesh``
and each leaf's PartitionSpec from the optimizer's helper
(``get_opt_state_partition_specs``, ``pro_opt_state_partition_specs``,
``distributed_shampoo_partition_specs``; XMat, LRA, Affine: their placement
rule), each
dim divided by the mesh axes that split it, rounded up. Rows where measured and
predicted bytes differ are marked ``!``, and the leaves that differ most listed.
``--quick``: small shapes, the transformer only, 8 devices measured (the 1-device
figure predicted).

Targets (issue "Scale and speed: sharded state that shrinks with the mesh"): at
8 devices, state bytes per device <= 1/6 of one device's; received bytes per
update step <= 2× the parameter bytes.

Usage::

    python benchmarks/sharded_memory.py               # ~30 min on 2 busy CPU cores
    python benchmarks/sharded_memory.py --quick       # small transformer, 8 devices
    python benchmarks/sharded_memory.py --optimizers kron,pro --models transformer
    python benchmarks/sharded_memory.py --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from precond._common.cpu_devices import simulate_cpu_devices

simulate_cpu_devices(8)

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from _common import device0_bytes, loadavg, machine_info, progress_log
from precond.bench.hlo import collectives
from precond.bench.report import write_json
from precond.jax import (
    affine,
    distributed_shampoo,
    distributed_shampoo_partition_specs,
    get_opt_state_partition_specs,
    kron,
    lra,
    pro,
    pro_opt_state_partition_specs,
    xmat,
)

AXIS = "fsdp"
MEASURED = (1, 2, 4, 8)
SIMULATED = (64, 256)
F32 = jnp.float32


class Model(NamedTuple):
    shapes: dict[str, tuple[int, ...]]  # parameter name -> shape (float32)
    scanned: dict[str, bool]  # leading axis stacks layers


def many_small(quick: bool) -> Model:
    """An MLP of many widths; every layer twice (stacks of 2 equal units)."""
    widths = [64 + 32 * i for i in range(5 if quick else 12)]
    shapes = {}
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        for twin in "ab":
            shapes[f"layer{i:02d}{twin}/w"] = (a, b)
            shapes[f"layer{i:02d}{twin}/b"] = (b,)
    return Model(shapes, dict.fromkeys(shapes, False))


def few_huge(quick: bool) -> Model:
    """Two d×d layers and a vocab×e embedding."""
    d, vocab, e = (512, 4000, 128) if quick else (4096, 32000, 1024)
    shapes = {"dense1": (d, d), "dense2": (d, d), "embed": (vocab, e)}
    return Model(shapes, dict.fromkeys(shapes, False))


def transformer(quick: bool) -> Model:
    """A transformer whose layers are stacked on a leading axis (scanned)."""
    layers, d, vocab = (2, 128, 1000) if quick else (12, 768, 32000)
    stacked = {
        "qkv": (d, 3 * d),
        "attn_out": (d, d),
        "mlp_in": (d, 4 * d),
        "mlp_out": (4 * d, d),
        "ln1": (d,),
        "ln2": (d,),
    }
    shapes = {"embed": (vocab, d), "final_ln": (d,)}
    shapes.update({f"layers/{k}": (layers, *s) for k, s in stacked.items()})
    return Model(shapes, {k: k.startswith("layers/") for k in shapes})


MODELS = {"many-small": many_small, "few-huge": few_huge, "transformer": transformer}


def fsdp_spec(shape: tuple[int, ...], scanned: bool) -> P:
    """The largest dim (after a scanned layer axis) split over the mesh axis."""
    first = 1 if scanned else 0
    if len(shape) <= first:
        return P()
    dims = list(shape[first:])
    axis = first + dims.index(max(dims))
    return P(*[AXIS if i == axis else None for i in range(axis + 1)])


def param_specs(model: Model) -> dict[str, P]:
    return {k: fsdp_spec(s, model.scanned[k]) for k, s in model.shapes.items()}


def abstract_params(model: Model, mesh: Any = None) -> dict[str, Any]:
    """The parameters as ``ShapeDtypeStruct``s, sharded on ``mesh`` if given."""
    specs = param_specs(model)
    return {
        k: jax.ShapeDtypeStruct(
            s, F32, sharding=None if mesh is None else NamedSharding(mesh, specs[k])
        )
        for k, s in model.shapes.items()
    }


def _kron_kwargs(model: Model, devices: int, mesh: Any) -> dict[str, Any]:
    return dict(
        preconditioner_update_probability=1.0,
        scanned_layers=model.scanned,
        params_partition_specs=param_specs(model),
        mesh=mesh,
    )


def _pro_kwargs(model: Model, devices: int, mesh: Any) -> dict[str, Any]:
    return dict(
        scanned_layers=model.scanned,
        pipeline_axis_name=AXIS,
        pipeline_axis_size=devices,
        params_partition_specs=param_specs(model),
    )


def _shampoo_kwargs(model: Model, devices: int, mesh: Any) -> dict[str, Any]:
    stacks = P(AXIS, None, None)
    return dict(
        learning_rate=1e-3,
        block_size=256,
        statistics_partition_spec=stacks,
        preconditioner_partition_spec=stacks,
        num_devices_for_pjit=devices,
        shard_optimizer_states=True,
        sharded_init_fns=False,
        params_partition_specs=param_specs(model),
        mesh=mesh,
    )


def _psgd_kwargs(model: Model, devices: int, mesh: Any) -> dict[str, Any]:
    return dict(
        params_partition_specs=param_specs(model),
        preconditioner_partition_spec=P(AXIS),
        mesh=mesh,
    )


def _psgd_specs(model: Model, kwargs: Any, params: Any, shapes: Any) -> Any:
    """The rule of precond.jax._psgd_placement: momentum as its parameter, every
    factor split along its first axis, the rest replicated."""
    core, learning_rate = shapes
    specs = jax.tree.map(lambda _: P(), core)
    return (
        specs._replace(
            mu=param_specs(model),
            preconditioner=jax.tree.map(
                lambda x: P(AXIS) if x.ndim else P(), core.preconditioner
            ),
        ),
        jax.tree.map(lambda _: P(), learning_rate),
    )


class Optimizer(NamedTuple):
    kwargs: Callable[[Model, int, Any], dict[str, Any]]  # (model, devices, mesh)
    build: Callable[..., Any]  # kwargs -> optax transformation
    specs: Callable[[Model, dict[str, Any], Any, Any], Any]  # state's specs


OPTIMIZERS = {
    "kron": Optimizer(
        _kron_kwargs,
        kron,
        lambda m, kw, params, shapes: get_opt_state_partition_specs(params, **kw),
    ),
    "pro": Optimizer(
        _pro_kwargs,
        pro,
        lambda m, kw, params, shapes: pro_opt_state_partition_specs(params, **kw),
    ),
    "shampoo": Optimizer(
        _shampoo_kwargs,
        distributed_shampoo,
        lambda m, kw, params, shapes: distributed_shampoo_partition_specs(
            params, param_specs(m), **kw
        ),
    ),
    "xmat": Optimizer(_psgd_kwargs, xmat, _psgd_specs),
    "lra": Optimizer(_psgd_kwargs, lra, _psgd_specs),
    "affine": Optimizer(_psgd_kwargs, affine, _psgd_specs),
}


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, P)


def shard_bytes(shape: Sequence[int], dtype: Any, spec: P | None, sizes) -> int:
    """Bytes of one device's shard: each dim over the axes that split it, rounded
    up (XLA pads the last shard)."""
    entries = list(spec or ()) + [None] * (len(shape) - len(spec or ()))
    numel = 1
    for dim, entry in zip(shape, entries, strict=True):
        axes = (
            () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        )
        numel *= -(-dim // math.prod(sizes[a] for a in axes))
    return numel * jnp.dtype(dtype).itemsize


def predicted_leaves(shapes: Any, specs: Any, sizes: dict[str, int]) -> list[dict]:
    """Per leaf: path, shape, spec and predicted per-device bytes (``specs`` is a
    tree prefix of ``shapes``; a None spec replicates its subtree)."""
    prefixes, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)
    rows = []
    for (prefix, spec), subtree in zip(
        prefixes, treedef.flatten_up_to(shapes), strict=True
    ):
        for path, leaf in jax.tree_util.tree_flatten_with_path(subtree)[0]:
            rows.append(
                {
                    "path": jax.tree_util.keystr(tuple(prefix) + tuple(path)),
                    "shape": tuple(leaf.shape),
                    "spec": str(spec or P()),
                    "bytes": shard_bytes(leaf.shape, leaf.dtype, spec, sizes),
                    "global_bytes": leaf.size * jnp.dtype(leaf.dtype).itemsize,
                }
            )
    return rows


def predict(model: Model, name: str, devices: int) -> dict[str, Any]:
    """Shapes-only per-device bytes on an AbstractMesh of ``devices``."""
    mesh = AbstractMesh((devices,), (AXIS,), axis_types=(AxisType.Auto,))
    opt = OPTIMIZERS[name]
    kwargs = opt.kwargs(model, devices, mesh)
    params = abstract_params(model)
    with jax.sharding.use_abstract_mesh(mesh):  # the init's sharding constraints
        shapes = jax.eval_shape(opt.build(**kwargs).init, params)
        state_specs = opt.specs(model, kwargs, params, shapes)
    leaves = predicted_leaves(shapes, state_specs, {AXIS: devices})
    specs = param_specs(model)
    return {
        "devices": devices,
        "param_bytes_per_device": sum(
            shard_bytes(p.shape, p.dtype, specs[k], {AXIS: devices})
            for k, p in params.items()
        ),
        "state_bytes_per_device": sum(r["bytes"] for r in leaves),
        "state_bytes": sum(r["global_bytes"] for r in leaves),
        "largest": sorted(leaves, key=lambda r: -r["bytes"])[:3],
        "leaf_bytes": {r["path"]: r["bytes"] for r in leaves},
    }


def _compile(tx: Any, params: Any, mesh: Any) -> tuple[Any, Any, Any]:
    """(compiled init, state shapes with init's output shardings, compiled update)."""
    with jax.set_mesh(mesh):
        init = jax.jit(tx.init).lower(params).compile()
        shapes = jax.eval_shape(tx.init, params)
        state = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            shapes,
            init.output_shardings,
        )
        update = jax.jit(tx.update).lower(params, state, params).compile()
    return init, state, update


def _leaf_shard_bytes(tree: Any) -> dict[str, int]:
    """Per-device bytes of each ``ShapeDtypeStruct`` from its sharding, by path."""
    return {
        jax.tree_util.keystr(path): math.prod(x.sharding.shard_shape(x.shape))
        * jnp.dtype(x.dtype).itemsize
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _shard_bytes_of(tree: Any) -> int:
    return sum(_leaf_shard_bytes(tree).values())


def measure(model: Model, name: str, devices: int, allocate: float) -> dict:
    """State bytes per device and received bytes per update on ``devices``."""
    mesh = jax.make_mesh(
        (devices,),
        (AXIS,),
        axis_types=(AxisType.Auto,),
        devices=jax.devices()[:devices],
    )
    opt = OPTIMIZERS[name]
    tx = opt.build(**opt.kwargs(model, devices, mesh))
    params = abstract_params(model, mesh)
    init, state, update = _compile(tx, params, mesh)
    state_bytes = _shard_bytes_of(state)
    param_bytes = sum(p.size * 4 for p in params.values())
    source = "compiled"
    if (state_bytes + _shard_bytes_of(params)) * devices <= allocate:
        shardings = jax.tree.map(lambda p: p.sharding, params)
        zeros = jax.jit(
            lambda: jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params),
            out_shardings=shardings,
        )()
        state_bytes, source = device0_bytes(init(zeros)), "arrays"
        del zeros
    by_op: dict[str, float] = {}
    for c in collectives(update.as_text(), devices):
        by_op[c.op] = by_op.get(c.op, 0.0) + c.received_bytes
    return {
        "devices": devices,
        "source": source,
        "param_bytes": param_bytes,
        "param_bytes_per_device": _shard_bytes_of(params),
        "state_bytes_per_device": state_bytes,
        "received_bytes": sum(by_op.values()),
        "received_by_op": by_op,
        "leaf_bytes": _leaf_shard_bytes(state),
    }


def run_pair(model: Model, name: str, args: argparse.Namespace, log) -> dict:
    """Measured rows (1-8 devices) and predicted rows (1-8, 64, 256) of one
    optimizer on one model."""
    measured, predicted = [], []
    for devices in args.devices:
        log(f"  {name}: {devices} devices")
        measured.append(measure(model, name, devices, args.allocate_mb * 1e6))
    for devices in sorted({1, *args.devices, *SIMULATED}):
        predicted.append(predict(model, name, devices))
    by_devices = {p["devices"]: p for p in predicted}
    for m in measured:
        m["differences"] = _differences(
            m.pop("leaf_bytes"), by_devices[m["devices"]]["leaf_bytes"]
        )
    for p in predicted:
        del p["leaf_bytes"]
    return {"measured": measured, "predicted": predicted}


def _differences(measured: dict[str, int], predicted: dict[str, int]) -> list:
    """The leaves whose measured and predicted bytes differ, largest gap first:
    (path, measured, predicted)."""
    rows = [
        (path, measured.get(path), predicted.get(path))
        for path in {**measured, **predicted}
        if measured.get(path) != predicted.get(path)
    ]
    return sorted(rows, key=lambda r: -abs((r[1] or 0) - (r[2] or 0)))


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


def _table(result: dict) -> list[str]:
    """One row per device count: measured where there is one, else predicted."""
    predicted = {r["devices"]: r for r in result["predicted"]}
    measured = {r["devices"]: r for r in result["measured"]}
    one = (measured.get(1) or predicted[1])["state_bytes_per_device"]
    out = [
        "| devices | source | params MB/device | state MB/device | predicted MB/device"
        " | state / 1 device | received / param bytes |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for devices, p in predicted.items():
        m = measured.get(devices)
        state = (m or p)["state_bytes_per_device"]
        mark = (
            " !"
            if m and m["state_bytes_per_device"] != p["state_bytes_per_device"]
            else ""
        )
        received = "-" if m is None else f"{m['received_bytes'] / m['param_bytes']:.2f}"
        out.append(
            f"| {devices} | {m['source'] if m else 'simulated'} | "
            f"{_mb(p['param_bytes_per_device'])} | {_mb(state)} | "
            f"{_mb(p['state_bytes_per_device'])}{mark} | {state / one:.3f} | "
            f"{received} |"
        )
    return out


def _largest(result: dict, devices: int) -> str:
    rows = [r for r in result["predicted"] if r["devices"] == devices]
    leaves = "; ".join(
        f"{x['path']} {x['shape']} {x['spec']} {_mb(x['bytes'])} MB"
        for x in rows[0]["largest"]
    )
    return f"Largest leaves per device at {devices} devices: {leaves}"


def _difference_lines(result: dict) -> list[str]:
    """Per measured device count, the 3 leaves most off the prediction."""
    out = []
    for m in result["measured"]:
        diffs = m["differences"]
        if diffs:
            shown = "; ".join(
                f"{path} measured {_mb(a or 0)} MB, predicted {_mb(b or 0)} MB"
                for path, a, b in diffs[:3]
            )
            out.append(
                f"Measured != predicted at {m['devices']} devices "
                f"({len(diffs)} leaves): {shown}  "
            )
    return out


def _targets(result: dict) -> str:
    """The issue's two targets at 8 devices, if 8 were measured."""
    measured = {r["devices"]: r for r in result["measured"]}
    if 8 not in measured:
        return "Targets at 8 devices: not measured"
    one = measured.get(1) or result["predicted"][0]  # --quick: 1 device predicted
    shrink = measured[8]["state_bytes_per_device"] / one["state_bytes_per_device"]
    received = measured[8]["received_bytes"] / measured[8]["param_bytes"]
    met = ["NOT met", "met"]
    return (
        f"Targets at 8 devices: state / 1 device = {shrink:.3f} (<= 1/6: "
        f"{met[shrink <= 1 / 6]}); received / param bytes = {received:.2f} "
        f"(<= 2: {met[received <= 2]})"
    )


def report(res: dict[str, Any]) -> str:
    info = res["machine"]
    out = [
        f"- CPU: {info['cpu_model']}, {info['usable_cpus']} usable cores; "
        f"jax {info['jax']}, jaxlib {info['jaxlib']}, optax {info['optax']}",
        f"- date (UTC) {info['date_utc']}; load average at start "
        f"{info['loadavg_start']}, at end {info['loadavg_end']}; "
        f"wall {res['wall_s']:.0f} s",
        "- state MB/device: measured (source arrays/compiled) where devices <= 8, "
        "else simulated; predicted = shapes-only arithmetic (`!`: differs from "
        "measured); received = bytes one device receives per update step",
    ]
    for model_name, model in res["models"].items():
        out += [
            "",
            f"## {model_name}: {model['num_params']:,} parameters "
            f"({_mb(4 * model['num_params'])} MB float32)",
        ]
        for name, result in model["optimizers"].items():
            out += ["", f"### {model_name}, {name}", "", *_table(result), ""]
            eight = [r for r in result["measured"] if r["devices"] == 8]
            if eight:
                by_op = ", ".join(
                    f"{op} {_mb(b)}"
                    for op, b in sorted(eight[0]["received_by_op"].items())
                )
                out.append(
                    f"Received MB by collective at 8 devices: {by_op or 'none'}  "
                )
            out += _difference_lines(result)
            for devices in (8, SIMULATED[-1]):
                out.append(_largest(result, devices) + "  ")
            out.append(_targets(result))
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", help=f"of {', '.join(MODELS)} (default all; --quick: transformer)"
    )
    parser.add_argument(
        "--optimizers", default=",".join(OPTIMIZERS), help=f"of {', '.join(OPTIMIZERS)}"
    )
    parser.add_argument(
        "--allocate-mb",
        type=float,
        default=2000.0,
        help="run init when all devices' state and params fit in this (default 2000)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small shapes, the transformer only, 8 devices measured (1 predicted)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write results as JSON")
    args = parser.parse_args(argv)
    default = "transformer" if args.quick else ",".join(MODELS)
    args.models = (args.models or default).split(",")
    args.optimizers = args.optimizers.split(",")
    for given, known in ((args.models, MODELS), (args.optimizers, OPTIMIZERS)):
        unknown = [x for x in given if x not in known]
        if unknown:
            parser.error(f"unknown {unknown}; choose from {list(known)}")
    args.devices = (8,) if args.quick else MEASURED
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    log = progress_log(t0)
    info = machine_info()
    if jax.device_count() < max(args.devices):
        raise SystemExit(
            f"needs {max(args.devices)} devices, found {jax.device_count()}"
        )
    models = {}
    for model_name in args.models:
        model = MODELS[model_name](args.quick)
        log(model_name)
        models[model_name] = {
            "shapes": model.shapes,
            "num_params": sum(math.prod(s) for s in model.shapes.values()),
            "optimizers": {
                name: run_pair(model, name, args, log) for name in args.optimizers
            },
        }
    info["loadavg_end"] = loadavg()
    result = {
        "machine": info,
        "quick": args.quick,
        "models": models,
        "wall_s": time.perf_counter() - t0,
    }
    print(report(result))
    if args.json:
        write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
