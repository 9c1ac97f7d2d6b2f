"""Training throughput of a config on the current devices: tokens/s, TFLOP/s per device, MFU.

    PYTHONPATH=. python benchmarks/step.py --config configs/proxy_1gpu.yaml [--steps 10 --warmup 2]
        [--variant model.remat=full --variant model.remat=save_dots_comm] [--json OUT] [key=value ...]

Sets up the process as `python -m maxmoe.train` does (host devices, the config's XLA flag
profile), builds the mesh from the config, compiles the donated train step and times
--steps steps on one synthetic batch after --warmup. Each --variant (space-separated
key=value overrides) is timed in this same process; an XLA flag profile is fixed for the
process, so compare profiles in separate runs. A variant that fails (out of memory, a kernel
that does not run here) is listed with its error; the table is ranked by tokens/s, best
first, and names the grouped matmul and attention each variant resolved to.
"""

import json
import os
import shlex
import sys
from pathlib import Path

import jax

from maxmoe import runtime
from maxmoe.cli import config_from_args, main_guard, make_parser
from maxmoe.config import UserError, load_config
from maxmoe.parallel.layout import build_layout
from maxmoe.sweep import time_shape


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
    args = parser.parse_args(argv)
    if not args.config:
        raise UserError("--config FILE is required")
    if args.steps <= 0 or args.warmup < 0:
        raise UserError("--steps must be positive and --warmup non-negative")
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
    write_json(args.json, command, flags, rows)
    return 0


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
