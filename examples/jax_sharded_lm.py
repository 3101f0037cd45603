"""Byte-level language model trained with PSGD Kron on an FSDP × tensor-parallel mesh.

Shows ``precond.jax.kron`` on a decoder-only transformer (flax linen) whose blocks
are scanned (one set of parameters stacked along a leading layer axis, marked with
``scanned_layers``), with every weight sharded over a 2-D ``("fsdp", "tp")`` mesh
(``params_partition_specs``), the batch split over ``"fsdp"``, and the
preconditioner's factors split over all devices (``preconditioner_partition_spec``).
Training checkpoints params, optimizer state and step with plain ``np.savez`` and
resumes from the latest checkpoint in ``--checkpoint-dir``.

The text is the Python documentation's topics (``pydoc_data.topics``, ~465 KB of
English), as bytes; the last 10% is held out for validation. Without accelerators
the script simulates ``--devices`` CPU devices (default 8); see examples/README.md
for the XLA:CPU settings it makes for them.

Usage::

    python examples/jax_sharded_lm.py                   # ~3 min on 2 CPU cores
    python examples/jax_sharded_lm.py --mesh 4,2 --steps 300
    python examples/jax_sharded_lm.py --checkpoint-dir ckpt --steps 20 --stop-after 10
    python examples/jax_sharded_lm.py --checkpoint-dir ckpt --steps 20  # resumes at 10

The model can be reused elsewhere through :func:`build_model`, :func:`init_params`
and :func:`param_specs_for`.
"""

import argparse
import glob
import math
import os
import pydoc_data.topics
import tempfile
import time
from collections.abc import Sequence
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import precond.jax as pj
from precond._common.cpu_devices import simulate_cpu_devices

VOCAB = 256  # byte-level tokens

# Sharding of each weight, by the name of the module that owns it. Kernels of the
# first matmul of a pair split their output over "tp" and the second its input
# (Megatron style), so a block needs one reduction per pair; the other dim of every
# weight is split over "fsdp". Parameters not listed (norm scales) are replicated.
WEIGHT_SPECS = {
    "embed": P("tp", "fsdp"),  # (vocab, d_model)
    "pos_embed": P(None, "fsdp"),  # (seq_len, d_model)
    "qkv": P("fsdp", "tp"),  # (d_model, 3·d_model), head-major columns
    "out": P("tp", "fsdp"),  # (d_model, d_model)
    "up": P("fsdp", "tp"),  # (d_model, 4·d_model)
    "down": P("tp", "fsdp"),  # (4·d_model, d_model)
    "head": P("fsdp", "tp"),  # (d_model, vocab)
}
SCANNED = "layers"  # name of the scanned stack of blocks


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP."""

    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        b, t, d = x.shape
        h = nn.RMSNorm(name="ln1")(x)
        # Columns grouped by head (q, k, v of head 0, then of head 1, ...), so that
        # splitting them over "tp" gives each device whole heads.
        qkv = nn.Dense(3 * d, use_bias=False, name="qkv")(h)
        q, k, v = jnp.split(qkv.reshape(b, t, self.heads, -1), 3, axis=-1)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d)
        x = x + nn.Dense(d, use_bias=False, name="out")(y)
        h = nn.RMSNorm(name="ln2")(x)
        h = nn.gelu(nn.Dense(4 * d, use_bias=False, name="up")(h))
        return x + nn.Dense(d, use_bias=False, name="down")(h), None


class Transformer(nn.Module):
    """Decoder-only transformer over byte tokens with scanned blocks."""

    d_model: int
    layers: int
    heads: int
    vocab: int
    seq_len: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.d_model, name="embed")(tokens)
        pos = self.param(
            "pos_embed", nn.initializers.normal(0.02), (self.seq_len, self.d_model)
        )
        x = x + pos[: tokens.shape[1]]
        blocks = nn.scan(
            Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.layers,
        )
        x, _ = blocks(self.heads, name=SCANNED)(x, None)
        x = nn.RMSNorm(name="ln_f")(x)
        head = nn.Dense(
            self.vocab,
            use_bias=False,
            kernel_init=nn.initializers.normal(0.02),
            name="head",
        )  # small logits at init: loss starts near ln(vocab)
        return head(x)


def build_model(
    d_model: int, layers: int, heads: int, vocab: int = VOCAB, seq_len: int = 128
) -> Transformer:
    """The transformer (a flax linen module); inputs are int token arrays (B, T)."""
    if d_model % heads:
        raise ValueError(f"d_model={d_model} is not a multiple of heads={heads}")
    return Transformer(d_model, layers, heads, vocab, seq_len)


def init_params(model: Transformer, key: jax.Array) -> dict:
    """Freshly initialised parameters of ``model`` (on the default device)."""
    tokens = jnp.zeros((1, model.seq_len), jnp.int32)
    return model.init(key, tokens)["params"]


def _owner(path: tuple) -> str:
    """Name of the module (or parameter) that owns the leaf at ``path``."""
    names = [str(getattr(k, "key", k)) for k in path]
    return names[-2] if len(names) > 1 else names[-1]


def param_specs_for(params: dict) -> dict:
    """A PartitionSpec per parameter (see ``WEIGHT_SPECS``); scanned ones get a
    leading None for the layer axis."""

    def spec(path: tuple, x: jax.Array) -> P:
        base = WEIGHT_SPECS.get(_owner(path), P())
        if getattr(path[0], "key", None) == SCANNED:
            return P(None, *base)
        return base

    return jax.tree_util.tree_map_with_path(spec, params)


def scanned_flags_for(params: dict) -> dict:
    """True for the parameters of the scanned blocks (leading layer axis)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[0], "key", None) == SCANNED, params
    )


def load_text_bytes() -> tuple[np.ndarray, np.ndarray]:
    """The train and validation splits (90% / 10%) of the corpus, as uint8."""
    text = "".join(pydoc_data.topics.topics.values()).encode("utf-8")
    data = np.frombuffer(text, dtype=np.uint8)
    split = int(0.9 * len(data))
    return data[:split], data[split:]


def train_batch(data: np.ndarray, step: int, args: argparse.Namespace) -> np.ndarray:
    """Random windows of ``seq_len + 1`` bytes; a pure function of (seed, step), so
    that a resumed run sees the same batches as an uninterrupted one."""
    rng = np.random.default_rng((args.seed, step))
    starts = rng.integers(0, len(data) - args.seq_len - 1, size=args.batch_size)
    return np.stack([data[s : s + args.seq_len + 1] for s in starts]).astype(np.int32)


def val_batches(data: np.ndarray, args: argparse.Namespace) -> list[np.ndarray]:
    """The validation split as full batches of non-overlapping windows."""
    width = args.seq_len + 1
    windows = data[: len(data) // width * width].reshape(-1, width).astype(np.int32)
    count = len(windows) // args.batch_size
    return [
        windows[i * args.batch_size : (i + 1) * args.batch_size] for i in range(count)
    ]


def _to_host(x: jax.Array) -> np.ndarray:
    """The full value of a (possibly sharded) array on this host."""
    if jax.process_count() > 1:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def latest_checkpoint(directory: str) -> str | None:
    """Path of the newest ``step_*.npz`` in ``directory``, if any."""
    paths = sorted(glob.glob(os.path.join(directory, "step_*.npz")))
    return paths[-1] if paths else None


def save_checkpoint(directory: str, step: int, state: tuple) -> None:
    """Writes every leaf of ``state`` and ``step`` to ``step_{step}.npz`` (atomic:
    written to a temporary file, then renamed) and removes older checkpoints."""
    leaves = [_to_host(x) for x in jax.tree.leaves(state)]
    if jax.process_index() != 0:
        return
    path = os.path.join(directory, f"step_{step:08d}.npz")
    with open(path + ".tmp", "wb") as f:
        np.savez(f, *leaves, step=step)
    os.replace(path + ".tmp", path)
    for old in glob.glob(os.path.join(directory, "step_*.npz")):
        if old != path:
            os.remove(old)


def restore_checkpoint(path: str, fresh: tuple) -> tuple[tuple, int]:
    """``state`` read from ``path``, each leaf placed with the sharding of the
    matching leaf of the freshly initialised ``fresh``, and its step."""
    fresh_leaves, treedef = jax.tree.flatten(fresh)
    with np.load(path) as data:
        if len(data.files) != len(fresh_leaves) + 1:
            raise ValueError(
                f"{path} holds {len(data.files) - 1} arrays, the state has "
                f"{len(fresh_leaves)}: was it written with other model options?"
            )
        leaves = []
        for i, like in enumerate(fresh_leaves):
            value = data[f"arr_{i}"]
            if value.shape != like.shape or value.dtype != like.dtype:
                raise ValueError(
                    f"{path}: array {i} is {value.dtype}{list(value.shape)}, the "
                    f"state expects {like.dtype}{list(like.shape)}"
                )
            leaves.append(jax.device_put(value, like.sharding))
        step = int(data["step"])
    return treedef.unflatten(leaves), step


def per_device_bytes(tree) -> tuple[int, int]:
    """Bytes of ``tree`` held by one device, and its total (global) bytes."""
    leaves = jax.tree.leaves(tree)
    local = sum(x.addressable_shards[0].data.nbytes for x in leaves)
    return local, sum(x.nbytes for x in leaves)


def make_mesh(shape: str | None) -> jax.sharding.Mesh:
    """The ("fsdp", "tp") mesh: ``shape`` like "2,4", or by default "tp" of up to 4
    devices and "fsdp" of the rest."""
    n = jax.device_count()
    if shape is None:
        tp = math.gcd(n, 4)
        dims = (n // tp, tp)
    else:
        dims = tuple(int(s) for s in shape.split(","))
    if len(dims) != 2 or math.prod(dims) != n:
        raise ValueError(f"--mesh {shape} must be two sizes whose product is {n}")
    return jax.make_mesh(
        dims, ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command-line options (see ``--help``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--steps", type=int, default=120, help="total training steps")
    add("--d-model", type=int, default=128)
    add("--layers", type=int, default=4)
    add("--heads", type=int, default=4)
    add("--seq-len", type=int, default=128)
    add("--batch-size", type=int, default=16, help="global batch (split over fsdp)")
    add("--learning-rate", type=float, default=5e-3, help="peak learning rate")
    add("--warmup", type=int, default=20, help="linear warmup steps")
    add("--weight-decay", type=float, default=0.01)
    add("--block-size", type=int, default=128, help="Kron's block size")
    add("--mesh", default=None, help='"fsdp,tp" sizes, e.g. "2,4" (default: auto)')
    add("--devices", type=int, default=8, help="simulated CPU devices without GPUs")
    add("--checkpoint-dir", default=None, help="default: a new temporary directory")
    add("--checkpoint-every", type=int, default=50)
    add("--stop-after", type=int, default=None, help="end after N steps of this run")
    add("--log-every", type=int, default=10)
    add("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Trains, checkpoints, resumes and reports; see the module docstring."""
    args = parse_args(argv)
    # Before the CPU backend starts (it only affects that backend).
    simulate_cpu_devices(args.devices)
    mesh = make_mesh(args.mesh)
    if args.batch_size % mesh.shape["fsdp"]:
        raise ValueError("--batch-size must be a multiple of the fsdp mesh size")
    checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="jax_sharded_lm_")
    os.makedirs(checkpoint_dir, exist_ok=True)
    print(
        f"devices: {jax.device_count()} x {jax.devices()[0].platform}, mesh "
        f"{dict(mesh.shape)}, checkpoints in {checkpoint_dir}"
    )

    train_data, val_data = load_text_bytes()
    model = build_model(args.d_model, args.layers, args.heads, seq_len=args.seq_len)
    params = init_params(model, jax.random.PRNGKey(args.seed))
    param_specs = param_specs_for(params)
    params = jax.device_put(
        params, jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs)
    )
    print(f"parameters: {sum(x.size for x in jax.tree.leaves(params)):,}")

    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        args.learning_rate,
        args.warmup,
        max(args.steps, args.warmup + 1),
        end_value=0.1 * args.learning_rate,
    )
    tx = pj.kron(
        learning_rate=schedule,
        b1=0.9,
        weight_decay=args.weight_decay,
        scanned_layers=scanned_flags_for(params),
        partition_grads_into_blocks=True,
        block_size=args.block_size,
        merge_small_dims=True,
        params_partition_specs=param_specs,
        preconditioner_partition_spec=P(("fsdp", "tp")),
    )
    batch_sharding = NamedSharding(mesh, P("fsdp", None))

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch[:, :-1])
        labels = batch[:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    @partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    with jax.set_mesh(mesh):
        # Jitted, so every state leaf gets its own buffer: eager kron init returns
        # one array for both counters, which the donating step rejects.
        opt_state = tx.init(params)
        local, total = per_device_bytes(opt_state)
        print(
            f"optimizer state: {local / 2**20:.2f} MiB per device, "
            f"{total / 2**20:.2f} MiB in all"
        )
        start = 0
        path = latest_checkpoint(checkpoint_dir)
        if path is not None:
            (params, opt_state), start = restore_checkpoint(path, (params, opt_state))
            print(f"resumed from {path} at step {start}")

        end = max(start, args.steps)
        if args.stop_after is not None:
            end = min(end, start + args.stop_after)
        t_start = time.perf_counter()
        for step in range(start, end):
            batch = jax.device_put(train_batch(train_data, step, args), batch_sharding)
            params, opt_state, loss = train_step(params, opt_state, batch)
            done = step + 1
            if step == start:
                loss.block_until_ready()
                t_first = time.perf_counter()
                print(f"first step (with compilation): {t_first - t_start:.1f} s")
            if done % args.log_every == 0 or step == start or done == end:
                print(f"step {done:5d}  train loss {float(loss):.6f}")
            if done % args.checkpoint_every == 0 or done == end:
                save_checkpoint(checkpoint_dir, done, (params, opt_state))
        if end - start > 1:
            seconds = (time.perf_counter() - t_first) / (end - start - 1)
            print(
                f"time per step: {1000 * seconds:.0f} ms (later steps, with logging "
                "and checkpoints)"
            )

        eval_loss = jax.jit(loss_fn)
        losses = [
            float(eval_loss(params, jax.device_put(b, batch_sharding)))
            for b in val_batches(val_data, args)
        ]
        print(
            f"validation loss at step {end}: {np.mean(losses):.6f} "
            f"({len(losses)} batches)"
        )


if __name__ == "__main__":
    main()
