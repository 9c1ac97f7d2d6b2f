"""XLA GPU flag profiles for compute/communication overlap, applied before the backend starts.

    flags = apply(config)          # first thing, before any jax computation: XLA reads XLA_FLAGS once
    write_effective(run_dir, flags)                  # run_dir/xla_flags.txt, to rerun with the same

Profiles (`xla.profile`): h100, h200, b200 (HGX nodes), gb200, gb300 (NVL72 racks), none, and
auto (from `nvidia-smi`'s GPU name; none without an NVIDIA GPU); `describe` lists a profile's
(flag, reason) pairs. Precedence, lowest to highest: the profile < `xla.extra_flags` < flags
already in the `XLA_FLAGS` environment variable, matched by name. A profile also depends on the
jaxlib (flags it does not know are never given: `jaxlib_version`) and on the expert axis size
(the ragged all-to-all's transport: `ragged_all_to_all_flags`). `apply` also sets the GPU
memory fraction; once the backends are up, flags that would change are a UserError.

docs/ARCHITECTURE.md, "XLA flags" has the profiles, the precedence's reasons and how they are
tested.
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

from maxmoe.config import XLA_PROFILES, Config, ConfigError, UserError

PROFILES = ("auto", "none") + XLA_PROFILES

# XLA:CPU's cheap LLVM settings, for programs compiled to be measured or compared rather than
# run for speed (the dry run, the tests): compiler options, or flags via `as_flags`.
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
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


def jaxlib_version() -> tuple[int, ...]:
    """The installed jaxlib's version, e.g. (0, 12, 0, 1); (0,) when it cannot be read."""
    try:
        text = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return (0,)
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:4])


# jaxlib 0.11 replaced the pipelining booleans by modes (default, off, on, explicit); the old
# names are still parsed there, as deprecated aliases of `on`, but are no DebugOptions fields.
NEW_PIPELINING_FLAGS = (0, 11)


def _pipelining_flags(jaxlib: tuple[int, ...]) -> list[tuple[str, str]]:
    reasons = {
        "all_gather": "FSDP: prefetch the next layer's weight all-gather during this layer's compute",
        "reduce_scatter": "FSDP: reduce-scatter a layer's gradients while the backward pass of the next runs",
        "all_reduce": "without FSDP: same overlap for the gradient all-reduce over data",
    }
    if jaxlib >= NEW_PIPELINING_FLAGS:
        return [(f"--xla_gpu_pipeline_{kind}=on", why) for kind, why in reasons.items()]
    return [(f"--xla_gpu_enable_pipelined_{kind}=true", why) for kind, why in reasons.items()]


def _overlap_flags(combine_bytes: int, jaxlib: tuple[int, ...]) -> list[tuple[str, str]]:
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
        *_pipelining_flags(jaxlib),
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


# ----------------------------------------------------------------------------- ragged all-to-all
#
# XLA:GPU runs a ragged all-to-all in one of these ways (flag help texts and XLA's sources):
#   one-shot kernel   every rank writes its slices straight into its peers' output buffers
#                     between two barriers: for ranks of one NVLink domain. The barrier is
#                     host-side (ranks in one process, <= 8 of them) or, with
#                     use_barrier_with_nccl, a device kernel over NCCL symmetric memory, which
#                     also serves one process per GPU; its signal region holds 32 peers, and
#                     more ranks were reported to fault (openxla/xla#47283).
#   device kernel     jaxlib >= 0.11: NCCL's device-initiated put/signal (NCCL >= 2.29) on
#                     symmetric buffers; no peer limit.
#   send/recv         the fallback: the sizes go to the host, the stream blocks, then one NCCL
#                     send/recv pair per slice. It cannot overlap anything; jaxlib >= 0.11
#                     refuses it unless allowed.
# The one-shot kernel gives each slice its own thread blocks, which is why moe.a2a_chunks
# matters there (public measurements: a few percent of NVLink bandwidth with one slice per
# peer, and a large gain with 32 slices per peer at 16 ranks).
# Safety: a public report saw NaN gradients with the one-shot kernel under the latency-hiding
# scheduler at 8 ranks (cause not public). Escape hatch, dense NCCL all-to-all of padded
# blocks: xla.extra_flags=[--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true].
ONE_SHOT_MAX_RANKS = 32  # the one-shot kernel's NCCL barrier signals at most this many peers
NEW_RAGGED_FLAGS = (0, 11)  # the device kernel and the fallback switch exist from here on


def ragged_all_to_all_flags(expert_size: int, jaxlib: tuple[int, ...]) -> list[tuple[str, str]]:
    """(flag, reason) pairs that choose the ragged all-to-all's transport for `expert_size` ranks."""
    flags = []
    if expert_size <= ONE_SHOT_MAX_RANKS:
        flags += [
            (
                "--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=true",
                "the one-shot kernel inside the NVLink domain: peers write into each other's buffers, "
                "asynchronously, with no host round trip (the default; pinned)",
            ),
            (
                "--xla_gpu_experimental_ragged_all_to_all_use_barrier_with_nccl=true",
                "let the one-shot kernel run with one process per GPU (SLURM, Kubernetes) through a "
                "device barrier over NCCL symmetric memory; jaxlib 0.10 defaults to false and then "
                "takes the host-synchronised send/recv fallback",
            ),
        ]
    elif jaxlib >= NEW_RAGGED_FLAGS:
        flags += [
            (
                "--xla_gpu_experimental_ragged_all_to_all_use_device_kernel=true",
                f"more than {ONE_SHOT_MAX_RANKS} expert ranks: the one-shot kernel's barrier cannot "
                "signal them all; NCCL's device-initiated kernel has no such limit (needs NCCL >= 2.29)",
            ),
            (
                "--xla_gpu_ragged_all_to_all_mode=symmetric",
                "the device kernel needs the buffers in NCCL symmetric memory",
            ),
            (
                "--xla_enable_nccl_symmetric_buffers_for_collectives=RaggedAllToAll",
                "register the ragged all-to-all's buffers as NCCL symmetric buffers (same reason)",
            ),
        ]
    if jaxlib >= NEW_RAGGED_FLAGS:
        flags.append(
            (
                "--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=false",
                "never take the host-synchronised send/recv path silently: a transport that does "
                "not apply is an error, not a 10x slower step (the default; pinned)",
            )
        )
    return flags


def transport_warning(expert_size: int, jaxlib: tuple[int, ...]) -> str | None:
    """Why no flag gives `expert_size` ranks a safe fast ragged all-to-all on this jaxlib, or None."""
    if expert_size > ONE_SHOT_MAX_RANKS and jaxlib < NEW_RAGGED_FLAGS:
        return (
            f"mesh.expert={expert_size}: jaxlib {'.'.join(map(str, jaxlib))} has no ragged all-to-all "
            f"transport for more than {ONE_SHOT_MAX_RANKS} ranks but the host-synchronised send/recv "
            f"fallback; use jaxlib >= 0.11 (NCCL's device kernel) or mesh.expert <= {ONE_SHOT_MAX_RANKS}"
        )
    return None


def _hopper(name: str, jaxlib: tuple[int, ...]) -> list[tuple[str, str]]:
    return _overlap_flags(_COMBINE_BYTES[name], jaxlib) + [
        (
            "--xla_gpu_enable_command_buffer=",
            "no CUDA graphs: a training step this large amortises launch overhead, and graphs "
            "cost memory and re-instantiation",
        ),
    ]


def _blackwell(name: str, jaxlib: tuple[int, ...]) -> list[tuple[str, str]]:
    return _overlap_flags(_COMBINE_BYTES[name], jaxlib) + [
        (
            "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL",
            "Blackwell kernels are short enough that launch overhead shows: graph fusions and "
            "custom calls (NVIDIA's Blackwell guidance), keep collectives and cuBLAS outside",
        ),
        (
            "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false",
            "XLA's one-shot all-reduce Triton kernel does not build for sm_100/sm_103 on a scalar "
            "f32 all-reduce peeled out of a double-buffered loop (LLVM: 'size mismatch when packing "
            "elements'; the 671B GB300 step, jaxlib 0.12.0.1): NCCL's all-reduce instead",
        ),
    ]


def _nvl72(name: str, jaxlib: tuple[int, ...]) -> list[tuple[str, str]]:
    return _blackwell(name, jaxlib) + [
        (
            "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
            "NVL72: the expert all-to-all (inside the rack, NVLink) and the FSDP / gradient "
            "collectives over data (between racks, InfiniBand) use different fabrics, so let the "
            "scheduler keep one of each in flight",
        ),
    ]


_BUILDERS = {"h100": _hopper, "h200": _hopper, "b200": _blackwell, "gb200": _nvl72, "gb300": _nvl72}


def describe(name: str, expert_size: int = 1, jaxlib: tuple[int, ...] | None = None) -> list[tuple[str, str]]:
    """(flag, reason) pairs of a concrete profile (`none` and the five GPU systems).

    `expert_size` is the size of the mesh's expert axis (the ranks of a ragged all-to-all);
    `jaxlib` the version the flags are for (default: the installed one).
    """
    if name == "none":
        return []
    if name not in _BUILDERS:
        raise ConfigError(f"xla.profile={name!r}: allowed values are {', '.join(PROFILES)}")
    jaxlib = jaxlib_version() if jaxlib is None else jaxlib
    return _BUILDERS[name](name, jaxlib) + ragged_all_to_all_flags(expert_size, jaxlib)


def profile_flags(
    name: str, device_kind: str | None = None, expert_size: int = 1, jaxlib: tuple[int, ...] | None = None
) -> list[str]:
    """The flags of profile `name`; `auto` is resolved first (see `resolve_profile`)."""
    return [flag for flag, _ in describe(resolve_profile(name, device_kind), expert_size, jaxlib)]


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


def as_flags(options: dict) -> list[str]:
    """Compiler options as XLA_FLAGS entries: {'xla_a': True, 'xla_b': 0} -> ['--xla_a=true', '--xla_b=0']."""
    return [f"--{name}={str(value).lower()}" for name, value in options.items()]


def _check_flags(flags: list[str]) -> None:
    for flag in flags:
        if not isinstance(flag, str) or not flag.startswith("--") or not flag_name(flag) or " " in flag.strip():
            raise ConfigError(f"xla.extra_flags: {flag!r} is not an XLA flag (expected --xla_name=value)")


# Parses XLA_FLAGS as a backend would, without starting one: building CompileOptions reads the
# DebugOptions from the environment, and XLA aborts the process on an unknown flag or a value
# it cannot read. Run in a child process, that abort is an answer instead of the end of this one.
_PARSE_XLA_FLAGS = (
    "try:\n    from jaxlib import xla_client\n"
    "except ImportError:\n    from jax._src.lib import xla_client\n"
    "xla_client.CompileOptions()\nprint('flags parsed')"
)
_ANY_BAD_VALUE = "--xla_backend_optimization_level=?"  # makes XLA print every flag it knows


def _parse_in_child(flags: tuple[str, ...]) -> tuple[int, str]:
    """(exit status, stderr) of a child process that parses `flags` as XLA_FLAGS; (0, '') if it cannot run."""
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "0"}
    try:
        result = subprocess.run(
            [sys.executable, "-c", _PARSE_XLA_FLAGS], env=env, capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.SubprocessError):
        return 0, ""  # no verdict: XLA checks them itself when the backend starts
    return result.returncode, result.stderr


def _near_flag_names() -> list[str]:
    """Flag names to suggest for a misspelt one: every profile's, and those XLA's usage text lists.

    XLA cuts its usage text short (a log line's size), so it names only some of its flags;
    the profiles' are the ones users most often retype.
    """
    _, text = _parse_in_child((_ANY_BAD_VALUE,))
    names = set(re.findall(r"^\s+--(\w+)=", text, re.MULTILINE))
    for profile in XLA_PROFILES:
        for expert_size in (1, ONE_SHOT_MAX_RANKS + 1):
            for jaxlib in ((0, 10), NEW_RAGGED_FLAGS):
                names.update(flag_name(flag) for flag, _ in describe(profile, expert_size, jaxlib))
    return sorted(names)


@functools.lru_cache(maxsize=16)
def installed_flag_problem(flags: tuple[str, ...]) -> str | None:
    """Why the installed jaxlib would refuse `flags` (an unknown name, a value it cannot read), or None.

    Checked in a child process (about half a second), so the refusal is one line here rather
    than XLA's abort and usage text when the backend starts.
    """
    if not flags:
        return None
    code, text = _parse_in_child(flags)
    if code == 0 or "parse_flags_from_env" not in text and "Couldn't interpret" not in text:
        return None  # parsed, or the child failed for another reason: XLA will tell at start-up
    value = re.search(r"Couldn't interpret value (.*) for flag (\w+)", text) or re.search(
        r"Illegal value for --(\w+) '(.*)'", text
    )
    if value:
        name, given = value.groups() if value.re.pattern.startswith("Illegal") else value.groups()[::-1]
        return f"--{name}={given}: the installed jaxlib cannot read this value"
    unknown = re.search(r"Unknown flags? in XLA_FLAGS: (\S+)", text)
    if unknown:
        name = flag_name(unknown.group(1))
        near = difflib.get_close_matches(name, _near_flag_names(), n=1, cutoff=0.8)
        hint = f"; did you mean --{near[0]}?" if near else ""
        return f"{unknown.group(1)}: not a flag of the installed jaxlib{hint}"
    line = next((ln for ln in text.splitlines() if "parse_flags_from_env" in ln), "")
    return f"the installed jaxlib refuses them ({line.split('] ', 1)[-1].strip()[:200]})"


def check_extra_flags(extra_flags: list[str]) -> None:
    """ConfigError when the installed jaxlib would abort on `xla.extra_flags`; call before the backend starts."""
    _check_flags(list(extra_flags))
    problem = installed_flag_problem(tuple(extra_flags))
    if problem:
        version = ".".join(map(str, jaxlib_version()))
        raise ConfigError(f"xla.extra_flags: {problem} (jaxlib {version})")


def compose(existing_xla_flags: str, profile: str, extra_flags: list[str], expert_size: int = 1) -> str:
    """XLA_FLAGS with `profile` and `extra_flags` added under the user's `existing_xla_flags`.

    The existing string is kept verbatim (first); extra flags follow, then profile flags, each
    only if no flag of higher precedence sets the same name (environment > extra > profile).
    `auto` is resolved on this host (see `resolve_profile`); `expert_size` as in `describe`.
    """
    extra_flags = list(extra_flags)
    _check_flags(extra_flags)
    taken = {flag_name(f) for f in existing_xla_flags.split()}
    added = []
    for flag in extra_flags + profile_flags(profile, expert_size=expert_size):
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
    # mesh.expert=-1 fills the devices, which are not known before the backend starts: the
    # flags for a small expert axis then (the transport warning below is skipped too).
    expert_size = max(config.mesh.expert, 1)
    if profile != "none":
        warning = transport_warning(expert_size, jaxlib_version())
        if warning:
            warnings.warn(warning, stacklevel=2)
    existing = os.environ.get("XLA_FLAGS", "")
    if config.xla.extra_flags and not backends_initialised():
        check_extra_flags(list(config.xla.extra_flags))
    composed = compose(existing, profile, list(config.xla.extra_flags), expert_size)
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
