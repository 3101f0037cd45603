"""precond.torch.ProAdamW against precond.jax.pro_adamw, and as a torch optimizer.

(1) Steps equal ``precond.jax.pro_adamw``'s, parameter by parameter, when both
    start from the same parameters, see the same gradients and make the same
    draws (each framework's draw function returns fixed arrays, a function of
    the requested shape, as tests/torch/kron/test_pro.py does for Pro). Float32, the
    only precision both take: 1e-5 relative on each step's change.
(2) Named parameters take the JAX rule (the same split of the same names);
    unnamed ones: every parameter of at least 2 dimensions; a group's
    ``preconditioned`` overrides both.
(3) A state dict loaded into a fresh optimizer continues bit for bit; an LR
    scheduler drives both parts; an unusable gradient skips both parts.
(4) Bad arguments raise the standard message.
(Copies, tensor lr, schedulers, hooks, param groups: the rows of
tests/torch/test_optimizer_conventions.py; hostile gradients:
tests/torch/test_robustness.py.)
"""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import precond.jax as pj
import precond.torch.kron.pro as pro_module
from precond._common.pro_adamw_recipe import PRO_LR_MULTIPLIER
from precond.jax._core import normal_draws
from precond.torch import ProAdamW

LR = 3e-3
# The rate of the JAX == torch comparison: steps of ~3% of the parameters, so
# that the parameters' float32 rounding is small beside each step's change.
MATCH_LR = 0.03


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _fixed_normal(shape) -> np.ndarray:
    shape = tuple(int(d) for d in shape)
    rng = np.random.default_rng([len(shape), *shape])
    return rng.standard_normal(shape).astype(np.float32)


class Model(torch.nn.Module):
    """An embedding, two hidden matrices (one with a bias), a norm and a head."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(16, 8)
        self.mlp_in = torch.nn.Linear(8, 12)
        self.mlp_out = torch.nn.Linear(12, 8, bias=False)
        self.norm = torch.nn.LayerNorm(8, bias=False)
        self.head = torch.nn.Linear(8, 16, bias=False)


HIDDEN = {"mlp_in.weight", "mlp_out.weight"}


def _initial_and_gradients(steps):
    """The model's parameters (name ↦ float32 array) and ``steps`` gradients."""
    rng = np.random.default_rng(0)
    shapes = {n: tuple(p.shape) for n, p in Model().named_parameters()}
    params = {
        n: np.asarray(0.3 * rng.standard_normal(s), np.float32)
        for n, s in shapes.items()
    }
    grads = [
        {n: np.asarray(rng.standard_normal(s), np.float32) for n, s in shapes.items()}
        for _ in range(steps)
    ]
    return params, grads


def _nested(flat: dict) -> dict:
    """{'mlp_in.weight': x} ↦ {'mlp_in': {'weight': x}}: the JAX model's tree,
    whose paths carry the torch names."""
    tree: dict = {}
    for name, value in flat.items():
        module, leaf = name.split(".")
        tree.setdefault(module, {})[leaf] = jnp.asarray(value)
    return tree


def _torch_model(params) -> Model:
    model = Model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(params[name]))
    return model


# (id, keyword arguments of both, steps): the defaults (the 'QEQ' fit at
# every step of the schedule's flat start); and 'PRO' fits at random steps,
# small blocks, a stronger decay and another multiplier.
CASES = [
    ("defaults", {}, 5),
    (
        "sometimes-fit",
        dict(
            preconditioner_update_style="PRO",
            preconditioner_update_probability=0.5,
            block_size=4,
            weight_decay=0.1,
            pro_lr_multiplier=2.0,
            b1=0.9,
        ),
        5,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_steps_equal_precond_jax_pro_adamw_with_the_same_draws(case, monkeypatch):
    _, kwargs, steps = case
    params, grads = _initial_and_gradients(steps)

    def jax_normal(key, shape=(), dtype=jnp.float32, **_):
        return jnp.asarray(_fixed_normal(shape), dtype)

    def torch_normal(generator, shape, dtype, device):
        W = torch.from_numpy(_fixed_normal(shape[1:])).to(dtype=dtype, device=device)
        return W.expand(shape)

    optimizer = pj.pro_adamw(MATCH_LR, draws="compact", **kwargs)
    jax_params = _nested(params)
    with monkeypatch.context() as patch:
        patch.setattr(normal_draws, "standard_normal", jax_normal)
        state = optimizer.init(jax_params)
        update = jax.jit(optimizer.update)
        jax_steps = []
        for g in grads:
            u, state = update(_nested(g), state, jax_params)
            jax_params = optax.apply_updates(jax_params, u)
            jax_steps.append(u)

    monkeypatch.setattr(pro_module, "draw_normal", torch_normal)
    model = _torch_model(params)
    opt = ProAdamW(model.named_parameters(), lr=MATCH_LR, **kwargs)
    for t, g in enumerate(grads):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad = torch.from_numpy(g[n])
        opt.step()
        for n, p in model.named_parameters():
            delta = (p.detach() - before[n]).numpy()
            module, leaf = n.split(".")
            want = jax_steps[t][module][leaf]
            # 2e-5 of the change, plus the rounding of the float32 parameters
            # it is read back from (measured: at most 0.8 times 1e-5 of it plus
            # that rounding). A change of 1e-4 relative in pro_lr_multiplier,
            # b1 or β₂ gives 4 to 120 times 1e-5 of it plus that rounding.
            error = np.linalg.norm(delta - np.asarray(want))
            ulps = np.finfo(np.float32).eps * np.linalg.norm(before[n].numpy())
            assert error <= 2e-5 * np.linalg.norm(want) + 2 * ulps, (t, n)


# ------------------------------------------------------------------ (2) the split


def _pro_parameters(optimizer) -> set[int]:
    """The parameters that hold pro's state (factors) after a step."""
    return {id(p) for p, entry in optimizer.state.items() if "factors" in entry}


def _step_once(model, optimizer):
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()


def test_named_parameters_get_the_jax_rule():
    params, _ = _initial_and_gradients(0)
    model = _torch_model(params)
    optimizer = ProAdamW(model.named_parameters(), lr=LR)
    _step_once(model, optimizer)
    named = dict(model.named_parameters())
    assert _pro_parameters(optimizer) == {id(named[n]) for n in HIDDEN}
    jax_rule = pj.pro_adamw_hidden_matrices(_nested(params))
    assert {
        f"{module}.{leaf}"
        for module, leaves in jax_rule.items()
        for leaf, hidden in leaves.items()
        if hidden
    } == HIDDEN
    # Every parameter has a state: pro's or AdamW's.
    assert len(optimizer.state) == len(named)
    for name, p in named.items():
        assert ("exp_avg" in optimizer.state[p]) is (name not in HIDDEN), name


def test_named_parameters_of_the_bench_s_char_lm_get_its_split():
    """The rule on the names of the bench's torch transformer picks the
    matrices of its hand-written split (``hidden_matrices()``, Muon's)."""
    from precond.bench.torch_models import CharLM

    model = CharLM()
    optimizer = ProAdamW(model.named_parameters(), lr=LR)
    _step_once(model, optimizer)
    assert _pro_parameters(optimizer) == {id(p) for p in model.hidden_matrices()}


def test_unnamed_parameters_and_group_overrides():
    """Without names every ≥2-D parameter is pro's (the embedding and the head
    too); a group with ``preconditioned=False`` gives them to AdamW, one with
    True gives pro even a vector."""
    params, _ = _initial_and_gradients(0)
    model = _torch_model(params)
    optimizer = ProAdamW(model.parameters(), lr=LR)
    _step_once(model, optimizer)
    assert _pro_parameters(optimizer) == {
        id(p) for p in model.parameters() if p.ndim >= 2
    }
    model = _torch_model(params)
    optimizer = ProAdamW(
        [
            {"params": [model.embedding.weight, model.head.weight]},
            {"params": [model.mlp_in.weight, model.mlp_out.weight]},
            {"params": [model.mlp_in.bias], "preconditioned": True},
            {"params": [model.norm.weight]},
        ],
        lr=LR,
        preconditioned=False,
    )
    optimizer.param_groups[1]["preconditioned"] = None  # the rule: ≥2-D, unnamed
    _step_once(model, optimizer)
    assert _pro_parameters(optimizer) == {
        id(model.mlp_in.weight),
        id(model.mlp_out.weight),
        id(model.mlp_in.bias),
    }


# ------------------------------------------------------------------ (3) a run


def _run(model, optimizer, grads, scheduler=None):
    for g in grads:
        for n, p in model.named_parameters():
            p.grad = torch.from_numpy(g[n]).clone()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def test_a_state_dict_loaded_into_a_fresh_optimizer_continues_bit_identically():
    """Through torch.save and torch.load, at a step between fits (probability
    0.5): the fresh optimizer and model end where the uninterrupted run ends."""
    params, grads = _initial_and_gradients(8)
    kwargs = dict(lr=LR, preconditioner_update_probability=0.5, weight_decay=0.1)
    model = _torch_model(params)
    optimizer = ProAdamW(model.named_parameters(), **kwargs)
    _run(model, optimizer, grads[:3])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": optimizer.state_dict()}, buffer)
    _run(model, optimizer, grads[3:])
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    fresh_model = _torch_model(params)
    fresh_model.load_state_dict(saved["model"])
    fresh = ProAdamW(fresh_model.named_parameters(), **kwargs)
    fresh.load_state_dict(saved["opt"])
    assert fresh.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    _run(fresh_model, fresh, grads[3:])
    for (name, a), b in zip(
        model.named_parameters(), fresh_model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_an_lr_scheduler_drives_both_parts():
    """LambdaLR halving the rate each step is pro_adamw with the same
    schedule: both parts follow it (pro at pro_lr_multiplier times it)."""
    params, grads = _initial_and_gradients(3)
    model = _torch_model(params)
    optimizer = ProAdamW(model.named_parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 0.5**n)
    _run(model, optimizer, grads, scheduler)
    jax_optimizer = pj.pro_adamw(lambda n: LR * 0.5**n)
    jax_params = _nested(params)
    state = jax_optimizer.init(jax_params)
    for g in grads:
        u, state = jax_optimizer.update(_nested(g), state, jax_params)
        jax_params = optax.apply_updates(jax_params, u)
    # Different draws (each framework's own): compare what the draws do not
    # reach, AdamW's part, exactly up to rounding, and pro's by its scale.
    for name, p in model.named_parameters():
        module, leaf = name.split(".")
        want = np.asarray(jax_params[module][leaf])
        change, jax_change = p.detach().numpy() - params[name], want - params[name]
        if name in HIDDEN:
            ratio = np.linalg.norm(change) / np.linalg.norm(jax_change)
            assert 0.5 < ratio < 2.0, name
        else:
            assert _relative(change, jax_change) <= 1e-5, name


def test_an_unusable_gradient_in_either_part_skips_both():
    """NaN in a hidden matrix's gradient or +Inf in the norm's: no state
    changes and each parameter moves by its part's decay alone (θ(1 − c·lr·λ),
    c = 4 on pro's); the skip is counted."""
    params, grads = _initial_and_gradients(2)
    for bad in ("mlp_out.weight", "norm.weight"):
        model = _torch_model(params)
        optimizer = ProAdamW(model.named_parameters(), lr=LR, weight_decay=0.1)
        _run(model, optimizer, grads[:1])
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        state = {
            n: {k: v.clone() if torch.is_tensor(v) else v for k, v in e.items()}
            for n, e in zip(before, optimizer.state.values(), strict=True)
        }
        g = {n: x.copy() for n, x in grads[1].items()}
        g[bad].flat[0] = np.nan if bad == "mlp_out.weight" else np.inf
        _run(model, optimizer, [g])
        assert optimizer.skipped_steps == 1
        for n, p in model.named_parameters():
            c = PRO_LR_MULTIPLIER if n in HIDDEN else 1.0
            torch.testing.assert_close(p.detach(), before[n] * (1 - c * LR * 0.1))
        for n, entry in zip(before, optimizer.state.values(), strict=True):
            assert entry.keys() == state[n].keys()
            assert entry["step"] == state[n]["step"], n


# ------------------------------------------------------------------ (4) arguments

BAD_ARGUMENTS = [
    ("lr", -1.0, ValueError, ">= 0.0"),
    ("b1", 1.0, ValueError, "in [0.0, 1.0)"),
    ("adam_betas", (0.9,), TypeError, "a pair"),
    ("adam_betas", (0.9, 1.0), ValueError, "Invalid adam_betas[1]=1.0"),
    ("adam_eps", -1.0, ValueError, ">= 0.0"),
    ("weight_decay", -0.1, ValueError, ">= 0.0"),
    ("pro_lr_multiplier", 0.0, ValueError, "> 0.0"),
    ("preconditioned", "yes", TypeError, "True or False"),
    ("preconditioner_update_style", "EQ", ValueError, "one of 'PRO', 'QUAD', 'QEQ'"),
    ("preconditioner_update_probability", 0.0, ValueError, "in (0.0, 1.0]"),
    ("preconditioner_lr", -1.0, ValueError, ">= 0.0"),
    ("preconditioner_init_scale", 0.0, ValueError, "> 0.0"),
    ("normalize_grads", "no", TypeError, "True or False"),
    ("max_size_dense", -1, ValueError, ">= 0"),
    ("block_size", 0, ValueError, ">= 1"),
    ("noise_scale", -1e-9, ValueError, ">= 0.0"),
    ("dtype", torch.float64, ValueError, "torch.float32 or torch.bfloat16"),
    ("seed", "0", TypeError, "a Python int"),
]


@pytest.mark.parametrize(
    ("name", "value", "error", "rule"),
    BAD_ARGUMENTS,
    ids=[f"{name}={value!r}" for name, value, _, _ in BAD_ARGUMENTS],
)
def test_bad_arguments_raise_the_standard_message(name, value, error, rule):
    with pytest.raises(error, match=f"Invalid {name}") as info:
        ProAdamW([torch.zeros(3, 2, requires_grad=True)], **{name: value})
    assert rule in str(info.value)
    group = {"params": [torch.zeros(2, requires_grad=True)], name: value}
    if name != "seed":  # an optimizer-wide argument, not a group's
        optimizer = ProAdamW([torch.zeros(3, 2, requires_grad=True)])
        with pytest.raises(error, match=f"Invalid {name}"):
            optimizer.add_param_group(group)


def test_integer_parameters_are_refused():
    with pytest.raises(TypeError, match="ProAdamW supports real floating"):
        ProAdamW([torch.zeros(3, dtype=torch.int64)])
