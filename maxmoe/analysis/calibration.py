"""The efficiency each compute row runs at: measured, carried from another device, assumed, or uncalibrated.

`efficiency(row, system, assumptions)` -> (fraction of the row's peak on its executed FLOPs, status,
source), first of: `--assume compute_efficiency.CLASS` (the row's class, else its kernel class:
"assumed"); `--assume compute_efficiency` ("uniform": a sensitivity); a rate of the row's kernel
(class, backend, precision) in the calibration file (maxmoe.kernels.rates) measured on this system
("measured") or on another ("carried": its fraction of that device's peak, a named assumption);
a rate of the kernel's stand-in (STAND_IN) ("uncalibrated", the source names it); else
DEFAULT_EFFICIENCY ("uncalibrated"). A rate's efficiency: its TFLOP/s x the kernel's overhead at
the measured dims (`overhead`: executed over useful FLOPs) over the peak it ran at (a stand-in
at the other precision's peak: that fraction of that peak, over the row's). Of several
rates of one kernel, fwd+bwd before fwd (a step runs both), then the nearest shape (least sum of
|log ratio| over the dims both name), then this system's.
"""

from __future__ import annotations

import math

from maxmoe.analysis.assumptions import SYSTEMS, Assumptions, System
from maxmoe.analysis.flops import fp8_gemm_classes
from maxmoe.config import UserError
from maxmoe.kernels.rates import Rate, RateTable, load_rates

DEFAULT_EFFICIENCY = 0.5
# A kernel without a rate of its own takes its stand-in's (kernel class, backend, precision), and why.
FLASH = "a flash core (blocks past the diagonal skipped); XLA's chunked core, the flash core measured"


def stand_in(kernel_class: str, backend: str, precision: str) -> tuple[tuple[str, str, str], str] | None:
    """The measured kernel that stands in for one with no rate, and why (None: none does)."""
    if kernel_class == "attention_core" and backend not in ("chunked", "xla"):
        return ("attention_core", "chunked", "bf16"), FLASH
    if kernel_class == "grouped_gemm" and backend == "ragged_dot":
        dense = "bf16" if precision in ("bf16", "mxfp8") else precision  # mxfp8: its rounded values in bf16
        return ("dense_gemm", "xla", dense), "XLA rewrites ragged_dot as a dense GEMM per group"
    if kernel_class == "grouped_gemm" and backend == "tokamax":
        return ("grouped_gemm", "mosaic_gpu", precision), "tokamax's grouped GEMM: a Mosaic GPU ragged dot"
    if kernel_class == "grouped_gemm" and precision == "mxfp8":
        return (kernel_class, backend, "tensorwise"), "rounded operands through the bf16 grouped kernel, as tensorwise"
    if kernel_class == "dense_gemm" and backend == "scaled_matmul":
        return ("dense_gemm", "xla", "tensorwise"), "one scaled FP8 GEMM per product, as tensorwise's fp8 dot"
    if kernel_class == "dense_gemm" and precision == "blockwise" and backend == "xla":
        return ("dense_gemm", "triton", "blockwise"), "blockwise's dense GEMMs, measured as maxmoe's Triton kernels"
    return None


def overhead(kernel_class: str, backend: str, dims: dict) -> float:
    """Executed over useful FLOPs of a kernel at `dims` (maxmoe.analysis.charging's table)."""
    if kernel_class == "attention_core":
        qk, v = dims.get("qk", 192), dims.get("v", 128)
        if backend == "triton":  # v padded to qk, both to a power of two (maxmoe.kernels.attention)
            return 2.0 * 2 ** math.ceil(math.log2(qk)) / (qk + v)
        if backend == "xla":
            return 2.0
        if backend == "chunked":
            t = dims["t"]
            n = t // next(c for c in range(min(t, dims.get("chunk", 512)), 0, -1) if t % c == 0)
            return (n + 1) / n
    if kernel_class == "grouped_gemm" and backend == "ragged_dot":
        return float(dims["groups"])
    return float(dims.get("capacity_factor", 1.0)) if backend == "capacity" else 1.0


def runs_fp8(kernel_class: str, precision: str, arch: str) -> bool:
    """Whether a kernel of `precision` runs FP8 GEMMs (at the FP8 peak) on `arch`."""
    gemm = {"dense_gemm": "attention", "grouped_gemm": "routed_experts"}.get(kernel_class)
    return precision != "bf16" and gemm in fp8_gemm_classes(precision, arch)


def rate_peak(rate: Rate) -> str:
    """The peak the measured kernel ran at on its device: "fp8" or "bf16"."""
    return "fp8" if runs_fp8(rate.kernel_class, rate.precision, SYSTEMS[rate.system].arch) else "bf16"


def rate_efficiency(rate: Rate) -> float:
    """The measured rate as a fraction of its device's peak on executed FLOPs."""
    peak = SYSTEMS[rate.system].peak_tflops(rate_peak(rate))
    return rate.tflops * overhead(rate.kernel_class, rate.backend, dict(rate.dims)) / peak


def _for_row(rate: Rate, row, system: System) -> float:
    """The rate as a fraction of the row's peak on `system`: the same fraction of the peak it ran at
    there, over the row's (they differ only where a stand-in runs at the other precision's peak)."""
    return rate_efficiency(rate) * system.peak_tflops(rate_peak(rate)) / system.peak_tflops(row.peak)


def _distance(rate: Rate, dims: dict) -> float:
    shared = [(v, dims[k]) for k, v in rate.dims if k in dims and v > 0 and dims[k] > 0]
    return sum(abs(math.log(a / b)) for a, b in shared)


def best_rate(rates, dims: dict, system: str) -> Rate | None:
    """The rate of one kernel a row takes (the module docstring's order), or None."""
    if not rates:
        return None
    return min(rates, key=lambda r: (r.pass_ != "fwd+bwd", round(_distance(r, dims), 6), r.system != system))


def _describe(rate: Rate) -> str:
    shape = ", ".join(f"{k} {v}" for k, v in rate.dims)
    return (
        f"{rate.tflops:g} TFLOP/s {rate.pass_} {rate.backend} {rate.precision} {rate.kernel_class} "
        f"at {rate.shape} ({shape}) on {rate.where}: {rate_efficiency(rate):.3f} of its peak"
    )


def load_calibration(path: str) -> RateTable:
    """The rates file at `path`, every rate on a system the planner knows; UserError (one line) if not."""
    table = load_rates(path)
    for i, rate in enumerate(table.rates):
        if rate.system not in SYSTEMS:
            raise UserError(
                f"rates file {path}: rates[{i}]: system {rate.system!r} is not one the planner knows "
                f"({', '.join(SYSTEMS)}; maxmoe/analysis/assumptions.py)"
            )
    return table


def calibrated(row, system: System, path: str) -> tuple[float, str, str]:
    """(efficiency, status, source) of `row` from the rates file at `path`: measured, carried, stand-in, default."""
    table = load_calibration(path)
    key = (row.kernel_class, row.backend, row.precision)
    notes = []
    for _ in range(4):  # a stand-in's stand-in, at most a few deep
        kernel_class, backend, precision = key
        rate = best_rate(
            table.find(kernel_class=kernel_class, backend=backend, precision=precision), dict(row.dims), system.name
        )
        if rate is not None and not notes:
            status = "measured" if rate.system == system.name else "carried"
            carried = "" if status == "measured" else f" (carried to {system.name}: the same fraction of its peak)"
            return _for_row(rate, row, system), status, f"measured: {_describe(rate)}{carried}"
        if rate is not None:
            return _for_row(rate, row, system), "uncalibrated", f"{'; '.join(notes)}: {_describe(rate)}"
        nearest = stand_in(*key)
        if nearest is None:
            break
        notes.append(f"{'/'.join(key)} not measured; {'/'.join(nearest[0])} stands in ({nearest[1]})")
        key = nearest[0]
    what = "; ".join(notes) or f"{'/'.join(key)} not measured"
    return DEFAULT_EFFICIENCY, "uncalibrated", f"{what}: no rate in {path}; planner default {DEFAULT_EFFICIENCY}"


def efficiency(row, system: System, a: Assumptions) -> tuple[float, str, str]:
    """(fraction of the row's peak reached on its executed FLOPs, status, source)."""
    by_hand = dict(a.class_efficiency)
    for name in (row.name, row.kernel_class):
        if name in by_hand:
            return by_hand[name], "assumed", f"set by hand: --assume compute_efficiency.{name}={by_hand[name]:g}"
    if a.compute_efficiency is not None:
        return a.compute_efficiency, "uniform", f"every class at {a.compute_efficiency:g} (a sensitivity, uncalibrated)"
    return calibrated(row, system, a.calibration)
