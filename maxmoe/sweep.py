"""`python -m maxmoe.sweep --config C --devices N [--dry-run]`: every (data, expert, tensor) mesh for N devices, ranked.

    python -m maxmoe.sweep --config configs/tiny.yaml --devices 8 --dry-run --json runs/sweep/tiny.json
    python -m maxmoe.sweep --config configs/proxy_1gpu.yaml --steps 10          # time on the real devices
    python -m maxmoe.sweep --config C --replan IN.json --assume NAME=VALUE      # predict a dry run again

Shapes: every (data, expert, tensor) of N / P devices for each pipeline size P (`--pipeline`, or
the `--mesh` ones) that the model, batch, scale-up domain and sharding rules accept; the others
are listed as skipped, each with its reason. --dry-run compiles one step per shape
(maxmoe.analysis.dry_run: XLA:GPU for the --system's GPU where jax's CUDA plugin is installed,
else XLA:CPU on N fake CPU devices) and reports memory, collective bytes, FLOPs, the pipeline
bubble and the planner's prediction; without it each shape is timed on the real devices.
Output: a ranked table, --json, --plot; --write-config writes the best-ranked shape that fits.
Options and method: docs/PERFORMANCE.md, "Mesh sweep: `maxmoe.sweep`".
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np

from maxmoe import runtime
from maxmoe.analysis import gpu_compile
from maxmoe.analysis.assumptions import Assumptions, assume
from maxmoe.analysis.assumptions import table as assumption_table
from maxmoe.analysis.calibration import load_calibration
from maxmoe.analysis.dry_run import GB, METHOD, dry_run_shape
from maxmoe.analysis.flops import flops_per_token, mfu, peak_tflops
from maxmoe.analysis.planner import SYSTEMS
from maxmoe.analysis.sweep_plan import format_predictions, rank, replan_main, with_mesh, write_winner
from maxmoe.analysis.sweep_table import COMPACT_COLUMNS, DRY_RUN_COLUMNS, format_table, parse_columns
from maxmoe.cli import check_output_file, config_from_args, main_guard, make_parser
from maxmoe.config import MAX_CPU_DEVICES, Config, ConfigError, UserError
from maxmoe.data import resolve_vocab_size
from maxmoe.parallel.layout import Layout, build_layout
from maxmoe.parallel.mesh import build_mesh, check_divisible, resolve_rules, resolve_shape
from maxmoe.parallel.names import SIZED_MESH_AXES
from maxmoe.training import step as step_lib
from maxmoe.training.optim import make_optimizer
from maxmoe.training.programs import build_programs
from maxmoe.training.progress import ProgressDisplay

AXES = SIZED_MESH_AXES  # the sizes a shape sets; replica follows from mesh.across_domains

# ---------------------------------------------------------------------------------------
# Shapes


def parse_mesh(text: str) -> dict[str, int]:
    """'pipeline=2,data=2,expert=4,tensor=1' -> sizes (missing axes are 1)."""
    sizes = {a: 1 for a in AXES}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in AXES:
            raise UserError(f"--mesh {text!r}: expected data=A,expert=B,tensor=C (and pipeline=P)")
        try:
            sizes[key] = int(value)
        except ValueError:
            raise UserError(f"--mesh {text!r}: {key}={value!r} is not an integer") from None
        if sizes[key] <= 0:
            raise UserError(f"--mesh {text!r}: {key} must be positive")
    return sizes


def factorisations(n: int, pipelines: tuple[int, ...] = (1,)) -> list[dict[str, int]]:
    """Every (pipeline, data, expert, tensor) with pipeline in `pipelines` and the product n."""
    out = []
    for pipeline in pipelines:
        if n % pipeline:
            continue
        stage = n // pipeline
        for tensor in range(1, stage + 1):
            if stage % tensor:
                continue
            for expert in range(1, stage // tensor + 1):
                if (stage // tensor) % expert == 0:
                    out.append(
                        {"pipeline": pipeline, "data": stage // (tensor * expert), "expert": expert, "tensor": tensor}
                    )
    return out


def mesh_name(sizes: dict[str, int]) -> str:
    return ",".join(f"{a}={sizes[a]}" for a in AXES if a not in ("pipeline", "context") or sizes.get(a, 1) > 1)


def candidate_shapes(
    config: Config, devices, meshes: list[dict[str, int]] | None = None, pipelines: tuple[int, ...] = (1,)
):
    """(kept, skipped): kept = [(sizes, mesh)], skipped = [(sizes, reason)], in enumeration order.

    A shape is skipped, with its one-line reason, when the model or batch does not divide, the
    mesh does not fit the scale-up domains, or a sharding rule splits a dimension of the state or
    the batch that the shape does not divide (`mesh.check_divisible`): all before compiling.
    """
    kept, skipped = [], []
    boxed = step_lib.abstract_state(config, make_optimizer(config.train), boxed=True)  # the same for every shape
    batch = (config.train.batch_size, config.train.seq_len + 1)
    for sizes in meshes or factorisations(len(devices), pipelines):
        try:
            shaped = with_mesh(config, sizes)  # validated: the model or batch may not divide
            resolve_shape(shaped, len(devices))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mesh = build_mesh(shaped, devices)
            layout = Layout(mesh, resolve_rules(shaped))
            layout.check_array("the token batch", ("batch", None), batch)
            check_divisible(boxed, layout.rules, layout.shape)
        except ConfigError as e:
            skipped.append((sizes, str(e)))
            continue
        kept.append((sizes, mesh))
    return kept, skipped


# ---------------------------------------------------------------------------------------
# Timing one step on the real devices


def time_shape(config: Config, layout, steps: int = 10, warmup: int = 2) -> dict:
    """Run `warmup` then `steps` train steps on the real devices of `layout`; throughput figures."""
    programs = build_programs(config, layout)
    batch_sharding = programs.batch_sharding
    start = time.perf_counter()
    compiled = programs.train_step.trace(programs.abstract_state, programs.abstract_batch(config)).lower().compile()
    compile_s = time.perf_counter() - start
    state = programs.init(jax.random.key(config.train.seed))
    t = config.train
    rng = np.random.default_rng(0)
    tokens = jax.device_put(
        rng.integers(0, config.model.vocab_size, (t.batch_size, t.seq_len + 1), dtype=np.int32), batch_sharding
    )
    for _ in range(warmup):
        state, metrics = compiled(state, tokens)
    jax.block_until_ready((state, metrics))
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, tokens)
    jax.block_until_ready((state, metrics))
    step_s = (time.perf_counter() - start) / steps
    devices = layout.mesh.size
    tokens_per_s = t.batch_size * t.seq_len / step_s
    per_token = flops_per_token(config.model, t.seq_len)
    kind = jax.devices()[0].device_kind
    peak = config.run.peak_tflops or peak_tflops(kind)
    mem = compiled.memory_analysis()
    total = (
        (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
        if mem is not None
        else None
    )
    return {
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "tflops_per_device": tokens_per_s / devices * per_token / 1e12,
        "mfu": mfu(tokens_per_s / devices, per_token, peak),
        "peak_tflops": peak,
        "device_kind": kind,
        "compile_s": compile_s,
        "loss": float(metrics["loss"]),
        "memory_total": total,
    }


# ---------------------------------------------------------------------------------------
# Output


def measured_text(p: dict) -> str:
    """The measured bubble of a pipeline report, with the dot FLOPs it comes from (maxmoe.analysis.dry_run)."""
    if p.get("bubble_measured") is None:
        return f"measured: - ({p['baseline_error']})" if p.get("baseline_error") else "measured: -"
    return (
        f"{p['bubble_measured']:.3f} (measured: {p['dot_flops'] / 1e12:.4g} dot TFLOP per device "
        f"against {p['dot_flops_ideal'] / 1e12:.4g} at {p['baseline']})"
    )


def plot(results: list[dict], path: str, dry_run: bool, hbm_gb: float) -> str | None:
    """Bar charts per shape (memory and bytes, and the predicted TFLOP/s per GPU where the results
    have predictions; or throughput), titled, written to `path` (said on stdout); returns why not
    when matplotlib is missing, else None.

    The memory panel's unit and scale follow the shapes (MB for a small model); the HBM line is
    drawn when it is within reach of the bars, else named in the legend with its distance."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; no plot"
    ok = [r for r in results if "error" not in r]
    names = [r["name"].replace("data=", "d").replace(",expert=", " e").replace(",tensor=", " t") for r in ok]
    x = range(len(ok))
    try:
        devices = f"{math.prod(parse_mesh(ok[0]['name']).values())} devices"
    except (UserError, IndexError):  # no shape compiled, or a name this parser does not read
        devices = "the devices"
    kinds = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    wire = {k: [r.get("collectives", {}).get(k, 0) / GB for r in ok] for k in kinds}  # --replan: maybe none
    wire = {k: v for k, v in wire.items() if any(v)}
    predicted = [r["prediction"]["tflops_per_gpu"] if r.get("prediction") else 0.0 for r in ok]
    what = "measured throughput"
    if dry_run:
        what = "dry run:\nper-device memory" + (" and bytes on the wire per step" if wire else "")
        what += ", predicted TFLOP/s per GPU" if any(predicted) else ""
        rows = 1 + bool(wire) + any(predicted)
        fig, axes = plt.subplots(rows, 1, figsize=(max(6, len(ok) * 0.9), 3.5 * rows), sharex=True, squeeze=False)
        ax1, *more = axes[:, 0]
        memory = [r["memory"]["total"] for r in ok]
        scale, unit = (GB, "GB") if max(memory, default=0) >= GB else (1e6, "MB")
        ax1.bar(x, [m / scale for m in memory], color="tab:blue")
        largest = max(memory, default=0) / GB
        if largest * 3 >= hbm_gb:
            ax1.axhline(hbm_gb * GB / scale, color="tab:red", linestyle="--", label=f"HBM {hbm_gb:g} GB")
        else:  # a line far above the bars would flatten them
            ax1.plot([], [], color="tab:red", linestyle="--", label=f"HBM {hbm_gb:g} GB (off scale)")
        ax1.set_ylabel(f"memory per device ({unit})")
        ax1.legend()
        if wire:
            ax2, bottom = more.pop(0), [0.0] * len(ok)
            for kind, values in wire.items():
                ax2.bar(x, values, bottom=bottom, label=kind)
                bottom = [b + v for b, v in zip(bottom, values)]
            ax2.set_ylabel("bytes on the wire per device per step (GB)")
            ax2.legend(fontsize="small")
        if more:  # with --system or --replan: the planner's figure, a prediction
            system = next(r["prediction"]["system"] for r in ok if r.get("prediction"))
            more[0].bar(x, predicted, color="tab:green")
            more[0].set_ylabel(f"predicted TFLOP/s per GPU ({system})")
    else:
        fig, ax2 = plt.subplots(figsize=(max(6, len(ok) * 0.9), 4))
        ax2.bar(x, [r["tokens_per_s"] for r in ok])
        ax2.set_ylabel("tokens/s")
    fig.axes[-1].set_xticks(list(x), names, rotation=30, ha="right")
    shapes = f"{len(ok)} shape" + ("" if len(ok) == 1 else "s")
    fig.suptitle(f"mesh shapes for {devices} ({shapes}), {what}", fontsize="medium")
    fig.tight_layout()  # after the title: it keeps the title's lines inside the figure
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"maxmoe: wrote {path}")
    return None


def run_shape(
    config: Config,
    sizes: dict[str, int],
    mesh,
    dry_run: bool,
    hbm_gb: float,
    steps: int,
    warmup: int,
    a2a: str,
    system: str | None = None,
    assumptions=None,
    compiler: str = "cpu",
) -> dict:
    """One shape's result: the dry-run description or the timing, or {"error": ...} if it failed."""
    shaped = with_mesh(config, sizes)
    gpu = system if compiler == "gpu" else None
    try:
        if dry_run:
            described = dry_run_shape(shaped, sizes, mesh, hbm_gb, a2a, system, assumptions=assumptions, gpu=gpu)
            return {"mesh": sizes, "name": mesh_name(sizes), **described}
        layout = build_layout(shaped, list(mesh.devices.flat))
        return {
            "mesh": sizes,
            "name": mesh_name(sizes),
            "devices": mesh.size,
            **time_shape(shaped, layout, steps, warmup),
        }
    except UserError as e:
        return {"mesh": sizes, "name": mesh_name(sizes), "error": str(e)}
    except Exception as e:  # noqa: BLE001 - one shape failing (e.g. out of memory) must not end the sweep
        return {"mesh": sizes, "name": mesh_name(sizes), "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}


def sweep(
    config: Config,
    num_devices: int | None,
    dry_run: bool,
    meshes: list[dict[str, int]] | None = None,
    hbm_gb: float = 141.0,
    steps: int = 10,
    warmup: int = 2,
    a2a: str = "proxy",
    progress: bool = True,
    pipelines: tuple[int, ...] = (1,),
    system: str | None = None,
    assumptions=None,
    compiler: str = "cpu",
) -> dict:
    """Run the sweep; returns {"results": ranked, "skipped": [...], ...}.

    `system` (dry run): a key of maxmoe.analysis.planner.SYSTEMS to predict each shape's throughput on;
    `compiler` "gpu": XLA:GPU compiles for its GPU (maxmoe.analysis.gpu_compile), under its xla.profile.
    """
    gpu = dry_run and compiler == "gpu"
    flags = None
    if dry_run:
        if not num_devices:
            raise UserError("--dry-run needs --devices N")
        if gpu:  # XLA:GPU compiles for the system's devices and runs nothing: the CPU backend only
            jax.config.update("jax_platforms", "cpu")
            flags = gpu_compile.use_profile(config, system)
        else:
            runtime.use_cpu_devices(num_devices)  # before the first jax.devices() starts the backend
    runtime.use_compile_cache(config.run.compile_cache)
    devices = gpu_compile.target_devices(system, num_devices) if gpu else jax.devices()
    if num_devices is None:
        num_devices = len(devices)
    if len(devices) < num_devices:
        raise UserError(
            f"--devices {num_devices}: only {len(devices)} {devices[0].platform} devices are available "
            f"(use --dry-run to compile for fake CPU devices)"
        )
    devices = devices[:num_devices]
    if meshes:
        for sizes in meshes:
            if math.prod(sizes.values()) != num_devices:
                raise UserError(
                    f"--mesh {mesh_name(sizes)} needs {math.prod(sizes.values())} devices, not --devices {num_devices}"
                )
    kept, skipped = candidate_shapes(config, devices, meshes, pipelines)
    if not kept:
        reasons = "; ".join(f"{mesh_name(s)}: {why}" for s, why in skipped[:3])
        raise UserError(f"no valid mesh for {num_devices} devices ({reasons})")
    display = ProgressDisplay(len(kept), mode="auto" if progress else "off", stream=sys.stderr, elapsed=True)
    results = []
    try:
        for done, (sizes, mesh) in enumerate(kept):
            display.update(done, f"{done}/{len(kept)}  compiling {mesh_name(sizes)}")
            results.append(
                run_shape(config, sizes, mesh, dry_run, hbm_gb, steps, warmup, a2a, system, assumptions, compiler)
            )
        display.update(len(kept), f"{len(kept)}/{len(kept)}  done")
    finally:
        display.close()
    return {
        "dry_run": dry_run,
        "devices": num_devices,
        "platform": devices[0].platform,
        "jax": jax.__version__,
        "hbm_gb": hbm_gb,
        "a2a_model": a2a if dry_run and not gpu else "native",
        "compiler": gpu_compile.choose_compiler(compiler, system)[1] if dry_run else None,
        "xla_flags": flags,  # XLA:GPU's: the system's xla.profile, as its GPU runs the step
        "system": system if dry_run else None,
        "assumptions": assumption_table(assumptions or Assumptions()) if dry_run and system else None,
        "batch_size": config.train.batch_size,
        "seq_len": config.train.seq_len,
        "method": METHOD if dry_run else None,
        "results": rank(results, dry_run),
        "skipped": [{"mesh": s, "name": mesh_name(s), "reason": why} for s, why in skipped],
    }


@main_guard
def main(argv: list[str] | None = None) -> int:
    parser = make_parser("python -m maxmoe.sweep", __doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=None, help="device count (dry run: fake CPU devices)")
    parser.add_argument("--dry-run", action="store_true", help="compile without running (--compiler); memory and bytes")
    parser.add_argument(
        "--mesh", action="append", default=[], metavar="data=A,expert=B,tensor=C", help="only these shapes (repeatable)"
    )
    parser.add_argument(
        "--pipeline", default="1", metavar="P[,P...]", help="pipeline sizes to enumerate (without --mesh); default 1"
    )
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON")
    parser.add_argument("--plot", metavar="OUT.png", help="bar charts per shape, with --replan too (needs matplotlib)")
    parser.add_argument(
        "--columns",
        metavar="all|NAME,...",
        help=f"dry run: the table's columns (default {','.join(COMPACT_COLUMNS)}; all: {','.join(DRY_RUN_COLUMNS)})",
    )
    parser.add_argument(
        "--hbm-gb",
        type=float,
        default=None,
        help="per-device memory for `fits` (GB, 1e9 B; default: the --system's, else 141)",
    )
    parser.add_argument(
        "--assume",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="dry run: set one planner assumption (names: maxmoe.analysis.assumptions; repeatable)",
    )
    parser.add_argument(
        "--calibration",
        metavar="RATES.yaml",
        help="dry run: the measured kernel rates each compute class runs at (format: maxmoe.kernels.rates; "
        "default: the committed maxmoe/kernels/rates.yaml)",
    )
    parser.add_argument(
        "--replan",
        metavar="IN.json",
        help="predict again from a dry run's JSON (its stored collectives and memory) under --system and --assume, "
        "without compiling; with --config the same config",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per shape (real devices)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before timing (real devices)")
    parser.add_argument(
        "--a2a",
        choices=("proxy", "emulate"),
        default="proxy",
        help="dry run: ragged all-to-all as a native-shaped stand-in or as the CPU emulation",
    )
    parser.add_argument(
        "--compiler",
        choices=("gpu", "cpu"),
        default=None,
        help="dry run: XLA:GPU for the --system's GPU (default where jax's CUDA plugin is installed: "
        "pip install 'maxmoe[gpu-compile]') or XLA:CPU on fake CPU devices",
    )
    parser.add_argument(
        "--system",
        choices=sorted(SYSTEMS),
        default=None,
        help="dry run: predict step time and TFLOP/s per GPU on this system (default: the config's xla.profile)",
    )
    parser.add_argument(
        "--write-config", metavar="OUT.yaml", help="write the best-ranked shape that fits as a full config"
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if not args.config:
        raise UserError("--config FILE is required")
    if args.devices is not None and (args.devices <= 0 or args.dry_run and args.devices > MAX_CPU_DEVICES):
        limit = f" up to {MAX_CPU_DEVICES} (fake CPU devices)" if args.dry_run else ""
        raise UserError(f"--devices {args.devices}: expected a positive integer{limit}")
    if (
        (args.hbm_gb is not None and not 0 < args.hbm_gb < math.inf) or args.steps <= 0 or args.warmup < 0
    ):  # nan fails the first
        raise UserError(
            f"--hbm-gb {args.hbm_gb}, --steps {args.steps}, --warmup {args.warmup}: "
            f"--hbm-gb and --steps must be positive (finite), --warmup non-negative"
        )
    columns = parse_columns(args.columns)
    for flag, path in (("--json", args.json), ("--plot", args.plot), ("--write-config", args.write_config)):
        if path:
            check_output_file(Path(path), flag)  # before the sweep, not after it
    meshes = [parse_mesh(m) for m in args.mesh] or None
    try:
        pipelines = tuple(int(p) for p in args.pipeline.split(","))
    except ValueError:
        raise UserError(f"--pipeline {args.pipeline!r}: expected sizes like 1,2,4") from None
    if any(p <= 0 for p in pipelines):
        raise UserError(f"--pipeline {args.pipeline!r}: sizes must be positive")
    config = config_from_args(args, resolve_vocab_size)
    if args.devices is None and meshes:
        args.devices = math.prod(meshes[0].values())
    system = args.system or (config.xla.profile if config.xla.profile in SYSTEMS else None)
    assumptions = Assumptions()
    if args.calibration:
        load_calibration(args.calibration)  # a bad file: one line now, before any compile
        assumptions = dataclasses.replace(assumptions, calibration=args.calibration)
    for text in args.assume:
        try:
            assumptions = assume(assumptions, text)
        except ValueError as e:
            raise UserError(str(e)) from None
    if args.hbm_gb is None:
        args.hbm_gb = SYSTEMS[system].hbm_gb if system else 141.0
    compiler, compiler_text = gpu_compile.choose_compiler(args.compiler, system) if args.dry_run else ("cpu", "")
    if compiler == "gpu" and args.a2a == "emulate":
        raise UserError("--a2a emulate is XLA:CPU's emulation; with --compiler gpu the ragged all-to-all is XLA:GPU's")
    if args.replan:
        report = replan_main(args, config, system, assumptions, sys.argv[1:] if argv is None else argv)
        _plot_to(args.plot, report["results"], True, args.hbm_gb)
        return 0
    start = time.perf_counter()
    report = sweep(
        config,
        args.devices,
        args.dry_run,
        meshes,
        args.hbm_gb,
        args.steps,
        args.warmup,
        args.a2a,
        progress=not args.no_progress,
        pipelines=pipelines,
        system=system,
        assumptions=assumptions,
        compiler=compiler,
    )
    report["wall_s"] = time.perf_counter() - start
    if args.dry_run:
        print(f"compiler: {compiler_text}")
    report["command"] = "python -m maxmoe.sweep " + " ".join(sys.argv[1:] if argv is None else argv)
    print(format_table(report["results"], args.dry_run, columns))
    for s in report["skipped"]:
        print(f"skipped {s['name']}: {s['reason']}")
    for r in report["results"]:
        if r.get("pipeline"):
            p = r["pipeline"]
            print(
                f"pipeline {r['name']}: {p['stages']} stages x {p['virtual']} chunks, {p['micro_batches']} micro-batches, "
                f"{p['slots_per_chunk']} layer slots per chunk: bubble {p['bubble']:.3f} (analytic), "
                f"{measured_text(p)}, {p['ring_slots']} items in flight per stage; busiest chunk "
                f"(v, p) = {tuple(p['busiest_chunk'])}: {p['stage_imbalance']:.2f} x the mean, "
                f"stages' compute time x {p['compute_scale']:.3f} (planner)"
            )
    notes = sorted({n for r in report["results"] for n in r.get("notes", [])})
    for n in notes:
        print(f"note: {n}")
    if args.dry_run:
        print(
            "GB = 1e9, MB = 1e6 bytes per device; wire = bytes each device sends per step (ring factors, loops x trip count); "
            "fwd/bwd = of which in the forward/backward pass (a rematerialised forward pass recomputes inside the backward; "
            "the optimizer update is neither); x-dom = of which in collectives spanning scale-up domains; "
            "a2a fwd/bwd = all-to-all by pass; AR/AG/RS = all-reduce/all-gather/reduce-scatter; "
            "TFLOP = model FLOPs per device per step"
        )
    if args.dry_run and system:
        print(format_predictions(report["results"]))
    print(f"{len(report['results'])} shapes in {report['wall_s']:.0f}s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    if args.write_config:
        try:
            print(f"wrote {write_winner(config, report['results'], args.write_config)} to {args.write_config}")
        except OSError as e:  # checked before the sweep; the disk can still fill meanwhile
            raise UserError(f"--write-config {args.write_config}: cannot write it ({e.strerror or e})") from None
    _plot_to(args.plot, report["results"], args.dry_run, args.hbm_gb)
    return 0


def _plot_to(path: str | None, results: list[dict], dry_run: bool, hbm_gb: float) -> None:
    why = plot(results, path, dry_run, hbm_gb) if path else None
    if why:
        print(f"note: {why}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
