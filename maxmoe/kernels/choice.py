"""Which grouped-matmul and attention implementation `auto` means on a platform and device kind.

Chosen once, when a layout is built, for the platform the program is compiled for (maybe not
this process's) and reported by `python -m maxmoe.info` and the run's log. Off CUDA: ragged_dot
and chunked. On CUDA, of the candidates that can be built there and do no padded work
(grouped: mosaic_gpu on Hopper in bf16, tokamax, ragged_dot; attention: cudnn, tokamax,
chunked), the one measured fastest for this device kind, else another of its generation, in the
committed rate table (maxmoe.kernels.rates): fwd+bwd, bf16, at the 671B shape, else the proxy's.
With none measured a fixed preference (that order) decides, and the reason says so; a program's
(`resolve_kernels`) refuses on Blackwell with no grouped kernel installed. Never `auto`: triton
attention (qk 192 padded to 256, v to qk's dim: 1.6x the work), xla attention (memory quadratic
in T), dense_loop. A CUDA target of unknown device kind counts as Hopper.
With `model.fp8=blockwise` the grouped choice also decides the FP8 GEMMs: maxmoe's Triton
kernels under mosaic_gpu or tokamax, XLA's program under ragged_dot. docs/KERNELS.md has more.
"""

from __future__ import annotations

import dataclasses

import jax

from maxmoe.config import ConfigError
from maxmoe.kernels.attention import cudnn_problem
from maxmoe.kernels.grouped_matmul import tokamax_problem
from maxmoe.kernels.mosaic_ragged_dot import KernelUnavailable, mosaic_modules
from maxmoe.kernels.rates import DEFAULT_RATES, Rate, load_rates

HOPPER = ("H100", "H200", "H800", "H20", "GH200")
BLACKWELL = ("B100", "B200", "B300", "GB200", "GB300", "BLACKWELL")
# What `auto` weighs on CUDA, in the fixed preference used where no rate is measured, and the
# shapes of the rate table compared (the 671B per-GPU shape first).
ATTENTION_CANDIDATES = ("cudnn", "tokamax", "chunked")
GROUPED_CANDIDATES = ("mosaic_gpu", "tokamax", "ragged_dot")
ATTENTION_SHAPES = ("671b_heads", "proxy_heads")
GROUPED_SHAPES = ("671b", "proxy")


@dataclasses.dataclass(frozen=True)
class Choice:
    """A resolved implementation and why it was chosen."""

    name: str
    reason: str


def normalise_platform(platform: str) -> str:
    """jax's backend names ('gpu') to lowering platform names ('cuda')."""
    return {"gpu": "cuda"}.get(platform, platform)


def gpu_generation(device_kind: str) -> str:
    """'hopper', 'blackwell' or 'other' from a device kind such as 'NVIDIA H200'; '' counts as hopper."""
    kind = device_kind.upper().replace("NVIDIA", "").strip()
    if not kind:
        return "hopper"
    words = kind.replace("-", " ").split()
    if any(w.startswith(BLACKWELL) for w in words):
        return "blackwell"
    if any(w.startswith(HOPPER) for w in words):
        return "hopper"
    return "other"


def target() -> tuple[str, str]:
    """This process's (platform, device kind)."""
    device = jax.devices()[0]
    return normalise_platform(device.platform), device.device_kind


def _named(key: str, requested: str, problem: str) -> Choice:
    """The implementation a config key names, or a ConfigError saying why it cannot run here."""
    if problem:
        raise ConfigError(f"{key}={requested}: {problem}")
    return Choice(requested, "set in the config")


def resolve_grouped_matmul(
    requested: str, platform: str, device_kind: str = "", compute_dtype: str = "bfloat16", rates=None
):
    """The grouped-matmul backend for moe.grouped_matmul=`requested` on a platform: a backend the
    config names (ConfigError where it cannot run), or the one `auto` picks by `rates` (the
    committed rate table by default)."""
    platform = normalise_platform(platform)
    if requested != "auto":
        problem = _grouped_matmul_problem(requested, platform, device_kind, compute_dtype)
        return _named("moe.grouped_matmul", requested, problem)
    if platform != "cuda":
        return Choice("ragged_dot", f"{platform}: XLA's ragged_dot is the grouped GEMM of this backend")
    label = device_kind or "CUDA (device kind unknown: taken as Hopper)"
    problems = {name: _grouped_auto_problem(name, device_kind, compute_dtype) for name in GROUPED_CANDIDATES}
    measured = measured_fastest("grouped_gemm", GROUPED_SHAPES, device_kind, problems, rates)
    if measured:
        return measured
    if not problems["mosaic_gpu"]:
        return Choice("mosaic_gpu", f"{label}: jax's Pallas Mosaic GPU ragged dot (Hopper wgmma), only valid row tiles")
    if not problems["tokamax"]:
        return Choice("tokamax", f"{label}: tokamax's ragged dot (its Mosaic GPU or Triton kernel)")
    why = (
        problems["mosaic_gpu"]
        if gpu_generation(device_kind) == "hopper"
        else "no grouped GEMM kernel for this GPU generation ships with jax"
    )
    return Choice(
        "ragged_dot",
        f"{label}: {why}; tokamax is not installed; XLA's ragged_dot (a dense rewrite that costs G x the "
        f"useful FLOPs) is used",
    )


def grouped_kernel_missing(device_kind: str) -> str:
    """Why `auto` has no grouped-GEMM kernel for this CUDA GPU ('' when it has one): on Blackwell
    jax ships none (its Mosaic GPU ragged dot is Hopper's wgmma) and tokamax is not installed."""
    if gpu_generation(device_kind) != "blackwell" or not tokamax_problem():
        return ""
    return "no grouped GEMM kernel for Blackwell is installed (jax's Mosaic GPU ragged dot is Hopper-only; no tokamax)"


def _grouped_auto_problem(name: str, device_kind: str, compute_dtype: str) -> str:
    """Why `auto` cannot take grouped backend `name` on this CUDA target ('' when it can)."""
    if name == "mosaic_gpu":
        if gpu_generation(device_kind) != "hopper":
            return "jax's Mosaic GPU ragged dot needs Hopper (sm_90a wgmma)"
        if compute_dtype != "bfloat16":
            return f"the Mosaic GPU kernels need bfloat16; model computes in {compute_dtype}"
        try:
            mosaic_modules()
        except KernelUnavailable as e:
            return str(e)
        return ""
    return tokamax_problem() if name == "tokamax" else ""


def resolve_attention(
    requested: str, platform: str, device_kind: str = "", compute_dtype: str = "bfloat16", rates=None
):
    """The attention core for model.attention=`requested` on a platform (ConfigError where a named
    one cannot run; `auto` picks by `rates`, the committed rate table by default)."""
    platform = normalise_platform(platform)
    if requested != "auto":
        return _named("model.attention", requested, _attention_problem(requested, platform))
    if platform != "cuda":
        return Choice("chunked", f"{platform}: XLA flash-style attention, memory linear in sequence length")
    label = device_kind or "CUDA"
    problems = {"cudnn": cudnn_problem(), "tokamax": tokamax_problem(), "chunked": ""}
    if compute_dtype not in ("bfloat16", "float16"):
        problems["cudnn"] = f"cuDNN's flash attention needs bf16/f16; model computes in {compute_dtype}"
    measured = measured_fastest("attention_core", ATTENTION_SHAPES, device_kind, problems, rates)
    if measured:
        return measured
    name = next(n for n in ATTENTION_CANDIDATES if not problems[n])
    reasons = {
        "cudnn": "cuDNN's flash attention, v at its own head dim",
        "tokamax": "tokamax's flash attention (separate value head dim)",
        "chunked": f"XLA flash-style attention ({problems['cudnn']})",
    }
    return Choice(name, f"{label}: {reasons[name]}; no measured rate to choose by")


def measured_fastest(
    kernel_class: str, shapes, device_kind: str, problems: dict[str, str], rates=None
) -> Choice | None:
    """The candidate (a key of `problems` whose problem is '') measured fastest for `kernel_class`
    on `device_kind` (else on another device of its generation): forward+backward, bf16, at the
    first of `shapes` where one is measured; None where none is (rates: a path, default the
    committed table)."""
    table = load_rates(rates or DEFAULT_RATES)
    usable = [n for n, problem in problems.items() if not problem]
    kinds = _measured_kinds(table, device_kind)
    for shape in shapes:
        found = [
            r
            for r in table.rates
            if (r.kernel_class, r.precision, r.pass_, r.shape) == (kernel_class, "bf16", "fwd+bwd", shape)
            and r.device_kind in kinds
            and r.backend in usable
        ]
        if found:
            return _measured_choice(max(found, key=lambda r: r.tflops), found, problems, table.path)
    return None


def _measured_kinds(table, device_kind: str) -> tuple[str, ...]:
    """The device kinds of `table` whose rates stand for `device_kind`: its own, else its generation's."""
    kinds = sorted({r.device_kind for r in table.rates})
    own = [
        k for k in kinds if k.upper().replace("NVIDIA", "").strip() == device_kind.upper().replace("NVIDIA", "").strip()
    ]
    return tuple(own or [k for k in kinds if gpu_generation(k) == gpu_generation(device_kind)])


def _measured_choice(best: Rate, found: list[Rate], problems: dict[str, str], path: str) -> Choice:
    others = ", ".join(f"{r.backend} {r.tflops:.0f}" for r in sorted(found, key=lambda r: -r.tflops) if r is not best)
    unmeasured = [n for n, problem in problems.items() if not problem and n not in {r.backend for r in found}]
    skipped = [f"{n}: {problem}" for n, problem in problems.items() if problem]
    return Choice(
        best.backend,
        f"{best.device_kind}: {best.backend} measured fastest, {best.tflops:.0f} TFLOP/s fwd+bwd at {best.shape}"
        + (f" (against {others})" if others else "")
        + (f"; not measured: {', '.join(unmeasured)}" if unmeasured else "")
        + (f"; cannot run here: {'; '.join(skipped)}" if skipped else "")
        + f" ({best.date}, {best.commit}; {path})",
    )


def _grouped_matmul_problem(name: str, platform: str, device_kind: str, compute_dtype: str) -> str:
    """Why backend `name` cannot run on this target ('' when it can)."""
    if name == "tokamax":
        return tokamax_problem()
    if name != "mosaic_gpu":
        return ""
    if platform != "cuda" or gpu_generation(device_kind) != "hopper":
        return f"needs an NVIDIA Hopper GPU (sm_90a wgmma); the target is {device_kind or platform}"
    if compute_dtype not in ("bfloat16", "float16"):
        return f"needs model.compute_dtype=bfloat16 (got {compute_dtype})"
    try:
        mosaic_modules()
    except KernelUnavailable as e:
        return str(e)
    return ""


def _attention_problem(name: str, platform: str) -> str:
    """Why attention `name` cannot run on this platform ('' when it can; triton interprets off the GPU)."""
    if name == "tokamax":
        return tokamax_problem()
    if name == "cudnn" and platform != "cuda":
        return f"cuDNN needs an NVIDIA GPU; the target is {platform}"
    return ""


@dataclasses.dataclass(frozen=True)
class Kernels:
    """What one program runs: its platform, device kind, grouped matmul and attention."""

    platform: str
    device_kind: str
    grouped_matmul: Choice
    attention: Choice


def resolve_kernels(config, platform: str | None = None, device_kind: str | None = None) -> Kernels:
    """The kernels of `config` (a maxmoe Config) for a platform (default: this process's).

    `device_kind` defaults to this device's when the platform is this process's, else
    unknown (on CUDA taken as Hopper). Raises ConfigError where `auto` has no grouped kernel for
    the GPU (`grouped_kernel_missing`): XLA's ragged_dot program would not fit there.
    """
    here, here_kind = target()
    platform = normalise_platform(platform or here)
    if device_kind is None:
        device_kind = here_kind if platform == here else ""
    dtype = config.model.compute_dtype
    missing = grouped_kernel_missing(device_kind) if platform == "cuda" and config.moe.grouped_matmul == "auto" else ""
    if missing:  # XLA's ragged_dot there: a dense rewrite, G x the FLOPs and memory (proxy_1gpu: 421 GB on a B200)
        raise ConfigError(
            f"moe.grouped_matmul=auto on {device_kind}: {missing}; install tokamax (pip install 'maxmoe[gpu]', "
            "Python >= 3.12), or set moe.grouped_matmul=ragged_dot for XLA's dense rewrite (G x the FLOPs and memory)"
        )
    return Kernels(
        platform,
        device_kind,
        resolve_grouped_matmul(config.moe.grouped_matmul, platform, device_kind, dtype),
        resolve_attention(config.model.attention, platform, device_kind, dtype),
    )
