"""The model knows nothing of training; the train step routes each layer's gradients from outside.

- maxmoe/model imports nothing of maxmoe.training, reads no hook from the layout, and names no
  variable collection but its own (params, router, moe_stats): checked on the source.
- `layer_grads.summing` on a small scanned stack: the sums that come out are the sums that
  went in plus `jax.grad` of the plain stack (the oracle), and `seed` is linear in the loss's
  cotangent (a scaled objective scales the sums with it).
"""

import ast
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from maxmoe.model.transformer import StackTransform
from maxmoe.training import layer_grads

MODEL = Path(__file__).resolve().parents[1] / "maxmoe" / "model"
LAYERS = 3


def _imports(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            out.append(node.module or "")
        elif isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
    return out


def test_the_model_imports_no_training_and_reads_no_hook():
    files = sorted(MODEL.glob("*.py"))
    assert len(files) >= 8
    variable_calls = {"variable", "sow", "put_variable", "get_variable", "has_variable", "is_mutable_collection"}
    for path in files:
        tree = ast.parse(path.read_text())
        assert not [m for m in _imports(tree) if m.startswith("maxmoe.training")], path.name
        attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        assert not [a for a in attributes if "hook" in a.lower()], (path.name, attributes)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in variable_calls and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant):
                    assert first.value in ("params", "router", "moe_stats"), (path.name, first.value)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        w = self.param("w", nn.initializers.normal(1.0), (4, 4))
        scale = self.param("scale", nn.initializers.ones, (4,))
        return jnp.tanh(x @ w) * scale, None


class _Stack(nn.Module):
    transform: StackTransform | None = None

    @nn.compact
    def __call__(self, x):
        t = self.transform
        block = _Block if t is None else t.wrap(_Block, "stack")
        scanned = nn.scan(
            block,
            variable_axes={"params": 0, **{c: 0 for c in (t.scanned if t else ())}},
            variable_carry=list(t.carried) if t else False,
            split_rngs={"params": True},
            in_axes=(nn.broadcast,),
            length=LAYERS,
        )
        y, _ = scanned(name="stack")(x, None)
        return jnp.sum(y**2)


def test_summing_adds_each_layers_gradient_to_its_row_and_seed_is_linear():
    x = jax.random.normal(jax.random.key(1), (2, 4))
    params = _Stack().init(jax.random.key(0), x)["params"]
    want = jax.grad(lambda p: _Stack().apply({"params": p}, x))(params)["stack"]["w"]
    sums = jax.random.normal(jax.random.key(2), (LAYERS, 4, 4))
    model = _Stack(layer_grads.summing({}))

    def objective(sums, scale):
        collections = {
            layer_grads.LAYER_SUM: {"stack": {"w": sums}},
            layer_grads.LAYER_INDEX: {"stack": {"w": jnp.arange(LAYERS)}},
        }
        loss, out = model.apply({"params": params, **collections}, x, mutable=[layer_grads.LAYER_SUM])
        return scale * (loss + layer_grads.seed(out[layer_grads.LAYER_SUM]))

    np.testing.assert_allclose(jax.grad(objective)(sums, 1.0), sums + want, rtol=1e-6, atol=1e-6)
    # Linear, as a gradient is: twice the objective, twice what comes out (sums included).
    np.testing.assert_allclose(jax.grad(objective)(sums, 2.0), 2 * (sums + want), rtol=1e-6, atol=1e-6)
