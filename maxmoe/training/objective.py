"""The training objective: the model's outputs -> the loss and its statistics.

    loss_fn = make_loss_fn(config, layout)            # loss_fn(params, router, batch, more) -> (loss, aux)

Loss = next-token cross-entropy (fp32 log-softmax; with train.loss_chunk > 0 fused with the
head in blocks of vocabulary columns: maxmoe.training.loss) + mtp_loss_weight x the mean MTP
cross-entropy + seq_aux_alpha x the sum over MoE layers of the sequence-wise balance loss.
`batch` is int32 [B, T + 1]: inputs tokens[:, :-1], targets tokens[:, 1:].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from maxmoe.config import Config
from maxmoe.model.transformer import COMPUTE_DTYPES, StackTransform, build_model, in_layout_order, shift_left
from maxmoe.training.layer_grads import seed
from maxmoe.training.loss import cross_entropy, head_cross_entropies


def _stats_leaves(stats: dict, name: str) -> list[jax.Array]:
    flat = traverse_util.flatten_dict(stats)
    return [v for k, v in flat.items() if k[-1] == name]


def make_output_loss(config: Config, layout: Any = None) -> Callable:
    """fn(w_head_DV, main, mtp, targets_BT, moe_stats) -> (loss, aux) from the model's outputs.

    main (None: the MTP terms alone) and mtp (one per depth) are logits, or with train.loss_chunk > 0 the final-normed
    hidden states the head is applied to block by block; moe_stats are the MoE layers'
    statistics (their seq_aux terms enter the loss).
    """
    weight, alpha = config.model.mtp_loss_weight, config.moe.seq_aux_alpha
    chunk = config.train.loss_chunk
    constrain = None if layout is None else layout.constrain

    def output_loss(w_head_DV, main, mtp, targets, stats):
        t = targets.shape[1]
        # Depth k predicts token t + k + 1: its last k positions have no target. main None:
        # the MTP terms alone (lm_loss 0; the pipeline computes the two on different stages).
        depths = ([0] if main is not None else []) + list(range(1, len(mtp) + 1))
        outputs = ([main] if main is not None else []) + list(mtp)
        targets_SBT = jnp.stack([shift_left(targets, k) if k else targets for k in depths])
        mask_SBT = jnp.stack(
            [jnp.broadcast_to((jnp.arange(t) < t - k).astype(jnp.float32), targets.shape) for k in depths]
        )
        # Made in natural order; the model's outputs are in the layout's (context parallelism: zigzag).
        targets_SBT = jnp.stack([in_layout_order(layout, x) for x in targets_SBT])
        mask_SBT = jnp.stack([in_layout_order(layout, x) for x in mask_SBT])
        if chunk > 0:  # main and mtp are hidden states: the head runs block by block, once for all of them
            losses = head_cross_entropies(
                jnp.stack(outputs),
                w_head_DV,
                targets_SBT,
                mask_SBT,
                chunk=chunk,
                dtype=COMPUTE_DTYPES[config.model.compute_dtype],
                constrain=constrain,
            )
        else:
            losses = jnp.stack([cross_entropy(x, y, m) for x, y, m in zip(outputs, targets_SBT, mask_SBT)])
        zero = jnp.zeros((), jnp.float32)
        lm_loss, mtp_losses = (losses[0], losses[1:]) if main is not None else (zero, losses)
        mtp_loss = jnp.mean(mtp_losses) if len(mtp) else zero
        seq_aux = sum((x.sum() for x in _stats_leaves(stats, "seq_aux")), zero)
        loss = lm_loss + weight * mtp_loss + alpha * seq_aux
        return loss, {"lm_loss": lm_loss, "mtp_loss": mtp_loss, "seq_aux": seq_aux, "moe_stats": stats}

    return output_loss


def make_loss_fn(config: Config, layout: Any = None, transform: StackTransform | None = None) -> Callable:
    """loss_fn(params, router, batch, more=None) -> (loss, aux) for the config's model.

    transform: applied to each layer of the model's scanned stacks (maxmoe.training.layer_grads);
    `more` holds the variable collections it reads. A collection it carries through the stacks
    (the running gradient sums) comes out of the model, and the loss gets `seed` of it (value 0).
    """
    model = build_model(config.model, layout, transform)
    output_loss = make_output_loss(config, layout)
    hidden_only = config.train.loss_chunk > 0
    carried = list(transform.carried) if transform is not None else []

    def loss_fn(params, router, batch_BT, more=None):
        tokens, targets = batch_BT[:, :-1], batch_BT[:, 1:]
        (main, mtp), variables = model.apply(
            {"params": params, "router": router, **(more or {})},
            tokens,
            hidden_only=hidden_only,
            mutable=["moe_stats", *carried],
        )
        loss, aux = output_loss(params["head"], main, mtp, targets, variables.get("moe_stats", {}))
        for name in carried:
            loss = loss + seed(variables[name])
        return loss, aux

    return loss_fn


def mean_stats(aux: dict, accum: int) -> dict:
    """Sums over micro-batches -> a step's figures: loads stay summed (global counts), the rest averaged."""
    aux = {k: (v if k == "moe_stats" else v / accum) for k, v in aux.items()}
    aux["moe_stats"] = jax.tree_util.tree_map_with_path(
        lambda p, v: v if getattr(p[-1], "key", "") == "load" else v / accum, aux["moe_stats"]
    )
    return aux
