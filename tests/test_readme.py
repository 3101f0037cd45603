"""The README's Python examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).parents[1] / "README.md"


def test_readme_jax_example_trains():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    namespace: dict = {}
    exec(blocks[0], namespace)  # the README's own example
    jnp = namespace["jnp"]
    x = jnp.linspace(-1, 1, 32 * 64).reshape(32, 64)
    y = jnp.tanh(x[:, :10])
    params, state = namespace["params"], namespace["state"]
    losses = []
    for _ in range(30):
        params, state, loss = namespace["train_step"](params, state, x, y)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
