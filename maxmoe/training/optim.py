"""AdamW with decoupled weight decay (not on norms or biases) and learning-rate schedules.

A schedule spans `train.schedule_steps` steps (0: train.steps) and then stays at its final
rate. `continued_schedule` decides the span of a resumed run whose train.steps changed: a
finished run continued with more steps keeps its span (no jump in the rate), and a change
that moves the rate is said on the console.
"""

from __future__ import annotations

import dataclasses

import jax
import optax

from maxmoe.config import TrainConfig


def learning_rate_schedule(train: TrainConfig) -> optax.Schedule:
    """Linear warmup, then cosine to lr*min_lr_ratio, warmup-stable-decay, or constant."""
    peak, floor = train.lr, train.lr * train.min_lr_ratio
    length = schedule_length(train)
    warmup = min(train.warmup_steps, length)
    rest = max(length - warmup, 1)
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


def schedule_length(train: TrainConfig) -> int:
    """The steps the learning-rate schedule spans: train.schedule_steps, or train.steps when it is 0."""
    return train.schedule_steps or train.steps


def continued_schedule(train: TrainConfig, saved: dict | None, step: int) -> tuple[TrainConfig, str | None]:
    """`train` with the schedule a run resumed at `step` continues on, and a console note, or None.

    `saved` is the train section stored with the checkpoint (None: a fresh start). With
    train.schedule_steps=0, a span kept by an earlier continuation stays; a run that had finished
    (step >= its train.steps) and now has more steps keeps its span, so the rate stays at its final
    value (the span is then written into train.schedule_steps, so later resumes keep it too);
    otherwise the schedule spans train.steps. The note says which, when the rate at `step` changes.
    """
    if not isinstance(saved, dict) or step <= 0 or not isinstance(saved.get("steps"), int):
        return train, None
    kept = saved.get("schedule_steps") or 0
    finished = step >= saved["steps"] and train.steps > saved["steps"]
    if train.schedule_steps or not (kept or finished):
        resolved = train
    else:
        resolved = dataclasses.replace(train, schedule_steps=kept or saved["steps"])
    before = dataclasses.replace(train, steps=saved["steps"], schedule_steps=kept)
    old_lr, new_lr = (float(learning_rate_schedule(t)(step)) for t in (before, resolved))
    span, old_span = schedule_length(resolved), schedule_length(before)
    if finished and not train.schedule_steps and span == old_span:
        stretched = float(learning_rate_schedule(dataclasses.replace(train, schedule_steps=0))(step))
        return resolved, (
            f"maxmoe: continuing a finished run (step {step} of {saved['steps']}) to {train.steps} steps: the "
            f"learning-rate schedule keeps its {span} steps, so the rate stays at its final {new_lr:.3g}; "
            f"train.schedule_steps={train.steps} stretches it over the new total instead (rate {stretched:.3g} "
            f"at step {step})"
        )
    if span == old_span or abs(new_lr - old_lr) <= 1e-6 * max(abs(old_lr), 1e-30):
        return resolved, None
    return resolved, (
        f"maxmoe: the learning-rate schedule now spans {span} steps (it spanned {old_span}): the rate at "
        f"step {step} moves from {old_lr:.3g} to {new_lr:.3g}"
    )


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
