"""Routing a layer-stack weight's gradient away from it, layer by layer, inside the backward layer loop.

`route_gradient` is the routing (a custom VJP); `stacked_paths` the weights it applies to. The
train step applies it to the model's scanned blocks from outside (maxmoe.training.layer_grads):
into the float32 running sums, or into `LayerGrads`' cross-domain reduce-scatter
(maxmoe.parallel.replicas, mesh.zero1_reduce=per_layer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import traverse_util


def stacked_paths(logical: Any, keep_f32: Any) -> list[tuple]:
    """Paths of the weights of scanned layer stacks (logical axes starting with `layers`) that the
    model uses in the compute dtype. The float32 ones (norm scales, the router's gate) live in
    modules that take no layout, so no hook reaches them; they are small and handled after the
    loop with the weights outside the stacks."""
    flat, f32 = traverse_util.flatten_dict(logical), traverse_util.flatten_dict(keep_f32)
    return [p for p, names in flat.items() if names is not None and tuple(names)[:1] == ("layers",) and not f32[p]]


def route_gradient(w: jax.Array, into: jax.Array, kept: Any, backward: Callable) -> jax.Array:
    """w as it is; backward, w's cotangent goes to `into` as backward(kept, cotangent).

    w itself gets none (the step does not differentiate it), nor does `kept`, which the
    backward pass reads (the forward pass saves it as it is).
    """

    @jax.custom_vjp
    def hook(w, into, kept):
        return w

    def forward(w, into, kept):
        return w, kept

    def routed(kept, ct):
        return None, backward(kept, ct), None

    hook.defvjp(forward, routed)
    return hook(w, into, kept)
