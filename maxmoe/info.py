"""`python -m maxmoe.info`: parameter counts, FLOPs and kernel choices of a config, without allocating parameters.

python -m maxmoe.info --config configs/deepseek_v3_671b.yaml [key=value ...] [--json]
python -m maxmoe.info --config configs/proxy_1gpu.yaml --platform cuda --device-kind "NVIDIA H200" --json
python -m maxmoe.info --config configs/tiny.yaml run.cpu_devices=8 mesh.expert=8 --lower cuda
python -m maxmoe.info --config configs/tiny.yaml run.cpu_devices=8 mesh.pipeline=2 mesh.expert=4 train.grad_accum=2 --lower cuda
python -m maxmoe.info --config configs/proxy_1gpu.yaml model.num_layers=2 --compile-for h200
python -m maxmoe.info --check      # this device's kernels against XLA (maxmoe.check); no config needed

The kernel choices are what `auto` (or the config) resolves to for --platform (default: this
process's) and --device-kind (default: this device's on this platform; on another platform
unknown, which on CUDA counts as Hopper): `grouped_matmul`, `attention` and the reasons.
--compile-for SYSTEM compiles one train step with XLA:GPU for that system's GPU, no GPU needed
(jax's CUDA plugin is: maxmoe.analysis.gpu_compile), and prints its memory per device, kernels
and collectives.
"""

from __future__ import annotations

import json
import sys

from maxmoe import runtime
from maxmoe.analysis.flops import count_params, flops_per_token
from maxmoe.analysis.gpu_compile import SYSTEMS as GPU_SYSTEMS
from maxmoe.analysis.gpu_compile import compiler_problem, step_report, use_profile
from maxmoe.analysis.hlo import count_collectives
from maxmoe.analysis.lowering import lower_train_step, stage_spans
from maxmoe.cli import config_from_args, main_guard, make_parser
from maxmoe.config import UserError
from maxmoe.data import resolve_vocab_size

PLATFORMS = ("cpu", "cuda", "gpu", "rocm", "tpu")  # jax's platform names ('gpu' is cuda here)


@main_guard
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--check" in argv:  # the on-device kernel check needs no config: its own arguments follow
        from maxmoe import check

        config_words = ("--config", "--print-config")
        given = [a for a in argv if a.split("=", 1)[0] in config_words or ("=" in a and not a.startswith("-"))]
        if given:
            raise UserError(
                f"--check checks this device's kernels and reads no config: drop {given[0]} "
                f"(and the other config arguments); see python -m maxmoe.check --help"
            )

        return check.main([a for a in argv if a != "--check"])
    parser = make_parser("python -m maxmoe.info", __doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--check", action="store_true", help="check this device's kernels against XLA (python -m maxmoe.check --help)"
    )
    parser.add_argument(
        "--lower",
        choices=["cuda"],
        help="lower one train step for this platform and count its collectives (no GPU needed)",
    )
    parser.add_argument(
        "--platform",
        choices=PLATFORMS,
        help="platform the kernels are chosen for: cpu, cuda (gpu), rocm, tpu (default: this one)",
    )
    parser.add_argument("--device-kind", help='GPU model, e.g. "NVIDIA H200" or "NVIDIA GB300"')
    parser.add_argument(
        "--compile-for",
        choices=GPU_SYSTEMS,
        help="compile one train step with XLA:GPU for this system's GPU (no GPU needed: jax's CUDA plugin is); "
        "memory per device, kernels, collectives",
    )
    args = parser.parse_args(argv)
    config = config_from_args(args, resolve_vocab_size)

    if args.compile_for:
        problem = compiler_problem()
        if problem:
            raise UserError(f"--compile-for {args.compile_for}: {problem}")
        runtime.use_cpu_devices(1)  # no CUDA backend: the plugin only compiles (before jax starts one)
        use_profile(config, args.compile_for)
        report = step_report(config, args.compile_for)
        print(json.dumps(report) if args.json else _describe_compiled(report))
        return 0

    if args.lower:
        runtime.set_host_device_count(config.run.cpu_devices)
        text = lower_train_step(config, args.lower).as_text()
        counts = count_collectives(text)
        # With stages: which collectives stay inside a stage and which cross between stages.
        spans = stage_spans(config, text) if config.mesh.pipeline > 1 else None
        if args.json:
            print(json.dumps(counts if spans is None else {**counts, "pipeline_stages": spans}))
        else:
            for name, count in counts.items():
                where = "" if not spans or not count else f" ({_describe_spans(spans[name])})"
                print(f"{name}: {count}{where}")
        return 0

    report = dict(count_params(config.model))
    report["flops_per_token"] = flops_per_token(config.model, config.train.seq_len)
    report["seq_len"] = config.train.seq_len
    report.update(kernel_report(config, args.platform, args.device_kind))
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>21}: {value:,.0f}" if isinstance(value, (int, float)) else f"{key:>21}: {value}")
    return 0


def _describe_compiled(r: dict) -> str:
    """`step_report`'s figures as lines of text (GB = 1e9 bytes, per device)."""
    m = r["memory"]
    lines = [
        f"{r['compiler']}: {r['devices']} devices, mesh {r['mesh']}; grouped_matmul {r['grouped_matmul']}, "
        f"attention {r['attention']} (lower {r['lower_s']:.0f} s, compile {r['compile_s']:.0f} s)",
        f"memory per device: arguments {m['argument'] / 1e9:.2f} GB, outputs {m['output'] / 1e9:.2f}, aliased "
        f"{m['alias'] / 1e9:.2f}, temp {m['temp'] / 1e9:.2f}; total {m['total'] / 1e9:.2f} GB",
        "kernels: " + ", ".join(f"{name} x{count}" for name, count in r["kernels"].items()),
        "collectives per device per step:",
    ]
    for kind, c in r["collectives"].items():
        lines.append(
            f"  {kind}: {c['ops']} runs, {c['bytes'] / 1e9:.3f} GB; {c.get('async', 0)} async "
            f"({c.get('with_compute', 0)} with work scheduled inside), {c.get('sync', 0)} sync"
        )
    return "\n".join(lines + [f"note: {n}" for n in r["notes"]])


def _describe_spans(spans: dict[str, int]) -> str:
    words = {"inside": "inside one stage", "across": "across stages", "mixed": "some groups across stages"}
    return ", ".join(f"{count} {words[kind]}" for kind, count in spans.items())


def kernel_report(config, platform: str | None, device_kind: str | None) -> dict:
    """The grouped matmul and attention `auto` resolves to on a platform, with the reasons and
    the table of measured kernel rates `auto` chooses by on a GPU."""
    from maxmoe.kernels.choice import resolve_kernels
    from maxmoe.kernels.rates import DEFAULT_RATES, load_rates

    kernels = resolve_kernels(config, platform, device_kind)
    table = load_rates(DEFAULT_RATES)
    kinds = sorted({r.device_kind for r in table.rates})
    return {
        "platform": kernels.platform,
        "device_kind": kernels.device_kind,
        "grouped_matmul": kernels.grouped_matmul.name,
        "grouped_matmul_reason": kernels.grouped_matmul.reason,
        "attention": kernels.attention.name,
        "attention_reason": kernels.attention.reason,
        # where `auto` reads its measured rates on a GPU (maxmoe.kernels.rates)
        "kernel_rates": f"{table.path} ({len(table.rates)} rates: {', '.join(kinds) or 'none'})",
        "loss_chunk": config.train.loss_chunk,
    }


if __name__ == "__main__":
    sys.exit(main())
