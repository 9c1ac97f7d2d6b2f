"""`python -m maxmoe.report RUN_DIR [--out report.png]`: a run's metrics as one picture.

    python -m maxmoe.report runs/tiny                 # writes runs/tiny/report.png

Panels: train and eval loss (with a uniform guess's), learning rate, tokens/s with MFU,
gradient norm, and expert load per MoE layer over the steps (max/mean load; 1 is balanced).
Damaged metrics lines are skipped with one warning line naming them. In Python:
`figure(run_dir_or_trainer_or_records)` returns a matplotlib Figure; `write_report(source, out)`
saves it as PNG. Needs matplotlib (`pip install 'maxmoe[plot]'`). docs/ARCHITECTURE.md,
"Report", says what each panel reads.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from maxmoe.analysis.flops import count_params
from maxmoe.cli import _Parser, check_output_file, main_guard, path_argument
from maxmoe.config import ConfigError, UserError, build_model_config, read_named_file
from maxmoe.training.progress import format_duration

LAYER_IMBALANCE_KEY = "moe_layer_imbalance"  # per-layer max/mean load lists in metrics.jsonl


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of run_dir/metrics.jsonl.

    A damaged line (not UTF-8, not a JSON record with an integer step) is skipped, and one
    warning line on stderr says how many and which: the report draws what is readable, where
    training (which appends to the file) refuses such a file. A last line cut short by a crash
    is skipped without a word, as a resumed run drops it.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not Path(run_dir).is_dir():
        raise UserError(f"{run_dir}: no such run folder")
    missing = ": not a training run folder, or no step was logged yet"
    records, damaged = [], []
    lines = read_named_file(path, "metrics", missing=missing).splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    for number, raw in enumerate(lines, 1):
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            record = None
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            records.append(record)
        elif raw.strip() and number < len(lines):
            damaged.append(number)
    if not records:
        raise UserError(f"{path} holds no metrics records")
    if damaged:
        which = ", ".join(map(str, damaged[:5])) + (", ..." if len(damaged) > 5 else "")
        plural = "s" if len(damaged) > 1 else ""
        print(
            f"maxmoe: warning: {path}: skipped {len(damaged)} damaged line{plural} (line{plural} {which})",
            file=sys.stderr,
        )
    return records


def _run_config(run_dir: Path | None) -> dict:
    """The run's config.yaml as {section: mapping} (sections of another kind left out; {} when absent
    or unreadable: the report draws without it)."""
    if run_dir is None or not (Path(run_dir) / "config.yaml").is_file():
        return {}
    try:
        raw = yaml.safe_load((Path(run_dir) / "config.yaml").read_bytes().decode("utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError, ValueError):
        return {}
    return {k: v for k, v in raw.items() if isinstance(v, dict)} if isinstance(raw, dict) else {}


def run_summary(records: Sequence[dict], config: dict) -> str:
    """One line: parameters, batch, tokens seen and time in train steps (what the config and records tell)."""
    parts = []
    model, train = config.get("model") or {}, config.get("train") or {}
    try:
        counts = count_params(build_model_config(model)) if model else None
    except ConfigError:
        counts = None
    if counts:
        parts.append(f"{counts['params_total']:,} parameters ({counts['params_active']:,} active per token)")
    batch, seq_len = train.get("batch_size"), train.get("seq_len")
    steps = [r for r in records if isinstance(r.get("step_time_s"), (int, float))]
    last = max((r["step"] for r in records), default=0)
    if isinstance(batch, int) and isinstance(seq_len, int):
        parts.append(f"batch {batch} x {seq_len}, {last * batch * seq_len:,} tokens to step {last}")
    if steps:
        seconds, previous = 0.0, None
        for r in sorted(steps, key=lambda r: r["step"]):  # step_time_s is the mean over the logged interval
            seconds += r["step_time_s"] * (r["step"] - (previous if previous is not None else 0))
            previous = r["step"]
        parts.append(f"{format_duration(seconds)} in train steps")
    return "; ".join(parts)


def _is_number(value: Any) -> bool:
    """A JSON number (not a boolean, not a string)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _layer_names(run_dir: Path | None, count: int) -> list[str]:
    """'layer 1', ..., 'MTP 1' when the run's config.yaml accounts for `count` MoE layers; else 'MoE 0', ..."""
    model = _run_config(run_dir).get("model") or {}
    first, layers, mtp = (model.get(k) for k in ("first_k_dense", "num_layers", "mtp_num_layers"))
    if all(isinstance(v, int) for v in (first, layers, mtp)) and layers - first + mtp == count:
        return [f"layer {i}" for i in range(first, layers)] + [f"MTP {k}" for k in range(1, mtp + 1)]
    return [f"MoE {i}" for i in range(count)]


def layer_imbalance(
    records: Sequence[dict], expert_loads: Sequence[tuple[int, Any]] | None = None
) -> tuple[list[int], np.ndarray, bool]:
    """(steps, max/mean load [layers, steps], per_layer) for the heatmap; see the module doc for the sources."""
    listed = [r for r in records if isinstance(r.get(LAYER_IMBALANCE_KEY), list)]
    rows = [r for r in listed if r[LAYER_IMBALANCE_KEY]]
    if listed and not rows:  # a model without MoE layers logs empty lists: nothing to draw
        return [], np.zeros((0, 0)), True
    if rows:
        width = max(len(r[LAYER_IMBALANCE_KEY]) for r in rows)
        matrix = np.full((width, len(rows)), np.nan)
        for j, r in enumerate(rows):
            values = [v if _is_number(v) else np.nan for v in r[LAYER_IMBALANCE_KEY]]
            matrix[: len(values), j] = values
        return [r["step"] for r in rows], matrix, True
    if expert_loads:
        loads = [(step, np.asarray(load, np.float64)) for step, load in expert_loads if np.size(load)]
        if loads:
            columns = [load.max(-1) / np.maximum(load.mean(-1), 1e-9) for _, load in loads]
            return [step for step, _ in loads], np.stack(columns, axis=1), True
    rows = [r for r in records if _is_number(r.get("moe_imbalance"))]
    return [r["step"] for r in rows], np.array([[r["moe_imbalance"] for r in rows]], np.float64), False


def _series(records: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if _is_number(r.get(key))]
    return [s for s, _ in points], [v for _, v in points]


def _matplotlib_figure():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("reports need matplotlib: pip install 'maxmoe[plot]' (or pip install matplotlib)") from None
    return Figure


def figure(source: Any, *, expert_loads: Sequence[tuple[int, Any]] | None = None, title: str | None = None):
    """A matplotlib Figure of a run: `source` is a run folder, a Trainer, or a list of metrics records."""
    run_dir = None
    config = {}
    if isinstance(source, (str, Path)):
        run_dir = Path(source)
        records = read_metrics(run_dir)
    elif hasattr(source, "history"):  # a Trainer
        records = list(source.history)
        expert_loads = expert_loads if expert_loads is not None else getattr(source, "expert_loads", None)
        run_dir = getattr(source, "run_dir", None)
        config = source.config.to_dict() if hasattr(source, "config") else {}
    elif isinstance(source, (list, tuple)) and all(isinstance(r, dict) for r in source):
        records = list(source)
    else:
        raise UserError(f"figure: expected a run folder, a Trainer or a list of metrics records, not {source!r:.80}")
    records = [r for r in records if isinstance(r.get("step"), int) and not isinstance(r.get("step"), bool)]
    config = config or _run_config(run_dir)
    if title is None and run_dir is not None:
        title = Path(run_dir).resolve().name  # the run's name, not the folder it happens to sit in
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if r.get("eval_loss") is not None]
    fig = _matplotlib_figure()(figsize=(12, 10), layout="constrained")
    grid = fig.add_gridspec(3, 2, height_ratios=[1, 1, 1.2])
    summary = run_summary(records, config)
    if title or summary:
        fig.suptitle("\n".join(t for t in (title, summary) if t))

    ax = fig.add_subplot(grid[0, 0])
    for key, label in (
        ("loss", "train loss (with MTP, balance)"),
        ("lm_loss", "train next-token loss"),
        ("mtp_loss", "train MTP loss"),
    ):
        if any(r.get(key) for r in train):  # a model without MTP logs 0
            ax.plot(*_series(train, key), label=label)
    if evals:
        best = min(evals, key=lambda r: r["eval_loss"])
        label = f"eval loss (final {evals[-1]['eval_loss']:.3f}; best {best['eval_loss']:.3f} at step {best['step']})"
        ax.plot(*_series(evals, "eval_loss"), "o-", label=label)
    vocab = (config.get("model") or {}).get("vocab_size")
    if isinstance(vocab, int) and vocab > 1:
        uniform = float(np.log(vocab))
        ax.axhline(uniform, color="gray", linestyle=":", label=f"uniform over {vocab} tokens ({uniform:.2f})")
    ax.set(title="loss (nats)", xlabel="step")
    ax.legend(fontsize=8)

    ax = fig.add_subplot(grid[0, 1])
    ax.plot(*_series(train, "lr"), color="tab:purple")
    ax.set(title="learning rate", xlabel="step")

    ax = fig.add_subplot(grid[1, 0])
    ax.plot(*_series(train, "tokens_per_s"), color="tab:green")
    ax.set(title="throughput", xlabel="step", ylabel="tokens/s")
    steps, mfu = _series(train, "mfu")
    if steps:
        twin = ax.twinx()
        twin.plot(steps, [100 * v for v in mfu], color="tab:orange")
        twin.set_ylabel("MFU %", color="tab:orange")
    else:
        ax.set_title("throughput (MFU n/a: peak unknown; set run.peak_tflops)")

    ax = fig.add_subplot(grid[1, 1])
    ax.plot(*_series(train, "grad_norm"), color="tab:red")
    ax.set(title="gradient norm (before clipping)", xlabel="step")

    ax = fig.add_subplot(grid[2, :])
    steps, matrix, per_layer = layer_imbalance(records, expert_loads)
    if steps:
        names = _layer_names(run_dir, matrix.shape[0]) if per_layer else ["max over layers"]
        # Columns placed at their steps (logged every train.log_every), so the axis has even step ticks.
        half = (steps[-1] - steps[0]) / max(len(steps) - 1, 1) / 2 or 0.5
        extent = (steps[0] - half, steps[-1] + half, len(names) - 0.5, -0.5)
        image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="magma", vmin=1.0, extent=extent)
        fig.colorbar(image, ax=ax, label="max / mean expert load")
        ax.set_yticks(range(len(names)), names)
    # No rows at all: the model logged empty per-layer lists (no MoE layer), not merely no steps.
    heading = (
        "expert load: the model has no MoE layer" if not len(matrix) else "expert load per MoE layer (1 = balanced)"
    )
    ax.set(title=heading, xlabel="step")
    return fig


def write_report(source: Any, out: str | Path | None = None, **kwargs) -> Path:
    """Save `figure(source, **kwargs)` as a PNG at `out` (default: RUN_DIR/report.png); returns the path."""
    if out is None:
        folder = Path(source) if isinstance(source, (str, Path)) else getattr(source, "run_dir", None)
        if folder is None:
            raise UserError("write_report: give `out` for a list of records")
        out = Path(folder) / "report.png"
    fig = figure(source, **kwargs)
    out = Path(out)
    try:
        fig.savefig(out, dpi=100)
    except OSError as e:
        raise UserError(f"--out {out}: cannot write it ({e.strerror or e})") from None
    except ValueError as e:  # matplotlib: a suffix it has no writer for
        raise UserError(f"--out {out}: {str(e).splitlines()[0]} (use .png, .pdf or .svg)") from None
    return out


@main_guard
def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m maxmoe.report", description=__doc__.splitlines()[0])
    parser.add_argument(
        "run_dir", type=path_argument, metavar="RUN_DIR", help="a training run folder (holds metrics.jsonl)"
    )
    parser.add_argument("--out", type=path_argument, default=None, metavar="PNG", help="default: RUN_DIR/report.png")
    args = parser.parse_args(argv)
    if args.out:
        check_output_file(Path(args.out), "--out")
    print(f"maxmoe: wrote {write_report(args.run_dir, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
