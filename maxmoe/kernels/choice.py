"""Which grouped-matmul and attention implementation `auto` means on a platform and device kind.

The choice is made once, when a layout is built (`maxmoe.parallel.layout.build_layout`), for the
platform the program is compiled for -- which may not be this process's (lowering for CUDA
on a CPU host) -- and is reported by `python -m maxmoe.info --json` and in the run's log.

| platform / device | grouped matmul | attention |
|---|---|---|
| cpu (and anything not below) | ragged_dot | chunked |
| NVIDIA Hopper (H100, H200, GH200, H800, H20) | mosaic_gpu | triton |
| NVIDIA Blackwell and older NVIDIA GPUs, tokamax installed | tokamax | tokamax |
| NVIDIA Blackwell and older NVIDIA GPUs, no tokamax | ragged_dot, with a warning | triton |
| CUDA lowered on a host without a GPU, jax >= 0.11 | as above | chunked (Triton cannot lower there) |

mosaic_gpu (jax's Pallas Mosaic GPU ragged dot) is built on wgmma, which only sm_90a has;
on Hopper it is preferred to tokamax because it lowers without a GPU (CI proves the
program). On other NVIDIA GPUs tokamax (an optional package: Python >= 3.12) has the
kernels; without it no maintained grouped GEMM ships with jax, so XLA's ragged_dot (its
dense rewrite: G x the FLOPs) stays, and the reason says so. A CUDA target of unknown
device kind counts as Hopper (the GPUs this project is measured on; pass a device kind to
be exact). Kernels that need bf16 fall back when the model computes in float32.
With `model.fp8=blockwise` the grouped choice also decides the FP8 GEMMs: under mosaic_gpu or
tokamax every blockwise GEMM runs maxmoe's Triton kernels (maxmoe.kernels.fp8_grouped),
under ragged_dot XLA's program.
"""

from __future__ import annotations

import dataclasses

import jax

from maxmoe.config import ConfigError
from maxmoe.kernels.attention import triton_lowers_here
from maxmoe.kernels.grouped_matmul import tokamax_problem
from maxmoe.kernels.mosaic_ragged_dot import KernelUnavailable, mosaic_modules

HOPPER = ("H100", "H200", "H800", "H20", "GH200")
BLACKWELL = ("B100", "B200", "B300", "GB200", "GB300", "BLACKWELL")


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


def resolve_grouped_matmul(requested: str, platform: str, device_kind: str = "", compute_dtype: str = "bfloat16"):
    """The grouped-matmul backend for `requested` ('auto' or a backend name) on a platform.

    Raises:
        ConfigError: when a backend named in the config cannot run there.
    """
    platform = normalise_platform(platform)
    if requested != "auto":
        problem = _grouped_matmul_problem(requested, platform, device_kind, compute_dtype)
        if problem:
            raise ConfigError(f"moe.grouped_matmul={requested}: {problem}")
        return Choice(requested, "set in the config")
    if platform != "cuda":
        return Choice("ragged_dot", f"{platform}: XLA's ragged_dot is the grouped GEMM of this backend")
    generation = gpu_generation(device_kind)
    label = device_kind or "CUDA (device kind unknown: taken as Hopper)"
    if generation != "hopper":
        if not tokamax_problem():
            return Choice("tokamax", f"{label}: tokamax's ragged dot (its Mosaic GPU or Triton kernel)")
        return Choice(
            "ragged_dot",
            f"{label}: no grouped GEMM kernel for this GPU generation ships with jax and tokamax is not "
            f"installed; XLA's ragged_dot (a dense rewrite that costs G x the useful FLOPs) is used",
        )
    if compute_dtype != "bfloat16":
        return Choice("ragged_dot", f"{label}: the Mosaic GPU kernels need bfloat16; model computes in {compute_dtype}")
    try:
        mosaic_modules()
    except KernelUnavailable as e:
        return Choice("ragged_dot", f"{label}: {e}")
    return Choice("mosaic_gpu", f"{label}: jax's Pallas Mosaic GPU ragged dot (Hopper wgmma), only valid row tiles")


def resolve_attention(requested: str, platform: str, device_kind: str = "", compute_dtype: str = "bfloat16"):
    """The attention implementation for `requested` ('auto' or a name) on a platform.

    Raises:
        ConfigError: when an implementation named in the config cannot run there.
    """
    platform = normalise_platform(platform)
    if requested != "auto":
        problem = _attention_problem(requested, platform)
        if problem:
            raise ConfigError(f"model.attention={requested}: {problem}")
        return Choice(requested, "set in the config")
    if platform != "cuda":
        return Choice("chunked", f"{platform}: XLA flash-style attention, memory linear in sequence length")
    label = device_kind or "CUDA"
    if gpu_generation(device_kind) != "hopper" and not tokamax_problem():
        return Choice("tokamax", f"{label}: tokamax's flash attention (separate value head dim)")

    problem = triton_lowers_here()
    if problem:
        return Choice("chunked", f"{label}: {problem}")
    return Choice(
        "triton",
        f"{label}: jax's Pallas Triton flash attention (causal blocks above the diagonal skipped; "
        f"v padded to the qk head dim)",
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
    unknown (on CUDA taken as Hopper).
    """
    here, here_kind = target()
    platform = normalise_platform(platform or here)
    if device_kind is None:
        device_kind = here_kind if platform == here else ""
    dtype = config.model.compute_dtype
    return Kernels(
        platform,
        device_kind,
        resolve_grouped_matmul(config.moe.grouped_matmul, platform, device_kind, dtype),
        resolve_attention(config.model.attention, platform, device_kind, dtype),
    )
