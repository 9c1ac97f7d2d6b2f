"""Step-time planner: a dry run's compute rows and collectives per device -> step time and TFLOP/s per GPU.

    prediction = predict(step_workload(config, rows, ...), SYSTEMS["gb300"], Assumptions())

Per device and step: compute is the sum over compute rows of executed FLOPs / (peak x
efficiency) (rows: maxmoe.analysis.charging; efficiencies: maxmoe.analysis.calibration); a
collective class costs launches x latency x hops + bytes / (bandwidth x link efficiency), the
`overlap` fraction of it hidden under its pass's compute, hidden traffic that outlasts that
compute extending the step; the pipeline's bubble and stage imbalance scale the compute; the
optimizer's HBM bytes add. Outputs: tokens/s, TFLOP/s per GPU on model FLOPs, MFU, the exposed
fraction and the bound (the longest term on the critical path). Every constant is a field of
Assumptions with its public source. The model in full, and where it is rough:
docs/PERFORMANCE.md, "The planner's model".
"""

from __future__ import annotations

import dataclasses
import math

from maxmoe.analysis.assumptions import GB, KINDS, PHASES, SYSTEMS, TIERS, Assumptions, System, table
from maxmoe.analysis.calibration import efficiency
from maxmoe.parallel.names import LATENT_GATHER, ZERO1_REDUCTION

__all__ = ["GB", "SYSTEMS", "System", "Assumptions", "KINDS", "PHASES", "TIERS", "Compute"]
PASSES = ("forward", "backward", "other")
DEFAULT_ASSUMPTIONS = Assumptions()
SENSITIVITY_EFFICIENCY = 0.5  # the uniform efficiency reported beside a calibrated prediction


@dataclasses.dataclass(frozen=True)
class Collective:
    """One class of collectives of a step, e.g. the cross-domain reduce-scatters of the backward pass."""

    kind: str
    tier: str  # "scale_up" or "scale_out"
    bytes: float  # per device per step, on the wire
    launches: int  # per step, after combining
    peers: int = 2  # largest group
    phase: str = "loop"  # "loop": inside a loop; "step": once per step outside every loop
    pass_: str = "backward"  # forward, backward or other (the optimizer update)
    window: float = 1.0  # the share of its pass it runs beside: 1 / micro-batches for the last one's only

    def __post_init__(self):
        if self.tier not in TIERS or self.kind not in KINDS or self.phase not in PHASES or self.pass_ not in PASSES:
            raise ValueError(f"bad collective {self}")
        if not 0 < self.window <= 1:
            raise ValueError(f"bad collective window {self}")


@dataclasses.dataclass(frozen=True)
class Compute:
    """One class of a step's FLOPs on one kernel, per device per step (maxmoe.analysis.charging)."""

    name: str  # maxmoe.analysis.flops's GEMM class, or latent_up
    kernel_class: str  # dense_gemm, grouped_gemm or attention_core (maxmoe.kernels.rates)
    backend: str  # the kernel that runs it
    precision: str  # bf16 or the model.fp8 recipe
    peak: str  # "bf16" or "fp8": the peak the kernel runs at
    model_flops: float
    executed_flops: float  # model + recompute, x the kernel's overhead
    overhead: float = 1.0  # executed over useful FLOPs of the kernel
    dims: tuple = ()  # ((name, size), ...): the shape a measured rate is matched by
    reason: str = ""  # why this kernel


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one step costs one device."""

    flops_per_device: float  # model FLOPs
    tokens_per_step: int
    devices: int
    collectives: tuple[Collective, ...] = ()
    memory_bytes: float = 0.0  # compiled footprint, for the fits check
    optimizer_bytes: float = 0.0  # HBM bytes the optimizer update reads and writes
    compute: tuple[Compute, ...] = ()  # the FLOPs by class and kernel
    bubble: float = 0.0  # the pipeline schedule's idle fraction
    stage_imbalance: float = 1.0  # busiest pipeline chunk over the mean
    a2a_independent_chains: bool = False  # moe.overlap=batch_split, verified on the lowered program

    @property
    def executed(self) -> float:
        """Executed FLOPs per device per step."""
        return sum(c.executed_flops for c in self.compute)

    @property
    def compute_scale(self) -> float:
        return self.stage_imbalance / (1.0 - self.bubble)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The planner's answer for one workload on one system."""

    step_s: float
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs
    mfu: float  # against the peak of each class's precision
    mfu_bf16_peak: float
    executed_tflops_per_gpu: float
    exposed_fraction: float  # (step - compute) / step
    bound: str
    fits: bool
    contributions: dict  # seconds each part adds to the step
    critical: dict  # seconds each part holds the critical path (the bound is the largest)
    compute: tuple = ()  # per compute row: its kernel, FLOPs, efficiency, status, source and seconds


def hops(kind: str, peers: int) -> int:
    """Latency steps of one collective: ring passes for gathers and reduce-scatters, a tree for an
    all-reduce (up and down), one for all-to-all and permutes; none on one device."""
    if peers < 2:
        return 0
    if kind in ("collective-permute", "all-to-all", "ragged-all-to-all"):
        return 1
    return 2 * math.ceil(math.log2(peers)) if kind == "all-reduce" else peers - 1


def collective_seconds(c: Collective, system: System, a: Assumptions) -> float:
    """Latency plus bytes over (bandwidth x efficiency of its kind) of one class of collectives."""
    bandwidth = {"scale_up": system.scale_up_gb_s, "scale_out": system.scale_out_gb_s}[c.tier] * GB
    latency = a.latency_of(c.tier) * c.launches * hops(c.kind, c.peers)
    return latency + c.bytes / (bandwidth * a.link_of(c.tier, c.kind))


def _label(c: Collective) -> str:
    if c.tier == "scale_out":
        return "cross-domain traffic"
    return "expert all-to-all" if "all-to-all" in c.kind else "scale-up traffic"


def _overlap(c: Collective, w: Workload, a: Assumptions) -> float:
    if c.tier == "scale_up" and "all-to-all" in c.kind and c.phase == "loop" and w.a2a_independent_chains:
        return max(a.a2a_batch_split_overlap, a.overlap_of(c.tier, c.kind, c.phase))
    return a.overlap_of(c.tier, c.kind, c.phase)


def compute_seconds(w: Workload, system: System, a: Assumptions) -> tuple[float, float, tuple]:
    """(executed FLOPs' time, model FLOPs' time at 100% of their peaks, a record per compute row:
    its kernel, FLOPs, efficiency with status and source, seconds)."""
    t_exec = t_model_peak = 0.0
    records = []
    for c in w.compute:
        peak = system.peak_tflops(c.peak) * 1e12
        e, status, source = efficiency(c, system, a)
        seconds = c.executed_flops / (peak * e)
        t_exec += seconds
        t_model_peak += c.model_flops / peak
        records.append(
            {**dataclasses.asdict(c), "efficiency": e, "status": status, "source": source, "seconds": seconds}
        )
    return t_exec, t_model_peak, tuple(records)


def predict(w: Workload, system: System, a: Assumptions = DEFAULT_ASSUMPTIONS) -> Prediction:
    """Step time and throughput of `w` on `system` under `a` (docs/PERFORMANCE.md, "The planner's model")."""
    t_compute, t_peak, records = compute_seconds(w, system, a)
    contributions = {"compute": t_compute}
    timeline = t_compute / (1.0 - w.bubble) * w.stage_imbalance
    if w.bubble:
        contributions["pipeline bubble"] = t_compute * w.bubble / (1.0 - w.bubble)
    if w.stage_imbalance != 1.0:
        contributions["stage imbalance"] = t_compute * (w.stage_imbalance - 1.0) / (1.0 - w.bubble)
    executed = w.executed
    forward_share = w.flops_per_device / 3.0 / executed if executed else 0.0
    beside = {"forward": timeline * forward_share, "backward": timeline * (1 - forward_share), "other": 0.0}
    hidden: list[tuple[str, str, str, float, float]] = []  # (pass, tier, label, window, seconds)
    for c in w.collectives:
        t, share = collective_seconds(c, system, a), _overlap(c, w, a)
        hidden.append((c.pass_, c.tier, _label(c), c.window, share * t))
        contributions[_label(c)] = contributions.get(_label(c), 0.0) + (1 - share) * t
    critical = dict(contributions)
    for p in PASSES:  # a fabric whose hidden traffic outlasts the compute beside it extends the step
        candidates = [
            (*_excess(hidden, p, tier, v, beside[p]), v)
            for tier in TIERS
            for v in {1.0} | {h[3] for h in hidden if h[:2] == (p, tier)}
        ]
        excess, loads, v = max(candidates, key=lambda c: c[0])
        if excess <= 0:
            continue
        total = sum(loads.values())
        for label, t in loads.items():
            contributions[label] += excess * t / total
            # On the critical path the traffic holds the window's whole time, compute none of it.
            critical[label] += (excess + beside[p] * v) * t / total
        critical["compute"] -= beside[p] * v * t_compute / timeline if timeline else 0.0
    contributions["memory"] = critical["memory"] = w.optimizer_bytes / (system.hbm_tb_s * 1e12)
    step = sum(contributions.values())
    fits = w.memory_bytes <= system.hbm_gb * GB
    bound = max(critical, key=critical.get) if fits else "memory (does not fit)"
    tflops = w.flops_per_device / step / 1e12
    return Prediction(
        step_s=step,
        tokens_per_s=w.tokens_per_step / step,
        tflops_per_gpu=tflops,
        mfu=t_peak / step,
        mfu_bf16_peak=tflops / system.peak_tflops("bf16"),
        executed_tflops_per_gpu=executed / step / 1e12,
        exposed_fraction=(step - t_compute) / step,
        bound=bound,
        fits=fits,
        contributions=contributions,
        critical=critical,
        compute=records,
    )


def _excess(hidden: list, pass_: str, tier: str, window: float, beside: float) -> tuple[float, dict]:
    """(excess seconds, {label: hidden seconds}) of one fabric in the last `window` of a pass.

    Hidden traffic of a collective class with window v spreads over the last v of its pass (v = 1:
    all of it; the last micro-batch's: 1 / micro-batches), so the last `window` of the pass
    holds min(1, window / v) of it, beside `window` of the pass's compute.
    """
    loads: dict[str, float] = {}
    for p, t, label, v, seconds in hidden:
        if p == pass_ and t == tier:
            loads[label] = loads.get(label, 0.0) + seconds * min(1.0, window / v)
    return (sum(loads.values()) - beside * window, loads)


def pipeline_compute_scale(pieces: dict, dense_per_chunk, moe_per_chunk, bubble: float) -> dict:
    """How much longer pipeline stages take than their work alone: the bubble and the busiest chunk.

    pieces: maxmoe.analysis.flops.pipeline_piece_flops_per_token (executed FLOPs of one dense layer,
    one MoE layer, the head with its loss, the MTP depths); dense_per_chunk, moe_per_chunk
    [V][P]: the dense and MoE layers chunk v of stage p runs in its slots (empty slots are
    skipped, so they cost nothing); bubble: the schedule's analytic idle fraction,
    (P - 1) / (M V + P - 1). As maxmoe.training.pipeline_step runs the model, chunk (V-1,
    P-1) also runs the head and the loss, and stage 0 the MTP depths (the pipeline's tail) in
    the ticks it runs chunk 0's forward: chunk (0, 0) carries them. The embedding (a lookup)
    costs no FLOPs. Every tick takes as long as the busiest stage's forward and backward, so
    the stages' time over the time of their work spread evenly is

        compute_scale = (busiest chunk / mean chunk) / (1 - bubble),

    1 / (1 - bubble) for chunks of equal work. Returns it with stage_imbalance (busiest over
    mean), busiest_chunk [v, p] and chunk_work [V][P] in MoE layers (executed).
    """
    work = [
        [d * pieces["dense_layer"] + n * pieces["moe_layer"] for d, n in zip(dense_row, moe_row, strict=True)]
        for dense_row, moe_row in zip(dense_per_chunk, moe_per_chunk, strict=True)
    ]
    work[-1][-1] += pieces["head"]
    work[0][0] += pieces["mtp"]
    mean = sum(map(sum, work)) / sum(map(len, work))
    busiest = max(max(row) for row in work)
    where = next([v, p] for v, row in enumerate(work) for p, w in enumerate(row) if w == busiest)
    return {
        "stage_imbalance": busiest / mean,
        "compute_scale": busiest / mean / (1.0 - bubble),
        "busiest_chunk": where,
        "chunk_work": [[w / pieces["moe_layer"] for w in row] for row in work],
    }


def scale_replicas(w: Workload, factor: int) -> Workload:
    """Weak scaling across domains: `factor` x the replicas, the same work and batch per device.

    Cross-domain groups grow from P to factor x P peers. Each kind moves (P-1)/P of a
    per-device buffer that does not depend on P (all-gather: its result; reduce-scatter:
    its input; all-reduce: 2 x its buffer), so bytes scale by ((P'-1)/P') / ((P-1)/P) and
    ring latency through `peers`. In-domain traffic is unchanged.
    """
    scaled = []
    for c in w.collectives:
        if c.tier == "scale_out":
            p, q = c.peers, c.peers * factor
            ratio = ((q - 1) / q) / ((p - 1) / p) if p > 1 else 1.0
            c = dataclasses.replace(c, bytes=c.bytes * ratio, peers=q)
        scaled.append(c)
    return dataclasses.replace(
        w, collectives=tuple(scaled), devices=w.devices * factor, tokens_per_step=w.tokens_per_step * factor
    )


def retention(small: Workload, large: Workload, system: System, a: Assumptions = DEFAULT_ASSUMPTIONS) -> float:
    """Per-GPU throughput of `large` over that of `small` (1.0 = perfect weak scaling)."""
    ps, pl = predict(small, system, a), predict(large, system, a)
    return (pl.tokens_per_s / large.devices) / (ps.tokens_per_s / small.devices)


def combine_bins(sizes: list[float], threshold: float) -> int:
    """Collectives left after XLA's combiner packs ops of `sizes` bytes, in program order, into
    groups of at most `threshold` bytes (an op larger than it stays alone); 0 threshold: none merge."""
    if threshold <= 0:
        return len(sizes)
    bins, current = 0, None
    for size in sizes:
        if current is None or current + size > threshold:
            bins, current = bins + 1, size
        else:
            current += size
    return bins


def result_bytes(row: dict) -> float:
    """The result bytes of one run of a collective row (the size XLA's combine thresholds count)."""
    p, moved = max(row["peers"], 2), row["bytes_per_run"]
    return {
        "all-gather": moved * p / (p - 1),
        "reduce-scatter": moved / (p - 1),
        "all-reduce": moved * p / (2 * (p - 1)),
    }.get(row["kind"], moved)


def workload_from_ops(
    rows: list[dict],
    flops_per_device: float,
    tokens_per_step: int,
    devices: int,
    memory_bytes: float = 0.0,
    optimizer_bytes: float = 0.0,
    combine_bytes: dict | None = None,
    micro_batches: int = 1,
) -> Workload:
    """A Workload from maxmoe.analysis.hlo.collective_ops rows (as the GPU moves them: maxmoe.analysis.dry_run.as_on_gpu).

    Rows group into classes by (tier, kind, phase, pass, group size); rows that move no bytes or
    span one device launch nothing and are left out. Phase "step" = rows outside every
    loop (`in_loop` false; without the key, rows that run once). Launches per class: each
    run of each row, or with `combine_bytes` ({kind: threshold}, maxmoe.xla_flags'
    combine_thresholds of the system's profile) the combined collectives: rows of a kind in
    `combine_bytes` that share computation, pass, tier and group size pack into
    `combine_bins` of their result bytes, once per run.
    "dependent" = the latent gathers of context parallelism (their jax scope names them).
    Rows of the ZeRO-1 reduction (scope `reduce_to_zero1`) inside a loop run in the last of
    `micro_batches` only (mesh.zero1_reduce=per_layer): their class's window is 1 / micro_batches.
    """
    combine_bytes = combine_bytes or {}
    classes: dict[tuple, list] = {}
    merged: dict[tuple, list] = {}
    for r in rows:
        if r["peers"] < 2 or not r["bytes"]:
            continue
        tier = "scale_out" if r["cross_domain"] else "scale_up"
        looped = r.get("in_loop", r["runs"] > 1)
        phase = "dependent" if LATENT_GATHER in r.get("op_name", "") else "loop" if looped else "step"
        window = 1.0 / micro_batches if looped and ZERO1_REDUCTION in r.get("op_name", "") else 1.0
        key = (tier, r["kind"], phase, r.get("pass", "backward"), window, r["peers"])
        total = classes.setdefault(key, [0.0, 0])
        total[0] += r["bytes"]
        if r["kind"] in combine_bytes:
            group = (key, r.get("computation", r.get("name")), r["peers"], r["runs"])
            merged.setdefault(group, []).append(result_bytes(r))
        else:
            total[1] += r["runs"]
    for (key, _, _, runs), sizes in merged.items():
        classes[key][1] += combine_bins(sizes, combine_bytes[key[1]]) * runs
    collectives = tuple(
        Collective(kind, tier, size, launches, peers, phase, pass_, window)
        for (tier, kind, phase, pass_, window, peers), (size, launches) in sorted(classes.items())
    )
    return Workload(flops_per_device, tokens_per_step, devices, collectives, memory_bytes, optimizer_bytes)


def optimizer_bytes(param_count: float, devices: int) -> float:
    """HBM bytes per device of one AdamW update over params sharded on every device.

    Per parameter: read f32 param, gradient, m, v (16 B); write param, m, v (12 B).
    """
    return param_count * 28 / devices


def report(w: Workload, system: System, a: Assumptions = DEFAULT_ASSUMPTIONS, scale: int = 4) -> dict:
    """The prediction as a dict, with per-GPU retention when the replicas grow `scale`-fold, every
    assumption with its source, and (when the classes run at their calibrated rates) the uniform
    efficiency's figure beside it as a sensitivity."""
    p = predict(w, system, a)
    larger = scale_replicas(w, scale)
    out = {
        "system": system.name,
        "assumptions": table(a),
        **dataclasses.asdict(p),
        "flops_per_device": w.flops_per_device,
        "executed_flops_per_device": w.executed,
        "launches": {
            f"{c.tier}/{c.kind}/{c.phase}/{c.pass_}/{c.peers}" + ("/last" if c.window < 1 else ""): c.launches
            for c in w.collectives
        },
        f"retention_at_{w.devices * scale}_devices": retention(w, larger, system, a),
        "tflops_per_gpu_at_scale": predict(larger, system, a).tflops_per_gpu,
        "uncalibrated": sorted({r["name"] for r in p.compute if r["status"] == "uncalibrated"}),
    }
    if a.compute_efficiency is None and not a.class_efficiency:
        uniform = dataclasses.replace(a, compute_efficiency=SENSITIVITY_EFFICIENCY)
        out["sensitivity"] = {
            "uniform_compute_efficiency": SENSITIVITY_EFFICIENCY,
            "tflops_per_gpu": predict(w, system, uniform).tflops_per_gpu,
            "note": "every class at one efficiency, uncalibrated: a sensitivity, not a prediction",
        }
    return out
