"""The README's Python examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).parents[1] / "README.md"


def _python_block(marker: str) -> str:
    """The README's one python example that contains ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    matching = [block for block in blocks if marker in block]
    assert len(matching) == 1, f"{len(matching)} README examples contain {marker!r}"
    return matching[0]


def test_readme_jax_example_trains():
    namespace: dict = {}
    exec(_python_block("pj.kron(learning_rate=1e-3"), namespace)  # the first example
    jnp = namespace["jnp"]
    x = jnp.linspace(-1, 1, 32 * 64).reshape(32, 64)
    y = jnp.tanh(x[:, :10])
    params, state = namespace["params"], namespace["state"]
    losses = []
    for _ in range(30):
        params, state, loss = namespace["train_step"](params, state, x, y)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]


def test_readme_sharded_example_trains_with_split_factors():
    import jax
    from jax.sharding import PartitionSpec as P

    namespace: dict = {}
    exec(_python_block("jax.set_mesh"), namespace)  # the "Sharded training" example
    jnp, mesh = namespace["jnp"], namespace["mesh"]
    params, state = namespace["params"], namespace["state"]
    x = jnp.linspace(-1, 1, 64 * 512).reshape(64, 512)
    y = jnp.sin(x[:, :16])
    losses = []
    with jax.set_mesh(mesh):
        for _ in range(10):
            params, state, loss = namespace["train_step"](params, state, x, y)
            losses.append(float(loss))
    assert losses[-1] < 0.9 * losses[0]
    factors = jax.tree.leaves(state[0].preconditioners)
    # 4 layers × 4 blocks = 16 units of 256×256 split over all 8 devices: 2 each.
    assert factors[-1].shape[0] == 16
    assert factors[-1].addressable_shards[0].data.shape[0] == 2
    assert factors[-1].sharding.spec[0] in (("fsdp", "tp"), "fsdp")
    assert params["layers"].sharding.spec == P(None, "fsdp", "tp")


def test_readme_hessian_example_solves_in_one_fitted_step(capsys):
    namespace: dict = {}
    exec(_python_block("hessian_helper"), namespace)  # the XMat/HVP example
    # psgd-jax's README: loss ≈ 0 one step after the first fit (P = H⁻¹ = I/2).
    assert float(capsys.readouterr().out) < 1e-10


def test_readme_shampoo_example_trains():
    namespace: dict = {}
    exec(_python_block("pj.distributed_shampoo("), namespace)
    jnp = namespace["jnp"]
    x = jnp.linspace(-1, 1, 32 * 64).reshape(32, 64)
    y = jnp.tanh(x[:, :10] + x[:, 10:20])
    params, state = namespace["params"], namespace["state"]
    losses = []
    for _ in range(40):
        params, state, loss = namespace["train_step"](params, state, x, y)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses


def test_readme_torch_example_trains():
    import torch

    namespace: dict = {}
    code = _python_block("from precond.torch import Kron")
    torch.manual_seed(0)
    exec(code, namespace)
    model, x, y = namespace["model"], namespace["x"], namespace["y"]
    with torch.no_grad():
        final = torch.nn.functional.cross_entropy(model(x), y)
    # From log(10) = 2.30 (chance) to below 0.7 in the example's 100 steps.
    assert float(final) < 0.7, float(final)


def test_readme_kfac_example_trains():
    import torch

    namespace: dict = {}
    torch.manual_seed(0)
    exec(_python_block("from precond.torch.kfac import KFAC"), namespace)
    model, x, y = namespace["model"], namespace["x"], namespace["y"]
    with torch.no_grad():
        final = torch.nn.functional.cross_entropy(model(x), y)
    # From log(10) = 2.30 (chance) to below 0.7 in the example's 50 steps.
    assert float(final) < 0.7, float(final)
