"""DeepSeek-V3: embedding -> scanned dense stack -> scanned MoE stack -> norm -> head, plus MTP.

Axis legend: B batch, T time, D embed, V vocab.

Variables: `params` (trainable, float32), `router` (correction biases, state),
`moe_stats` (per-call expert load, balance loss and dropped fraction; apply with
mutable=["moe_stats"] to read them). Scanned stacks put a leading `layers` axis on every
variable, so compile time does not grow with depth.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxmoe.config import ModelConfig
from maxmoe.model.attention import MLA, attention_for_length
from maxmoe.model.layers import Embed, RMSNorm, SwiGLU, constrain, logical_param
from maxmoe.model.moe import MoE
from maxmoe.parallel.names import ATTENTION_OUT, COMM_NAMES, EXPERT_MATMUL_NAMES, FP8_DENSE_OUT

COMPUTE_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}  # model.compute_dtype -> jax dtype

# model.remat: what the backward pass of a scanned block keeps (docs/ARCHITECTURE.md, "Remat").
_policies = jax.checkpoint_policies
_save_dots = _policies.save_from_both_policies(
    _policies.dots_with_no_batch_dims_saveable, _policies.save_only_these_names(FP8_DENSE_OUT)
)
REMAT_POLICIES = {
    "full": _policies.nothing_saveable,
    "save_matmuls": _save_dots,
    "save_comm": _policies.save_only_these_names(*COMM_NAMES),
    "save_moe": _policies.save_only_these_names(*COMM_NAMES, *EXPERT_MATMUL_NAMES, ATTENTION_OUT),
    "save_dots_comm": _policies.save_from_both_policies(
        _save_dots, _policies.save_only_these_names(*COMM_NAMES, *EXPERT_MATMUL_NAMES)
    ),
}


class Block(nn.Module):
    """Pre-norm decoder layer: x + MLA(norm(x)), then + MLP or MoE of the norm."""

    config: ModelConfig
    moe: bool
    dtype: Any = jnp.float32
    layout: Any = None

    @nn.compact
    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array):
        c = self.config
        attn_in = RMSNorm(c.rms_norm_eps, name="attn_norm")(x_BTD)
        attention_BTD = MLA(c, self.dtype, self.layout, name="attention")(attn_in, positions_BT)
        h = x_BTD + checkpoint_name(attention_BTD, ATTENTION_OUT).astype(x_BTD.dtype)
        mlp_in = RMSNorm(c.rms_norm_eps, name="mlp_norm")(h)
        if self.moe:
            y = MoE(c, self.dtype, self.layout, name="moe")(mlp_in)
        else:
            y = SwiGLU(c.hidden_size, c.mlp_dim, self.dtype, c.init_std, self.layout, c.fp8, name="mlp")(mlp_in)
        out = constrain(self.layout, h + y.astype(h.dtype), ("batch", "seq", "embed"))
        return out, None


@dataclasses.dataclass(frozen=True)
class StackTransform:
    """What a caller applies to each layer of the scanned stacks, from outside the model.

    wrap(block_class, stack_name) -> the module class the stack scans in its place (e.g. a
    flax `nn.map_variables` over the block's parameters); `scanned` names the variable
    collections it reads one slice per layer of, `carried` those it carries whole through the
    stack's loop. The model knows nothing of what the transform does (the train step routes
    each layer's weight gradients with one).
    """

    wrap: Callable[[type, str], type]
    scanned: tuple[str, ...] = ()
    carried: tuple[str, ...] = ()


def _stack(config: ModelConfig, moe: bool, length: int, name: str, dtype, layout, transform=None):
    """A scanned stack of `length` identical blocks (each wrapped by `transform`, a StackTransform)."""
    block = Block if transform is None else transform.wrap(Block, name)
    if config.remat != "none":
        block = nn.remat(block, policy=REMAT_POLICIES[config.remat], prevent_cse=False)
    scanned_collections = () if transform is None else transform.scanned
    scanned = nn.scan(
        block,
        variable_axes={"params": 0, "router": 0, "moe_stats": 0, **{c: 0 for c in scanned_collections}},
        variable_carry=list(transform.carried) if transform is not None and transform.carried else False,
        split_rngs={"params": True},
        in_axes=(nn.broadcast,),
        length=length,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )
    return scanned(config, moe, dtype, layout, name=name)


class MTPLayer(nn.Module):
    """Multi-token prediction depth k: combine h^{k-1} with the embedding of token t+k, one MoE block."""

    config: ModelConfig
    dtype: Any = jnp.float32
    layout: Any = None

    @nn.compact
    def __call__(self, h_prev_BTD, emb_next_BTD, positions_BT):
        c = self.config
        emb = RMSNorm(c.rms_norm_eps, name="emb_norm")(emb_next_BTD)
        hid = RMSNorm(c.rms_norm_eps, name="hidden_norm")(h_prev_BTD)
        w_proj = logical_param(self, "w_proj", (2 * c.hidden_size, c.hidden_size), (None, "embed"), std=c.init_std)
        h = jnp.concatenate([emb, hid], axis=-1).astype(self.dtype) @ w_proj.astype(self.dtype)
        h, _ = Block(c, moe=True, dtype=self.dtype, layout=self.layout, name="block")(h, positions_BT)
        return h, RMSNorm(c.rms_norm_eps, name="out_norm")(h)


def head_logits(h_BTD: jax.Array, w_head_DV: jax.Array, dtype, layout: Any = None) -> jax.Array:
    """float32 logits [B, T, V] of final-normed hidden states through the head (matmul in `dtype`)."""
    out = jnp.einsum("btd,dv->btv", h_BTD.astype(dtype), w_head_DV.astype(dtype), preferred_element_type=jnp.float32)
    return constrain(layout, out, ("batch", "seq", "vocab"))


def shift_left(x_BT: jax.Array, k: int) -> jax.Array:
    """x[:, t + k] at position t; the last k positions are zero (masked by the loss); all zero when k >= T."""
    return jnp.pad(x_BT[:, k:], ((0, 0), (0, min(k, x_BT.shape[1]))))


def in_layout_order(layout: Any, x_BT: jax.Array) -> jax.Array:
    """A [B, T, ...] array made in natural order, its columns permuted into the layout's sequence
    order (the zigzag split under context parallelism; unchanged otherwise)."""
    order = None if layout is None else layout.sequence_order(x_BT.shape[1])
    return x_BT if order is None else x_BT[:, order]


class Transformer(nn.Module):
    """The DeepSeek-V3 language model; returns main logits and MTP logits (fp32).

    With `hidden_only=True` it stops before the head and returns the final-normed hidden
    states of the main model and of each MTP depth ([B, T, D] each, compute dtype); the
    loss then applies the head (param `head` [D, V]) chunk by chunk, so float32 logits of
    the whole batch never exist (`maxmoe.training.loss`).

    Under context parallelism (a layout with mesh.context > 1) the outputs' T axis is in the
    layout's order (`in_layout_order`): positions and MTP's shifted inputs are made from the
    natural-order tokens, then permuted, and the loss permutes targets and masks alike.
    """

    config: ModelConfig
    layout: Any = None
    stack_transform: StackTransform | None = None

    @nn.compact
    def __call__(self, tokens_BT: jax.Array, hidden_only: bool = False):
        c = self.config
        dtype = COMPUTE_DTYPES[c.compute_dtype]
        b, t = tokens_BT.shape
        positions_BT = in_layout_order(self.layout, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
        embed = Embed(c.vocab_size, c.hidden_size, dtype, c.init_std, self.layout, name="embed")
        x = constrain(self.layout, embed(in_layout_order(self.layout, tokens_BT)), ("batch", "seq", "embed"))
        if c.first_k_dense:
            stack = _stack(c, False, c.first_k_dense, "dense_layers", dtype, self.layout, self.stack_transform)
            x, _ = stack(x, positions_BT)
        if c.num_layers > c.first_k_dense:
            length = c.num_layers - c.first_k_dense
            stack = _stack(c, True, length, "moe_layers", dtype, self.layout, self.stack_transform)
            x, _ = stack(x, positions_BT)
        w_head_DV = logical_param(self, "head", (c.hidden_size, c.vocab_size), ("embed", "vocab"), std=c.init_std)

        def head(h_BTD):
            return h_BTD if hidden_only else head_logits(h_BTD, w_head_DV, dtype, self.layout)

        normed_BTD = RMSNorm(c.rms_norm_eps, name="final_norm")(x)
        logits_BTV = head(normed_BTD)
        mtp_logits = []
        h = normed_BTD  # MTP depth 1 reads the final-normed hidden state, as the release's MTP does
        for k in range(1, c.mtp_num_layers + 1):
            h, normed = MTPLayer(c, dtype, self.layout, name=f"mtp_{k - 1}")(
                h, embed(in_layout_order(self.layout, shift_left(tokens_BT, k))), positions_BT
            )
            mtp_logits.append(head(normed))
        return logits_BTV, mtp_logits


def uses_float32(path: tuple) -> bool:
    """Whether the model computes with the parameter at `path` (a tree path) in float32, not the compute dtype.

    Norm scales and the router's gate (DeepSeek-V3 routes in float32); every other weight
    is cast to the compute dtype where it is used.
    """
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    return names[-1] == "scale" or "router" in names


def build_model(config: ModelConfig, layout: Any = None, stack_transform: StackTransform | None = None) -> Transformer:
    """The network for a model config; `layout` (maxmoe.parallel.layout) shards activations and experts;
    `stack_transform` is applied to each layer of the scanned stacks."""
    return Transformer(config, layout, stack_transform)


def init_variables(config: ModelConfig, rng: jax.Array) -> dict:
    """A fresh {'params', 'router'}: parameters boxed with their logical axes, router biases.

    Only the initialisers run (flax's lazy_init): the forward pass that creates the variables
    is traced abstractly and left out of a compiled program. The `moe_stats` a forward pass
    writes are outputs, not variables a model keeps, and are left out. The attention core has
    no parameters, so that trace uses the `xla` core: a kernel may refuse the 8-token probe
    sequence or need a GPU to trace, and initialisation must run anywhere.
    """
    model = build_model(dataclasses.replace(config, attention="xla"))
    variables = model.lazy_init(rng, jax.ShapeDtypeStruct((1, 8), jnp.int32))
    return {"params": variables["params"], "router": variables.get("router", {})}


def abstract_variables(config: ModelConfig, *, boxed: bool = False) -> dict:
    """`init_variables`' shapes and dtypes as jax.ShapeDtypeStruct; nothing is allocated or run.

    With boxed=True the parameters keep their logical-axis boxes (what `Layout.tree_shardings`
    reads); otherwise they are plain structs.
    """
    variables = jax.eval_shape(lambda: init_variables(config, jax.random.key(0)))
    return variables if boxed else nn.unbox(variables)


def logits(config: ModelConfig, variables: dict, tokens_BT) -> jax.Array:
    """Main-model logits [B, T, V] (float32) for int token ids [B, T]; variables hold params and router.

    A length the attention kernel cannot take runs the `xla` core instead, with a warning.
    """
    variables = {k: v for k, v in nn.unbox(variables).items() if k in ("params", "router")}
    tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
    model = build_model(attention_for_length(config, tokens_BT.shape[1]))
    out, _ = model.apply(variables, tokens_BT, mutable=["moe_stats"])
    return out[0]
