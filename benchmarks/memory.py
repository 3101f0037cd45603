"""Optimizer state per device of sharded Kron, pro and Shampoo on 1 to 256 devices.

Each model's weights are split FSDP-style (the largest dim, after a scanned layer
axis, over the mesh axis ``fsdp``) and each optimizer shards what it can: Kron
its factor stacks (``params_partition_specs``), pro along
``pipeline_axis_name``, Shampoo its statistics (``shard_optimizer_states``).

On 1, 2, 4 and 8 simulated CPU devices the update is compiled on the sharded
shapes (nothing allocated): the state's bytes per device come from the
shardings XLA gives ``init``'s outputs, and the bytes one device receives per
update from the collectives of the compiled HLO (``precond.bench.hlo``). On 64
and 256 devices the bytes are planned on shapes: ``jax.eval_shape(init)`` on an
``AbstractMesh``, each leaf divided as the optimizer's partition-spec helper
says. A measured row whose bytes differ from the plan is marked ``!``.

``python benchmarks/memory.py --json out.json [--quick]``; ``speed.py`` runs it
in a process of its own for the ``memory`` table.
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from precond._common.cpu_devices import simulate_cpu_devices

simulate_cpu_devices(8)

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import precond.jax as pj
from precond.bench.hlo import received_bytes

AXIS = "fsdp"


class Model(NamedTuple):
    shapes: dict[str, tuple[int, ...]]  # name -> shape, float32
    scanned: dict[str, bool]  # the leading axis stacks layers


def many_small(quick: bool) -> Model:
    """An MLP of many widths, each layer twice."""
    widths = [64 + 32 * i for i in range(5 if quick else 12)]
    shapes = {}
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        for twin in "ab":
            shapes |= {f"layer{i:02d}{twin}/w": (a, b), f"layer{i:02d}{twin}/b": (b,)}
    return Model(shapes, dict.fromkeys(shapes, False))


def few_huge(quick: bool) -> Model:
    d, vocab, e = (512, 4096, 128) if quick else (4096, 32000, 1024)
    shapes = {"dense1": (d, d), "dense2": (d, d), "embed": (vocab, e)}
    return Model(shapes, dict.fromkeys(shapes, False))


def transformer(quick: bool) -> Model:
    """Layers stacked on a leading axis (scanned), an embedding, a final norm."""
    layers, d, vocab = (2, 128, 1024) if quick else (12, 768, 32000)
    stacked = {"qkv": (d, 3 * d), "attn_out": (d, d), "mlp_in": (d, 4 * d)}
    stacked |= {"mlp_out": (4 * d, d), "ln1": (d,), "ln2": (d,)}
    shapes = {"embed": (vocab, d), "final_ln": (d,)}
    shapes |= {f"layers/{k}": (layers, *s) for k, s in stacked.items()}
    return Model(shapes, {k: k.startswith("layers/") for k in shapes})


MODELS = {"transformer": transformer, "many-small": many_small, "few-huge": few_huge}


def param_specs(model: Model) -> dict[str, P]:
    specs = {}
    for name, shape in model.shapes.items():
        first = int(model.scanned[name])
        if len(shape) <= first:
            specs[name] = P()
            continue
        axis = first + shape[first:].index(max(shape[first:]))
        specs[name] = P(*[AXIS if i == axis else None for i in range(axis + 1)])
    return specs


def _kron(model: Model, devices: int, mesh: Any) -> dict[str, Any]:
    return dict(
        preconditioner_update_probability=1.0,
        scanned_layers=model.scanned,
        params_partition_specs=param_specs(model),
        mesh=mesh,
    )


def _pro(model: Model, devices: int, mesh: Any) -> dict[str, Any]:
    return dict(
        scanned_layers=model.scanned,
        pipeline_axis_name=AXIS,
        pipeline_axis_size=devices,
        params_partition_specs=param_specs(model),
    )


def _shampoo(model: Model, devices: int, mesh: Any) -> dict[str, Any]:
    return dict(
        learning_rate=1e-3,
        block_size=256,
        statistics_partition_spec=P(AXIS, None, None),
        preconditioner_partition_spec=P(AXIS, None, None),
        num_devices_for_pjit=devices,
        shard_optimizer_states=True,
        sharded_init_fns=False,
        params_partition_specs=param_specs(model),
        mesh=mesh,
    )


# name -> (arguments, optimizer, the state's partition specs)
OPTIMIZERS = {
    "kron": (
        _kron,
        pj.kron,
        lambda m, kw, params: pj.get_opt_state_partition_specs(params, **kw),
    ),
    "pro": (
        _pro,
        pj.pro,
        lambda m, kw, params: pj.pro_opt_state_partition_specs(params, **kw),
    ),
    "distributed_shampoo": (
        _shampoo,
        pj.distributed_shampoo,
        lambda m, kw, params: pj.distributed_shampoo_partition_specs(
            params, param_specs(m), **kw
        ),
    ),
}


def _params(model: Model, mesh: Any = None) -> dict[str, Any]:
    specs = param_specs(model)
    return {
        k: jax.ShapeDtypeStruct(
            s, jnp.float32, sharding=mesh and NamedSharding(mesh, specs[k])
        )
        for k, s in model.shapes.items()
    }


def _shard_bytes(shape, dtype, spec: P | None, devices: int) -> int:
    """One device's shard: each dim over the mesh axes that split it, rounded up."""
    entries = list(spec or ()) + [None] * (len(shape) - len(spec or ()))
    count = 1
    for dim, entry in zip(shape, entries, strict=True):
        count *= -(-dim // (1 if entry is None else devices))
    return count * jnp.dtype(dtype).itemsize


def planned(model: Model, name: str, devices: int) -> int:
    """State bytes per device from shapes alone, on an AbstractMesh."""
    mesh = AbstractMesh((devices,), (AXIS,), axis_types=(AxisType.Auto,))
    arguments, build, specs_of = OPTIMIZERS[name]
    kwargs = arguments(model, devices, mesh)
    params = _params(model)
    with jax.sharding.use_abstract_mesh(mesh):
        shapes = jax.eval_shape(build(**kwargs).init, params)
        specs = specs_of(model, kwargs, params)
    is_spec = lambda x: x is None or isinstance(x, P)  # noqa: E731
    prefixes, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    return sum(
        _shard_bytes(leaf.shape, leaf.dtype, spec, devices)
        for spec, subtree in zip(prefixes, treedef.flatten_up_to(shapes), strict=True)
        for leaf in jax.tree.leaves(subtree)
    )


def _bytes_per_device(tree: Any) -> int:
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(tree)
    )


def measured(model: Model, name: str, devices: int) -> dict[str, Any]:
    """State bytes per device and bytes received per update, from the compiled
    programs on ``devices`` simulated devices."""
    mesh = jax.make_mesh(
        (devices,),
        (AXIS,),
        axis_types=(AxisType.Auto,),
        devices=jax.devices()[:devices],
    )
    arguments, build, _ = OPTIMIZERS[name]
    tx = build(**arguments(model, devices, mesh))
    params = _params(model, mesh)
    with jax.set_mesh(mesh):
        init = jax.jit(tx.init).lower(params).compile()
        state = jax.tree.map(
            lambda s, sharding: jax.ShapeDtypeStruct(
                s.shape, s.dtype, sharding=sharding
            ),
            jax.eval_shape(tx.init, params),
            init.output_shardings,
        )
        update = jax.jit(tx.update).lower(params, state, params).compile()
    return {
        "state_bytes_per_device": _bytes_per_device(state),
        "param_bytes_per_device": _bytes_per_device(params),
        "received_bytes": received_bytes(update.as_text(), devices),
    }


def rows(model_names: Sequence[str], quick: bool) -> list[dict[str, Any]]:
    out = []
    for model_name, name in itertools.product(model_names, OPTIMIZERS):
        model = MODELS[model_name](quick)
        param_bytes = 4 * sum(math.prod(s) for s in model.shapes.values())
        specs = param_specs(model)
        one = None
        for devices in (1, 8, 64) if quick else (1, 2, 4, 8, 64, 256):
            row = {
                "model": model_name,
                "optimizer": name,
                "devices": devices,
                "param_bytes": param_bytes,
            }
            try:
                plan = planned(model, name, devices)
                if devices <= jax.device_count():
                    row |= measured(model, name, devices) | {"source": "compiled"}
                    row["off"] = row["state_bytes_per_device"] != plan
                else:
                    row |= {
                        "source": "planned on shapes",
                        "state_bytes_per_device": plan,
                        "received_bytes": None,
                    }
                    row["param_bytes_per_device"] = sum(
                        _shard_bytes(s, jnp.float32, specs[k], devices)
                        for k, s in model.shapes.items()
                    )
            except ValueError as error:  # e.g. a dim the mesh does not divide
                out.append(row | {"skipped": str(error).split(";")[0][:160]})
                continue
            one = one or row["state_bytes_per_device"]
            out.append(row | {"one_device_state_bytes": one})
    return out


def main(argv: Sequence[str] | None = None) -> None:
    from precond.bench.report import write_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--quick", action="store_true", help="small shapes, 1 model")
    parser.add_argument("--json", metavar="PATH", required=True)
    args = parser.parse_args(argv)
    models = ["transformer"] if args.quick else args.models.split(",")
    write_json(rows(models, args.quick), args.json)


if __name__ == "__main__":
    main()
