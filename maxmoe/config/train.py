"""train: optimisation and the loop, and their checks."""

from __future__ import annotations

import dataclasses

from maxmoe.config.errors import ConfigError
from maxmoe.config.fields import field

PIPELINE_RESIDUALS = ("vjp", "recompute")  # maxmoe.parallel.pipeline
MAX_BATCH_TOKENS = 2**31 - 1  # DeepSeek-V3 trained on 15,360 x 4,096 = 63M tokens per step
MAX_SEED = 2**32 - 1  # jax.random.key keeps the low 32 bits: seed 2**32 would repeat seed 0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and the loop."""

    steps: int = field(300, gt=0, doc="training steps in all (a resumed run continues to this)")
    schedule_steps: int = field(
        0,
        ge=0,
        doc="length of the learning-rate schedule in steps; 0: train.steps, except that a finished run continued "
        "with more steps keeps the length it finished with (the rate stays at its final value); "
        "set it to the new train.steps to stretch the schedule over the new total instead",
    )
    batch_size: int = field(16, gt=0, doc="global sequences per step")
    seq_len: int = field(128, gt=0, doc="tokens per sequence")
    seed: int = field(0, ge=0, doc="parameter init and data order")
    grad_accum: int = field(1, gt=0, doc="micro-batches per step")
    lr: float = field(3e-3, gt=0, doc="peak learning rate (AdamW)")
    schedule: str = field("cosine", choices=("cosine", "wsd", "constant"), doc="after warmup; wsd: warmup-stable-decay")
    warmup_steps: int = field(30, ge=0, doc="linear warmup to train.lr")
    min_lr_ratio: float = field(0.1, ge=0, doc="final learning rate / train.lr")
    decay_fraction: float = field(0.2, ge=0, doc="wsd: final fraction of steps that decays")
    b1: float = field(0.9, ge=0, doc="Adam beta1, in [0, 1)")
    b2: float = field(0.95, ge=0, doc="Adam beta2, in [0, 1)")
    eps: float = field(1e-8, gt=0, doc="Adam epsilon")
    weight_decay: float = field(0.1, ge=0, doc="decoupled weight decay (AdamW)")
    clip_norm: float = field(1.0, ge=0, doc="0: no clipping")
    loss_chunk: int = field(
        16384,
        ge=0,
        doc="cross-entropy over blocks of this many vocabulary columns, logits never whole; 0: whole [B, T, V]",
    )
    log_every: int = field(10, gt=0, doc="steps between metric lines")
    eval_every: int = field(100, gt=0, doc="steps between evaluations (and one at the end)")
    eval_batches: int = field(4, gt=0, doc="global batches of held-out data per evaluation")
    max_bad_steps: int = field(5, gt=0, doc="consecutive non-finite steps before stopping")
    pipeline_residuals: str = field(
        "vjp",
        choices=PIPELINE_RESIDUALS,
        doc="pipeline: keep each chunk's backward residuals (vjp) or its input only and re-run it (recompute)",
    )


def check_train(config) -> None:
    """Adam's moment decays below 1, micro-batches that divide the batch, and the upper limits."""
    t = config.train
    for name in ("b1", "b2"):  # 1.0 divides by 1 - beta**t = 0: every parameter NaN after the first update
        if not getattr(t, name) < 1:
            raise ConfigError(f"train.{name}={getattr(t, name)}: must be below 1 (Adam's moment decay, in [0, 1))")
    if t.batch_size % t.grad_accum:
        raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}")
    if t.batch_size * t.seq_len > MAX_BATCH_TOKENS:
        raise ConfigError(
            f"train.batch_size={t.batch_size} x train.seq_len={t.seq_len} tokens per step: must be <= "
            f"{MAX_BATCH_TOKENS:,} (the step's token batch is indexed in int32)"
        )
    if t.seed > MAX_SEED:
        raise ConfigError(f"train.seed={t.seed}: must be <= {MAX_SEED} (jax keeps 32 bits of a seed)")
    for key, value, what in (
        ("train.decay_fraction", t.decay_fraction, "the share of the steps after warmup that decays"),
        ("train.min_lr_ratio", t.min_lr_ratio, "the final learning rate as a share of train.lr"),
    ):
        if value > 1:
            raise ConfigError(f"{key}={value}: must be <= 1 ({what})")
