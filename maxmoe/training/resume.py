"""Whether a checkpoint in run.dir may be resumed by this config: the run must be the same one.

    check_init_from(saved_config, config, run_dir, step)          # UserError: run.dir holds another run
    changes = check_resume(saved_config, config, run_dir, step)   # UserError, or the accepted changes

A resume that changes the model, its numerics, the optimizer or the data order would continue
the stored run as a different one, and would overwrite run.dir/config.yaml with a config that
no longer describes its checkpoints; it is refused in one line naming the keys, unless
checkpoint.allow_config_change says so. Cadence, output, the mesh and implementation choices
that compute the same numbers may change freely (RESUME_FREE).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from maxmoe.config import Config, UserError, source_in_effect

# Keys a resumed run may change freely: cadence, output, implementation choices that compute the
# same numbers, the mesh (arrays are restored onto any mesh). Every other key of these sections
# changes the model, its numerics, the optimizer or the data order; mesh, checkpoint, run, xla and
# dist keys are all free (checkpoint.init_from is checked on its own).
RESUME_FREE = {
    "model": {"attention", "attention_chunk", "remat"},
    "moe": {"grouped_matmul", "overlap", "a2a_chunks", "emulate_ragged_a2a"},
    "train": {
        "steps",
        "schedule_steps",
        "log_every",
        "eval_every",
        "eval_batches",
        "max_bad_steps",
        "loss_chunk",
        "grad_accum",
        "pipeline_residuals",
    },
    "data": {"cache_dir"},
}


def resume_changes(saved: Any, config: Config) -> list[str]:
    """'section.key: A there, B here' for each key whose change a resume refuses (see RESUME_FREE).

    `saved` is the config dict stored with the checkpoint; keys it lacks (an older maxmoe) are
    not compared.
    """
    if not isinstance(saved, dict):
        return []
    here, changes = _as_computed(config.to_dict()), []
    for section, free in RESUME_FREE.items():
        there = saved.get(section)
        if not isinstance(there, dict):
            continue
        there = _as_computed({section: there})[section]
        for key in sorted(set(here[section]) & set(there)):
            if key not in free and there[key] != here[section][key]:
                changes.append(f"{section}.{key}: {there[key]!r} there, {here[section][key]!r} here")
    return changes


def _as_computed(sections: dict) -> dict:
    """Config sections with the values that name one computation in two ways made one: data.source
    with `auto` resolved (config.source_in_effect) (stored `stdlib` and `auto` with no path read the
    same data), data paths with `~` expanded (stored by a maxmoe that kept it), moe.dispatch as
    dropless or capacity (ragged_a2a, allgather and auto route every token copy to its experts
    and give the same numbers; capacity drops copies)."""
    out = {name: dict(values) for name, values in sections.items()}
    data, moe = out.get("data"), out.get("moe")
    if data is not None and isinstance(data.get("path"), str):
        data["path"] = os.path.expanduser(data["path"])
    if data is not None and isinstance(data.get("mixture"), dict):
        data["mixture"] = {os.path.expanduser(k) if isinstance(k, str) else k: v for k, v in data["mixture"].items()}
    if data is not None and "source" in data:
        data["source"] = source_in_effect(data["source"], data.get("path"), data.get("mixture"))
    if moe is not None and "dispatch" in moe:
        moe["dispatch"] = "capacity" if moe["dispatch"] == "capacity" else "dropless"
    return out


def optimizer_hint(saved_config: Any, config: Config) -> str:
    """' (the optimizer changed: train.clip_norm: 1.0 there, 0.0 here)' from the configs."""
    there = saved_config.get("train") if isinstance(saved_config, dict) else None
    here = config.to_dict()["train"]
    diffs = [
        f"train.{k}: {there.get(k)!r} there, {here[k]!r} here"
        for k in sorted(here)
        if isinstance(there, dict) and k in there and there[k] != here[k] and k not in RESUME_FREE["train"]
    ]
    return f" (the optimizer changed{': ' + '; '.join(diffs) if diffs else ''})"


def check_init_from(saved_config: Any, config: Config, run_dir: Path, step: int) -> None:
    """UserError when checkpoint.init_from is set and run.dir's run (its checkpoint `step`, saved
    with `saved_config`) did not start from it: run.dir holds another run, and resuming it would
    ignore init_from."""
    c = config.checkpoint
    saved_checkpoint = saved_config.get("checkpoint") if isinstance(saved_config, dict) else None
    started_from = saved_checkpoint.get("init_from", "") if isinstance(saved_checkpoint, dict) else ""
    if c.init_from and started_from != c.init_from:
        origin = f"checkpoint.init_from={started_from}" if started_from else "scratch"
        raise UserError(
            f"checkpoint.init_from={c.init_from}: run.dir {run_dir} already holds another run (step {step}, "
            f"started from {origin}); choose a new run.dir, or drop checkpoint.init_from to resume that run"
        )


def check_resume(saved_config: Any, config: Config, run_dir: Path, step: int) -> list[str]:
    """UserError when `config` changes what run.dir's run (its checkpoint `step`, saved with
    `saved_config`) is; returns the changes accepted under checkpoint.allow_config_change."""
    c = config.checkpoint
    changes = resume_changes(saved_config, config)
    if changes and not c.allow_config_change:
        shown = "; ".join(changes[:4]) + ("; ..." if len(changes) > 4 else "")
        raise UserError(
            f"run.dir {run_dir} holds a run (step {step}) with another config ({shown}); resuming would "
            f"continue it as a different run: use a new run.dir, or set checkpoint.allow_config_change=true"
        )
    return changes
