"""Step-time planner: a dry run's per-device FLOPs and collective bytes by tier -> step time and TFLOP/s per GPU.

    prediction = predict(workload_from_ops(rows, ...), SYSTEMS["gb300"], Assumptions())

`maxmoe.sweep --dry-run --system NAME` calls it for every shape (default: the config's
xla.profile). The model, per device and per step; every assumption is a field of
`Assumptions`:

  compute     t_c = (model FLOPs - FP8 FLOPs) / (peak[precision] x compute_efficiency)
                    + FP8 FLOPs / (peak["fp8"] x compute_efficiency).
              FP8 FLOPs: the GEMMs `model.fp8` runs in FP8 (maxmoe.flops.fp8_flops_per_token;
              0 without it); the rest (attention core, router, head) at the precision's peak.
              compute_efficiency is the one constant to calibrate: the fraction of dense peak
              the model's own math reaches with no communication, measured on one GPU as
              proxy_1gpu's MFU (benchmarks/gpu_suite.sh); until then 0.5, for FP8 GEMMs too
              (their quantisation passes are not charged). MFU is against peak[precision].
              With pipeline stages t_c grows by
              compute_scale (pipeline_compute_scale: the schedule's bubble and the busiest
              stage's extra work); the growth is the step part "pipeline bubble".
  collective  t_i = launches x latency[tier] x hops + bytes / (bandwidth[tier] x link_efficiency[tier]).
              Bytes are what each device puts on the wire (maxmoe.analysis.hlo's ring factors), the
              bandwidth is per GPU per direction, hops = P - 1 for one ring pass (all-gather,
              reduce-scatter), 2 (P - 1) for an all-reduce, 1 for an all-to-all or a permute.
              tier: scale_up (inside a scale-up domain) or scale_out (replica groups that
              span domains).
  overlap     a fraction overlap[(tier, kind, phase)] of t_i runs under compute, the rest
              adds to the step. phase "loop": the op runs more than once per step (inside
              the micro-batch loop or the layer scan), where XLA's scheduler can prefetch
              it; phase "step": once per step, outside the loop (the two-tier weight gather
              and gradient reduce-scatter, which have no compute beside them: overlap 0);
              phase "dependent": in the loop but on the layer's own activations, so nothing
              can prefetch it (context parallelism's latent gathers and their reduce-scatters,
              `maxmoe.parallel.context.LATENT_GATHER`): exposed.
  step        t = max(t_c, hidden scale-up, hidden scale-out) + exposed + t_optimizer: the
              two fabrics run beside compute and beside each other; hidden traffic that
              does not fit under compute extends the step. t_optimizer = optimizer bytes
              through HBM.
  outputs     tokens/s, TFLOP/s per GPU (model FLOPs / t), MFU, and the bound: the largest
              contribution to t (compute, pipeline bubble, expert all-to-all, scale-up
              traffic, cross-domain traffic, memory), or "memory (does not fit)" when the
              compiled footprint exceeds HBM.
Rough where it is rough: no contention between collectives sharing a fabric, no
stragglers or jitter, one efficiency for every matmul shape, ring latency only, the
expert all-to-all assumed balanced (what the dry run's stand-in moves).
"""

from __future__ import annotations

import dataclasses

from maxmoe.config import LATENT_GATHER

GB = 1e9


@dataclasses.dataclass(frozen=True)
class System:
    """Per-GPU figures of one system: dense (no 2:4 sparsity) peaks, bandwidths per direction."""

    name: str
    peak_bf16_tflops: float
    peak_fp8_tflops: float
    hbm_gb: float
    hbm_tb_s: float
    scale_up_gb_s: float  # NVLink, per GPU per direction
    scale_out_gb_s: float  # NICs, per GPU per direction
    domain_gpus: int  # GPUs per NVLink domain

    def peak_tflops(self, precision: str) -> float:
        return {"bf16": self.peak_bf16_tflops, "fp8": self.peak_fp8_tflops}[precision]


# Public sources, per GPU; vendor figures "with sparsity" halved to dense:
# h100  NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 / FP8 3,958 TFLOPS with
#       sparsity; 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s (both directions). DGX H100 user
#       guide: 8 GPUs per NVLink domain, 8x ConnectX-7 400 Gb/s = 50 GB/s per GPU.
# h200  NVIDIA H200 datasheet: Hopper compute as H100; 141 GB HBM3e at 4.8 TB/s; NVLink
#       900 GB/s; HGX/DGX H200: 8 GPUs, ConnectX-7 400 Gb/s per GPU.
# b200  NVIDIA DGX B200 page: 8 GPUs, 72 PFLOPS FP8 training (sparse) -> 4.5 PF dense per GPU,
#       BF16 2.25 PF dense; 1,440 GB HBM3e (180 GB each) at 64 TB/s (8 TB/s each); NVLink 5
#       1.8 TB/s per GPU (both directions); 8x ConnectX-7 400 Gb/s.
# gb200 NVIDIA GB200 NVL72 page: 72 GPUs, FP8 720 PF / BF16 360 PF (sparse) -> 5 / 2.5 PF
#       dense per GPU; 13.4 TB HBM3e (186 GB each) at 576 TB/s (8 TB/s each); NVLink 130 TB/s
#       (1.8 TB/s per GPU); ConnectX-7 400 Gb/s per GPU.
# gb300 NVIDIA GB300 NVL72 page: 72 GPUs, FP8 360 PF dense (5 PF per GPU), BF16 2.5 PF dense
#       per GPU; 20 TB HBM3e (279 GB per GPU as the devices report it) at 576 TB/s (8 TB/s
#       each); NVLink 130 TB/s; ConnectX-8 800 Gb/s = 100 GB/s per GPU (4 per 4-GPU tray).
SYSTEMS = {
    "h100": System("h100", 989.4, 1978.9, 80.0, 3.35, 450.0, 50.0, 8),
    "h200": System("h200", 989.4, 1978.9, 141.0, 4.8, 450.0, 50.0, 8),
    "b200": System("b200", 2250.0, 4500.0, 180.0, 8.0, 900.0, 50.0, 8),
    "gb200": System("gb200", 2500.0, 5000.0, 186.0, 8.0, 900.0, 50.0, 72),
    "gb300": System("gb300", 2500.0, 5000.0, 279.0, 8.0, 900.0, 100.0, 72),
}

TIERS = ("scale_up", "scale_out")
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
PHASES = ("loop", "step", "dependent")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One class of collectives of a step, e.g. the cross-domain reduce-scatters."""

    kind: str
    tier: str  # "scale_up" or "scale_out"
    bytes: float  # per device per step, on the wire
    launches: int  # per step
    peers: int = 2  # largest group
    phase: str = "loop"  # "loop": runs more than once per step; "step": once

    def __post_init__(self):
        if self.tier not in TIERS or self.kind not in KINDS or self.phase not in PHASES:
            raise ValueError(f"bad collective {self}")


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one step costs one device."""

    flops_per_device: float  # model FLOPs
    tokens_per_step: int
    devices: int
    collectives: tuple[Collective, ...] = ()
    memory_bytes: float = 0.0  # compiled footprint, for the fits check
    optimizer_bytes: float = 0.0  # HBM bytes the optimizer update reads and writes
    compute_scale: float = 1.0  # pipeline stages: their compute time over the work's (pipeline_compute_scale)
    fp8_flops_per_device: float = 0.0  # the part of flops_per_device that runs as FP8 GEMMs (model.fp8)


DEFAULT_OVERLAP = (
    # The expert all-to-all and tensor-parallel all-reduces sit between the ops that make and
    # use them (no micro-batch interleaving yet): exposed.
    (("scale_up", "all-to-all", "loop"), 0.0),
    (("scale_up", "all-reduce", "loop"), 0.0),
    # Per-layer FSDP gathers and gradient reductions: prefetched and pipelined by XLA's
    # latency-hiding scheduler (xla_flags profiles).
    (("scale_up", "all-gather", "loop"), 0.9),
    (("scale_up", "reduce-scatter", "loop"), 0.9),
    (("scale_out", "all-gather", "loop"), 0.9),
    (("scale_out", "reduce-scatter", "loop"), 0.9),
    (("scale_out", "all-reduce", "loop"), 0.5),
)


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """Efficiencies, latencies and overlap fractions; anything not in `overlap` is exposed."""

    compute_efficiency: float = 0.5
    precision: str = "bf16"
    link_efficiency: tuple = (("scale_up", 0.8), ("scale_out", 0.85))
    latency_s: tuple = (("scale_up", 2e-6), ("scale_out", 5e-6))  # per ring hop
    overlap: tuple = DEFAULT_OVERLAP

    def overlap_of(self, c: Collective) -> float:
        return dict(self.overlap).get((c.tier, c.kind, c.phase), 0.0)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The planner's answer for one workload on one system."""

    step_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    bound: str
    fits: bool
    contributions: dict  # seconds each part adds to the step


def hops(kind: str, peers: int) -> int:
    """Latency steps of one collective: ring passes for gathers and reductions, one for all-to-all and permutes."""
    if kind in ("collective-permute", "all-to-all", "ragged-all-to-all"):
        return 1
    return (2 if kind == "all-reduce" else 1) * max(peers - 1, 0)


def collective_seconds(c: Collective, system: System, a: Assumptions) -> float:
    """Latency plus bytes over (bandwidth x efficiency) of one class of collectives."""
    bandwidth = {"scale_up": system.scale_up_gb_s, "scale_out": system.scale_out_gb_s}[c.tier] * GB
    latency = dict(a.latency_s)[c.tier] * c.launches * hops(c.kind, c.peers)
    return latency + c.bytes / (bandwidth * dict(a.link_efficiency)[c.tier])


def _label(c: Collective) -> str:
    if c.tier == "scale_out":
        return "cross-domain traffic"
    return "expert all-to-all" if "all-to-all" in c.kind else "scale-up traffic"


def predict(w: Workload, system: System, a: Assumptions = Assumptions()) -> Prediction:
    """Step time and throughput of `w` on `system` under `a` (the module docstring's model)."""
    peak = system.peak_tflops(a.precision) * 1e12
    fp8_peak = system.peak_tflops("fp8") * 1e12
    other = w.flops_per_device - w.fp8_flops_per_device
    t_compute = (other / peak + w.fp8_flops_per_device / fp8_peak) / a.compute_efficiency
    contributions = {"compute": t_compute}
    if w.compute_scale != 1.0:
        contributions["pipeline bubble"] = t_compute * (w.compute_scale - 1.0)
    t_compute *= w.compute_scale  # the stages' timeline, idle ticks included: traffic hides under it
    hidden = {tier: 0.0 for tier in TIERS}
    hidden_by_label: dict[str, float] = {}
    for c in w.collectives:
        t, share = collective_seconds(c, system, a), a.overlap_of(c)
        hidden[c.tier] += share * t
        hidden_by_label[_label(c)] = hidden_by_label.get(_label(c), 0.0) + share * t
        contributions[_label(c)] = contributions.get(_label(c), 0.0) + (1 - share) * t
    base = max(t_compute, *hidden.values())
    if base > t_compute:  # hidden traffic longer than compute: the excess goes to its fabric's labels
        tier = max(TIERS, key=lambda k: hidden[k])
        labels = [k for k in hidden_by_label if (k == "cross-domain traffic") == (tier == "scale_out")]
        for k in labels:
            contributions[k] += (base - t_compute) * hidden_by_label[k] / hidden[tier]
    contributions["memory"] = w.optimizer_bytes / (system.hbm_tb_s * 1e12)
    step = sum(contributions.values())
    fits = w.memory_bytes <= system.hbm_gb * GB
    bound = max(contributions, key=contributions.get) if fits else "memory (does not fit)"
    tflops = w.flops_per_device / step / 1e12
    return Prediction(step, w.tokens_per_step / step, tflops, tflops * 1e12 / peak, bound, fits, contributions)


def pipeline_compute_scale(parts: dict, layers_per_chunk, bubble: float) -> dict:
    """How much longer pipeline stages take than their work alone: the bubble and the busiest chunk.

    parts: flops.flops_per_token_by_part; layers_per_chunk [V][P]: the MoE layers chunk v of
    stage p runs (empty slots are skipped, so they cost nothing); bubble: the schedule's
    analytic idle fraction, (P - 1) / (M V + P - 1). Chunk (0, 0) also runs the dense layers,
    forward and backward, and their forward once more in its backward tick; chunk (V-1, P-1)
    the head and MTP. Every tick takes as long as the busiest chunk's forward and backward,
    so the stages' time over the time of their work spread evenly is

        compute_scale = (busiest chunk / mean chunk) / (1 - bubble),

    1 / (1 - bubble) for chunks of equal work. The mean counts useful work only (not the
    dense layers' second forward).
    """
    work = [[n * parts["moe_layer"] for n in row] for row in layers_per_chunk]
    work[0][0] += parts["dense_layers"]
    work[-1][-1] += parts["head_and_mtp"]
    mean = sum(map(sum, work)) / sum(map(len, work))
    # Chunk (0, 0) is busier by the dense layers' re-run forward (a third of forward + backward).
    busiest = max(max(map(max, work)), work[0][0] + parts["dense_layers"] / 3)
    return {"stage_imbalance": busiest / mean, "compute_scale": busiest / mean / (1.0 - bubble)}


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


def retention(small: Workload, large: Workload, system: System, a: Assumptions = Assumptions()) -> float:
    """Per-GPU throughput of `large` over that of `small` (1.0 = perfect weak scaling)."""
    ps, pl = predict(small, system, a), predict(large, system, a)
    return (pl.tokens_per_s / large.devices) / (ps.tokens_per_s / small.devices)


def workload_from_ops(
    rows: list[dict],
    flops_per_device: float,
    tokens_per_step: int,
    devices: int,
    memory_bytes: float = 0.0,
    optimizer_bytes: float = 0.0,
) -> Workload:
    """A Workload from maxmoe.analysis.hlo.collective_ops rows (as the GPU moves them: maxmoe.analysis.dry_run.as_on_gpu).

    Rows group into classes by (tier, kind, phase); phase "step" = rows that run once,
    "dependent" = the latent gathers of context parallelism (their jax scope names them).
    """
    classes: dict[tuple, list] = {}
    for r in rows:
        phase = "step" if r["runs"] == 1 else "loop"
        phase = "dependent" if LATENT_GATHER in r.get("op_name", "") else phase
        key = ("scale_out" if r["cross_domain"] else "scale_up", r["kind"], phase)
        total = classes.setdefault(key, [0.0, 0, 2])
        total[0] += r["bytes"]
        total[1] += r["runs"]
        total[2] = max(total[2], r["peers"])
    collectives = tuple(
        Collective(kind, tier, size, launches, peers, phase)
        for (tier, kind, phase), (size, launches, peers) in sorted(classes.items())
    )
    return Workload(flops_per_device, tokens_per_step, devices, collectives, memory_bytes, optimizer_bytes)


def optimizer_bytes(param_count: float, devices: int) -> float:
    """HBM bytes per device of one AdamW update over params sharded on every device.

    Per parameter: read f32 param, gradient, m, v (16 B); write param, m, v (12 B).
    """
    return param_count * 28 / devices


def report(w: Workload, system: System, a: Assumptions = Assumptions(), scale: int = 4) -> dict:
    """The prediction as a dict, with per-GPU retention when the replicas grow `scale`-fold."""
    p = predict(w, system, a)
    larger = scale_replicas(w, scale)
    return {
        "system": system.name,
        "assumptions": dataclasses.asdict(a),
        **dataclasses.asdict(p),
        f"retention_at_{w.devices * scale}_devices": retention(w, larger, system, a),
        "tflops_per_gpu_at_scale": predict(larger, system, a).tflops_per_gpu,
    }
