"""Training throughput of a config on the current devices: tokens/s, TFLOP/s per device, MFU.

    PYTHONPATH=. python benchmarks/step.py --config configs/proxy_1gpu.yaml [--steps 10 --warmup 2]
        [--variant model.remat=full --variant model.remat=save_dots_comm] [--json OUT] [key=value ...]

Sets up the process as `python -m maxmoe.train` does (host devices, the config's XLA flag
profile), builds the mesh from the config, compiles the donated train step and times
--steps steps on one synthetic batch after --warmup. Each --variant (space-separated
key=value overrides) is timed in this same process; an XLA flag profile is fixed for the
process, so compare profiles in separate runs. A variant that fails (out of memory, a kernel
that does not run here) is listed with its error; the table is ranked by tokens/s, best
first, and names the grouped matmul and attention each variant resolved to. --profile DIR traces
--profile-steps more steps of the first variant that ran (jax.profiler, after its timing) and
prints where their time went (maxmoe.analysis.trace_breakdown), written as DIR/breakdown.json.
"""

import json
import os
import shlex
import sys
from pathlib import Path

import jax

from maxmoe import runtime
from maxmoe.analysis.trace_breakdown import Breakdown, format_table, model_flops_by_class, profile_breakdown
from maxmoe.cli import config_from_args, main_guard, make_parser
from maxmoe.config import UserError, load_config
from maxmoe.parallel.layout import build_layout
from maxmoe.sweep import time_shape
from maxmoe.training.programs import build_programs


@main_guard
def main(argv=None):
    parser = make_parser("benchmarks/step.py", __doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="'k=v k=v'",
        help="extra overrides for one timed variant (repeatable)",
    )
    parser.add_argument("--label", default="", help="a name for this run in the table and JSON")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--profile", metavar="DIR", help="trace the first variant's steps and break them down")
    parser.add_argument("--profile-steps", type=int, default=3, help="steps traced with --profile")
    args = parser.parse_args(argv)
    if not args.config:
        raise UserError("--config FILE is required")
    if args.steps <= 0 or args.warmup < 0 or args.profile_steps <= 0:
        raise UserError("--steps and --profile-steps must be positive and --warmup non-negative")
    base = config_from_args(args)
    variants = [(v, load_config(args.config, list(args.overrides) + v.split())) for v in args.variant] or [("", base)]

    flags = runtime.setup(base, distributed_init=False)  # one process: no jax.distributed
    command = " ".join(
        shlex.quote(a) for a in [f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}", sys.executable] + sys.argv
    )
    rows = []
    for name, config in variants:
        row = {"label": args.label, "variant": name or "-", "profile": config.xla.profile}
        try:
            layout = build_layout(config)
            row.update(
                mesh=layout.shape,
                kernels=f"{layout.grouped_matmul.name}+{layout.attention.name}",
                **time_shape(config, layout, args.steps, args.warmup),
            )
        except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        rows.append(row)
        write_json(args.json, command, flags, rows)
        if args.profile and "error" not in row and not any("breakdown" in r for r in rows):
            try:
                row["breakdown"] = profile_steps(config, layout, args.profile_steps, Path(args.profile))
            except Exception as e:  # noqa: BLE001 - the timing stands; the profile's failure is reported
                row["breakdown_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            write_json(args.json, command, flags, rows)
    rows.sort(key=lambda r: -r.get("tokens_per_s", -1.0))
    device = jax.devices()[0]
    print(f"$ {command}")
    print(
        f"jax {jax.__version__}, {jax.device_count()} x {device.platform} {device.device_kind}, "
        f"XLA flags: {' '.join(flags) or '(none)'}"
    )
    head = (
        f"{'run':<14} {'variant':<44} {'kernels':<18} {'tokens/s':>10} {'TFLOP/s/dev':>11} {'MFU':>6} {'step s':>8} "
        f"{'compile s':>9} {'loss':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['label'] or '-':<14} {r['variant']:<44} {'-':<18} failed: {r['error']}")
            continue
        mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "n/a"
        print(
            f"{r['label'] or '-':<14} {r['variant']:<44} {r['kernels']:<18} {r['tokens_per_s']:10.0f} {r['tflops_per_device']:11.3f} "
            f"{mfu:>6} {r['step_s']:8.4f} {r['compile_s']:9.1f} {r['loss']:8.4f}"
        )
    for r in rows:
        if "breakdown" in r:
            print(format_table(Breakdown.from_dict(r["breakdown"])))
        elif "breakdown_error" in r:
            print(f"profile of {r['variant']} failed: {r['breakdown_error']}")
    write_json(args.json, command, flags, rows)
    return 1 if any("error" in r or "breakdown_error" in r for r in rows) else 0


def profile_steps(config, layout, steps: int, out: Path) -> dict:
    """Trace `steps` train steps (after one untraced) into `out`, with the program's HLO beside the
    trace; the breakdown of their device time, as a dict (trace_breakdown.Breakdown.as_dict)."""
    import numpy as np

    programs = build_programs(config, layout)
    compiled = programs.train_step.trace(programs.abstract_state, programs.abstract_batch(config)).lower().compile()
    out.mkdir(parents=True, exist_ok=True)
    (out / "program.hlo.txt").write_text(compiled.as_text())
    state = programs.init(jax.random.key(config.train.seed))
    t = config.train
    rng = np.random.default_rng(0)
    batch = rng.integers(0, config.model.vocab_size, (t.batch_size, t.seq_len + 1), dtype=np.int32)
    tokens = jax.device_put(batch, programs.batch_sharding)
    state, metrics = compiled(state, tokens)
    jax.block_until_ready((state, metrics))
    jax.profiler.start_trace(str(out))
    try:
        for _ in range(steps):
            state, metrics = compiled(state, tokens)
        jax.block_until_ready((state, metrics))
    finally:
        jax.profiler.stop_trace()
    flops = model_flops_by_class(config.model, t.seq_len, t.batch_size * t.seq_len / layout.mesh.size)
    breakdown = profile_breakdown(out, steps=steps, flops=flops)
    (out / "breakdown.json").write_text(json.dumps(breakdown.as_dict(), indent=1))
    return breakdown.as_dict()


def write_json(path, command, flags, rows):
    """The results so far (written after every variant, so a run cut short keeps what it measured)."""
    if not path:
        return
    import jax

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(
        json.dumps(
            {
                "command": command,
                "xla_flags": flags,
                "jax": jax.__version__,
                "device_kind": jax.devices()[0].device_kind,
                "runs": sorted(rows, key=lambda r: -r.get("tokens_per_s", -1.0)),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
