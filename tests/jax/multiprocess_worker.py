"""One process of test_kron_multiprocess.py: sharded Kron steps on a (2, 4) mesh.

Run as ``python multiprocess_worker.py PROCESS_ID PORT OUT_DIR`` twice (process ids
0 and 1), each with 4 simulated CPU devices; the test sets XLA_FLAGS and
JAX_PLATFORMS in their environment. The processes join over
``jax.distributed.initialize`` on localhost and process 0 writes the gathered
results to OUT_DIR/results.npz. The test imports :func:`sharded_steps` to compute
the same steps in a single process with 8 devices.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import precond.jax as pj

SHAPES = {
    "emb": (64, 32),
    "w1": (32, 48),
    "b1": (48,),
    "layers": (4, 16, 32),
    "w2": (48, 10),
}
# Placements: columns, both mesh axes, one axis, the scanned axis, replicated.
SPECS = {
    "emb": P(None, "tp"),
    "w1": P("fsdp", "tp"),
    "b1": P("tp"),
    "layers": P(None, "fsdp", "tp"),
    "w2": P(),
}
KWARGS = dict(
    preconditioner_update_probability=1.0,
    scanned_layers={name: name == "layers" for name in SHAPES},
    partition_grads_into_blocks=True,
    block_size=16,
    params_partition_specs=SPECS,
)
STEPS = 3
SEED = 0


def sharded_steps(seed=SEED):
    """Float64 Kron updates of ``STEPS`` steps on a (2, 4) mesh of all devices.

    Every process builds the same global gradients from the same numpy data and
    gets the same host arrays back: the updates of each step (``update{step}_{name}``),
    the final momentum (``mu_{name}``) and the final factor stacks (``factor{i}``).
    Call it with float64 enabled.
    """
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(seed)
    grads = [{k: rng.normal(size=s) for k, s in SHAPES.items()} for _ in range(STEPS)]

    def put(tree):
        return {
            k: jax.make_array_from_callback(
                x.shape, NamedSharding(mesh, SPECS[k]), lambda idx, x=x: x[idx]
            )
            for k, x in tree.items()
        }

    optimizer = pj.scale_by_kron(**KWARGS, precond_dtype=jnp.float64)
    results = {}
    with jax.set_mesh(mesh):
        state = optimizer.init(put({k: np.zeros(s) for k, s in SHAPES.items()}))
        update = jax.jit(optimizer.update)
        for step, g in enumerate(grads):
            updates, state = update(put(g), state)
            for k, x in multihost_utils.process_allgather(updates, tiled=True).items():
                results[f"update{step}_{k}"] = x
    for k, x in multihost_utils.process_allgather(state.mu, tiled=True).items():
        results[f"mu_{k}"] = x
    factors = jax.tree.leaves(state.preconditioners)
    for i, x in enumerate(multihost_utils.process_allgather(factors, tiled=True)):
        results[f"factor{i}"] = x
    return results


def main(process_id, port, out_dir):
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}",
        num_processes=2,
        process_id=process_id,
    )
    topology = (jax.process_count(), jax.device_count(), jax.local_device_count())
    assert topology == (2, 8, 4), topology
    results = sharded_steps()
    if process_id == 0:
        np.savez(Path(out_dir) / "results.npz", **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
