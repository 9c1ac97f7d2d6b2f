"""XLA GPU flag profiles for compute/communication overlap, applied before the backend starts.

XLA reads `XLA_FLAGS` once, when JAX creates its first backend; `apply` must therefore run
before any jax computation (`python -m maxmoe.train` calls it first thing). A profile is a
list of (flag, reason) pairs per system:

  h100, h200, b200   HGX nodes: 8 GPUs per NVLink domain, so `expert` x `tensor` <= 8
  gb200, gb300       NVL72 racks: 72 GPUs per NVLink domain, `expert` x `tensor` up to 64
  none               adds nothing (CPU hosts, debugging, bisecting a flag)
  auto               picks from `nvidia-smi`'s GPU name; none when there is no NVIDIA GPU

Precedence, lowest to highest: profile < `xla.extra_flags` (config) < flags already in the
`XLA_FLAGS` environment variable. The environment wins because it is the most specific,
last-minute intent (set by whoever launched this one process: a shell, an sbatch script, a
container image) and because a run must be reproducible by re-exporting the `XLA_FLAGS`
it recorded (`write_effective`), whatever the config says. Flags are matched by name, so
`--xla_gpu_enable_command_buffer=` in the environment replaces the profile's value.

Every flag here is accepted by the jaxlib this project pins: tests/test_xla_flags.py starts
XLA with each profile (an unknown flag or a bad value aborts XLA at start-up). The values
are starting points chosen by the arithmetic in the comments, not yet measured on GPUs;
measurements go to docs/PERFORMANCE.md.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

from maxmoe.config import XLA_PROFILES, Config, ConfigError, UserError

PROFILES = ("auto", "none") + XLA_PROFILES

MIB = 1 << 20
GIB = 1 << 30

# Combine thresholds, sized to one MoE layer's weights as each device holds them after the
# FSDP all-gather (and, symmetrically, its gradients before the reduce-scatter). DeepSeek-V3
# per layer: routed experts 256 x 3 x 7168 x 2048 = 11.3 G params; MLA ~0.19 G params.
# Params are float32 here (matmuls cast to bf16), so count 4 bytes per param.
#   NVL72 rack, expert x tensor = 64: experts 45 GB / 64 = 0.70 GB + MLA 0.75 GB = 1.45 GB
#     -> 2 GiB: one combined gather / reduce-scatter per layer.
#   HGX node, expert x tensor <= 8: experts >= 5.6 GB per layer per device, each expert
#     tensor is already one large collective; the threshold only needs to merge the rest of
#     a layer (MLA, norms, router), and is capped by HBM since pipelining double-buffers:
#     H100 (80 GB) 256 MiB; H200 (141 GB) and B200 (180 GB) 512 MiB.
_COMBINE_BYTES = {"h100": 256 * MIB, "h200": 512 * MIB, "b200": 512 * MIB, "gb200": 2 * GIB, "gb300": 2 * GIB}


def _overlap_flags(combine_bytes: int) -> list[tuple[str, str]]:
    """Flags every GPU profile shares: scheduling and pipelining of the collectives."""
    return [
        (
            "--xla_gpu_enable_latency_hiding_scheduler=true",
            "schedule async collectives early and their waits late so they run under compute",
        ),
        (
            "--xla_gpu_enable_highest_priority_async_stream=true",
            "give the collective stream priority so NCCL kernels are not starved by GEMMs",
        ),
        (
            "--xla_gpu_enable_while_loop_double_buffering=true",
            "unroll the scanned MoE stack by two so layer i+1's collectives can overlap layer i",
        ),
        (
            "--xla_gpu_enable_pipelined_all_gather=true",
            "FSDP: prefetch the next layer's weight all-gather during this layer's compute",
        ),
        (
            "--xla_gpu_enable_pipelined_reduce_scatter=true",
            "FSDP: reduce-scatter a layer's gradients while the backward pass of the next runs",
        ),
        (
            "--xla_gpu_enable_pipelined_all_reduce=true",
            "without FSDP: same overlap for the gradient all-reduce over data",
        ),
        (
            f"--xla_gpu_all_gather_combine_threshold_bytes={combine_bytes}",
            "merge a layer's weight gathers into one collective (size: see _COMBINE_BYTES)",
        ),
        (
            f"--xla_gpu_reduce_scatter_combine_threshold_bytes={combine_bytes}",
            "merge a layer's gradient reduce-scatters into one collective",
        ),
        (
            f"--xla_gpu_all_reduce_combine_threshold_bytes={combine_bytes}",
            "merge a layer's gradient all-reduces into one collective",
        ),
        (
            "--xla_gpu_enable_all_gather_combine_by_dim=false",
            "let gathers along different dimensions combine (layer weights are gathered on embed, "
            "which is not the same dimension in every weight)",
        ),
        ("--xla_gpu_enable_reduce_scatter_combine_by_dim=false", "same for gradient reduce-scatters"),
    ]


def _hopper(name: str) -> list[tuple[str, str]]:
    return _overlap_flags(_COMBINE_BYTES[name]) + [
        (
            "--xla_gpu_enable_command_buffer=",
            "no CUDA graphs: a training step this large amortises launch overhead, and graphs "
            "cost memory and re-instantiation",
        ),
    ]


def _blackwell(name: str) -> list[tuple[str, str]]:
    return _overlap_flags(_COMBINE_BYTES[name]) + [
        (
            "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL",
            "Blackwell kernels are short enough that launch overhead shows: graph fusions and "
            "custom calls (NVIDIA's Blackwell guidance), keep collectives and cuBLAS outside",
        ),
    ]


def _nvl72(name: str) -> list[tuple[str, str]]:
    return _blackwell(name) + [
        (
            "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
            "NVL72: the expert all-to-all (inside the rack, NVLink) and the FSDP / gradient "
            "collectives over data (between racks, InfiniBand) use different fabrics, so let the "
            "scheduler keep one of each in flight",
        ),
    ]


_BUILDERS = {"h100": _hopper, "h200": _hopper, "b200": _blackwell, "gb200": _nvl72, "gb300": _nvl72}


def describe(name: str) -> list[tuple[str, str]]:
    """(flag, reason) pairs of a concrete profile (`none` and the five GPU systems)."""
    if name == "none":
        return []
    if name not in _BUILDERS:
        raise ConfigError(f"xla.profile={name!r}: allowed values are {', '.join(PROFILES)}")
    return _BUILDERS[name](name)


def profile_flags(name: str, device_kind: str | None = None) -> list[str]:
    """The flags of profile `name`; `auto` is resolved first (see `resolve_profile`)."""
    return [flag for flag, _ in describe(resolve_profile(name, device_kind))]


# ----------------------------------------------------------------------------- auto


# Word boundaries keep GB200 from matching B200 and GH200 from matching H200.
_KIND_PATTERNS = (
    ("gb300", r"\bGB300\b"),
    ("gb200", r"\bGB200\b"),
    ("b200", r"\bB200\b"),
    ("h200", r"\bH200\b"),
    ("h100", r"\bH(100|800)\b"),
)


def profile_for_device_kind(device_kind: str) -> str | None:
    """The profile for a GPU name ('NVIDIA H100 80GB HBM3', 'NVIDIA GB300'); None if unknown."""
    for name, pattern in _KIND_PATTERNS:
        if re.search(pattern, device_kind.upper()):
            return name
    return None


def detect_gpu_name(timeout_s: float = 10.0) -> str | None:
    """The first GPU's name from `nvidia-smi`, or None (no tool, no GPU, error, timeout).

    JAX cannot report the device kind before its backend starts, and the backend must not
    start before XLA_FLAGS is set, so ask the driver's tool instead.
    """
    if _cpu_only_requested():
        return None
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None
    try:
        result = subprocess.run(
            [tool, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    return names[0] if result.returncode == 0 and names else None


def _cpu_only_requested() -> bool:
    platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    return bool(platforms) and all(p == "cpu" for p in platforms)


def resolve_profile(name: str, device_kind: str | None = None) -> str:
    """A concrete profile name: `auto` becomes the profile of `device_kind` (or the local GPU).

    `auto` on a host without an NVIDIA GPU gives `none`; on a GPU with no profile it gives
    `none` with a warning naming the GPU.
    """
    if name != "auto":
        if name not in PROFILES:
            raise ConfigError(f"xla.profile={name!r}: allowed values are {', '.join(PROFILES)}")
        return name
    kind = device_kind if device_kind is not None else detect_gpu_name()
    if not kind or kind.lower() == "cpu":
        return "none"
    found = profile_for_device_kind(kind)
    if found is None:
        warnings.warn(
            f"xla.profile=auto: no XLA flag profile for GPU {kind!r}; using none "
            f"(set xla.profile to one of {', '.join(XLA_PROFILES)} to choose one)",
            stacklevel=2,
        )
        return "none"
    return found


# ----------------------------------------------------------------------------- compose


def flag_name(flag: str) -> str:
    """The name a flag sets: '--xla_a=1' -> 'xla_a'; absl's '--noxla_a' also sets 'xla_a'."""
    name = flag.lstrip("-").split("=", 1)[0]
    if name.startswith("noxla_"):
        name = name[2:]
    return name


def _check_flags(flags: list[str]) -> None:
    for flag in flags:
        if not isinstance(flag, str) or not flag.startswith("--") or not flag_name(flag) or " " in flag.strip():
            raise ConfigError(f"xla.extra_flags: {flag!r} is not an XLA flag (expected --xla_name=value)")


def compose(existing_xla_flags: str, profile: str, extra_flags: list[str]) -> str:
    """XLA_FLAGS with `profile` and `extra_flags` added under the user's `existing_xla_flags`.

    The existing string is kept verbatim (first); extra flags follow, then profile flags, each
    only if no flag of higher precedence sets the same name (environment > extra > profile).
    `auto` is resolved on this host (see `resolve_profile`).
    """
    extra_flags = list(extra_flags)
    _check_flags(extra_flags)
    taken = {flag_name(f) for f in existing_xla_flags.split()}
    added = []
    for flag in extra_flags + profile_flags(profile):
        if flag_name(flag) not in taken:
            taken.add(flag_name(flag))
            added.append(flag)
    return " ".join([existing_xla_flags.strip()] + added).strip()


# ----------------------------------------------------------------------------- apply


def backends_initialised() -> bool:
    """Whether JAX has already created a backend (after which XLA_FLAGS is ignored)."""
    if "jax" not in sys.modules:  # nothing can have started; do not import jax for the question
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:
        return False
    check = getattr(xla_bridge, "backends_are_initialized", None)
    if check is not None:
        return bool(check())
    return bool(getattr(xla_bridge, "_backends", {}))  # older / newer jax without the helper


MEMORY_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def memory_fraction(config: Config, environ) -> str | None:
    """The XLA_PYTHON_CLIENT_MEM_FRACTION this process should run with; None: JAX's default.

    JAX's GPU client preallocates 75% of the device's memory by default and XLA cannot use
    more, so a plan that fits the dry run's figure (`--hbm-gb`) would fail on the device;
    `xla.memory_fraction` (default 0.95: the rest is the CUDA context, cuDNN and NCCL
    workspaces) raises it. The environment variable wins, as XLA_FLAGS does.
    """
    if MEMORY_FRACTION_ENV in environ:
        return environ[MEMORY_FRACTION_ENV]
    fraction = config.xla.memory_fraction
    return f"{fraction:g}" if fraction > 0 else None


def apply(config: Config, device_kind: str | None = None) -> list[str]:
    """Set os.environ["XLA_FLAGS"] (and the GPU memory fraction) from config.xla; return the effective flags.

    Call before any jax computation. If JAX's backends are already up and the flags would
    change, raises UserError: XLA would silently ignore them, and a run that believes it
    has a profile it does not have is worse than one that stops. The memory fraction is set
    only before the backends start (afterwards it is the backend's, and recorded as such).
    """
    fraction = memory_fraction(config, os.environ)
    if fraction is not None and not backends_initialised():
        os.environ[MEMORY_FRACTION_ENV] = fraction
    profile = resolve_profile(config.xla.profile, device_kind)
    existing = os.environ.get("XLA_FLAGS", "")
    composed = compose(existing, profile, list(config.xla.extra_flags))
    if composed.split() != existing.split():
        if backends_initialised():
            raise UserError(
                f"XLA flags for xla.profile={config.xla.profile} ({profile}) must be set before JAX "
                f"starts its backends; call maxmoe.xla_flags.apply() before any jax computation "
                f"(or export XLA_FLAGS, or set xla.profile=none)"
            )
        os.environ["XLA_FLAGS"] = composed
    return composed.split()


def write_effective(run_dir: str | os.PathLike, flags: list[str]) -> Path:
    """Write `flags` one per line to run_dir/xla_flags.txt (rerun: XLA_FLAGS="$(tr '\\n' ' ' < xla_flags.txt)").

    The allocator setting goes beside it, to run_dir/allocator.env (`NAME=value` lines; an
    empty file means JAX's defaults): rerun with `env $(cat allocator.env) ...`.
    """
    path = Path(run_dir) / "xla_flags.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{flag}\n" for flag in flags))
    value = os.environ.get(MEMORY_FRACTION_ENV)
    (path.parent / "allocator.env").write_text(f"{MEMORY_FRACTION_ENV}={value}\n" if value else "")
    return path
