"""A user's plain training script, run by tests/jax/test_no_hang.py in a new
process: JAX starts first (the model's parameters are made), precond.jax is
imported afterwards, and nothing sets XLA_FLAGS or PJRT_NPROC but, with
``--devices N``, the device count this script asks for itself.

    python tests/jax/plain_script.py kron pro --steps 30 [--devices 8] [--d-model 128]

Trains the bench's char-lm transformer (random bytes: only the programs
matter; its width ``--d-model``) with each named optimizer; with
``--devices`` > 1, its weight matrices and Kron's or pro's preconditioner are
sharded over a mesh of that many simulated CPU devices. Prints one line per
optimizer when it is done.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("optimizers", nargs="+")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=64)
    return parser.parse_args(argv)


def optimizer(name: str, sharding: dict):
    import precond.jax as pj

    rate = 3e-3
    return {
        "kron": lambda: pj.kron(rate, weight_decay=0.0, **sharding),
        # pro places its preconditioner by the parameters' specs.
        "pro": lambda: pj.pro(
            rate, params_partition_specs=sharding.get("params_partition_specs")
        ),
        "xmat": lambda: pj.xmat(rate),
        "lra": lambda: pj.low_rank_approximation(rate),
        "affine": lambda: pj.affine(rate),
        "shampoo": lambda: pj.distributed_shampoo(rate, block_size=64),
        "shampoo-eigh": lambda: pj.distributed_shampoo(rate, block_size=64, eigh=True),
        "soap": lambda: pj.soap(
            rate,
            precondition_frequency=2,
            params_partition_specs=sharding.get("params_partition_specs"),
        ),
    }[name]()


def sharded(params, devices: int):
    """(params laid out on a 1-D mesh, the optimizer's sharding arguments)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("fsdp",))

    def spec(x):
        return P("fsdp", None) if x.ndim == 2 and x.shape[0] % devices == 0 else P()

    specs = jax.tree.map(spec, params)
    layout = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    params = jax.device_put(params, layout)
    arguments = {
        "params_partition_specs": specs,
        "preconditioner_partition_spec": P("fsdp", None),
    }
    return params, arguments, mesh


def train(name: str, params, steps: int, sharding: dict) -> float:
    import jax
    import numpy as np
    import optax

    from precond.bench.jax_models import char_lm_logits, cross_entropy

    loss_fn = cross_entropy(char_lm_logits)
    tx = optimizer(name, sharding)
    state = tx.init(params)

    @jax.jit
    def step(params, state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens[:, :-1], tokens[:, 1:])
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    rng = np.random.default_rng(0)
    for _ in range(steps):
        tokens = rng.integers(0, 256, size=(16, 65)).astype(np.int32)
        params, state, loss = step(params, state, tokens)
        loss.block_until_ready()
    return float(loss)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.devices > 1:
        os.environ["XLA_FLAGS"] = (
            f"--xla_force_host_platform_device_count={args.devices}"
        )
    import jax

    from precond.bench.jax_models import init_char_lm

    # JAX's backend starts here, before precond.jax is imported.
    params = init_char_lm(0, d_model=args.d_model)
    assert "precond.jax" not in sys.modules
    sharding, mesh = {}, None
    if args.devices > 1:
        params, sharding, mesh = sharded(params, args.devices)
    for name in args.optimizers:
        start = time.perf_counter()
        if mesh is None:
            loss = train(name, params, args.steps, sharding)
        else:
            with jax.set_mesh(mesh):
                loss = train(name, params, args.steps, sharding)
        print(
            f"{name}: {args.steps} steps, loss {loss:.3f}, "
            f"{time.perf_counter() - start:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
