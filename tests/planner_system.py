"""The made-up system and ideal assumptions the planner's hand-worked tests count against.

1,000 TFLOP/s bf16 (2,000 fp8), 100 GB of HBM at 1 TB/s, 500 GB/s NVLink and 100 GB/s
scale-out per GPU, 8 GPUs per scale-up domain; compute at efficiency 0.5 (1e15 FLOP take 2 s),
links at their full bandwidth, no latency per hop. `gemm` makes one compute row.
"""

from maxmoe.analysis.planner import KINDS, Assumptions, Compute, System

SYSTEM = System("test", 1000.0, 2000.0, 100.0, 1.0, 500.0, 100.0, 8)
FULL_LINKS = tuple(((tier, kind), 1.0) for tier in ("scale_up", "scale_out") for kind in KINDS)
IDEAL = Assumptions(
    compute_efficiency=0.5, link_efficiency=FULL_LINKS, latency_s=(("scale_up", 0.0), ("scale_out", 0.0))
)


def gemm(flops: float, peak: str = "bf16", executed: float | None = None, name: str = "attention") -> Compute:
    """A compute row of `flops` model FLOPs (executed: `executed`, default the same) on XLA's dot."""
    return Compute(name, "dense_gemm", "xla", "bf16", peak, flops, flops if executed is None else executed)
