"""XLA:GPU's compiler on a host without a GPU: compile-only devices of a target GPU, a train step compiled for them.

With jax's CUDA plugin installed (the `gpu-compile` extra; `compiler_problem()` says why not
elsewhere), `target_devices(system, n)` are n compile-only devices of the system's GPU, made from
XLA's target spec for it (gpu_targets/<system>.txtpb names its source); a program traced and
lowered under a mesh of them (`jax.set_mesh`: Pallas reads the target GPU from it) compiles with
XLA:GPU (`compile_options`). Nothing runs or is autotuned: GEMM tiles from XLA's cost model, sorts
XLA's own (CUB needs a device; off on sm_100, where XLA fails without that), cuDNN builds no graph
(workspace 0). So no speed, but memory, kernels, collectives and schedule are XLA:GPU's. A Mosaic
GPU kernel built once is reused for any GPU in the process: one system per process. XLA flags are
the process's (`use_profile` sets a system's profile before the backends start, as on its GPU).
`compile_train_step` builds a config's step with its kernels or, where `auto` finds no grouped
kernel for the GPU (Blackwell without tokamax), the dry run's balanced stand-in, its reason saying so.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import re
import shutil
import time
from pathlib import Path

import jax

from maxmoe.config import Config, UserError

TARGET_DIR = Path(__file__).with_name("gpu_targets")
# GPUs per host in each system: an HGX node holds 8, a GB200 / GB300 NVL72 tray 4.
GPUS_PER_HOST = {"h100": 8, "h200": 8, "b200": 8, "gb200": 4, "gb300": 4}
SYSTEMS = tuple(GPUS_PER_HOST)
_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One system's GPU as XLA's target spec describes it."""

    system: str
    spec: str  # the GpuTargetConfigProto text
    device_kind: str  # its device_description_str, what jax reports as device_kind
    compute_capability: tuple[int, int]

    @property
    def sm(self) -> str:
        """'sm_90', 'sm_100', 'sm_103'."""
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def compiler_problem() -> str:
    """'' when XLA:GPU can compile here (jax's CUDA plugin and ptxas are installed), else why not."""
    if not any(_found(p) for p in _PLUGINS):
        return (
            f"jax's CUDA plugin is not installed (jax {jax.__version__}); pip install 'maxmoe[gpu-compile]' "
            "(Python >= 3.12: jax-cuda12-plugin, ptxas) to compile for GPUs here"
        )
    if not (_found("nvidia.cuda_nvcc") or shutil.which("ptxas")):
        return "ptxas is not installed (pip install nvidia-cuda-nvcc-cu12); XLA:GPU needs it to compile kernels"
    return ""


def choose_compiler(requested: str | None, system: str | None) -> tuple[str, str]:
    """("gpu" or "cpu", a sentence saying which and why) for a dry run asking for `requested`
    (None: XLA:GPU where it can compile for `system`'s GPU here, else XLA:CPU). UserError when
    "gpu" cannot be had."""
    problem = compiler_problem() if system in GPUS_PER_HOST else f"no GPU target for system {system!r}"
    if requested == "gpu" and problem:
        raise UserError(
            f"--compiler gpu: {problem}" if system else "--compiler gpu needs --system (the GPU to compile for)"
        )
    if requested == "cpu" or problem:
        why = "as asked" if requested == "cpu" else problem if system else "no --system to compile for"
        return "cpu", f"XLA:CPU on fake CPU devices ({why})"
    target = gpu_target(system)
    return "gpu", f"XLA:GPU for {target.device_kind} ({target.sm}), without a device"


@functools.cache
def gpu_target(system: str) -> GpuTarget:
    """The GPU of `system` (a key of GPUS_PER_HOST) from its spec file."""
    if system not in GPUS_PER_HOST:
        raise UserError(f"no GPU target for system {system!r}; expected one of {', '.join(SYSTEMS)}")
    spec = (TARGET_DIR / f"{system}.txtpb").read_text()
    kind = re.search(r'^device_description_str: "([^"]+)"', spec, re.M).group(1)
    capability = re.search(r"cuda_compute_capability \{([^}]*)\}", spec).group(1)
    major, minor = (re.search(rf"\b{k}: (\d+)", capability) for k in ("major", "minor"))
    return GpuTarget(system, spec, kind, (int(major.group(1)), int(minor.group(1)) if minor else 0))


@functools.cache
def target_devices(system: str, count: int) -> list:
    """`count` compile-only devices of `system`'s GPU, hosts of GPUS_PER_HOST each (fewer: one host)."""
    problem = compiler_problem()
    if problem:
        raise UserError(f"cannot compile for {system} with XLA:GPU: {problem}")
    from jax.experimental import topologies

    per_host = GPUS_PER_HOST[system] if count % GPUS_PER_HOST[system] == 0 else count
    topology = f"1x{count // per_host}x{per_host}"
    try:
        description = topologies.get_topology_desc(
            platform="cuda", target_config=gpu_target(system).spec, topology=topology
        )
    except Exception as e:  # noqa: BLE001 - an older plugin that cannot read the spec: one line, not a trace
        raise UserError(
            f"jax {jax.__version__}'s CUDA plugin cannot make {system} devices ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:160]})"
        ) from None
    return list(description.devices)


def compile_options(system: str) -> dict:
    """The compile options XLA:GPU needs without a device, for `system`'s GPU."""
    options = {"xla_gpu_experimental_cost_model_gemm_tiling_default": True}  # GEMM tiles: no autotuning here
    if gpu_target(system).compute_capability[0] >= 10:
        options["xla_gpu_deviceless_cub_mode"] = "DEVICELESS_CUB_DISABLED"
    return options


def use_profile(config: Config, system: str) -> list[str]:
    """Set XLA_FLAGS for `system`'s xla.profile before the backends start (maxmoe.xla_flags.apply);
    the effective flags. Once they have started, the process's flags stay and are returned."""
    import os

    from maxmoe import xla_flags

    if xla_flags.backends_initialised():
        return os.environ.get("XLA_FLAGS", "").split()
    return xla_flags.apply(config.replace(xla={"profile": system}), gpu_target(system).device_kind)


def gpu_layout(config: Config, devices: list, target: GpuTarget):
    """The layout of `config` on `devices` for the target's GPU: its own kernels, or where `auto`
    finds no grouped-GEMM kernel for this GPU, the balanced stand-in (dry runs: a grouped kernel's
    buffers and FLOPs over balanced groups), its Choice's reason saying so."""
    from maxmoe.kernels.choice import Choice, grouped_kernel_missing
    from maxmoe.kernels.grouped_matmul import BALANCED_STAND_IN
    from maxmoe.parallel.layout import build_layout

    missing = grouped_kernel_missing(target.device_kind) if config.moe.grouped_matmul == "auto" else ""
    if not missing:
        return build_layout(config, devices, platform="cuda", device_kind=target.device_kind)
    stand_in = config.replace(moe={"grouped_matmul": "ragged_dot"})
    layout = build_layout(stand_in, devices, platform="cuda", device_kind=target.device_kind)
    reason = (
        f"{target.device_kind}: {missing}, so `auto` refuses to train there; compiled with the balanced "
        "stand-in, a batched GEMM over equal blocks of the rows: a grouped kernel's buffers and FLOPs"
    )
    layout = dataclasses.replace(layout, grouped_matmul=Choice(BALANCED_STAND_IN, reason))
    if layout.dispatch_plan is not None:
        plan = dataclasses.replace(layout.dispatch_plan, grouped_matmul=BALANCED_STAND_IN)
        layout = dataclasses.replace(layout, dispatch_plan=plan)
    return layout


def program_report(text: str, domain: list[int], layout, system: str) -> tuple[list[dict], list[str], dict]:
    """(collective rows, notes, what else the dry run records) of an XLA:GPU optimized program.

    Rows: maxmoe.analysis.hlo.collective_ops' as XLA:GPU combined them (one row, one launch per
    run), its ragged all-to-alls counted as all-to-all. Recorded: the compiler, the kernels
    (maxmoe.analysis.gpu_program.kernel_calls), the async schedule per kind (schedule_summary, with
    `sync`: collectives of the kind that run synchronously) and `a2a_overlapped`: every ragged
    all-to-all is async with work scheduled inside.
    """
    from maxmoe.analysis.gpu_program import async_collectives, kernel_calls, schedule_summary
    from maxmoe.analysis.hlo import collective_ops
    from maxmoe.kernels.grouped_matmul import BALANCED_STAND_IN

    rows = collective_ops(text, domain)
    pairs = async_collectives(text)
    schedule = schedule_summary(pairs)
    for kind in {r["kind"] for r in rows}:
        entry = schedule.setdefault(kind, {"async": 0, "with_compute": 0, "runs": 0, "runs_with_compute": 0})
        entry["sync"] = sum(r["kind"] == kind for r in rows) - entry["async"]
    ragged = schedule.get("ragged-all-to-all", {})
    target = gpu_target(system)
    notes = [
        f"compiled by XLA:GPU for {target.device_kind} ({target.sm}) without a device "
        "(maxmoe.analysis.gpu_compile): memory, collectives as XLA combined them, and their schedule are its "
        "program's; nothing autotuned (GEMM tiles from XLA's cost model)"
    ]
    if ragged:
        notes.append(
            "all-to-all: XLA:GPU's ragged all-to-alls, each at the smaller of its send and receive buffers "
            "(what balanced routing moves)"
        )
    if layout.grouped_matmul is not None and layout.grouped_matmul.name == BALANCED_STAND_IN:
        notes.append(f"grouped GEMM: {layout.grouped_matmul.reason}")
    recorded = {
        "compiler": f"XLA:GPU {target.device_kind} ({target.sm})",
        "kernels": kernel_calls(text),
        "async_schedule": schedule,
        "a2a_overlapped": bool(ragged) and ragged["with_compute"] == ragged["async"] and not ragged["sync"],
    }
    rows = [{**r, "kind": "all-to-all", "ragged": True} if r["kind"] == "ragged-all-to-all" else r for r in rows]
    return rows, notes, recorded


def step_report(config: Config, system: str) -> dict:
    """One train step of `config` compiled by XLA:GPU for `system`'s GPU, described per device (what
    `python -m maxmoe.info --compile-for SYSTEM` prints): memory, kernels, collectives per kind
    (ops and bytes per step, and how many run async with work inside: `program_report`)."""
    from maxmoe.analysis.hlo import summarize_ops
    from maxmoe.parallel.mesh import device_domains

    compiled, layout, _, lower_s, compile_s = compile_train_step(config, system)
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    domain = device_domains(list(layout.mesh.devices.flat), config.mesh.scale_up_domain)
    rows, notes, recorded = program_report(text, domain, layout, system)
    wire = summarize_ops([{**r, "kind": "ragged-all-to-all"} if r.get("ragged") else r for r in rows])
    schedule = recorded["async_schedule"]
    memory = {
        "argument": mem.argument_size_in_bytes,
        "output": mem.output_size_in_bytes,
        "alias": mem.alias_size_in_bytes,
        "temp": mem.temp_size_in_bytes,
    }
    return {
        "compiler": recorded["compiler"],
        "devices": layout.mesh.size,
        "mesh": dict(layout.mesh.shape),
        "grouped_matmul": layout.grouped_matmul.name,
        "attention": layout.attention.name,
        "memory": {**memory, "total": memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]},
        "kernels": recorded["kernels"],
        "collectives": {
            kind: {"ops": wire["ops"][kind], "bytes": wire["by_kind"][kind], **schedule.get(kind, {})}
            for kind in sorted(wire["ops"])
        },
        "notes": notes,
        "lower_s": lower_s,
        "compile_s": compile_s,
    }


def device_count(config: Config) -> int:
    """How many devices `config`'s mesh names: the product of its sizes, or with an axis at -1
    (fill) run.cpu_devices, else the other axes' product."""
    from maxmoe.config.mesh import mesh_sizes

    sizes = mesh_sizes(config).values()
    fixed = math.prod(s for s in sizes if s > 0)
    return (config.run.cpu_devices or fixed) if -1 in sizes else fixed


def compile_train_step(config: Config, system: str, devices: list | None = None, options: dict | None = None):
    """One train step of `config` compiled by XLA:GPU for `system`'s GPU; (compiled, layout, lowered,
    lower s, compile s). `devices`: compile-only devices of that GPU (default: `device_count`'s); `options`:
    compile options added to `compile_options`'. Raises UserError (one line) where XLA:GPU refuses."""
    from maxmoe.training.programs import build_programs

    target = gpu_target(system)
    devices = devices if devices is not None else target_devices(system, device_count(config))
    start = time.perf_counter()
    layout = gpu_layout(config, devices, target)
    programs = build_programs(config, layout)
    with jax.set_mesh(layout.mesh):
        lowered = programs.train_step.trace(programs.abstract_state, programs.abstract_batch(config)).lower()
    lower_s = time.perf_counter() - start
    try:
        compiled = lowered.compile({**compile_options(system), **(options or {})})
    except Exception as e:  # noqa: BLE001 - XLA:GPU's refusal (a kernel it cannot build for this GPU): one line
        raise UserError(f"XLA:GPU cannot compile this step for {target.device_kind} ({target.sm}): {why(e)}") from None
    return compiled, layout, lowered, lower_s, time.perf_counter() - start - lower_s


def why(error: Exception) -> str:
    """The first line of a compiler error (XLA:GPU and ptxas put what failed there), shortened."""
    first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return " ".join(first.split())[:300]
