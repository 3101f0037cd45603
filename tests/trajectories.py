"""Recorded optimizer trajectories: the regression table of issue 20.

Every case builds one optimizer setting, small parameters θ₀ and the gradients of
L_t(θ) = Σ ½ d⊙θ² + n_t⊙θ (so g_t = d⊙θ + n_t: fixed curvature d, fresh noise
n_t each step, all drawn from the seed), takes ``STEPS`` steps and returns the
final parameters θ_T and the last update u_T for each of ``SEEDS``. Torch's K-FAC
cases train a tiny MLP on fixed inputs instead. ``tests/test_trajectories.py``
compares them with the recordings in ``tests/data/trajectories``: bit for bit
where those bits are known to come out, within ``CROSS_MACHINE_RTOL`` elsewhere.

Where bits are known: each recording lists the :func:`fingerprint` of every
process that produced its numbers exactly (the recorder's, and those added by
``--confirm``), and the test compares bit for bit only in a process whose
fingerprint is one of them. A fingerprint names the machine itself (a hash of
its machine id) and everything else the bits were seen to depend on or may
plausibly depend on: the CPU's identity, microcode, full feature-flag list and
caches, the CPUs this process may use, the thread and kernel settings of XLA,
OpenBLAS and torch (environment variables, the BLAS libraries loaded and their
threads), and JAX's live configuration. The CPU's "kind" is not enough: on a
second AMD EPYC of the same family, model and vector extensions as the recorder,
14 cases differed by one float32 ulp. What is known to decide the bits:

* the code XLA and LLVM generate for the CPU and the kernels OpenBLAS and torch
  pick for it: the recordings of an AMD EPYC of family 26, replayed on one of
  family 25, differ in 34 of 66 cases, by at most 3.5e-5 of an array's largest
  entry;
* the process's history: JAX caches compiled programs (its eager operations
  among them) without the ``jax_disable_most_optimizations`` setting they were
  compiled under, so after every case had run once with XLA's optimizations on
  (as tests marked ``optimized_xla`` run), the three LRA cases came out with
  other bits. :func:`run_jax` therefore clears JAX's caches before each case,
  and the fingerprint holds JAX's live configuration.

On the 2-core AMD EPYC these were measured on, the number of usable CPUs (1 or
2), ``PJRT_NPROC`` (5 or 17), ``OPENBLAS_NUM_THREADS=1`` and capping XLA's
vector ISA at AVX2 (``--xla_cpu_max_isa``) changed no bit of any case; they are
in the fingerprint all the same, since with more cores thread counts can
decide how a reduction is split. Why the second EPYC of the recorder's model
differed (in LRA, pro and Shampoo cases) is not known for certain: the process
history above explains the LRA cases, not the others. So the machine id is in
the fingerprint too, which keeps every claim of bits to a machine where they
were seen; an unknown cause can then at worst fail that machine's comparison,
and every other machine is compared within the tolerance.

Record (one file per case, so re-recording a deliberate change is one command),
and confirm (add this process's fingerprint to the recordings it reproduces bit
for bit; the numbers are never rewritten)::

    python -m tests.trajectories --record [CASE ...]
    python -m tests.trajectories --confirm [CASE ...]

The recorder imports ``tests/conftest.py`` first, so it runs under the test
suite's XLA settings (8 simulated CPU devices, optimizations off, elemental
emitter, one torch thread): the numbers depend on them.
"""

import tests.conftest  # noqa: F401  # isort: skip  (XLA/torch settings before jax)

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import platform
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import torch.nn.functional as F

import precond.jax as pj
import precond.torch as pt
from precond.torch.kfac import KFAC

STEPS = 20
SEEDS = (0, 1)
DATA_DIR = pathlib.Path(__file__).parent / "data" / "trajectories"

# Parameter shapes: a matrix, a vector and a 4-D kernel (merging, diagonal and
# triangular factors), and a stack of 3 layers (scanned layers).
MIXED = {"w": (12, 10), "b": (10,), "k": (2, 3, 4, 5)}
SCANNED = {"layers": (3, 6, 5), "b": (5,)}
SCANNED_FLAGS = {"layers": True, "b": False}


@dataclasses.dataclass(frozen=True)
class Case:
    """One optimizer setting: ``run()`` → named float arrays to record (every
    seed's, named ``seed<s>:<kind>:<leaf>``)."""

    name: str
    run: Callable[[], dict[str, np.ndarray]]


# -- the problem ----------------------------------------------------------------


def problem(shapes: dict, seed: int) -> tuple[dict, dict, list[dict]]:
    """θ₀ ~ N(0, 1), curvature d ~ U(0.5, 2) and noises n_t ~ N(0, 1), float32."""
    rng = np.random.default_rng(seed)

    def draw(sample: Callable) -> dict:
        return {k: sample(size=s).astype(np.float32) for k, s in shapes.items()}

    params = draw(rng.standard_normal)
    curvature = draw(functools.partial(rng.uniform, 0.5, 2.0))
    noises = [draw(rng.standard_normal) for _ in range(STEPS)]
    return params, curvature, noises


def loss(params: dict, curvature: dict, noise: dict) -> jax.Array:
    """L(θ) = Σ ½ d⊙θ² + n⊙θ, whose gradient is d⊙θ + n and Hessian diag(d)."""
    terms = jax.tree.map(
        lambda p, d, n: jnp.sum(0.5 * d * p * p + n * p), params, curvature, noise
    )
    return sum(jax.tree.leaves(terms))


def recorded(seed: int, params: dict, update: dict) -> dict[str, np.ndarray]:
    """The arrays kept per seed: final parameters and last update, by name."""
    out = {f"seed{seed}:params:{k}": np.asarray(v) for k, v in params.items()}
    out.update({f"seed{seed}:update:{k}": np.asarray(v) for k, v in update.items()})
    return out


# -- JAX ------------------------------------------------------------------------


def gradient_step(optimizer, params, state, curvature, noise, key):
    """One step on g = ∇L(θ) (``key`` unused: the signature of ``newton_step``)."""
    del key
    grads = jax.grad(loss)(params, curvature, noise)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates


def newton_step(optimizer, params, state, curvature, noise, key):
    """One step that fits the preconditioner to (H·v, v) from ``hessian_helper``."""
    _, grads, hvp, vector, flag = pj.hessian_helper(
        key, loss, params, loss_fn_extra_args=(curvature, noise)
    )
    updates, state = optimizer.update(
        grads, state, params, Hvp=hvp, vector=vector, update_preconditioner=flag
    )
    return optax.apply_updates(params, updates), state, updates


def run_jax(make, shapes, step) -> dict[str, np.ndarray]:
    """STEPS jitted steps of ``make()`` on ``problem(shapes, seed)`` per seed
    (one optimizer and one compilation for all seeds), every program compiled
    afresh (module docstring: a cached one may have other settings)."""
    jax.clear_caches()
    optimizer = make()
    jitted = jax.jit(functools.partial(step, optimizer))
    arrays = {}
    for seed in SEEDS:
        params, curvature, noises = problem(shapes, seed)
        params = jax.tree.map(jnp.asarray, params)
        state = optimizer.init(params)
        key = jax.random.PRNGKey(seed)
        for t, noise in enumerate(noises):
            step_key = jax.random.fold_in(key, t)
            params, state, updates = jitted(params, state, curvature, noise, step_key)
        arrays.update(recorded(seed, params, updates))
    return arrays


def jax_case(name, make, shapes=MIXED, step=gradient_step) -> Case:
    """A JAX case: ``make()`` builds the optax transformation."""
    return Case(name, functools.partial(run_jax, make, shapes, step))


def kron(**kwargs) -> Callable:
    """Builds ``pj.kron`` with learning rate 0.01 and ``kwargs`` (which may set
    another)."""
    return functools.partial(pj.kron, **({"learning_rate": 0.01} | kwargs))


def pro(**kwargs) -> Callable:
    """Builds ``pj.pro`` with learning rate 0.01 and ``kwargs`` (which may set
    another)."""
    return functools.partial(pj.pro, **({"learning_rate": 0.01} | kwargs))


def psgd(alias, **kwargs) -> Callable:
    """Builds psgd-jax's ``alias`` (xmat, lra, affine) with learning rate 0.01."""
    return functools.partial(alias, learning_rate=0.01, seed=3, **kwargs)


def soap(**kwargs) -> Callable:
    """Builds ``pj.soap`` with learning rate 0.01 and ``kwargs``."""
    return functools.partial(pj.soap, **({"learning_rate": 0.01} | kwargs))


def shampoo(**kwargs) -> Callable:
    """Builds ``pj.distributed_shampoo`` (learning rate 0.01, blocks of 8)."""
    options = dict(learning_rate=0.01, block_size=8, start_preconditioning_step=2)
    return functools.partial(pj.distributed_shampoo, **(options | kwargs))


JAX_CASES = [
    # Kron: update styles, caches, layouts, factor structure, schedules, options.
    jax_case("kron_eq", kron()),
    jax_case("kron_quad", kron(preconditioner_update_style="QUAD")),
    jax_case("kron_pro", kron(preconditioner_update_style="PRO")),
    jax_case("kron_qeq", kron(preconditioner_update_style="QEQ")),
    jax_case("kron_cache_dense", kron(preconditioner_cache="dense")),
    jax_case("kron_cache_none", kron(preconditioner_cache=None)),
    jax_case("kron_no_merge", kron(merge_small_dims=False)),
    jax_case("kron_merge_dk", kron(merge_rule="distributed_kron")),
    jax_case("kron_blocks", kron(block_size=4)),
    jax_case(
        "kron_blocks_quad", kron(block_size=4, preconditioner_update_style="QUAD")
    ),
    jax_case("kron_blocks_dk", kron(block_size=4, block_padding="distributed_kron")),
    jax_case("kron_scanned", kron(scanned_layers=SCANNED_FLAGS), SCANNED),
    jax_case(
        "kron_scanned_independent",
        kron(scanned_layers=SCANNED_FLAGS, independent_scanned_layers=True),
        SCANNED,
    ),
    jax_case(
        "kron_scanned_lax_map",
        kron(
            scanned_layers=SCANNED_FLAGS,
            lax_map_scanned_layers=True,
            lax_map_batch_size=2,
        ),
        SCANNED,
    ),
    jax_case("kron_diagonal_large_axes", kron(max_size_triangular=8)),
    jax_case("kron_one_diag", kron(memory_save_mode="one_diag")),
    jax_case("kron_all_diag", kron(memory_save_mode="all_diag")),
    jax_case("kron_prob_03", kron(preconditioner_update_probability=0.3)),
    jax_case(
        "kron_quad_prob_03",
        kron(preconditioner_update_probability=0.3, preconditioner_update_style="QUAD"),
    ),
    jax_case("kron_grad_into_precond", kron(momentum_into_precond_update=False)),
    jax_case("kron_b1_0", kron(b1=0.0)),
    jax_case(
        "kron_weight_decay",
        kron(weight_decay=0.1, weight_decay_mask={"w": True, "b": False, "k": True}),
    ),
    jax_case("kron_noise_dk", kron(noise_draws="distributed_kron", seed=7)),
    jax_case("kron_bf16", kron(precond_dtype=jnp.bfloat16, mu_dtype=jnp.bfloat16)),
    jax_case("kron_newton", kron(), step=newton_step),
    # pro: draws, styles, blocks, schedules, scanned layers, dtypes, options.
    jax_case("pro_default", pro()),
    jax_case("pro_compact", pro(draws="compact")),
    jax_case("pro_quad", pro(preconditioner_update_style="QUAD")),
    jax_case("pro_qeq", pro(preconditioner_update_style="QEQ")),
    jax_case("pro_blocks", pro(block_size=4)),
    jax_case("pro_prob_03", pro(preconditioner_update_probability=0.3)),
    jax_case("pro_scanned", pro(scanned_layers=SCANNED_FLAGS), SCANNED),
    jax_case("pro_small_dense", pro(max_size_dense=8)),
    jax_case("pro_options", pro(lr_style=None, normalize_grads=True)),
    jax_case("pro_bf16", pro(dtype=jnp.bfloat16)),
    # psgd-jax's XMat, LRA and Affine: gradient and Newton (Hessian-vector) modes.
    jax_case("xmat", psgd(pj.xmat)),
    jax_case("xmat_newton", psgd(pj.xmat), step=newton_step),
    jax_case(
        "xmat_options",
        psgd(
            pj.xmat,
            preconditioner_update_probability=0.5,
            nesterov=True,
            weight_decay=0.01,
            update_global_norm_clip=1.0,
            step_normalizer_order="1st",
        ),
    ),
    jax_case("lra", psgd(pj.lra)),
    jax_case("lra_newton", psgd(pj.lra, uvd_rank_of_approximation=4), step=newton_step),
    jax_case(
        "lra_options",
        psgd(pj.lra, balance_method="norm", preconditioner_update_probability=0.5),
    ),
    jax_case("affine", psgd(pj.affine)),
    jax_case("affine_newton", psgd(pj.affine), step=newton_step),
    jax_case(
        "affine_diagonal",
        psgd(pj.affine, max_size_triangular=8, max_skew_triangular=1),
    ),
    jax_case("affine_permuted", psgd(pj.affine, permute_axes=True)),
    # Distributed Shampoo: grafting, blocks, schedules, quantized state, options.
    jax_case("shampoo", shampoo()),
    jax_case("shampoo_adagrad", shampoo(graft_type=pj.GraftingType.ADAGRAD)),
    jax_case(
        "shampoo_rmsprop_normalized",
        shampoo(graft_type=pj.GraftingType.RMSPROP_NORMALIZED),
    ),
    jax_case("shampoo_blocks_4", shampoo(block_size=4)),
    jax_case(
        "shampoo_compute_steps",
        shampoo(preconditioning_compute_steps=3, statistics_compute_steps=2),
    ),
    jax_case("shampoo_quantized", shampoo(quantize_statistics=True)),
    jax_case("shampoo_eigh", shampoo(eigh=True)),
    jax_case(
        "shampoo_options",
        shampoo(
            nesterov=False,
            moving_average_for_momentum=True,
            weight_decay=0.01,
            decoupled_weight_decay=True,
            clip_by_scaled_gradient_norm=1.0,
            merge_small_dims_block_size=16,
        ),
    ),
    jax_case(
        "shampoo_memory_mode",
        shampoo(best_effort_memory_usage_reduction=True, exponent_override=2),
    ),
    # SOAP: both sides, one side (12 > max_precond_dim), eigh refreshes with
    # merged dimensions and 1-D statistics.
    jax_case("soap", soap()),
    jax_case("soap_one_sided", soap(max_precond_dim=11, shampoo_beta=0.9)),
    jax_case(
        "soap_eigh_merged",
        soap(refresh="eigh", merge_dims=True, precondition_1d=True, correct_bias=False),
    ),
    # pro on the matrices and AdamW on the vector, in one call.
    jax_case("pro_adamw", functools.partial(pj.pro_adamw, learning_rate=0.01)),
]


# -- torch ----------------------------------------------------------------------


@contextlib.contextmanager
def one_torch_thread():
    """Runs torch on one intra-op thread (its reductions' order depends on it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def as_torch(arrays: dict) -> dict[str, torch.Tensor]:
    """NumPy arrays → torch tensors, by name."""
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def torch_trajectory(make, seed: int) -> dict[str, np.ndarray]:
    """STEPS steps of ``make(params)`` on g_t = d⊙θ + n_t from ``problem``."""
    params, curvature, noises = problem(MIXED, seed)
    params = {k: torch.nn.Parameter(v) for k, v in as_torch(params).items()}
    curvature = as_torch(curvature)
    optimizer = make(list(params.values()))
    for noise in map(as_torch, noises):
        before = {k: p.detach().clone() for k, p in params.items()}
        for k, p in params.items():
            p.grad = curvature[k] * p.detach() + noise[k]
        optimizer.step()
    update = {k: p.detach() - before[k] for k, p in params.items()}
    return recorded(seed, {k: p.detach() for k, p in params.items()}, update)


def mlp_trajectory(options: dict, seed: int) -> dict[str, np.ndarray]:
    """STEPS steps of K-FAC (``options``) + SGD(0.1) on a 4-6-3 tanh MLP fitting
    fixed random (x_t, y_t) batches of 8 with the mean squared error."""
    rng = np.random.default_rng(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(p.shape).astype(np.float32)))
    preconditioner = KFAC(model, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        x, y = (rng.standard_normal((8, n)).astype(np.float32) for n in (4, 3))
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        optimizer.zero_grad()
        F.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        preconditioner.step()
        optimizer.step()
    params = {k: p.detach() for k, p in model.named_parameters()}
    return recorded(seed, params, {k: p - before[k] for k, p in params.items()})


def run_torch(trajectory, setting) -> dict[str, np.ndarray]:
    """``trajectory(setting, seed)`` for every seed, on one torch thread."""
    arrays = {}
    with one_torch_thread():
        for seed in SEEDS:
            arrays.update(trajectory(setting, seed))
    return arrays


def torch_case(name, make) -> Case:
    """A torch case: ``make(params)`` builds the torch.optim optimizer."""
    return Case(name, functools.partial(run_torch, torch_trajectory, make))


def kfac_case(name, **options) -> Case:
    """A K-FAC case: ``options`` of ``KFAC`` (SGD applies the step)."""
    return Case(name, functools.partial(run_torch, mlp_trajectory, options))


def torch_kron(**kwargs) -> Callable:
    """Builds ``pt.Kron`` with learning rate 0.01 and ``kwargs`` (which may set
    another)."""
    return lambda params: pt.Kron(params, **({"lr": 0.01} | kwargs))


def torch_pro(**kwargs) -> Callable:
    """Builds ``pt.Pro`` with learning rate 0.01 and ``kwargs``."""
    return lambda params: pt.Pro(params, lr=0.01, **kwargs)


def torch_shampoo(**kwargs) -> Callable:
    """Builds ``pt.Shampoo`` as :func:`shampoo` builds JAX's (learning rate 0.01,
    blocks of 8, roots from step 2) with ``kwargs``."""
    options = dict(lr=0.01, block_size=8, start_preconditioning_step=2)
    return lambda params: pt.Shampoo(params, **(options | kwargs))


TORCH_CASES = [
    torch_case("torch_kron_eq", torch_kron()),
    torch_case("torch_kron_quad", torch_kron(preconditioner_update_style="QUAD")),
    torch_case("torch_kron_pro", torch_kron(preconditioner_update_style="PRO")),
    torch_case("torch_kron_qeq", torch_kron(preconditioner_update_style="QEQ")),
    torch_case("torch_kron_prob_03", torch_kron(preconditioner_update_probability=0.3)),
    torch_case(
        "torch_kron_options",
        torch_kron(
            merge_small_dims=True,
            memory_save_mode="one_diag",
            weight_decay=0.01,
            preconditioner_cache="packed",
            update_clipping="rms",
            damping=True,
        ),
    ),
    torch_case("torch_pro", torch_pro()),
    torch_case("torch_pro_prob_03", torch_pro(preconditioner_update_probability=0.3)),
    torch_case("torch_pro_blocks", torch_pro(block_size=4, max_size_dense=8)),
    torch_case("torch_pro_qeq", torch_pro(preconditioner_update_style="QEQ")),
    torch_case("torch_pro_adamw", lambda params: pt.ProAdamW(params, lr=0.01)),
    torch_case("torch_soap", lambda params: pt.SOAP(params, lr=0.01)),
    torch_case(
        "torch_soap_one_sided",
        lambda params: pt.SOAP(params, lr=0.01, max_precond_dim=11, refresh="eigh"),
    ),
    torch_case("torch_shampoo", torch_shampoo()),
    torch_case(
        "torch_shampoo_adagrad", torch_shampoo(graft_type=pt.GraftingType.ADAGRAD)
    ),
    kfac_case("torch_kfac_eigen"),
    kfac_case(
        "torch_kfac_inverse",
        compute_method="inverse",
        factor_update_steps=2,
        inv_update_steps=4,
        damping=0.01,
        kl_clip=None,
    ),
]


def all_cases() -> dict[str, Case]:
    """The table: case name → case."""
    cases = JAX_CASES + TORCH_CASES
    table = {case.name: case for case in cases}
    assert len(table) == len(cases), "duplicate case names"
    return table


CASES = all_cases()


# -- recording ------------------------------------------------------------------


def recording_path(name: str) -> pathlib.Path:
    """Where case ``name``'s recording lives."""
    return DATA_DIR / f"{name}.npz"


def environment() -> str:
    """What the numbers depend on besides the code: versions and XLA settings."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return " ".join(
        [
            f"jax={jax.__version__}",
            f"jaxlib={jax.lib.__version__}",
            f"torch={torch.__version__}",
            f"numpy={np.__version__}",
            f"devices={jax.device_count()}",
            "JAX_DISABLE_MOST_OPTIMIZATIONS="
            + os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS", ""),
            *sorted(f for f in flags if "fusion_emitters" in f),
        ]
    )


# Where the bits are not known (another machine, other settings), each entry
# may differ from the recording by this fraction of its array's largest entry.
# Measured: recordings of an AMD EPYC of family 26 replayed on one of family 25,
# 34 of 66 cases differed, by at most 3.5e-5 of the largest entry
# (shampoo_quantized); of an Intel Xeon on an AMD EPYC, 17 of 63, at most
# 1.8e-5. 2e-4 is 5.8 times the largest difference seen and still fails a change
# of the math itself, by 48-120x for a 1% larger learning rate, b1 = 0.91
# instead of 0.9 or Shampoo's beta2 = 0.989 instead of 0.999, and 1.8x for a
# preconditioner step of 0.1001 instead of 0.1 (tests/test_trajectories.py,
# test_cross_machine_comparison_fails_a_changed_hyperparameter).
CROSS_MACHINE_RTOL = 2e-4

# Environment variables that choose thread counts or kernels of XLA, OpenBLAS,
# MKL or torch.
_SETTINGS_VARIABLES = (
    "PJRT_NPROC",
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "OPENBLAS_CORETYPE",
    "GOTO_NUM_THREADS",
    "MKL_NUM_THREADS",
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
    "ATEN_CPU_CAPABILITY",
)
# The /proc/cpuinfo fields that identify the CPU and its microcode.
_CPU_FIELDS = ("vendor_id", "cpu family", "model", "stepping", "microcode")
_CPU_FIELDS += ("model name",)
_CACHES = pathlib.Path("/sys/devices/system/cpu/cpu0/cache")
# threadpoolctl's description of a BLAS library.
_BLAS_KEYS = ("prefix", "version", "architecture", "threading_layer", "num_threads")
# JAX's configuration read when a program is traced or compiled.
_JAX_OPTIONS = (
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_disable_most_optimizations",
    "jax_threefry_partitionable",
    "jax_default_prng_impl",
)


def _machine_id() -> str:
    """A salted hash of the OS's machine id (the id itself is not recorded), or
    "none" where there is none."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        with contextlib.suppress(OSError):
            text = pathlib.Path(path).read_text().strip()
            if text:
                salted = f"precond tests/trajectories {text}".encode()
                return hashlib.sha256(salted).hexdigest()[:16]
    return "none"


def _cpu() -> dict[str, str]:
    """The first CPU's identity, microcode and sorted feature flags (Linux), and
    its caches' levels, types and sizes."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"cpu": platform.processor() or platform.machine() or "unknown"}
    first = text.split("\n\n")[0]
    fields = {}
    for line in first.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = " ".join(value.split())
    cpu = {f"cpu {key}": fields.get(key, "") for key in _CPU_FIELDS}
    cpu["cpu flags"] = " ".join(sorted(fields.get("flags", "").split()))
    caches = []
    for index in sorted(_CACHES.glob("index*")):
        with contextlib.suppress(OSError):
            fields = ((index / f).read_text() for f in ("level", "type", "size"))
            caches.append("/".join(f.strip() for f in fields))
    cpu["cpu caches"] = " ".join(caches)
    return cpu


def _blas() -> str:
    """The BLAS libraries loaded (numpy's, and scipy's, which jaxlib's LAPACK
    kernels call): version, the kernels chosen for this CPU and threads."""
    import scipy.linalg  # noqa: F401  (loads scipy's BLAS, as jaxlib does)

    try:
        import threadpoolctl
    except ImportError:
        return "threadpoolctl not installed"
    libraries = [
        ":".join(str(info.get(key)) for key in _BLAS_KEYS)
        for info in threadpoolctl.threadpool_info()
        if info.get("user_api") == "blas"
    ]
    return " ".join(sorted(libraries))


def _jax_option(name: str) -> str:
    """The live value of JAX's option ``name`` (an attribute of ``jax.config``
    for options with a context manager, a flag to ``read`` for the others)."""
    try:
        return str(getattr(jax.config, name))
    except AttributeError:
        return str(jax.config.read(name))


def fingerprint() -> dict[str, str]:
    """What this process's numbers may depend on besides the code and
    :func:`environment` (module docstring); equal fingerprints are required for
    a bit-for-bit comparison. Every value is a string."""
    import scipy

    flags = " ".join(sorted(os.environ.get("XLA_FLAGS", "").split()))
    return {
        "machine id": _machine_id(),
        **_cpu(),
        "cpus": str(os.cpu_count()),
        "usable cpus": str(len(os.sched_getaffinity(0)))
        if hasattr(os, "sched_getaffinity")
        else "unknown",
        "XLA_FLAGS": flags,
        **{name: os.environ.get(name, "") for name in _SETTINGS_VARIABLES},
        **{name: _jax_option(name) for name in _JAX_OPTIONS},
        "scipy": scipy.__version__,
        "blas": _blas(),
        "torch cpu capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
    }


def fingerprint_differences(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """The names of the fields in which fingerprints ``a`` and ``b`` differ."""
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def save_recording(name: str, arrays: dict, fingerprints: list[dict]) -> None:
    """Writes case ``name``'s ``arrays`` with this process's environment and the
    ``fingerprints`` of the processes known to produce them bit for bit."""
    np.savez_compressed(
        recording_path(name),
        environment=np.array(environment()),
        fingerprints=np.array(json.dumps(fingerprints, sort_keys=True)),
        **arrays,
    )


def load_recording(name: str) -> tuple[str, list[dict], dict[str, np.ndarray]]:
    """(environment, fingerprints, arrays) of case ``name``'s recording."""
    with np.load(recording_path(name)) as data:
        arrays = {key: data[key] for key in data.files}
    environment_ = str(arrays.pop("environment"))
    fingerprints = json.loads(str(arrays.pop("fingerprints")))
    return environment_, fingerprints, arrays


def _check_names(names: list[str]) -> list[str]:
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown cases: {unknown}; known: {sorted(CASES)}")
    return names or list(CASES)


def record(names: list[str]) -> None:
    """Writes the recordings of ``names`` (all cases when empty), known bit for
    bit under this process's fingerprint only."""
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    for name in _check_names(names):
        save_recording(name, CASES[name].run(), [fingerprint()])
        print(f"recorded {recording_path(name)}")


def confirm(names: list[str]) -> None:
    """Adds this process's fingerprint to each recording of ``names`` (all when
    empty) that this process reproduces bit for bit, under the recording's
    environment; leaves the others (and every number) as they are."""
    here = fingerprint()
    for name in _check_names(names):
        environment_, fingerprints, expected = load_recording(name)
        if environment_ != environment():
            print(f"{name}: not confirmed, recorded under {environment_}")
            continue
        actual = CASES[name].run()
        differing = sorted(
            key
            for key, value in expected.items()
            if key not in actual
            or actual[key].dtype != value.dtype
            or actual[key].shape != value.shape
            or not np.array_equal(actual[key], value, equal_nan=True)
        )
        if differing or sorted(actual) != sorted(expected):
            print(f"{name}: not confirmed, differs in {differing or 'its keys'}")
        elif here in fingerprints:
            print(f"{name}: already confirmed here")
        else:
            save_recording(name, expected, [*fingerprints, here])
            print(f"{name}: confirmed bit for bit here")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--record", action="store_true", help="write recordings")
    action.add_argument(
        "--confirm",
        action="store_true",
        help="add this machine's fingerprint to the recordings it reproduces "
        "bit for bit",
    )
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    args = parser.parse_args()
    (record if args.record else confirm)(args.cases)


if __name__ == "__main__":
    main()
