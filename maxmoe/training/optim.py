"""AdamW with decoupled weight decay (not on norms or biases) and learning-rate schedules."""

from __future__ import annotations

import jax
import optax

from maxmoe.config import TrainConfig


def learning_rate_schedule(train: TrainConfig) -> optax.Schedule:
    """Linear warmup, then cosine to lr*min_lr_ratio, warmup-stable-decay, or constant."""
    peak, floor = train.lr, train.lr * train.min_lr_ratio
    warmup = min(train.warmup_steps, train.steps)
    rest = max(train.steps - warmup, 1)
    # Step s of warmup (0-based) gets peak * (s + 1) / warmup: the last warmup step reaches the peak.
    ramp = optax.linear_schedule(peak / max(warmup, 1), peak, max(warmup - 1, 1))
    if train.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, rest, alpha=train.min_lr_ratio)
    elif train.schedule == "wsd":
        decay = max(int(round(rest * train.decay_fraction)), 1)
        after = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay)], [rest - decay]
        )
    else:
        after = optax.constant_schedule(peak)
    if warmup == 0:
        return after
    return optax.join_schedules([ramp, after], [warmup])


def _decays(path, leaf) -> bool:
    """Weight decay applies to matrices, not to norm scales or biases."""
    names = [getattr(p, "key", getattr(p, "name", "")) for p in path]
    return not any(str(n).endswith("norm") or n in ("scale", "bias") for n in names)


def make_optimizer(train: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping (if train.clip_norm > 0) then AdamW on the schedule."""
    adamw = optax.adamw(
        learning_rate_schedule(train),
        b1=train.b1,
        b2=train.b2,
        eps=train.eps,
        weight_decay=train.weight_decay,
        mask=lambda params: jax.tree_util.tree_map_with_path(_decays, params),
    )
    if train.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(train.clip_norm), adamw)
    return adamw
