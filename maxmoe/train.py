"""`python -m maxmoe.train --config configs/X.yaml [key=value ...]`: the training job, top to bottom.

    python -m maxmoe.train --config configs/tiny.yaml                     # 1 CPU device
    python -m maxmoe.train --config configs/tiny.yaml run.cpu_devices=8 mesh.data=2 mesh.expert=4

Steps: parse the config; set up the process (host devices, XLA flags, jax.distributed);
build the mesh; build the data; initialise or restore the state; jit the step with
explicit shardings; loop (log, evaluate, checkpoint); save at the end or on SIGTERM.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import numpy as np

from maxmoe import data, runtime, xla_flags
from maxmoe.cli import config_from_args, exit_with, main_guard, make_parser
from maxmoe.config import Config, UserError
from maxmoe.flops import flops_per_token, mfu, peak_tflops
from maxmoe.mesh import build_layout
from maxmoe.training import checkpoint
from maxmoe.training.metrics import MetricsLogger
from maxmoe.training.optim import learning_rate_schedule
from maxmoe.training.preemption import StopSignal
from maxmoe.training.programs import build_programs
from maxmoe.training.run_dir import claim_run_dir


def host_value(x) -> np.ndarray:
    """A replicated array on the host, read from this process's own copy (with several processes,
    `jax.device_get` refuses arrays that span devices of other processes; every copy is equal)."""
    return np.asarray(x.addressable_data(0))


def host_scalar(x) -> int:
    return int(host_value(x))


def train(config: Config) -> int:
    """Run the job described by `config`; returns the process exit status."""
    # -- process setup: before any jax computation starts a backend ------------------------
    flags = runtime.setup(config)
    config = data.resolve_vocab_size(config)  # model.vocab_size=auto: from the data

    is_main = jax.process_index() == 0
    run_dir = Path(config.run.dir)
    ckpt = checkpoint.Checkpointer(config, run_dir)
    ckpt.check_start()
    # Before anything compiles: run.dir must be writable and no other job may be using it.
    lock = claim_run_dir(run_dir, jax.process_index(), jax.process_count())
    stop = None

    try:
        # -- mesh ------------------------------------------------------------------------------
        layout = build_layout(config)
        devices = layout.mesh.size

        # -- data ------------------------------------------------------------------------------
        train_data = data.make_dataset(
            config, split="train", process_index=jax.process_index(), process_count=jax.process_count()
        )

        def to_device(local_batch):
            return jax.make_array_from_process_local_data(
                layout.sharding(("batch", None)), np.asarray(local_batch, np.int32)
            )

        # -- state: init or restore; the compiled steps ----------------------------------------
        # From here on, SIGTERM/SIGINT mean "save and stop after this step" (the same step on every process).
        stop = StopSignal(jax.process_count())
        programs = build_programs(config, layout)
        rng = jax.random.key(config.train.seed)
        restored = ckpt.restore_latest(programs.abstract_state)
        if restored is not None:
            state, start = restored.state, restored.step
            train_data.set_state(restored.data)
        else:
            state = programs.init(rng)
            if config.checkpoint.init_from:
                state = state.replace(**checkpoint.load_params(config.checkpoint.init_from, programs.abstract_state))
            start = 0
        t = config.train
        if start >= t.steps:
            if is_main:
                print(
                    f"maxmoe: run.dir {run_dir} already finished step {start} of {t.steps}; "
                    f"raise train.steps to continue"
                )
            return 0
        train_step, eval_step = programs.train_step, programs.eval_step

        def evaluate(state) -> float:
            losses = [
                eval_step(state.params, state.router, to_device(b))
                for b in data.make_dataset(
                    config, split="eval", process_index=jax.process_index(), process_count=jax.process_count()
                )
            ]
            return float(np.mean([host_value(x) for x in losses]))

        # -- loop ------------------------------------------------------------------------------
        tokens_per_step = t.batch_size * t.seq_len
        flops_token = flops_per_token(config.model, t.seq_len)
        peak = config.run.peak_tflops or peak_tflops(jax.devices()[0].device_kind)
        schedule = learning_rate_schedule(t)
        logger = MetricsLogger(
            run_dir,
            enabled=is_main,
            total_steps=t.steps,
            start_step=start,
            tensorboard=config.run.tensorboard,
            progress=config.run.progress,
        )
        if is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(config.to_yaml())
            xla_flags.write_effective(run_dir, flags)
            shape = " x ".join(f"{k}={v}" for k, v in layout.shape.items())
            logger.message(
                f"maxmoe: {devices} {jax.devices()[0].platform} device(s), mesh {shape}, "
                f"{train_data.description}, steps {start}->{t.steps}"
            )
            for part, choice in (("grouped matmul", layout.grouped_matmul), ("attention", layout.attention)):
                logger.message(f"maxmoe: {part}: {choice.name} ({choice.reason})")
        profile = config.run.profile_steps
        # Compile ahead of the loop, so that no step's time (or tokens/s, or ETA) includes it.
        batch = to_device(next(train_data))
        logger.message("maxmoe: compiling the train step ...")
        compile_start = time.perf_counter()
        train_step = train_step.lower(state, batch).compile()
        logger.message(f"maxmoe: compiled in {time.perf_counter() - compile_start:.1f}s")
        skipped_before = host_scalar(state.skipped)
        last_time, last_step, pending = time.perf_counter(), start, None
        step = start
        while step < t.steps:
            if profile and step == profile[0]:
                jax.profiler.start_trace(str(run_dir / "profile"))
            state, metrics = train_step(state, batch if step == start else to_device(next(train_data)))
            step += 1
            if profile and step == profile[1] + 1:
                jax.profiler.stop_trace()
            if step % t.log_every == 0 or step == t.steps:
                host = {k: host_value(v) for k, v in metrics.items()}
                now = time.perf_counter()
                step_time = (now - last_time) / (step - last_step)
                last_time, last_step = now, step
                tokens_per_s = tokens_per_step / step_time
                per_device = tokens_per_s / devices
                logger.log(
                    {
                        "step": step,
                        **{k: host[k] for k in ("loss", "lm_loss", "mtp_loss", "grad_norm")},
                        "lr": float(schedule(step - 1)),
                        "tokens_per_s": tokens_per_s,
                        "step_time_s": step_time,
                        "tflops_per_device": per_device * flops_token / 1e12,
                        "mfu": mfu(per_device, flops_token, peak),
                        "moe_imbalance": host["moe_imbalance"],
                        "moe_layer_imbalance": host["moe_layer_imbalance"],
                        "router_bias_spread": host["router_bias_spread"],
                        "dropped_frac": host["dropped_frac"],
                        "seq_aux": host["seq_aux"],
                        "skipped_steps": host["skipped"],
                    }
                )
            if step % t.eval_every == 0 or step == t.steps:
                logger.log({"step": step, "eval_loss": evaluate(state)})
                last_time = time.perf_counter()  # evaluation is not training time
            # Read the previous step's counter so one step stays in flight. Skipped steps left the
            # parameters as the last finite step made them, so the state saved here is a good one.
            if pending is not None and host_scalar(pending) >= t.max_bad_steps:
                ckpt.save(step, state, train_data.get_state(), force=True)
                ckpt.close()
                logger.close()
                if is_main:
                    print(
                        f"maxmoe: stopping: {t.max_bad_steps} consecutive steps had a non-finite loss or gradient "
                        f"norm and were skipped; the last good parameters are saved as step {step} in "
                        f"{ckpt.directory}",
                        file=sys.stderr,
                    )
                return 1
            pending = metrics["bad_steps"]
            stopping = stop.should_stop(step)
            ckpt.save(step, state, train_data.get_state(), force=step == t.steps or stopping)
            if stopping:
                ckpt.wait()
                logger.message(f"maxmoe: {stop.requested}: saved step {step} in {ckpt.directory}; exiting")
                break
        skipped = host_scalar(state.skipped) - skipped_before
        if skipped:
            logger.message(
                f"maxmoe: {skipped} of the {step - start} steps of this run had a non-finite loss or gradient norm "
                f"and were skipped (skipped_steps in {logger.path})"
            )
        logger.close()
        return 0
    finally:
        ckpt.close()  # finish pending saves before any exit, error or not
        lock.release()
        if stop is not None:
            stop.restore()


@main_guard
def main(argv: list[str] | None = None) -> int:
    parser = make_parser("python -m maxmoe.train", __doc__.splitlines()[0])
    args = parser.parse_args(argv)
    return train(config_from_args(args))


if __name__ == "__main__":
    exit_with(main())


__all__ = ["main", "train", "UserError"]
