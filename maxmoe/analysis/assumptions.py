"""The planner's constants, each once, with its public source: systems, efficiencies, latencies, overlap.

Per-GPU system figures (`SYSTEMS`) are datasheet numbers; everything else the planner
assumes is a field of `Assumptions`, named flat as `sweep --assume NAME=VALUE` sets it
(`values`, `assume`) and recorded with its source in the sweep's JSON (`table`):

  calibration                   the measured kernel rates each compute class runs at
                                (maxmoe.kernels.rates; maxmoe.analysis.calibration), `sweep --calibration`
  compute_efficiency.CLASS      a class's (or a kernel class's) fraction of its peak, set by hand
  compute_efficiency            every class at one fraction: a sensitivity, not a prediction
  latency_s.TIER                seconds per hop of one launch
  link_efficiency.TIER.KIND     fraction of the link's bandwidth a collective kind reaches
  overlap.TIER.KIND.PHASE       fraction of a collective class's time under compute
  a2a_batch_split_overlap       the expert all-to-all's hidden fraction under moe.overlap=batch_split
(TIER: scale_up or scale_out; KIND: a collective kind; PHASE: loop, step or dependent).
"""

from __future__ import annotations

import dataclasses

from maxmoe.kernels.rates import DEFAULT_RATES, KERNEL_CLASSES

GB = 1e9
# The classes a compute efficiency may be set for: maxmoe.analysis.flops's GEMM classes, context
# parallelism's latent up-projections, and the kernel classes of maxmoe.kernels.rates.
COMPUTE_CLASSES = ("attention", "attention_core", "router", "dense_mlp", "shared_experts", "routed_experts", "head")
EFFICIENCY_CLASSES = (*COMPUTE_CLASSES, "latent_up", *(k for k in KERNEL_CLASSES if k not in COMPUTE_CLASSES))


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
    arch: str = "hopper"  # hopper or blackwell: which FP8 GEMMs lower (maxmoe.analysis.flops.fp8_gemm_classes)
    device_kind: str = ""  # as jax names it: which kernels `auto` picks there (maxmoe.kernels.choice)

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
    "h100": System("h100", 989.4, 1978.9, 80.0, 3.35, 450.0, 50.0, 8, "hopper", "NVIDIA H100"),
    "h200": System("h200", 989.4, 1978.9, 141.0, 4.8, 450.0, 50.0, 8, "hopper", "NVIDIA H200"),
    "b200": System("b200", 2250.0, 4500.0, 180.0, 8.0, 900.0, 50.0, 8, "blackwell", "NVIDIA B200"),
    "gb200": System("gb200", 2500.0, 5000.0, 186.0, 8.0, 900.0, 50.0, 72, "blackwell", "NVIDIA GB200"),
    "gb300": System("gb300", 2500.0, 5000.0, 279.0, 8.0, 900.0, 100.0, 72, "blackwell", "NVIDIA GB300"),
}
SYSTEM_SOURCE = "vendor datasheets, dense peaks (maxmoe/analysis/assumptions.py, SYSTEMS)"

TIERS = ("scale_up", "scale_out")
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
PHASES = ("loop", "step", "dependent")  # "dependent": on the layer's own activations (exposed)

_A2A_SOURCE = (
    "public EP-transport measurements on NVL72 (DeepEP and NCCL-based dispatch/combine at 32-36 "
    "ranks): 450-640 GB/s of NVLink's 900 per direction, ~0.6; XLA's ragged all-to-all is not "
    "measured and may reach less"
)
_RING_SOURCE = (
    "planner default: NCCL ring collectives on large messages reach ~80% of NVLink (nccl-tests bus bandwidth)"
)
_OUT_SOURCE = "planner default: ring collectives over ConnectX NICs at ~85% of line rate (nccl-tests bus bandwidth)"
DEFAULT_LINK = tuple(
    ((tier, kind), 0.6 if "all-to-all" in kind and tier == "scale_up" else 0.8 if tier == "scale_up" else 0.85)
    for tier in TIERS
    for kind in KINDS
)

DEFAULT_OVERLAP = (
    # The expert all-to-all and tensor-parallel all-reduces sit between the ops that make and
    # use them: exposed (moe.overlap=batch_split: a2a_batch_split_overlap, where it applies).
    (("scale_up", "all-to-all", "loop"), 0.0),
    (("scale_up", "all-reduce", "loop"), 0.0),
    # Per-layer FSDP gathers and gradient reductions: prefetched and pipelined by XLA's
    # latency-hiding scheduler (xla_flags profiles); whether they fit under their layer's
    # compute is checked per pass (maxmoe.analysis.planner.predict).
    (("scale_up", "all-gather", "loop"), 0.9),
    (("scale_up", "reduce-scatter", "loop"), 0.9),
    (("scale_out", "all-gather", "loop"), 0.9),
    (("scale_out", "reduce-scatter", "loop"), 0.9),
    (("scale_out", "all-reduce", "loop"), 0.5),
)


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """Efficiencies, latencies and overlap fractions; a class not in `overlap` is exposed.

    Compute runs at the calibration's measured rates (maxmoe.analysis.calibration) unless
    `class_efficiency` ((class, fraction), ...) sets a class by hand or `compute_efficiency`
    sets every class (a uniform sensitivity)."""

    compute_efficiency: float | None = None
    class_efficiency: tuple = ()
    calibration: str = str(DEFAULT_RATES)
    latency_s: tuple = (("scale_up", 2e-6), ("scale_out", 5e-6))  # per ring hop
    link_efficiency: tuple = DEFAULT_LINK  # ((tier, kind), fraction)
    overlap: tuple = DEFAULT_OVERLAP  # ((tier, kind, phase), fraction)
    a2a_batch_split_overlap: float = 0.8

    def overlap_of(self, tier: str, kind: str, phase: str) -> float:
        return dict(self.overlap).get((tier, _kind(kind), phase), 0.0)

    def link_of(self, tier: str, kind: str) -> float:
        return dict(self.link_efficiency)[(tier, kind)]

    def latency_of(self, tier: str) -> float:
        return dict(self.latency_s)[tier]


def _kind(kind: str) -> str:
    return "all-to-all" if kind == "ragged-all-to-all" else kind


SOURCES = {
    "compute_efficiency": "set by hand (--assume): every class at this fraction of its peak, a sensitivity",
    "calibration": (
        "measured kernel rates, each with its device, date, commit and command (maxmoe.kernels.rates); "
        "every class's efficiency and its source are in the prediction's `compute`"
    ),
    "latency_s.scale_up": "planner default: 2 us per ring hop over NVLink (NCCL small-message latency order)",
    "latency_s.scale_out": "planner default: 5 us per ring hop over InfiniBand/RoCE",
    "a2a_batch_split_overlap": (
        "planner default: the share of the expert all-to-all that runs under the other half-batch's "
        "GEMMs when moe.overlap=batch_split gives two independent chains"
    ),
    "overlap": "planner default: XLA's latency-hiding scheduler prefetches per-layer collectives (xla_flags)",
}


def _source(name: str) -> str:
    if name.startswith("link_efficiency."):
        _, tier, kind = name.split(".")
        if "all-to-all" in kind and tier == "scale_up":
            return _A2A_SOURCE
        return _RING_SOURCE if tier == "scale_up" else _OUT_SOURCE
    return SOURCES.get(name, SOURCES.get(name.split(".")[0], ""))


def values(a: Assumptions) -> dict[str, float]:
    """Every assumption of `a` under its flat name (the names `assume` takes)."""
    out = {"compute_efficiency": a.compute_efficiency} if a.compute_efficiency is not None else {}
    out.update({f"compute_efficiency.{cls}": v for cls, v in a.class_efficiency})
    out["a2a_batch_split_overlap"] = a.a2a_batch_split_overlap
    out.update({f"latency_s.{tier}": v for tier, v in a.latency_s})
    out.update({f"link_efficiency.{tier}.{kind}": v for (tier, kind), v in a.link_efficiency})
    out.update({f"overlap.{tier}.{kind}.{phase}": v for (tier, kind, phase), v in a.overlap})
    return out


def table(a: Assumptions) -> dict[str, dict]:
    """{name: {"value", "source"}} of every assumption of `a`, for the JSON record."""
    out = {"calibration": {"value": a.calibration, "source": SOURCES["calibration"]}}
    return out | {name: {"value": v, "source": _source(name)} for name, v in values(a).items()}


def assume(a: Assumptions, text: str) -> Assumptions:
    """`a` with one assumption set from 'NAME=VALUE' (names as `values` gives them); ValueError if bad.

    An overlap name need not exist yet (any TIER.KIND.PHASE may be given a fraction).
    """
    name, sep, raw = text.partition("=")
    name = name.strip()
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"--assume {text!r}: expected NAME=NUMBER") from None
    if not sep or value < 0:
        raise ValueError(f"--assume {text!r}: expected NAME=NUMBER (>= 0)")
    parts = name.split(".")
    fraction = parts[0] in ("compute_efficiency", "link_efficiency", "overlap", "a2a_batch_split_overlap")
    if fraction and not (0 < value <= 1 or (parts[0] == "overlap" and value == 0)):
        raise ValueError(f"--assume {text!r}: {parts[0]} is a fraction in (0, 1]")
    if name in ("compute_efficiency", "a2a_batch_split_overlap"):
        return dataclasses.replace(a, **{name: value})
    if parts[0] == "compute_efficiency" and len(parts) == 2 and parts[1] in EFFICIENCY_CLASSES:
        return dataclasses.replace(a, class_efficiency=_set(a.class_efficiency, parts[1], value))
    if parts[0] == "latency_s" and len(parts) == 2 and parts[1] in TIERS:
        return dataclasses.replace(a, latency_s=_set(a.latency_s, parts[1], value))
    if parts[0] == "link_efficiency" and len(parts) == 3 and parts[1] in TIERS and parts[2] in KINDS:
        return dataclasses.replace(a, link_efficiency=_set(a.link_efficiency, (parts[1], parts[2]), value))
    if parts[0] == "overlap" and len(parts) == 4 and parts[1] in TIERS and parts[2] in KINDS and parts[3] in PHASES:
        return dataclasses.replace(a, overlap=_set(a.overlap, (parts[1], _kind(parts[2]), parts[3]), value))
    known = ", ".join(
        sorted({n.rsplit(".", 1)[0] if n.count(".") > 1 else n for n in values(a)} | {"compute_efficiency"})
    )
    classes = ", ".join(EFFICIENCY_CLASSES)
    raise ValueError(
        f"--assume {text!r}: unknown name {name!r} (known: {known}, with .TIER[.KIND[.PHASE]]; "
        f"compute_efficiency.CLASS for CLASS in {classes})"
    )


def _set(pairs: tuple, key, value: float) -> tuple:
    table = dict(pairs)
    table[key] = value
    return tuple(table.items())
