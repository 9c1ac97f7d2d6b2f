"""Metrics: run.dir/metrics.jsonl (one JSON object per logged step), console progress, TensorBoard.

Only the main process writes. On resume, lines past the restored step (written by a run
that died before its next checkpoint) are dropped, so no step appears twice.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from maxmoe.config import UserError
from maxmoe.training.progress import ProgressDisplay, format_duration


def _clean(value: Any) -> Any:
    """JSON-safe values: numpy/jax numbers to float/int, arrays to lists, NaN/inf to None."""
    if hasattr(value, "tolist") and getattr(value, "ndim", 0) > 0:
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _bad_line(path: Path, number: int, why: str) -> UserError:
    return UserError(
        f"{path}, line {number}: {why}; only a last line cut short by a crash is dropped on resume "
        f"(mend or remove the line, or move the file away)"
    )


def _record_step(line: str) -> int | None:
    """The step of one metrics line, or None when it is not a record with an integer step."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def truncate_after(path: Path, step: int) -> str:
    """Keep only lines whose step is <= `step` (atomic rewrite); returns a note for the console or ''.

    Only the last line may be unreadable (a crash cut it short): it is dropped and the note
    says so. Any other line that is not a JSON record with an integer step, or bytes that
    are not UTF-8, is a UserError naming the line; the file is left as it was.
    """
    if not path.exists():
        return ""
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        number = path.read_bytes()[: e.start].count(b"\n") + 1
        raise _bad_line(path, number, "not UTF-8 text") from None
    kept, note = [], ""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        line_step = _record_step(line)
        if line_step is None:
            if number == len(lines) and not path.read_bytes().endswith(b"\n"):
                note = f"maxmoe: {path}: dropped its last line, cut short by the end of the previous run"
                continue
            raise _bad_line(path, number, "not a JSON record with an integer step")
        if line_step <= step:
            kept.append(line)
    # A name of its own: two processes rewriting one file must not share a temporary file.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, path)
    except OSError as e:  # a full disk: the file stays as it was
        raise UserError(f"cannot rewrite {path} ({e.strerror or type(e).__name__}); it was left as it was") from None
    finally:
        tmp.unlink(missing_ok=True)
    return note


class MetricsLogger:
    """Writes metric records to JSONL, TensorBoard (optional) and the console."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int = 0,
        tensorboard: bool = False,
        progress: str = "auto",
        stream=None,
    ):
        self.enabled = enabled
        self.total_steps = total_steps
        self.start_step = start_step
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        self._file = None
        self.display = ProgressDisplay(
            total_steps,
            mode=progress if enabled and progress != "none" else "off",
            stream=stream or sys.stdout,
            completed=start_step,
        )
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        note = truncate_after(self.path, start_step)
        self._file = self.path.open("a")
        if note:
            self.message(note)
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                raise UserError("run.tensorboard=true needs tensorboardX (pip install 'maxmoe[logging]')") from None
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def log(self, record: dict[str, Any]) -> dict[str, Any]:
        """Append one record (must hold `step`) and show it; returns it as written (JSON-safe)."""
        record = {k: _clean(v) for k, v in record.items()}
        if not self.enabled:
            return record
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as e:  # a full disk: a line cut short is dropped when the run resumes
            raise UserError(f"cannot write {self.path} ({e.strerror or type(e).__name__})") from None
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])
                elif isinstance(value, list):  # one series per entry, e.g. per MoE layer
                    for index, item in enumerate(value):
                        if isinstance(item, (int, float)):
                            self._tb.add_scalar(f"{key}/{index}", item, record["step"])
        self._show(record)
        return record

    def message(self, text: str) -> None:
        """A line on the console that stays (above the progress bar on a terminal)."""
        self.display.print(text)

    def _show(self, r: dict[str, Any]) -> None:
        step = r["step"]
        if "eval_loss" in r:
            value = r["eval_loss"]
            self.message(f"step {step:>6}  eval_loss {'nan' if value is None else f'{value:.4f}'}")
            return
        # The latest step time, not elapsed / done: the first steps include compilation.
        eta = (r.get("step_time_s") or 0.0) * (self.total_steps - step)
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        loss = f"{r['loss']:.4f}" if r.get("loss") is not None else "nan"
        text = (
            f"step {step:>6}/{self.total_steps}  loss {loss}  {r.get('tokens_per_s', 0):,.0f} tok/s  "
            f"MFU {mfu}  ETA {format_duration(eta)}"
        )
        if r.get("skipped_steps"):  # updates left out because the loss or gradient norm was not finite
            text += f"  skipped {r['skipped_steps']} non-finite"
        self.display.log(step, text)

    def close(self) -> None:
        self.display.close()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
