"""A training run as an object: what `python -m maxmoe.train` runs and what a notebook drives.

    trainer = Trainer(config)             # process setup, mesh, data, state (restored or fresh)
    trainer.run()                         # to train.steps; trainer.run(10): ten more steps
    trainer.evaluate()                    # mean next-token loss over the eval batches
    trainer.history                       # the records of metrics.jsonl, as dicts
    trainer.expert_load                   # token copies per expert [MoE layer, expert], last logged step
    trainer.save(); trainer.close()       # or: with Trainer(config) as trainer: ...

`Trainer(config, devices=jax.devices()[:1])` lays the mesh over those devices only. While `run`
runs, SIGTERM and SIGINT mean "finish this step, save it, stop"; a closed Trainer refuses every
method that would touch run.dir. docs/ARCHITECTURE.md, "The training loop", has the loop's
rules (signals, steps in flight, non-finite steps).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from maxmoe import data, runtime, xla_flags
from maxmoe.analysis.flops import flops_per_token, mfu, peak_tflops
from maxmoe.analysis.trace_breakdown import format_table, model_flops_by_class, profile_breakdown
from maxmoe.config import Config, UserError
from maxmoe.parallel.layout import build_layout
from maxmoe.training import checkpoint
from maxmoe.training.metrics import MetricsLogger
from maxmoe.training.optim import continued_schedule, learning_rate_schedule
from maxmoe.training.preemption import StopSignal, hold, interruptible
from maxmoe.training.programs import build_programs
from maxmoe.training.progress import format_duration
from maxmoe.training.run_dir import LOCK_NAME, check_run_config, claim_run_dir, write_run_config


def host_value(x) -> np.ndarray:
    """A replicated array on the host, read from this process's own copy (with several processes,
    `jax.device_get` refuses arrays that span devices of other processes; every copy is equal)."""
    return np.asarray(x.addressable_data(0))


BAD_STEPS = "bad_steps"  # Trainer.stop_reason when train.max_bad_steps non-finite steps stopped the run


class Trainer:
    """One training run: state on a mesh, its data, checkpoints and metrics (see the module doc).

    Args:
        config: the validated Config (`maxmoe.load_config`).
        devices: the devices of the mesh; default all of `jax.devices()`.
        stop: the StopSignal that signals feed while `run` runs (default: a new one).

    Attributes: config, layout (mesh and rules), programs (compiled steps), state, step
    (completed steps), start_step, history (metrics.jsonl records of this process's runs),
    expert_loads ([(step, array [MoE layers, experts])] at logged steps), stop_reason
    (None, "SIGTERM", "SIGINT" or "bad_steps": why the last `run` stopped early).
    """

    def __init__(self, config: Config, devices: Sequence[Any] | None = None, *, stop: StopSignal | None = None):
        self.config = config
        self.lock = None
        self.history: list[dict] = []
        self.expert_loads: list[tuple[int, np.ndarray]] = []
        self.stop_reason: str | None = None
        self.logger = None
        devices = runtime.check_inputs(config, devices)
        self._started = time.perf_counter()
        self._seconds = {"training": 0.0, "compiling": 0.0, "eval": 0.0, "checkpoints": 0.0}
        self._eval_step = None  # compiled at the first evaluate()
        self._closed = False
        self._tracing = False
        # Before any jax computation starts a backend: host devices, XLA flags, jax.distributed.
        flags = runtime.setup(config)
        self.is_main = jax.process_index() == 0
        self.config = data.resolve_vocab_size(config)  # model.vocab_size=auto: from the data
        if note := data.vocab_size_note(config, self.config):
            self._say(note)
        config = self.config
        self.run_dir = Path(config.run.dir)
        self.checkpointer = checkpoint.Checkpointer(config, self.run_dir)
        self.checkpointer.check_start()
        check_run_config(self.run_dir)  # a user's own config.yaml there is never overwritten
        self.stop = stop.bind(jax.process_count()) if stop else StopSignal(jax.process_count())
        # Before anything compiles: run.dir must be writable and no other job may be using it.
        new_dir, new_lock = not self.run_dir.exists(), not (self.run_dir / LOCK_NAME).exists()
        self.lock = claim_run_dir(self.run_dir, jax.process_index(), jax.process_count())
        try:
            hold("trainer-init")
            self._start(devices, flags)
        except BaseException:
            if new_lock:  # refused or stopped before training: run.dir is left as it was found
                self.lock.remove_file()
            self.close()  # finish pending work before any exit, error or not
            if new_dir:
                with contextlib.suppress(OSError):
                    self.run_dir.rmdir()  # only if empty
            raise

    def _start(self, devices: Sequence[Any] | None, flags: list[str]) -> None:
        config, t = self.config, self.config.train
        self.layout = build_layout(config, devices)
        self.devices = list(self.layout.mesh.devices.flat)
        self.train_data = self._dataset("train")
        next(iter(self._dataset("eval")))  # the eval split is read at the end of every run: checked now
        schedule_note = self._continue_schedule()
        config, t = self.config, self.config.train
        self.programs = build_programs(config, self.layout)
        restored = self.checkpointer.restore_latest(self.programs.abstract_state)
        if restored is None or restored.step < t.steps:
            self._say_setup(0 if restored is None else restored.step)
        if restored is not None:
            self.state, self.step = restored.state, restored.step
            self.train_data.set_state(restored.data)
            allowed = config.checkpoint.allow_config_change
            if changed := data.check_same_data(restored.data, self.train_data, restored.step, allowed):
                self.checkpointer.changes.append(changed)
            if self.step < t.steps:
                self._say(f"maxmoe: resumed from {self.checkpointer.directory}, step {self.step}")
                if self.checkpointer.changes:
                    self._say(
                        f"maxmoe: resuming step {self.step} with a changed config (checkpoint.allow_config_change): "
                        + "; ".join(self.checkpointer.changes)
                    )
            self._check_profile_steps()
            if schedule_note and self.step < t.steps:
                self._say(schedule_note)
        else:
            key = jax.random.key(t.seed)
            self.state = self._compiled("the parameter initialisation", self.programs.init, key)(key)
            if config.checkpoint.init_from:
                loaded = checkpoint.load_params(
                    config.checkpoint.init_from, self.programs.abstract_state, config=config
                )
                self.state = self.state.replace(**loaded)
                self._say(f"maxmoe: initialised from {config.checkpoint.init_from}, step {self._init_from_step()}")
            else:
                self._say(f"maxmoe: initialised at random (train.seed={t.seed})")
            self.step = 0
        self.start_step = self.step
        self._train_step = None  # compiled at the first run(), before its loop
        self._first_batch = None  # drawn to compile with; the first step's batch
        self._pending_bad = None  # the bad-step counter of the step in flight
        self._skipped_at_start = int(host_value(self.state.skipped))
        self._flops_per_token = flops_per_token(config.model, t.seq_len)
        self._peak = config.run.peak_tflops or peak_tflops(self.devices[0].device_kind)
        self._schedule = learning_rate_schedule(t)
        if self.step >= t.steps:
            if self.is_main:
                print(
                    f"maxmoe: run.dir {self.run_dir} already finished step {self.step} of {t.steps}; "
                    f"raise train.steps to continue"
                )
            return
        self.logger = MetricsLogger(
            self.run_dir,
            enabled=self.is_main,
            total_steps=t.steps,
            start_step=self.step,
            tensorboard=config.run.tensorboard,
            progress=config.run.progress,
        )
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_run_config(self.run_dir, config.to_yaml())
            xla_flags.write_effective(self.run_dir, flags)

    # -- console -----------------------------------------------------------------------------

    def _say(self, text: str) -> None:
        """A console line from the main process (above the live bar once the logger exists)."""
        if self.logger is not None:
            self.logger.message(text)
        elif self.is_main and self.config.run.progress != "none":
            print(text, flush=True)

    def _say_setup(self, step: int) -> None:
        shape = " x ".join(f"{k}={v}" for k, v in self.layout.shape.items())
        self._say(
            f"maxmoe: {len(self.devices)} {self.devices[0].platform} device(s), mesh {shape}, "
            f"{self.train_data.description}, steps {step}->{self.config.train.steps}"
        )
        for part, choice in (("grouped matmul", self.layout.grouped_matmul), ("attention", self.layout.attention)):
            self._say(f"maxmoe: {part}: {choice.name} ({choice.reason})")

    def _compiled(self, what: str, fn, *args, hold_point: str | None = None):
        """`fn` compiled for `args`, announced and timed: compilation is the longest silent wait.

        XLA compiles in a thread of its own while this one waits: a signal's handler runs (and
        says so) at once rather than when the compilation ends.
        """
        self._say(f"maxmoe: compiling {what} ...")
        start, hits = time.perf_counter(), runtime.compile_cache_hits()

        def compile_program():
            if hold_point:
                hold(hold_point)
            return fn.lower(*args).compile()

        compiled = interruptible(compile_program)
        seconds = time.perf_counter() - start
        self._seconds["compiling"] += seconds
        cached = " (cache hit)" if runtime.compile_cache_hits() > hits else ""
        self._say(f"maxmoe: compiled {what} in {seconds:.1f}s{cached}")
        return compiled

    def _continue_schedule(self) -> str | None:
        """The learning-rate schedule of a resumed run whose train.steps changed (optim.continued_schedule):
        self.config (and what checkpoints store) gets the span it continues on; returns the note to say."""
        saved = self.checkpointer.saved_config()
        if saved is None:
            return None
        step, saved_config = saved
        train, note = continued_schedule(self.config.train, saved_config.get("train"), step)
        if train != self.config.train:
            self.config = self.checkpointer.config = self.config.replace(train={"schedule_steps": train.schedule_steps})
        return note

    def _init_from_step(self) -> int:
        path = self.config.checkpoint.init_from
        with checkpoint.latest_step_of(path, f"checkpoint.init_from={path}") as (_, step, _):
            return step

    def _check_profile_steps(self) -> None:
        """run.profile_steps must not start before the step a resumed run starts from."""
        profile = self.config.run.profile_steps
        if profile and profile[0] < self.step:
            raise UserError(
                f"run.profile_steps={profile}: this run resumes at step {self.step}, after the first traced step; "
                f"trace steps from {self.step} on (e.g. run.profile_steps=[{self.step}, {self.step + 2}])"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise UserError(f"this Trainer of run.dir {self.run_dir} is closed; make a new Trainer to continue")

    # -- data --------------------------------------------------------------------------------

    def _dataset(self, split: str) -> data.BatchIterator:
        return data.make_dataset(
            self.config, split=split, process_index=jax.process_index(), process_count=jax.process_count()
        )

    def _to_device(self, local_batch) -> jax.Array:
        return jax.make_array_from_process_local_data(self.programs.batch_sharding, np.asarray(local_batch, np.int32))

    # -- the loop ----------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """Whether the run has reached train.steps."""
        return self.step >= self.config.train.steps

    def _compile(self, end: int) -> None:
        """Compile the train step (and the eval step, if steps up to `end` evaluate) ahead of the loop:
        no step's time, tokens/s or ETA includes compilation."""
        self._first_batch = self._to_device(next(self.train_data))
        self._train_step = self._compiled(
            "the train step", self.programs.train_step, self.state, self._first_batch, hold_point="compile"
        )
        every, steps = self.config.train.eval_every, self.config.train.steps
        evaluates = end == steps or end // every > self.step // every
        if self._eval_step is None and evaluates:
            params, router = self.state.params, self.state.router
            self._eval_step = self._compiled(
                "the eval step", self.programs.eval_step, params, router, self._first_batch
            )

    def _stop_before_training(self) -> bool:
        """A signal that came before the first step of a `run`: stop with nothing trained (nothing new to save)."""
        if not self.stop.requested:
            return False
        self.stop_reason = self.stop.clear()
        message = (
            f"maxmoe: {self.stop_reason}: stopped before training a step; run.dir {self.run_dir} is at step {self.step}"
        )
        if self.logger is not None:
            self.logger.message(message)
        elif self.is_main:
            print(message)
        return True

    def _next_batch(self) -> jax.Array:
        batch, self._first_batch = self._first_batch, None
        return batch if batch is not None else self._to_device(next(self.train_data))

    def run(self, steps: int | None = None) -> list[dict]:
        """Train `steps` more steps (default: up to train.steps; never past it); returns the records logged.

        Logs every train.log_every steps, evaluates every train.eval_every, checkpoints as
        checkpoint.every says and at train.steps. Stops early, saving the step it is on, on
        SIGTERM/SIGINT or after train.max_bad_steps non-finite steps in a row (see `stop_reason`).
        """
        self._check_open()
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0):
            raise UserError(f"run(steps={steps!r:.80}): expected a number of steps (an integer >= 0) or None")
        t = self.config.train
        end = t.steps if steps is None else min(t.steps, self.step + int(steps))
        first_record = len(self.history)
        self.stop_reason = None
        profile, run_dir = self.config.run.profile_steps, self.run_dir
        with self.stop.installed(), self._trace_closed():
            if self._stop_before_training():
                return []
            if self._train_step is None and self.step < end:
                self._compile(end)
                if self._stop_before_training():
                    return []
            last_time, last_step, paused = time.perf_counter(), self.step, 0.0
            while self.step < end:
                if profile and self.step == profile[0]:
                    jax.block_until_ready(self.state)  # the trace holds the traced steps' kernels only
                    jax.profiler.start_trace(str(run_dir / "profile"))
                    self._tracing = True
                self.state, metrics = self._train_step(self.state, self._next_batch())
                self.step += 1
                step = self.step
                if self._tracing and step == profile[1] + 1:
                    jax.block_until_ready((self.state, metrics))
                    jax.profiler.stop_trace()
                    self._tracing = False
                    self._report_profile(profile)
                if step % t.log_every == 0 or step == t.steps:
                    jax.block_until_ready(metrics)  # the step's time to completion, not to dispatch
                    seconds = self._count("training", last_time + paused)
                    step_time = seconds / (step - last_step)
                    last_time, last_step, paused = last_time + paused + seconds, step, 0.0
                    self._log_step(step, {k: host_value(v) for k, v in metrics.items()}, step_time)
                if step % t.eval_every == 0 or step == t.steps:
                    start = time.perf_counter()
                    self._log({"step": step, "eval_loss": self.evaluate()})
                    paused += self._count("eval", start)
                # Read the previous step's counter so one step stays in flight. Skipped steps left the
                # parameters as the last finite step made them, so the state saved here is a good one.
                bad = None if self._pending_bad is None else int(host_value(self._pending_bad))
                if bad == 0:  # the previous step was finite: the save it trained from is proven
                    self.checkpointer.proof.trained_cleanly(step - 1)
                if bad is not None and bad >= t.max_bad_steps:
                    self._stop_on_bad_steps()
                    break
                self._pending_bad = metrics["bad_steps"]
                stopping = self.stop.should_stop(step)
                force = step == t.steps or stopping
                if force or (self.config.checkpoint.every and step % self.config.checkpoint.every == 0):
                    # Saving waits for the step in flight: finish it first so that the wait counts as training.
                    jax.block_until_ready(self.state)
                    if int(host_value(metrics["bad_steps"])) == 0:  # the step is done: read with no wait
                        self.checkpointer.proof.trained_cleanly(step)
                start = time.perf_counter()
                self.checkpointer.save(step, self.state, self.train_data.get_state(), force=force)
                paused += self._count("checkpoints", start)
                if stopping:
                    self.checkpointer.wait()
                    self.stop_reason = self.stop.clear()
                    self.logger.message(
                        f"maxmoe: {self.stop_reason}: saved step {step} in {self.checkpointer.directory}; exiting"
                    )
                    break
            skipped = int(host_value(self.state.skipped)) - self._skipped_at_start
            if skipped and (self.finished or self.stop_reason):
                self.logger.message(
                    f"maxmoe: {skipped} of the {self.step - self.start_step} steps of this run had a non-finite "
                    f"loss or gradient norm and were skipped (skipped_steps in {self.logger.path})"
                )
        return [r for r in self.history[first_record:] if "loss" in r]

    def _count(self, part: str, start: float) -> float:
        """Seconds since `start`, counted under `part`: time kept out of tokens/s and ETA."""
        seconds = time.perf_counter() - start
        self._seconds[part] += seconds
        return seconds

    def _report_profile(self, profile) -> None:
        """Where the traced steps' device time went, by kernel class (maxmoe.analysis.trace_breakdown):
        on the console and in profile/breakdown.json, the compiled program beside the trace."""
        if not self.is_main:
            return
        out, t = self.run_dir / "profile", self.config.train
        try:
            (out / "program.hlo.txt").write_text(self._train_step.as_text())
            flops = model_flops_by_class(self.config.model, t.seq_len, t.batch_size * t.seq_len / len(self.devices))
            breakdown = profile_breakdown(out, steps=profile[1] - profile[0] + 1, flops=flops)
            (out / "breakdown.json").write_text(json.dumps(breakdown.as_dict(), indent=1))
        except (UserError, OSError) as e:
            self._say(f"maxmoe: the trace in {out} was written; its breakdown could not be read ({e})")
            return
        for line in format_table(breakdown).splitlines():
            self._say(line)

    @contextlib.contextmanager
    def _trace_closed(self):
        """A run that stops inside run.profile_steps (signal, bad steps, `run(n)`) still writes its trace."""
        try:
            yield
        finally:
            if self._tracing:
                jax.profiler.stop_trace()
                self._tracing = False

    def _log_step(self, step: int, host: dict, step_time: float) -> None:
        t = self.config.train
        tokens_per_s = t.batch_size * t.seq_len / step_time
        per_device = tokens_per_s / len(self.devices)
        self.expert_loads.append((step, np.asarray(host["expert_load"])))
        self._log(
            {
                "step": step,
                **{k: host[k] for k in ("loss", "lm_loss", "mtp_loss", "grad_norm")},
                "lr": float(self._schedule(step - 1)),
                "tokens_per_s": tokens_per_s,
                "step_time_s": step_time,
                "tflops_per_device": per_device * self._flops_per_token / 1e12,
                "mfu": mfu(per_device, self._flops_per_token, self._peak),
                "moe_imbalance": host["moe_imbalance"],
                "moe_layer_imbalance": host["moe_layer_imbalance"],
                "router_bias_spread": host["router_bias_spread"],
                "dropped_frac": host["dropped_frac"],
                "seq_aux": host["seq_aux"],
                "skipped_steps": host["skipped"],
            }
        )

    def _log(self, record: dict) -> None:
        self.history.append(self.logger.log(record))

    def _stop_on_bad_steps(self) -> None:
        t = self.config.train
        self.save()
        self.stop_reason = BAD_STEPS
        proven = self.checkpointer.proof.proven
        kept = (
            f"step {proven}, the last step that trained cleanly, is kept"
            if proven is not None and proven != self.step
            else "no step saved before them has trained cleanly"
        )
        if self.is_main:
            print(
                f"maxmoe: stopping: {t.max_bad_steps} consecutive steps had a non-finite loss or gradient "
                f"norm and were skipped; step {self.step} in {self.checkpointer.directory} holds the parameters "
                f"from before them; {kept}",
                file=sys.stderr,
            )

    # -- evaluation, state, saving -----------------------------------------------------------

    def evaluate(self) -> float:
        """Mean next-token loss (nats, no MTP) over the train.eval_batches held-out batches."""
        self._check_open()
        params, router = self.state.params, self.state.router
        batches = [self._to_device(b) for b in self._dataset("eval")]
        if self._eval_step is None:
            self._eval_step = self._compiled("the eval step", self.programs.eval_step, params, router, batches[0])
        losses = [self._eval_step(params, router, b) for b in batches]
        return float(np.mean([host_value(x) for x in losses]))

    @property
    def variables(self) -> dict:
        """{'params', 'router'}: what `maxmoe.model.logits` and `maxmoe.generate` take."""
        return {"params": self.state.params, "router": self.state.router}

    @property
    def expert_load(self) -> np.ndarray | None:
        """Token copies per expert at the last logged step, [MoE layers (main stack, then MTP), experts]."""
        return self.expert_loads[-1][1] if self.expert_loads else None

    def save(self) -> None:
        """Checkpoint the current step now and wait until it is on disk."""
        self._check_open()
        self.checkpointer.save(self.step, self.state, self.train_data.get_state(), force=True)
        self.checkpointer.wait()

    def close(self) -> None:
        """Finish pending saves and close the metrics files; safe to call twice.

        SIGTERM/SIGINT meanwhile are noted, not fatal: the last checkpoint completes first.
        """
        self._closed = True
        with self.stop.installed():
            if self.logger is not None:
                self.logger.close()
            self.checkpointer.close()
            if self.lock is not None:
                self.lock.release()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _python() -> str:
    """How to name this interpreter in a suggested command: relative when it lives under the current folder."""
    relative = os.path.relpath(sys.executable)
    return relative if not relative.startswith("..") and os.sep in relative else "python"


def _seconds(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 60 else format_duration(seconds)


def summary(trainer: Trainer) -> list[str]:
    """The closing lines of a run: what it did, how long each part took, where its files are, what next."""
    t, run_dir, took = trainer.config.train, trainer.run_dir, trainer._seconds
    steps = trainer.step - trainer.start_step
    wall = time.perf_counter() - trainer._started
    how = f"stopped ({trainer.stop_reason})" if trainer.stop_reason else "done"
    parts = ", ".join(f"{_seconds(seconds)} {part}" for part, seconds in took.items() if seconds >= 0.05)
    lines = [
        f"maxmoe: {how}: steps {trainer.start_step}->{trainer.step} of {t.steps}, {steps * t.batch_size * t.seq_len:,} "
        f"tokens in {_seconds(wall)}" + (f" ({parts})" if parts else "")
    ]
    last = {key: r[key] for r in trainer.history for key in ("loss", "eval_loss") if r.get(key) is not None}
    if last:
        lines.append("maxmoe: final " + ", ".join(f"{key} {value:.4f}" for key, value in last.items()))
    tensorboard = (
        f"TensorBoard events in {run_dir / 'tensorboard'}"
        if trainer.config.run.tensorboard
        else "TensorBoard: add run.tensorboard=true"
    )
    saved = trainer.checkpointer.latest_step()
    lines.append(
        f"maxmoe: {run_dir}/: checkpoints/ (step {saved}), metrics.jsonl, config.yaml; {tensorboard}"
        if saved is not None
        else f"maxmoe: {run_dir}/: metrics.jsonl, config.yaml; {tensorboard}"
    )
    python = _python()
    if trainer.stop_reason and trainer.stop_reason != BAD_STEPS:
        lines.append("maxmoe: next: the same command again resumes from the last checkpoint")
    prompt = "def main(" if trainer.config.data.kind == "stdlib" else "The"
    lines.append(
        f'maxmoe: next: {python} -m maxmoe.generate --run {shlex.quote(str(run_dir))} --prompt "{prompt}" '
        f"--max-new-tokens 120 --temperature 0.6 --top-k 5"
    )
    quoted = shlex.quote(str(run_dir))  # a run.dir with spaces or quotes: the command still runs as shown
    lines.append(f"maxmoe:       {python} -m maxmoe.report {quoted}    # writes {run_dir / 'report.png'}")
    return lines


def train(config: Config, devices: Sequence[Any] | None = None, *, stop: StopSignal | None = None) -> int:
    """Run the job described by `config` to train.steps; returns the process exit status.

    0 when done or stopped by SIGTERM/SIGINT/SIGHUP (saved), 1 when train.max_bad_steps stopped it.
    Signal handlers are in place from the start (set-up, compiling and the last save included;
    `stop`: the command line's, installed before jax was imported) and restored on return; a
    signal before the first step stops the job with nothing trained, and a second SIGINT exits
    at once (status 130).
    """
    stop = stop or StopSignal(exit_on_second_interrupt=True)
    with stop.installed():
        if stop.say_stopped(f"run.dir {config.run.dir} was not touched"):
            return 0
        return _train(config, devices, stop)


def _train(config: Config, devices: Sequence[Any] | None, stop: StopSignal) -> int:
    with Trainer(config, devices, stop=stop) as trainer:
        if trainer.finished:
            return 0  # the Trainer said so
        trainer.run()
        if trainer.is_main and config.run.progress != "none":
            trainer.logger.display.close()  # the summary goes below the bar's last state
            print("\n".join(summary(trainer)), flush=True)
        return 1 if trainer.stop_reason == BAD_STEPS else 0
