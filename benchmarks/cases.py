"""The speed harness's table of cases (``benchmarks/speed.py`` runs them).

A case is two optimizers, each stepped on the same model with the same fixed
random gradients: the subject (precond's) and its reference (the original a user
switches from, or AdamW). To add one, append a :class:`Case` to the list its
function returns; ``make`` builds both steppers when the case runs, so a case
whose original is not installed costs nothing until then.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

REPO = pathlib.Path(__file__).resolve().parents[1]
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 1e-4
MODELS = ("digits-mlp", "char-lm")  # the bench's MLP and transformer
SHAMPOO_BLOCK = 128

Stepper = Callable[[int], None]  # run(n): n steps, returns once they are done


class Case(NamedTuple):
    table: str  # the table of BENCHMARKS.md it is a row of (speed.TABLES)
    model: str  # a workload of precond bench: its parameters (JAX) or module
    subject: str  # precond's optimizer, as the table names it
    reference: str  # the original it replaces, or "adamw"
    setting: str  # what differs between rows of one optimizer
    steps: int  # steps per round: enough to hold a round's rare events
    make: Callable[[], tuple[Stepper, Stepper]]  # (subject, reference) steppers


# ------------------------------------------------------------------ steppers


def jax_problem(model: str):
    """The bench workload's parameters and fixed random gradients of their shapes."""
    import jax

    from precond.bench.workloads import get_workload

    params = get_workload(model).init_params(0)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    grads = [
        jax.random.normal(k, x.shape, x.dtype)
        for k, x in zip(keys, leaves, strict=True)
    ]
    return params, treedef.unflatten(grads)


def keyed(tree) -> dict:
    """The leaves as a flat dict: distributed-kron reads a key from every path
    entry, and the char-lm's layers are a list."""
    import jax

    return {f"{i:05d}": x for i, x in enumerate(jax.tree.leaves(tree))}


def jax_stepper(tx, params, grads) -> Stepper:
    """n jitted updates of ``tx`` (state donated and fed back), on JAX's default
    device; the first two (compilation, the first fit) before timing."""
    import jax

    update = jax.jit(tx.update, donate_argnums=1)
    box = [tx.init(params)]

    def run(n: int) -> None:
        state = box[0]
        for _ in range(n):
            updates, state = update(grads, state, params)
        jax.block_until_ready((updates, state))
        box[0] = state

    run(2)
    return run


def jax_steppers(model: str, ours, theirs, keyed_theirs: bool = False):
    """``make`` of a JAX case: ``ours`` and ``theirs`` are optax transformations."""

    def make():
        params, grads = jax_problem(model)
        other = (keyed(params), keyed(grads)) if keyed_theirs else (params, grads)
        return jax_stepper(ours(), params, grads), jax_stepper(theirs(), *other)

    return make


def torch_device() -> str:
    import torch

    return os.environ.get("PRECOND_TORCH_DEVICE") or (
        "cuda" if torch.cuda.is_available() else "cpu"
    )


def torch_stepper(make_optimizer, model: str, train: bool = False) -> Stepper:
    """n ``step()`` calls of ``make_optimizer(module)`` on the bench's torch
    module, the fixed random gradients set before each; with ``train``, each
    step is a whole training step on one fixed batch (forward, backward, step:
    what K-FAC needs, its factors coming from the forward and backward passes)."""
    import torch

    from precond.bench.torch_models import build_model
    from precond.bench.workloads import get_workload

    device = torch_device()
    workload = get_workload(model)
    module = build_model(workload.torch_model, 0).to(device)
    parameters = [p for p in module.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=generator).to(device) for p in parameters]
    optimizer = make_optimizer(module)
    if train:
        split = workload.load_split(0)
        x = torch.as_tensor(split.x_train[:64]).to(device)
        y = torch.as_tensor(split.y_train[:64]).long().to(device)
        x = x.long() if x.dtype == torch.int32 else x

    def step() -> None:
        if train:
            logits = module(x)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
            )
            module.zero_grad(set_to_none=True)
            loss.backward()
        else:
            for p, g in zip(parameters, grads, strict=True):
                p.grad = g
        optimizer.step()

    def run(n: int) -> None:
        for _ in range(n):
            step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    run(2)
    return run


def torch_steppers(model: str, ours, theirs, train: bool = False):
    return lambda: (
        torch_stepper(ours, model, train),
        torch_stepper(theirs, model, train),
    )


# ----------------------------------------------------------------- originals


def _oracles():
    sys.path.insert(0, str(REPO))
    from tests import oracles

    return oracles


def distributed_kron_1():
    return _oracles().distributed_kron()


def distributed_kron_2():
    """distributed-kron 2.0.0's ``kron`` module, from the folder the tests load
    its ``pro`` from (it shares 1.0.0's distribution name), its annotations left
    unevaluated as ``tests/oracles.py`` does for 1.0.0."""
    name = "distributed_kron_2_kron"
    if name not in sys.modules:
        path = os.path.join(_oracles().DISTRIBUTED_KRON_2_DIR, "distributed_kron")
        source = pathlib.Path(path, "kron.py").read_text(encoding="utf-8")
        module = importlib.util.module_from_spec(
            importlib.util.spec_from_loader(name, loader=None)
        )
        sys.modules[name] = module
        code = "from __future__ import annotations\n" + source
        exec(compile(code, os.path.join(path, "kron.py"), "exec"), module.__dict__)
    return sys.modules[name]


def google_shampoo():
    """optax-shampoo 0.0.6 with the parity tests' shims for today's JAX, wherever
    the layout keeps that test (its generator is left suspended: shims applied)."""
    try:
        tests = importlib.import_module("tests.jax.test_parity_shampoo")
    except ImportError:
        (path,) = glob.glob(str(REPO / "tests/**/test_parity_shampoo.py"), recursive=1)
        relative = pathlib.Path(path).relative_to(REPO).with_suffix("")
        tests = importlib.import_module(".".join(relative.parts))
    return next(tests.patched_optax_shampoo())


def heavyball():
    """HeavyBall 3.2.1 as it ships (its steps compiled by ``torch.compile``)."""
    import heavyball

    return heavyball


def available(original: str) -> str | None:
    """None when ``original`` imports here, else why not."""
    finders = {
        "distributed-kron 1.0.0": distributed_kron_1,
        "distributed-kron 2.0.0": distributed_kron_2,
        "kron-torch": lambda: _oracles().kron_torch(),
        "Google's Shampoo": google_shampoo,
        "distributed-kron 2.0.0 pro": lambda: _oracles().distributed_kron_pro(),
        "HeavyBall SOAP": heavyball,
    }
    try:
        finders[original]()
    except BaseException as error:  # pytest's skip is not an Exception
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    return None


# ---------------------------------------------------------------- the table


# Merging and blocking off on both sides: the factors are the same matrices.
SAME_LAYOUT = dict(merge_small_dims=False, partition_grads_into_blocks=False)
KRON_SETTINGS = (("p=1", 1.0, 20), ("p=0.03", 0.03, 200))


def jax_pairs(models=MODELS) -> list[Case]:
    import precond.jax as pj

    cases = []
    for model in models:
        for setting, p, steps in KRON_SETTINGS:
            args = dict(
                learning_rate=LEARNING_RATE,
                weight_decay=WEIGHT_DECAY,
                preconditioner_update_probability=p,
            )
            for version, original in (
                ("1.0.0", distributed_kron_1),
                ("2.0.0", distributed_kron_2),
            ):
                for layout, extra in (("defaults", {}), ("same layout", SAME_LAYOUT)):
                    cases.append(
                        Case(
                            "jax-pairs",
                            model,
                            "kron",
                            f"distributed-kron {version}",
                            f"{setting}, {layout}",
                            steps,
                            jax_steppers(
                                model,
                                lambda a=args | extra: pj.kron(**a),
                                lambda a=args | extra, o=original: o().kron(**a),
                                keyed_theirs=True,
                            ),
                        )
                    )
        args = dict(learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
        cases.append(
            Case(
                "jax-pairs",
                model,
                "pro",
                "distributed-kron 2.0.0 pro",
                "defaults",
                20,
                jax_steppers(
                    model,
                    lambda a=args: pj.pro(**a),
                    lambda a=args: _oracles().distributed_kron_pro().pro(**a),
                    keyed_theirs=True,
                ),
            )
        )
        for every, steps in ((1, 5), (33, 66)):
            args = dict(
                learning_rate=LEARNING_RATE,
                block_size=SHAMPOO_BLOCK,
                preconditioning_compute_steps=every,
                start_preconditioning_step=1,
                # optax-shampoo 0.0.6's default differs from the seed's: set both.
                merge_small_dims_block_size=SHAMPOO_BLOCK,
            )
            cases.append(
                Case(
                    "jax-pairs",
                    model,
                    "distributed_shampoo",
                    "Google's Shampoo",
                    f"roots every {every}",
                    steps,
                    jax_steppers(
                        model,
                        lambda a=args: pj.distributed_shampoo(**a),
                        lambda a=args: google_shampoo().distributed_shampoo(**a),
                    ),
                )
            )
    return cases


def _jax_subjects(model: str) -> list[tuple[str, str, int, Callable[[], Any]]]:
    """(optimizer, setting, steps per round, its transformation) vs AdamW."""
    import precond.jax as pj
    from precond.bench.jax_optimizers import make_shampoo
    from precond.bench.workloads import get_workload

    base = dict(learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    hidden = get_workload(model).hidden_matrices
    subjects = []
    for name in ("kron", "pro"):
        for p, steps in ((1.0, 20), (0.1, 50)):
            subjects.append(
                (
                    name,
                    f"p={p:g}",
                    steps,
                    lambda n=name, p=p: getattr(pj, n)(
                        **base, preconditioner_update_probability=p
                    ),
                )
            )
    subjects.append(
        (
            "pro_adamw",
            "defaults",
            50,
            lambda: pj.pro_adamw(**base, preconditioned=hidden),
        )
    )
    for name in ("xmat", "lra", "affine"):
        subjects.append((name, "p=1", 20, lambda n=name: getattr(pj, n)(**base)))
    for every, steps in ((1, 5), (10, 50)):
        subjects.append(
            (
                "distributed_shampoo",
                f"block {SHAMPOO_BLOCK}, roots every {every}",
                steps,
                lambda e=every: make_shampoo(
                    LEARNING_RATE, WEIGHT_DECAY, preconditioning_compute_steps=e
                ),
            )
        )
    subjects.append(("soap", "the paper's defaults", 50, lambda: pj.soap(**base)))
    return subjects


def jax_versus_adamw(models=MODELS) -> list[Case]:
    import optax

    def adamw():
        return optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)

    return [
        Case(
            "jax-adamw",
            model,
            name,
            "adamw",
            setting,
            steps,
            jax_steppers(model, make, adamw),
        )
        for model in models
        for name, setting, steps, make in _jax_subjects(model)
    ]


def torch_pairs(models=MODELS) -> list[Case]:
    import precond.torch as pt

    cases = []
    for model in models:
        for setting, p, steps in KRON_SETTINGS:
            args = dict(
                lr=LEARNING_RATE,
                weight_decay=WEIGHT_DECAY,
                preconditioner_update_probability=p,
            )
            cases.append(
                Case(
                    "torch-pairs",
                    model,
                    "Kron",
                    "kron-torch",
                    setting,
                    steps,
                    torch_steppers(
                        model,
                        lambda m, a=args: pt.Kron(m.parameters(), **a),
                        lambda m, a=args: (
                            _oracles().kron_torch().Kron(m.parameters(), **a)
                        ),
                    ),
                )
            )
        cases.append(
            Case(
                "torch-pairs",
                model,
                "SOAP",
                "HeavyBall SOAP",
                "the paper's defaults",
                50,
                torch_steppers(
                    model,
                    lambda m: pt.SOAP(m.parameters(), **SOAP_TORCH),
                    lambda m: heavyball().SOAP(m.parameters(), **SOAP_TORCH),
                ),
            )
        )
    return cases


def _torch_subjects(model: str) -> list[tuple[str, str, int, Callable, bool]]:
    """(optimizer, setting, steps per round, module ↦ optimizer, train step)."""
    import precond.torch as pt

    base = dict(lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)

    def pro_adamw(module):
        hidden = {id(p) for p in module.hidden_matrices()}
        groups = [
            {
                "params": [p for p in module.parameters() if (id(p) in hidden) is pro],
                "preconditioned": pro,
            }
            for pro in (True, False)
        ]
        return pt.ProAdamW(groups, **base)

    def kfac_sgd(module):
        import torch

        from precond.torch.kfac import KFAC

        sgd = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        kfac = KFAC(module, damping=0.003, inv_update_steps=10)

        class Step:  # K-FAC's usage: backward, kfac.step(), sgd.step()
            def step(self):
                kfac.step()
                sgd.step()

        return Step()

    subjects = []
    for name, cls in (("Kron", pt.Kron), ("Pro", pt.Pro)):
        for p, steps in ((1.0, 20), (0.1, 50)):
            subjects.append(
                (
                    name,
                    f"p={p:g}",
                    steps,
                    lambda m, c=cls, p=p: c(
                        m.parameters(), **base, preconditioner_update_probability=p
                    ),
                    False,
                )
            )
    subjects.append(("ProAdamW", "defaults", 50, pro_adamw, False))
    subjects.append(
        (
            "Shampoo",
            f"block {SHAMPOO_BLOCK}, roots every 10",
            50,
            lambda m: pt.Shampoo(
                m.parameters(),
                **base,
                block_size=SHAMPOO_BLOCK,
                preconditioning_compute_steps=10,
            ),
            False,
        )
    )
    subjects.append(
        ("SOAP", "the paper's defaults", 50, lambda m: pt.SOAP(m.parameters()), False)
    )
    subjects.append(("KFAC + SGD", "train step, inverses every 10", 20, kfac_sgd, True))
    return subjects


def torch_versus_adamw(models=MODELS) -> list[Case]:
    def adamw(module):
        import torch

        return torch.optim.AdamW(module.parameters(), **ADAMW_TORCH)

    return [
        Case(
            "torch-adamw",
            model,
            name,
            "adamw",
            setting,
            steps,
            torch_steppers(model, make, adamw, train),
        )
        for model in models
        for name, setting, steps, make, train in _torch_subjects(model)
    ]


ADAMW_TORCH = dict(lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
# SOAP against HeavyBall's: the paper's betas, frequency and dims on both sides
# (HeavyBall's own defaults differ), no weight decay (the two decay differently).
SOAP_TORCH = dict(
    lr=LEARNING_RATE,
    betas=(0.95, 0.95),
    weight_decay=0.0,
    precondition_frequency=10,
    max_precond_dim=10000,
)

CASES: dict[str, Callable[..., list[Case]]] = {
    "jax-pairs": jax_pairs,
    "jax-adamw": jax_versus_adamw,
    "torch-pairs": torch_pairs,
    "torch-adamw": torch_versus_adamw,
}
