"""The sweep's dry run: one training step compiled ahead of time for a mesh, nothing allocated, described.

`dry_run_shape(shaped, sizes, mesh, hbm_gb, a2a, system, gpu=...)` compiles one step (donated
state, as maxmoe.train jits it) from abstract shapes, by XLA:CPU on fake CPU devices or, with
`gpu`, by XLA:GPU for that system's GPU (maxmoe.analysis.gpu_compile), and reports per device:
memory (arguments + outputs - aliased + temp; `fits` against hbm_gb), bytes on the wire per step
by collective kind, pass and across scale-up domains, model and compiled dot FLOPs, with pipeline
stages the analytic and measured bubble, and with `system` the planner's prediction (its rows
kept as `planner_rows`: `replan` predicts again without compiling). On XLA:CPU the program
stands in for the GPU's: bf16 compiled as f16, the ragged all-to-all and the grouped GEMM as
stand-ins of the native shapes (`a2a="proxy"`; "emulate" compiles the CPU emulation), collectives
counted at the widths and kinds the GPU moves (`as_on_gpu`); `native_a2a_bytes` is the analytic
all-to-all figure.
Method: docs/PERFORMANCE.md, "How the dry run reads a program".
"""

from __future__ import annotations

import dataclasses
import math
import time

from maxmoe.analysis import planner
from maxmoe.analysis.charging import compute_rows, seconds_per_flop
from maxmoe.analysis.flops import count_params, flops_per_token, pipeline_piece_flops_per_token
from maxmoe.analysis.gpu_compile import compile_train_step, program_report
from maxmoe.analysis.half_width import compile_half_width
from maxmoe.analysis.hlo import DTYPE_BYTES, collective_ops, dot_flops, summarize_ops
from maxmoe.analysis.hlo_slices import parse_computations, sliced_elements
from maxmoe.analysis.hlo_widened import MOVING, narrowed_operands
from maxmoe.analysis.lowering import a2a_independent_chains
from maxmoe.config import Config, ConfigError
from maxmoe.config.mesh import mesh_sizes
from maxmoe.kernels.choice import Choice
from maxmoe.kernels.grouped_matmul import BALANCED_STAND_IN
from maxmoe.parallel.fp8_dispatch import payload_bytes_per_row
from maxmoe.parallel.layout import build_layout
from maxmoe.parallel.mesh import device_domains
from maxmoe.parallel.names import COMM_SAVING_POLICIES, ZERO1_REDUCTION
from maxmoe.parallel.pipeline_schedule import SlotLayout, build_schedule
from maxmoe.training.programs import build_programs
from maxmoe.training.stage_state import slot_layout
from maxmoe.xla_flags import FAST_CPU_COMPILE, profile_flags

GB = 1e9
# What a report records as its method: the module docstring past its first line.
METHOD = __doc__.split("\n\n", 1)[1].strip()

# ---------------------------------------------------------------------------------------
# The analytic model


def tokens_per_shard(config: Config, sizes: dict[str, int]) -> int:
    """Tokens of one (data, [context,] expert) shard in one micro-batch."""
    t = config.train
    shards = sizes["data"] * sizes.get("context", 1) * sizes["expert"]
    return math.ceil(t.batch_size // t.grad_accum * t.seq_len / shards)


def native_a2a_bytes(config: Config, sizes: dict[str, int]) -> dict[str, float]:
    """Per-device bytes per step of native ragged all-to-alls under balanced routing, by pass.

    n x K x D x bytes x (P-1)/P per call; dispatch + combine per MoE layer forward and their
    transposes backward, plus the forward two again in the backward pass of the scanned MoE
    layers where model.remat recomputes collectives (full, save_matmuls; the MTP block is
    not rematerialised); times grad_accum micro-batches. Returns {"forward", "backward"}.
    """
    m = config.model
    p = sizes.get("context", 1) * sizes["expert"]  # experts fold over context x expert
    if p <= 1:
        return {"forward": 0.0, "backward": 0.0}
    width = 2 if m.compute_dtype == "bfloat16" else 4
    rows = tokens_per_shard(config, sizes) * m.experts_per_token * (p - 1) / p * config.train.grad_accum
    row_bytes = m.hidden_size * width
    # moe.fp8_dispatch: each forward dispatch (recomputed ones too; not the combine, not the
    # transposes) moves e4m3 values and their scales.
    dispatch_bytes = payload_bytes_per_row(m.hidden_size, m.fp8) if config.moe.fp8_dispatch else row_bytes
    # A stage runs its own slots of the layer plan (stage 0 also MTP): the busiest device's calls,
    # every slot counted as a MoE layer (the program holds a MoE branch in each).
    scanned, mtp = m.num_layers - m.first_k_dense, m.mtp_num_layers
    if sizes.get("pipeline", 1) > 1:
        mesh = config.mesh
        slots = SlotLayout(scanned, sizes["pipeline"], mesh.pipeline_virtual, mesh.pipeline_pad_front, m.first_k_dense)
        scanned = slots.per_chunk * slots.virtual
    recomputed = scanned if m.remat not in ("none",) + COMM_SAVING_POLICIES else 0
    forward = rows * (dispatch_bytes + row_bytes) * (scanned + mtp)
    backward = rows * (2 * row_bytes * (scanned + mtp) + (dispatch_bytes + row_bytes) * recomputed)
    return {"forward": forward, "backward": backward}


def emulation_temp_bytes(config: Config, sizes: dict[str, int], plan) -> float:
    """Rough extra temp of the CPU emulation per call: the sent and received [P, M, D] blocks."""
    m = config.model
    p = sizes.get("context", 1) * sizes["expert"]
    if plan is None or p <= 1:
        return 0.0
    width = 2 if m.compute_dtype == "bfloat16" else 4
    rows = plan.buffer_rows(tokens_per_shard(config, sizes), m.experts_per_token, m.num_experts)
    return 2.0 * p * rows * m.hidden_size * width


def pipeline_pieces(config: Config, weights: dict[str, float] | None = None) -> dict[str, float]:
    """What each piece of the stage plan costs a stage per token: its executed FLOPs
    (maxmoe.analysis.flops.pipeline_piece_flops_per_token), each class's weighted by `weights`
    ({class: seconds per FLOP}, maxmoe.analysis.charging.seconds_per_flop: time is what a tick
    waits for); without weights, FLOPs."""
    m, t = config.model, config.train
    expert_parallel = math.prod(mesh_sizes(config).values()) > 1
    if not weights:
        return pipeline_piece_flops_per_token(m, t.seq_len, t.loss_chunk, expert_parallel=expert_parallel)
    out: dict[str, float] = {}
    for name, weight in weights.items():
        part = pipeline_piece_flops_per_token(m, t.seq_len, t.loss_chunk, (name,), expert_parallel)
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + weight * v
    return out


def pipeline_report(config: Config, system: str | None = None, assumptions=None) -> dict | None:
    """The pipeline schedule of a config: stages, chunks, slots, analytic bubble, items in flight,
    and the planner's stage_imbalance and compute_scale (on `system`: each class's work timed at
    its kernel's calibrated rate there, maxmoe.analysis.charging.seconds_per_flop)."""
    slots = slot_layout(config)
    if slots is None:
        return None
    turnaround = 2 if config.model.mtp_num_layers else 1  # MTP: the tail on stage 0 (maxmoe.training.pipeline_step)
    schedule = build_schedule(slots.stages, slots.virtual, config.train.grad_accum, turnaround)
    devices = math.prod(mesh_sizes(config).values())
    weights = seconds_per_flop(config, system, devices, assumptions) if system else None
    pieces = pipeline_pieces(config, weights)
    dense, moe = (slots.dense_at() >= 0).sum(-1).tolist(), slots.mask().sum(-1).tolist()  # [V][P]
    return {
        "stages": slots.stages,
        "virtual": slots.virtual,
        "micro_batches": schedule.micro,
        "slots_per_chunk": slots.per_chunk,
        "padding_slots": slots.pad_front + slots.pad_back,
        "bubble": schedule.bubble,
        "ring_slots": schedule.in_flight(),
        **planner.pipeline_compute_scale(pieces, dense, moe, schedule.bubble),
    }


def as_on_gpu(
    rows: list[dict], config: Config, sliced: dict | None = None, narrowed: dict | None = None
) -> tuple[list[dict], list[str]]:
    """Rows of `collective_ops` with the bytes the GPU program moves where XLA:CPU differs; notes saying so.

    An all-reduce whose result elements are only ever sliced to each device's 1/P
    (`sliced`: maxmoe.analysis.hlo_slices.sliced_elements of the same HLO; the partitioner's reduction
    of a sharded weight's gradient) is, on the GPU, a reduce-scatter of those elements (XLA:GPU's
    reduce-scatter creator) in the dtype the slices hold: counted as one, half the bytes of
    the all-reduce at that dtype's width (XLA:CPU reduces bf16 in f32 between two converts).

    XLA:CPU runs bf16 collectives in f32 (float normalisation). A gather, all-to-all or permute
    whose operands' values passed through a narrower float type (`narrowed`:
    maxmoe.analysis.hlo_widened.narrowed_operands of the same HLO: bf16 weights gathered for a GEMM,
    the dispatch's rows; with `moe.fp8_dispatch` the e4m3 rows XLA:CPU sends as f16) is
    counted at that type's width, and a reduction whose reducer XLA:CPU promoted from bf16 at
    bf16's. A cross-domain ZeRO-1 gradient reduction (scope `reduce_to_zero1`) still left an
    all-reduce is counted as the reduce-scatter (half the bytes).
    """
    notes, corrected = [], []
    halve_bf16 = config.model.compute_dtype == "bfloat16"
    seen = set()
    rows, scattered = _sliced_all_reduces(rows, sliced or {})
    if scattered:
        notes.append(
            f"all-reduce + slice of the shards (XLA:CPU's weight-gradient reductions): {scattered / GB:.2f} GB "
            "of all-reduce counted as the GPU's reduce-scatter, at the slices' dtype"
        )
    narrowed = narrowed or {}
    for row in rows:
        parts = narrowed.get(row.get("name")) if row["kind"] in MOVING else None
        if parts:
            row = _narrowed(row, parts)
            seen.add("narrowed")
        elif halve_bf16 and row["dtype"] == "f32" and row.get("promoted"):
            row = _narrowed(row, [(1, "f32", "bf16")])
            seen.add("promoted")
        if row["kind"] == "all-reduce" and row["cross_domain"] and ZERO1_REDUCTION in row["op_name"]:
            row = {
                **row,
                "kind": "reduce-scatter",
                "bytes": row["bytes"] / 2,
                "bytes_per_run": row["bytes_per_run"] / 2,
            }
            seen.add("reduce_to_zero1")
        corrected.append(row)
    if "narrowed" in seen:
        notes.append(
            "gathers and all-to-alls of bf16 (fp8) values that XLA:CPU runs in f32 (f16): counted at the values' "
            "width, as the GPU moves them; other f32 collectives as compiled (f32 params; tensor-axis activation "
            "all-reduces are an upper bound)"
        )
    if "promoted" in seen:
        notes.append(
            "reductions XLA:CPU widened to f32 (a `_promoted` reducer: bf16 in the program) counted at bf16 width"
        )
    if "reduce_to_zero1" in seen:
        notes.append(
            "ZeRO-1 gradient reduction across domains (scope reduce_to_zero1): XLA:CPU leaves all-reduce + "
            "slice, the GPU pipeline a reduce-scatter; counted as the reduce-scatter"
        )
    return corrected, notes


def _narrowed(row: dict, parts: list[tuple[int, str, str]]) -> dict:
    """`row` moving each operand's values at the width of the narrowest type they passed through."""
    compiled = sum(b for b, _, _ in parts)
    scale = sum(b * DTYPE_BYTES[narrow] / DTYPE_BYTES[dtype] for b, dtype, narrow in parts) / compiled
    dtype = min((narrow for _, _, narrow in parts), key=DTYPE_BYTES.get)
    return {**row, "dtype": dtype, "bytes": row["bytes"] * scale, "bytes_per_run": row["bytes_per_run"] * scale}


def _sliced_all_reduces(rows: list[dict], sliced: dict) -> tuple[list[dict], float]:
    """Each all-reduce row split into its elements that stay an all-reduce and a reduce-scatter
    row of those only ever sliced (as_on_gpu); and the all-reduce bytes so converted."""
    out, converted = [], 0.0
    for row in rows:
        parts = sliced.get(row.get("name")) if row["kind"] == "all-reduce" else None
        moved = [(n, compiled, dtype) for n, compiled, dtype in parts or () if dtype is not None]
        if not moved or row["peers"] < 2:
            out.append(row)
            continue
        p = row["peers"]
        ar_run = sum(n * DTYPE_BYTES[compiled] for n, compiled, _ in moved) * 2 * (p - 1) / p
        rs_run = sum(n * DTYPE_BYTES[dtype] for n, _, dtype in moved) * (p - 1) / p
        converted += ar_run * row["runs"]
        left = row["bytes_per_run"] - ar_run
        if left > 0:
            out.append({**row, "bytes_per_run": left, "bytes": left * row["runs"]})
        dtype = min((d for _, _, d in moved), key=DTYPE_BYTES.get)
        out.append(
            {**row, "kind": "reduce-scatter", "dtype": dtype, "bytes_per_run": rs_run, "bytes": rs_run * row["runs"]}
        )
    return out, converted


# ---------------------------------------------------------------------------------------
# Compiling one step


def combine_thresholds(system: str | None) -> dict[str, int]:
    """{collective kind: bytes} XLA:GPU combines up to under `system`'s xla_flags profile ({} without one)."""
    if system is None:
        return {}
    out = {}
    for flag in profile_flags(system):
        name, _, value = flag.lstrip("-").partition("=")
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            if name == f"xla_gpu_{kind}_combine_threshold_bytes":
                out[kind.replace("_", "-")] = int(value)
    return out


# op_name: the planner reads jax scopes from it (context parallelism's latent gathers, the ZeRO-1
# reduction inside a loop), on --replan too.
PLANNER_ROW_KEYS = (
    "kind", "runs", "bytes", "bytes_per_run", "peers", "cross_domain", "pass", "computation", "in_loop", "op_name"
)  # fmt: skip


def step_workload(
    config: Config,
    rows: list[dict],
    devices: int,
    memory_bytes: float,
    pipeline,
    system: str,
    a2a_independent_chains: bool = False,
    assumptions=None,
    combined: bool = False,
) -> planner.Workload:
    """The planner's Workload of one step on `system`: model FLOPs; the compute rows (each class's
    executed FLOPs on the kernel that runs it there: maxmoe.analysis.charging); the collectives
    `rows` (as_on_gpu's) combined as the system's xla_flags profile combines them; the compiled
    footprint; the optimizer's HBM bytes; with stages (`pipeline`: pipeline_report's), their bubble
    and imbalance, each class's work timed under `assumptions`."""
    t = config.train
    tokens = t.batch_size * t.seq_len
    params = count_params(config.model)
    workload = planner.workload_from_ops(
        rows,
        flops_per_token(config.model, t.seq_len) * tokens / devices,
        tokens,
        devices,
        memory_bytes=memory_bytes,
        optimizer_bytes=planner.optimizer_bytes(params["params_total"] + params["params_mtp"], devices),
        combine_bytes={} if combined else combine_thresholds(system),  # XLA:GPU's rows come combined
        micro_batches=t.grad_accum,
    )
    workload = dataclasses.replace(
        workload,
        compute=compute_rows(config, system, devices),
        a2a_independent_chains=a2a_independent_chains,
    )
    if pipeline is not None:  # the imbalance on this system (each class at its rate), whatever the stored one's
        balance = pipeline_report(config, system, assumptions)
        workload = dataclasses.replace(workload, bubble=balance["bubble"], stage_imbalance=balance["stage_imbalance"])
    return workload


def replan(result: dict, config: Config, system: str, assumptions=None) -> dict:
    """The planner's report for a stored dry-run result (its `planner_rows`, memory and pipeline)
    on `system` under `assumptions`: a prediction again without compiling."""
    assumptions = assumptions or planner.Assumptions()
    workload = step_workload(
        config,
        result["planner_rows"],
        result["devices"],
        result["memory"]["total"],
        result.get("pipeline"),
        system,
        result.get("a2a_independent_chains", False),
        assumptions,
        result.get("compiler", "").startswith("XLA:GPU"),
    )
    return planner.report(workload, planner.SYSTEMS[system], assumptions)


def bubble_baseline(config: Config) -> Config:
    """`config` without pipeline stages on the same devices: pipeline=1, data x P, grad_accum M / P."""
    stages = config.mesh.pipeline
    mesh = dataclasses.replace(config.mesh, pipeline=1, data=config.mesh.data * stages)
    return config.replace(
        mesh=mesh, train=dataclasses.replace(config.train, grad_accum=config.train.grad_accum // stages)
    )


def dry_run_layout(shaped: Config, devices: list, a2a: str = "proxy"):
    """(layout the dry run compiles with, the config's dispatch plan, whether it is ragged).

    With `a2a` "proxy" and a ragged all-to-all, the GPU-shaped program: native-shaped
    all-to-alls, and the GPU kernels' grouped-GEMM buffers instead of XLA:CPU's ragged_dot
    expansion ([G, M, D] masked copies), model.fp8's GEMMs included.
    """
    layout = build_layout(shaped, devices, platform="cpu")
    plan = layout.dispatch_plan
    ragged = plan is not None and plan.strategy == "ragged_a2a" and plan.expert_ranks > 1
    if ragged and a2a == "proxy":
        stand_in = {"a2a_impl": "balanced_stand_in"}
        if plan.grouped_matmul == "ragged_dot":
            stand_in["grouped_matmul"] = BALANCED_STAND_IN
            # The layout's choice too: model.fp8's GEMMs then run as on a kernel backend
            # (maxmoe.kernels.fp8_matmul.blockwise_kernels), the dense projections' included.
            kernel = Choice(BALANCED_STAND_IN, "dry run: the GPU kernels' buffers and FLOPs")
            layout = dataclasses.replace(layout, grouped_matmul=kernel)
        layout = dataclasses.replace(layout, dispatch_plan=dataclasses.replace(plan, **stand_in))
    return layout, plan, ragged


def _compile_step(shaped: Config, devices: list, a2a: str, gpu: str | None = None):
    """(compiled step, layout, the config's dispatch plan, whether it is ragged, bf16 types compiled as
    f16, lower s, compile s). `gpu`: by XLA:GPU for that system's GPU, `devices` its compile-only
    devices (maxmoe.analysis.gpu_compile): the program as it is, no stand-in, `a2a` unused."""
    if gpu:
        compiled, layout, _, lower_s, compile_s = compile_train_step(shaped, gpu, devices)
        plan = layout.dispatch_plan
        ragged = plan is not None and plan.strategy == "ragged_a2a" and plan.expert_ranks > 1
        return compiled, layout, plan, ragged, 0, lower_s, compile_s
    start = time.perf_counter()
    layout, plan, ragged = dry_run_layout(shaped, devices, a2a)
    programs = build_programs(shaped, layout)
    lowered = programs.train_step.trace(programs.abstract_state, programs.abstract_batch(shaped)).lower()
    lower_s = time.perf_counter() - start
    # LLVM's optimisation level changes code speed, not the HLO buffer assignment the memory
    # figures come from; skipping its expensive passes halves compile time on a small CPU.
    # bf16 compiled as f16 (maxmoe.analysis.half_width): no f32 copies of bf16 stacks.
    compiled, half = compile_half_width(lowered, FAST_CPU_COMPILE)
    compile_s = time.perf_counter() - start - lower_s
    return compiled, layout, plan, ragged, half, lower_s, compile_s


def measured_bubble(shaped: Config, devices: list, a2a: str, pipeline_dots: float) -> dict:
    """The measured bubble of a staged config against `bubble_baseline` (docs/PERFORMANCE.md, "How the dry
    run reads a program": the measured bubble)."""
    try:
        baseline = bubble_baseline(shaped)
        compiled, *_, compile_s = _compile_step(baseline, devices, a2a)
    except ConfigError as e:  # the stage-less shape may not fit these devices: no measurement, say why
        return {"bubble_measured": None, "dot_flops": pipeline_dots, "baseline_error": str(e)}
    ideal = dot_flops(compiled.as_text())
    return {
        "bubble_measured": 1.0 - ideal / pipeline_dots if pipeline_dots else None,
        "dot_flops": pipeline_dots,
        "dot_flops_ideal": ideal,
        "baseline": f"pipeline=1 data={baseline.mesh.data} train.grad_accum={baseline.train.grad_accum}",
        "baseline_compile_s": compile_s,
    }


def dry_run_shape(
    shaped: Config,
    sizes: dict[str, int],
    mesh,
    hbm_gb: float,
    a2a: str = "proxy",
    system: str | None = None,
    measure_bubble: bool = True,
    assumptions=None,
    gpu: str | None = None,
) -> dict:
    """Compile one step of `shaped` (a config whose mesh is `sizes`) for `mesh` and describe it.

    `mesh` holds fake CPU devices; `a2a` is "proxy" or "emulate" (docs/PERFORMANCE.md, "How the
    dry run reads a program"); `system` (a key of maxmoe.analysis.planner.SYSTEMS) adds the
    planner's prediction for it;
    `measure_bubble` (with stages) compiles the stage-less baseline for the measured bubble;
    `gpu` (a system): XLA:GPU compiles for its GPU, `mesh` holds its compile-only devices and the
    figures are that program's (maxmoe.analysis.gpu_compile.program_report).
    """
    devices = list(mesh.devices.flat)
    compiled, layout, plan, ragged, half, lower_s, compile_s = _compile_step(shaped, devices, a2a, gpu)
    mesh = layout.mesh
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    dots = dot_flops(text)
    domain = device_domains(devices, shaped.mesh.scale_up_domain)
    if gpu:
        rows, notes, recorded = program_report(text, domain, layout, gpu)
    else:
        parsed = parse_computations(text)  # read once for both searches
        rows, notes = as_on_gpu(
            collective_ops(text, domain),
            shaped,
            sliced_elements(text, len(devices), parsed),
            narrowed_operands(text, parsed),
        )
        recorded = {"compiler": "XLA:CPU"}
    wire = summarize_ops(rows)
    by_kind, cross = dict(wire["by_kind"]), dict(wire["cross_domain"])
    by_pass = {name: dict(kinds) for name, kinds in wire["by_pass"].items()}
    native = native_a2a_bytes(shaped, sizes) if ragged else {"forward": 0.0, "backward": 0.0}
    memory_bound = "compiled"
    emulation_temp = 0.0
    if ragged and a2a == "emulate" and not gpu:
        emulated = by_kind.pop("all-to-all", 0.0)
        cross.pop("all-to-all", None)
        by_kind["emulated_all_to_all"] = emulated
        by_kind["all-to-all"] = sum(native.values())
        for name in ("forward", "backward"):
            by_pass[name]["all-to-all"] = native[name]
        emulation_temp = emulation_temp_bytes(shaped, sizes, plan)
        memory_bound = "upper bound"
        notes.append(
            "all-to-all: analytic native bytes replace the emulation's (emulated_all_to_all); memory is "
            f"an upper bound: the emulation adds roughly {emulation_temp / GB:.2f} GB of [P, M, D] blocks "
            "per live call"
        )
    elif ragged and not gpu:
        notes.append("all-to-all: measured on the native-shaped stand-in (balanced routing)")
    if half:
        notes.append(
            "bf16 compiled as f16 (the same width; maxmoe.analysis.half_width): XLA:CPU would run bf16 dots in f32 "
            "and keep f32 copies of bf16 stacks beside them, which the GPU does not"
        )
    wire_kinds = {k: v for k, v in by_kind.items() if k != "emulated_all_to_all"}
    arg, out, alias, temp = (
        mem.argument_size_in_bytes,
        mem.output_size_in_bytes,
        mem.alias_size_in_bytes,
        mem.temp_size_in_bytes,
    )
    total = arg + out - alias + temp
    t = shaped.train
    tokens = t.batch_size * t.seq_len
    flops = flops_per_token(shaped.model, t.seq_len) * tokens / mesh.size
    pipeline = pipeline_report(shaped, system, assumptions)
    prediction = None
    if gpu:  # batch_split's overlap as XLA:GPU scheduled it
        chains = shaped.moe.overlap == "batch_split" and recorded["a2a_overlapped"]
    else:
        chains = a2a_independent_chains(shaped, devices) if ragged else False
    if system is not None:
        workload = step_workload(shaped, rows, mesh.size, total, pipeline, system, chains, assumptions, bool(gpu))
        prediction = planner.report(workload, planner.SYSTEMS[system], assumptions or planner.Assumptions())
    if shaped.mesh.scale_up_domain:
        domain_note = f"scale-up domain {shaped.mesh.scale_up_domain} devices"
    else:
        domain_note = f"{len(set(domain))} domain(s) (one per process)"
    if pipeline is not None and measure_bubble and gpu:  # its GEMMs are kernels (cuBLAS, Mosaic GPU): no dot FLOPs
        why = "XLA:GPU's GEMMs are kernels, not dots: --compiler cpu measures it"
        pipeline.update({"bubble_measured": None, "dot_flops": dots, "baseline_error": why})
    elif pipeline is not None and measure_bubble:
        pipeline.update(measured_bubble(shaped, devices, a2a, dots))
    return {
        "devices": mesh.size,
        "pipeline": pipeline,
        "dispatch": plan.strategy if plan else "local",
        "a2a_model": ("native" if gpu else a2a) if ragged else "-",
        "memory": {
            "argument": arg,
            "output": out,
            "alias": alias,
            "temp": temp,
            "total": total,
            "generated_code": getattr(mem, "generated_code_size_in_bytes", 0),
            "kind": memory_bound,
            "emulation_temp_estimate": emulation_temp,
        },
        "fits": total <= hbm_gb * GB,
        "hbm_gb": hbm_gb,
        "collectives": by_kind,
        "collective_ops": wire["ops"],
        "collective_total": sum(wire_kinds.values()),
        "cross_domain": cross,
        "cross_domain_total": sum(v for k, v in cross.items() if k != "emulated_all_to_all"),
        "cross_domain_max_runs": max((r["runs"] for r in rows if r["cross_domain"]), default=0),
        "mesh_axes": dict(mesh.shape),
        "native_a2a_bytes": sum(native.values()),
        "native_a2a_bytes_by_pass": native,
        "collectives_by_pass": by_pass,
        "forward_total": sum(by_pass["forward"].values()),
        "backward_total": sum(by_pass["backward"].values()),
        "tokens_per_shard": tokens_per_shard(shaped, sizes),
        "flops_per_device": flops,
        "dot_flops_per_device": dots,
        "domains": domain_note,
        "lower_s": lower_s,
        "compile_s": compile_s,
        "notes": notes,
        "prediction": prediction,
        "a2a_independent_chains": chains,
        "planner_rows": [{k: r.get(k) for k in PLANNER_ROW_KEYS} for r in rows],
        **recorded,
    }
