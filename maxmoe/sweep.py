"""`python -m maxmoe.sweep --config C --devices N [--dry-run]`: every (data, expert, tensor) mesh for N devices, ranked.

    python -m maxmoe.sweep --config configs/tiny.yaml --devices 8 --dry-run --json runs/sweep/tiny.json
    python -m maxmoe.sweep --config configs/deepseek_v3_671b.yaml --config configs/mesh_256_gb300.yaml \\
        --devices 256 --dry-run --mesh data=4,expert=64,tensor=1
    python -m maxmoe.sweep --config configs/proxy_1gpu.yaml --steps 10          # time on the real devices

Shapes: every (data, expert, tensor) whose product is N (or the `--mesh` ones), kept when
the model and batch divide (`config.check_mesh_fits` via `mesh.resolve_shape`) and
`mesh.build_mesh` accepts it (expert x tensor inside one scale-up domain, unless
`mesh.allow_cross_domain`).

--dry-run: N fake CPU devices; one training step (donated state, as train.py jits it) is
compiled ahead of time from abstract shapes -- nothing is allocated -- and per shape it
reports, per device:
  memory      compiled.memory_analysis(): arguments, outputs, temp, aliased (donated) and
              total = arguments + outputs - aliased + temp; `fits` = total <= --hbm-gb.
  collectives bytes each device puts on the wire per step, by kind, from the compiled HLO:
              all-gather / all-to-all (P-1)/P of the result, reduce-scatter (P-1) x its
              result, all-reduce 2 (P-1)/P of it (ring), collective-permute its result,
              ops inside loops multiplied by the trip count (scanned layers, grad
              accumulation). `cross-domain` sums the ops whose replica groups hold devices
              of more than one scale-up domain.
  flops       analytic model FLOPs per device per step (maxmoe.flops).
The ragged all-to-all: XLA:CPU has none and the CPU emulation pads every peer block to the
whole receive buffer ([P, M, D] per call), which would describe neither the GPU's bytes nor
its memory. By default (`--a2a proxy`) the dry run compiles a stand-in with the native
collective's shapes instead: a dense all-to-all of min(N, M) rows -- what a native ragged
all-to-all moves under balanced routing, (P-1)/P of the n x K token copies -- written into
the same [M, D] output buffer. `--a2a emulate` compiles the emulation as the CPU runs it,
reports its all-to-all bytes as `emulated_all_to_all`, replaces them by the analytic native
figure and marks the memory as an upper bound. Either way `native_a2a_bytes` is the analytic
figure: n x K x D x bytes x (P-1)/P per call, two calls (dispatch, combine) per MoE layer
forward, twice that backward, and one more forward under remat (recompute).

Without --dry-run: the same shapes on the real devices, timed over --steps steps after
--warmup: tokens/s, TFLOP/s per device and MFU against maxmoe.flops.peak_tflops.
Output: a ranked table on stdout (progress on stderr), --json, --plot (matplotlib).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import sys
import time
import warnings
from pathlib import Path

from maxmoe.cli import config_from_args, main_guard, make_parser
from maxmoe.config import Config, ConfigError, UserError

AXES = ("data", "expert", "tensor")
GB = 1e9
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

# ---------------------------------------------------------------------------------------
# Shapes


def parse_mesh(text: str) -> dict[str, int]:
    """'data=2,expert=4,tensor=1' -> sizes (missing axes are 1)."""
    sizes = {a: 1 for a in AXES}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in AXES:
            raise UserError(f"--mesh {text!r}: expected data=A,expert=B,tensor=C")
        try:
            sizes[key] = int(value)
        except ValueError:
            raise UserError(f"--mesh {text!r}: {key}={value!r} is not an integer") from None
        if sizes[key] <= 0:
            raise UserError(f"--mesh {text!r}: {key} must be positive")
    return sizes


def factorisations(n: int) -> list[dict[str, int]]:
    """Every (data, expert, tensor) with data x expert x tensor = n."""
    out = []
    for tensor in range(1, n + 1):
        if n % tensor:
            continue
        for expert in range(1, n // tensor + 1):
            if (n // tensor) % expert == 0:
                out.append({"data": n // (tensor * expert), "expert": expert, "tensor": tensor})
    return out


def with_mesh(config: Config, sizes: dict[str, int]) -> Config:
    return config.replace(mesh=dataclasses.replace(config.mesh, **sizes))


def mesh_name(sizes: dict[str, int]) -> str:
    return ",".join(f"{a}={sizes[a]}" for a in AXES)


def candidate_shapes(config: Config, devices, meshes: list[dict[str, int]] | None = None):
    """(kept, skipped): kept = [(sizes, mesh)], skipped = [(sizes, reason)], in enumeration order."""
    from maxmoe.mesh import build_mesh, resolve_shape

    kept, skipped = [], []
    for sizes in meshes or factorisations(len(devices)):
        shaped = with_mesh(config, sizes)
        try:
            resolve_shape(shaped, len(devices))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mesh = build_mesh(shaped, devices)
        except ConfigError as e:
            skipped.append((sizes, str(e)))
            continue
        kept.append((sizes, mesh))
    return kept, skipped


# ---------------------------------------------------------------------------------------
# HLO collectives

DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
_OP_RE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+(" + "|".join(KINDS) + r")(-start)?\(")
_SHAPE_RE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*[({]")
_CALL_RE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def _shape_bytes(text: str) -> list[int]:
    return [DTYPE_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _SHAPE_RE.findall(text)]


def replica_groups(line: str, num_devices: int) -> list[list[int]]:
    """The device groups of one collective line (explicit, iota or empty = everyone)."""
    import numpy as np

    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        groups, size = int(iota.group(1)), int(iota.group(2))
        dims = [int(d) for d in iota.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
        return ids.reshape(groups, size).tolist()
    named = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
        r"\s*\{([^}]*)\}",
        line,
    )
    if named:  # mesh['axis_0'=4,'axis_1'=2] {'axis_0'}: groups vary the listed axes
        axes = re.findall(r"'([^']+)'=(\d+)", named.group(1))
        names, dims = [a for a, _ in axes], [int(d) for _, d in axes]
        ids = np.arange(math.prod(dims))
        if named.group(2):
            order = np.arange(math.prod(int(d) for d in named.group(2).split(","))).reshape(
                [int(d) for d in named.group(2).split(",")]
            )
            if named.group(3):
                order = order.transpose([int(p) for p in named.group(3).split(",")])
            ids = order.reshape(-1)
        ids = ids.reshape(dims)
        chosen = [names.index(a) for a in re.findall(r"'([^']+)'", named.group(4)) if a in names]
        rest = [i for i in range(len(dims)) if i not in chosen]
        return ids.transpose(rest + chosen).reshape(-1, math.prod(dims[i] for i in chosen) if chosen else 1).tolist()
    explicit = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
    if explicit:
        return [[int(i) for i in g.split(",") if i.strip()] for g in re.findall(r"\{([\d, ]*)\}", explicit.group(1))]
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if pairs:
        return [[int(i) for i in p.split(",")] for p in re.findall(r"\{?(\d+,\d+)\}?", pairs.group(1) + "}")]
    return [list(range(num_devices))]


def _multipliers(hlo_text: str) -> tuple[dict[str, list[str]], dict[str, float]]:
    """Lines of each computation and how many times it runs per step (trip counts of while loops)."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if not line.startswith((" ", "\t", "}")) and line.strip():
            m = _COMP_RE.match(line)
            if m and line.rstrip().endswith("{"):
                current = m.group(1)
                comps[current] = []
                if line.startswith("ENTRY"):
                    entry = current
                continue
        if current is not None:
            comps[current].append(line)
    calls: dict[str, list[tuple[str, float]]] = {name: [] for name in comps}
    for name, lines in comps.items():
        for line in lines:
            trip = _TRIP_RE.search(line)
            for role, callee in _CALL_RE.findall(line):
                factor = float(trip.group(1)) if (role in ("body", "condition") and trip) else 1.0
                calls[name].append((callee, factor))
            branches = _BRANCHES_RE.search(line)
            if branches:
                calls[name] += [(b.strip().lstrip("%"), 1.0) for b in branches.group(1).split(",") if b.strip()]
    times = {name: 0.0 for name in comps}
    if entry is None:
        return comps, {name: 1.0 for name in comps}

    def visit(name, factor, depth=0):
        if name not in times or depth > 64:
            return
        times[name] += factor
        for callee, f in calls.get(name, ()):
            visit(callee, factor * f, depth + 1)

    visit(entry, 1.0)
    return comps, times


def collective_bytes(hlo_text: str, device_domain: list[int]) -> dict:
    """Per-device bytes on the wire per step by collective kind, and the part crossing domains.

    `device_domain[i]` is the scale-up domain of the program's device (partition) i.
    Returns {"by_kind": {kind: bytes}, "cross_domain": {kind: bytes}, "ops": {kind: count}}.
    """
    comps, times = _multipliers(hlo_text)
    by_kind: dict[str, float] = {}
    cross: dict[str, float] = {}
    ops: dict[str, int] = {}
    n = len(device_domain)
    for name, lines in comps.items():
        runs = times.get(name, 1.0)
        if runs == 0:
            continue
        for line in lines:
            m = _OP_RE.match(line)
            if not m:
                continue
            result, kind, started = m.group(1), m.group(2), m.group(3)
            sizes = _shape_bytes(result)
            if not sizes:
                continue
            # An async start returns (operands..., results...): count the results only.
            size = max(sizes) if started and kind != "all-reduce" else sum(sizes) if not started else sizes[-1]
            groups = replica_groups(line, n)
            peers = max(len(g) for g in groups) if kind != "collective-permute" else 2
            factor = {
                "all-reduce": 2 * (peers - 1) / peers,
                "reduce-scatter": peers - 1,
                "collective-permute": 1.0,
            }.get(kind, (peers - 1) / peers)
            moved = size * factor * runs
            by_kind[kind] = by_kind.get(kind, 0.0) + moved
            ops[kind] = ops.get(kind, 0) + int(runs)
            if any(len({device_domain[i] for i in g if i < n}) > 1 for g in groups):
                cross[kind] = cross.get(kind, 0.0) + moved
    return {"by_kind": by_kind, "cross_domain": cross, "ops": ops}


# ---------------------------------------------------------------------------------------
# The analytic model


def tokens_per_shard(config: Config, sizes: dict[str, int]) -> int:
    t = config.train
    return math.ceil(t.batch_size // t.grad_accum * t.seq_len / (sizes["data"] * sizes["expert"]))


def native_a2a_bytes(config: Config, sizes: dict[str, int]) -> float:
    """Per-device bytes per step of native ragged all-to-alls under balanced routing.

    n x K x D x bytes x (P-1)/P per call; dispatch + combine per MoE layer forward, the
    same again backward, and the forward again where remat recomputes it (scanned MoE
    layers; the MTP block is not rematerialised); times grad_accum micro-batches.
    """
    m = config.model
    p = sizes["expert"]
    if p <= 1:
        return 0.0
    width = 2 if m.compute_dtype == "bfloat16" else 4
    per_call = tokens_per_shard(config, sizes) * m.experts_per_token * m.hidden_size * width * (p - 1) / p
    passes_scanned = 6 if m.remat != "none" else 4
    calls = (m.num_layers - m.first_k_dense) * passes_scanned + m.mtp_num_layers * 4
    return per_call * calls * config.train.grad_accum


def emulation_temp_bytes(config: Config, sizes: dict[str, int], plan) -> float:
    """Rough extra temp of the CPU emulation per call: the sent and received [P, M, D] blocks."""
    m = config.model
    p = sizes["expert"]
    if plan is None or p <= 1:
        return 0.0
    width = 2 if m.compute_dtype == "bfloat16" else 4
    rows = plan.buffer_rows(tokens_per_shard(config, sizes), m.experts_per_token, m.num_experts)
    return 2.0 * p * rows * m.hidden_size * width


# ---------------------------------------------------------------------------------------
# Compiling and timing one step


def _proxy_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, emulate
):  # noqa: ARG001 - same signature as the real one
    """Stand-in with the native collective's shapes and balanced-routing bytes (dry runs only).

    Moves min(N, M) rows with one dense all_to_all ((P-1)/P of them leave the device) and
    writes them into `output`; the values are meaningless, the buffers and bytes are the
    GPU program's.
    """
    import jax
    import jax.numpy as jnp

    p = jax.lax.axis_size(axis_name)
    rows = min(operand.shape[0], output.shape[0])
    padded = -(-rows // p) * p
    chunk = jnp.pad(operand[:rows], [(0, padded - rows)] + [(0, 0)] * (operand.ndim - 1))
    moved = jax.lax.all_to_all(chunk, axis_name, 0, 0, tiled=True)[:rows]
    # Keep the size arguments live, as the real op reads them.
    moved = moved + (send_sizes.sum() + recv_sizes.sum() + input_offsets[0] + output_offsets[0]).astype(moved.dtype) * 0
    return jax.lax.dynamic_update_slice(output, moved, (0,) * output.ndim)


@contextlib.contextmanager
def native_a2a_proxy(enabled: bool):
    """Swap the dispatch's ragged all-to-all for `_proxy_ragged_all_to_all` while compiling."""
    from maxmoe.parallel import dispatch_shard

    original = dispatch_shard.ragged_all_to_all
    if enabled:
        dispatch_shard.ragged_all_to_all = _proxy_ragged_all_to_all
    try:
        yield
    finally:
        dispatch_shard.ragged_all_to_all = original


def dry_run_shape(config: Config, sizes: dict[str, int], mesh, hbm_gb: float, a2a: str = "proxy") -> dict:
    """Compile one step for `mesh` (fake CPU devices) and describe it; see the module docstring."""
    from maxmoe.flops import flops_per_token
    from maxmoe.mesh import build_layout, device_domains
    from maxmoe.training.programs import build_programs

    shaped = with_mesh(config, sizes)
    start = time.perf_counter()
    layout = build_layout(shaped, list(mesh.devices.flat), platform="cpu")
    mesh = layout.mesh
    plan = layout.dispatch_plan
    ragged = plan is not None and plan.strategy == "ragged_a2a" and plan.expert_ranks > 1
    with native_a2a_proxy(ragged and a2a == "proxy"):
        programs = build_programs(shaped, layout)
        lowered = programs.train_step.trace(programs.abstract_state, programs.abstract_batch(shaped)).lower()
    lower_s = time.perf_counter() - start
    # LLVM's optimisation level changes code speed, not the HLO buffer assignment the memory
    # figures come from; skipping its expensive passes halves compile time on a small CPU.
    compiled = lowered.compile(compiler_options=FAST_CPU_COMPILE)
    compile_s = time.perf_counter() - start - lower_s
    mem = compiled.memory_analysis()
    devices = list(mesh.devices.flat)
    domain = device_domains(devices, shaped.mesh.scale_up_domain)
    wire = collective_bytes(compiled.as_text(), domain)
    by_kind, cross = dict(wire["by_kind"]), dict(wire["cross_domain"])
    notes = []
    if shaped.model.compute_dtype == "bfloat16" and by_kind.get("all-to-all"):
        # XLA:CPU computes bf16 in f32 (float normalisation), so the dispatch's all-to-alls of
        # bf16 activations appear as f32; the GPU moves them in bf16.
        by_kind["all-to-all"] /= 2
        if "all-to-all" in cross:
            cross["all-to-all"] /= 2
        notes.append(
            "all-to-all: counted at bf16 width (XLA:CPU runs bf16 collectives in f32); other kinds as "
            "compiled (f32 gradients and params; tensor-axis activation all-reduces are an upper bound)"
        )
    native = native_a2a_bytes(shaped, sizes) if ragged else 0.0
    memory_bound = "compiled"
    emulation_temp = 0.0
    if ragged and a2a == "emulate":
        emulated = by_kind.pop("all-to-all", 0.0)
        cross.pop("all-to-all", None)
        by_kind["emulated_all_to_all"] = emulated
        by_kind["all-to-all"] = native
        emulation_temp = emulation_temp_bytes(shaped, sizes, plan)
        memory_bound = "upper bound"
        notes.append(
            "all-to-all: analytic native bytes replace the emulation's (emulated_all_to_all); memory is "
            f"an upper bound: the emulation adds roughly {emulation_temp / GB:.2f} GB of [P, M, D] blocks "
            "per live call"
        )
    elif ragged:
        notes.append("all-to-all: measured on the native-shaped stand-in (balanced routing)")
    wire_kinds = {k: v for k, v in by_kind.items() if k != "emulated_all_to_all"}
    arg, out, alias, temp = (
        mem.argument_size_in_bytes,
        mem.output_size_in_bytes,
        mem.alias_size_in_bytes,
        mem.temp_size_in_bytes,
    )
    total = arg + out - alias + temp
    t = shaped.train
    tokens = t.batch_size * t.seq_len
    flops = flops_per_token(shaped.model, t.seq_len) * tokens / mesh.size
    if shaped.mesh.scale_up_domain:
        domain_note = f"scale-up domain {shaped.mesh.scale_up_domain} devices"
    else:
        domain_note = f"{len(set(domain))} domain(s) (one per process)"
    return {
        "mesh": sizes,
        "name": mesh_name(sizes),
        "devices": mesh.size,
        "dispatch": plan.strategy if plan else "local",
        "a2a_model": a2a if ragged else "-",
        "memory": {
            "argument": arg,
            "output": out,
            "alias": alias,
            "temp": temp,
            "total": total,
            "generated_code": getattr(mem, "generated_code_size_in_bytes", 0),
            "kind": memory_bound,
            "emulation_temp_estimate": emulation_temp,
        },
        "fits": total <= hbm_gb * GB,
        "hbm_gb": hbm_gb,
        "collectives": by_kind,
        "collective_ops": wire["ops"],
        "collective_total": sum(wire_kinds.values()),
        "cross_domain": cross,
        "cross_domain_total": sum(v for k, v in cross.items() if k != "emulated_all_to_all"),
        "native_a2a_bytes": native,
        "tokens_per_shard": tokens_per_shard(shaped, sizes),
        "flops_per_device": flops,
        "domains": domain_note,
        "lower_s": lower_s,
        "compile_s": compile_s,
        "notes": notes,
    }


def time_shape(config: Config, layout, steps: int = 10, warmup: int = 2) -> dict:
    """Run `warmup` then `steps` train steps on the real devices of `layout`; throughput figures."""
    import jax
    import numpy as np

    from maxmoe.flops import flops_per_token, mfu, peak_tflops
    from maxmoe.training.programs import build_programs

    programs = build_programs(config, layout)
    batch_sharding = programs.batch_sharding
    start = time.perf_counter()
    compiled = programs.train_step.trace(programs.abstract_state, programs.abstract_batch(config)).lower().compile()
    compile_s = time.perf_counter() - start
    state = programs.init(jax.random.key(config.train.seed))
    t = config.train
    rng = np.random.default_rng(0)
    tokens = jax.device_put(
        rng.integers(0, config.model.vocab_size, (t.batch_size, t.seq_len + 1), dtype=np.int32), batch_sharding
    )
    for _ in range(warmup):
        state, metrics = compiled(state, tokens)
    jax.block_until_ready((state, metrics))
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, tokens)
    jax.block_until_ready((state, metrics))
    step_s = (time.perf_counter() - start) / steps
    devices = layout.mesh.size
    tokens_per_s = t.batch_size * t.seq_len / step_s
    per_token = flops_per_token(config.model, t.seq_len)
    kind = jax.devices()[0].device_kind
    peak = config.run.peak_tflops or peak_tflops(kind)
    mem = compiled.memory_analysis()
    total = (
        (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
        if mem is not None
        else None
    )
    return {
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "tflops_per_device": tokens_per_s / devices * per_token / 1e12,
        "mfu": mfu(tokens_per_s / devices, per_token, peak),
        "peak_tflops": peak,
        "device_kind": kind,
        "compile_s": compile_s,
        "loss": float(metrics["loss"]),
        "memory_total": total,
    }


# ---------------------------------------------------------------------------------------
# Output


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled, self.start = total, 0, enabled, time.perf_counter()

    def show(self, label: str) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / max(self.total, 1))
        elapsed = time.perf_counter() - self.start
        print(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {elapsed:6.0f}s  {label:<40}",
            end="",
            file=sys.stderr,
            flush=True,
        )

    def step(self, label: str) -> None:
        self.done += 1
        self.show(label)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr, flush=True)


def rank(results: list[dict], dry_run: bool) -> list[dict]:
    ok = [r for r in results if "error" not in r]
    if dry_run:
        ok.sort(key=lambda r: (not r["fits"], r["cross_domain_total"], r["collective_total"], r["memory"]["total"]))
    else:
        ok.sort(key=lambda r: -r["tokens_per_s"])
    return ok + [r for r in results if "error" in r]


def format_table(results: list[dict], dry_run: bool) -> str:
    ok = [r for r in results if "error" not in r]
    big = dry_run and ok and max(max(r["memory"]["total"], r["collective_total"]) for r in ok) >= GB
    unit, scale = ("GB", GB) if big or not ok else ("MB", 1e6)

    def _gb(x) -> str:
        return f"{x / scale:.2f}" if x is not None else "-"

    u = unit
    if dry_run:
        head = (
            f"{'#':>2} {'mesh (data,expert,tensor)':<26} {'arg ' + u:>8} {'out ' + u:>7} {'alias ' + u:>8} "
            f"{'temp ' + u:>8} {'total ' + u:>8} {'fits':>4} {'wire ' + u:>8} {'x-dom ' + u:>8} {'a2a ' + u:>7} "
            f"{'AR ' + u:>7} {'AG ' + u:>7} {'RS ' + u:>7} {'TFLOP':>7} {'compile s':>9}"
        )
    else:
        head = (
            f"{'#':>2} {'mesh (data,expert,tensor)':<26} {'tokens/s':>10} {'TFLOP/s/dev':>11} {'MFU':>6} "
            f"{'step s':>8} {'compile s':>9}"
        )
    lines = [head, "-" * len(head)]
    for i, r in enumerate(results, 1):
        name = r["name"]
        if "error" in r:
            lines.append(f"{i:>2} {name:<26} error: {r['error']}")
            continue
        if dry_run:
            m, c = r["memory"], r["collectives"]
            lines.append(
                f"{i:>2} {name:<26} {_gb(m['argument']):>8} {_gb(m['output']):>7} {_gb(m['alias']):>8} "
                f"{_gb(m['temp']):>8} {_gb(m['total']):>8} {'yes' if r['fits'] else 'no':>4} "
                f"{_gb(r['collective_total']):>8} {_gb(r['cross_domain_total']):>8} {_gb(c.get('all-to-all', 0)):>7} "
                f"{_gb(c.get('all-reduce', 0)):>7} {_gb(c.get('all-gather', 0)):>7} {_gb(c.get('reduce-scatter', 0)):>7} "
                f"{r['flops_per_device'] / 1e12:7.3g} {r['compile_s']:9.1f}"
            )
        else:
            mfu_text = f"{r['mfu']:.3f}" if r.get("mfu") is not None else "n/a"
            lines.append(
                f"{i:>2} {name:<26} {r['tokens_per_s']:10.0f} {r['tflops_per_device']:11.2f} {mfu_text:>6} "
                f"{r['step_s']:8.4f} {r['compile_s']:9.1f}"
            )
    return "\n".join(lines)


def plot(results: list[dict], path: str, dry_run: bool, hbm_gb: float) -> str | None:
    """Bar charts per shape (memory and bytes, or throughput); None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; no plot"
    ok = [r for r in results if "error" not in r]
    names = [r["name"].replace("data=", "d").replace(",expert=", " e").replace(",tensor=", " t") for r in ok]
    x = range(len(ok))
    if dry_run:
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6, len(ok) * 0.9), 7), sharex=True)
        ax1.bar(x, [r["memory"]["total"] / GB for r in ok], color="tab:blue")
        ax1.axhline(hbm_gb, color="tab:red", linestyle="--", label=f"HBM {hbm_gb:g} GB")
        ax1.set_ylabel("memory per device (GB)")
        ax1.legend()
        bottom = [0.0] * len(ok)
        for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
            values = [r["collectives"].get(kind, 0) / GB for r in ok]
            if any(values):
                ax2.bar(x, values, bottom=bottom, label=kind)
                bottom = [b + v for b, v in zip(bottom, values)]
        ax2.set_ylabel("bytes on the wire per device per step (GB)")
        ax2.legend(fontsize="small")
    else:
        fig, ax2 = plt.subplots(figsize=(max(6, len(ok) * 0.9), 4))
        ax2.bar(x, [r["tokens_per_s"] for r in ok])
        ax2.set_ylabel("tokens/s")
    ax2.set_xticks(list(x), names, rotation=30, ha="right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


# ---------------------------------------------------------------------------------------
# Entry point


def sweep(
    config: Config,
    num_devices: int | None,
    dry_run: bool,
    meshes: list[dict[str, int]] | None = None,
    hbm_gb: float = 141.0,
    steps: int = 10,
    warmup: int = 2,
    a2a: str = "proxy",
    progress: bool = True,
) -> dict:
    """Run the sweep; returns {"results": ranked, "skipped": [...], ...}."""
    from maxmoe.train import set_host_device_count

    if dry_run:
        if not num_devices:
            raise UserError("--dry-run needs --devices N")
        set_host_device_count(num_devices)
    import jax

    if dry_run:
        jax.config.update("jax_platforms", "cpu")
    devices = jax.devices()
    if num_devices is None:
        num_devices = len(devices)
    if len(devices) < num_devices:
        raise UserError(
            f"--devices {num_devices}: only {len(devices)} {devices[0].platform} devices are available "
            f"(use --dry-run to compile for fake CPU devices)"
        )
    devices = devices[:num_devices]
    if meshes:
        for sizes in meshes:
            if math.prod(sizes.values()) != num_devices:
                raise UserError(
                    f"--mesh {mesh_name(sizes)} needs {math.prod(sizes.values())} devices, not --devices {num_devices}"
                )
    kept, skipped = candidate_shapes(config, devices, meshes)
    if not kept:
        reasons = "; ".join(f"{mesh_name(s)}: {why}" for s, why in skipped[:3])
        raise UserError(f"no valid mesh for {num_devices} devices ({reasons})")
    bar = Progress(len(kept), progress)
    results = []
    for sizes, mesh in kept:
        bar.show(f"compiling {mesh_name(sizes)}")
        try:
            if dry_run:
                result = dry_run_shape(config, sizes, mesh, hbm_gb, a2a)
            else:
                from maxmoe.mesh import build_layout

                shaped = with_mesh(config, sizes)
                layout = build_layout(shaped, list(mesh.devices.flat))
                result = {
                    "mesh": sizes,
                    "name": mesh_name(sizes),
                    "devices": mesh.size,
                    **time_shape(shaped, layout, steps, warmup),
                }
        except UserError as e:
            result = {"mesh": sizes, "name": mesh_name(sizes), "error": str(e)}
        except Exception as e:  # noqa: BLE001 - one shape failing (e.g. out of memory) must not end the sweep
            result = {
                "mesh": sizes,
                "name": mesh_name(sizes),
                "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
            }
        results.append(result)
        bar.step(mesh_name(sizes))
    bar.close()
    return {
        "dry_run": dry_run,
        "devices": num_devices,
        "platform": devices[0].platform,
        "jax": jax.__version__,
        "hbm_gb": hbm_gb,
        "a2a_model": a2a if dry_run else "native",
        "batch_size": config.train.batch_size,
        "seq_len": config.train.seq_len,
        "method": __doc__.split("--dry-run:", 1)[1].split("Output:", 1)[0].strip() if dry_run else None,
        "results": rank(results, dry_run),
        "skipped": [{"mesh": s, "name": mesh_name(s), "reason": why} for s, why in skipped],
    }


@main_guard
def main(argv: list[str] | None = None) -> int:
    parser = make_parser("python -m maxmoe.sweep", __doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=None, help="device count (dry run: fake CPU devices)")
    parser.add_argument("--dry-run", action="store_true", help="compile on fake CPU devices; memory and bytes")
    parser.add_argument(
        "--mesh", action="append", default=[], metavar="data=A,expert=B,tensor=C", help="only these shapes (repeatable)"
    )
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON")
    parser.add_argument("--plot", metavar="OUT.png", help="bar charts per shape (needs matplotlib)")
    parser.add_argument("--hbm-gb", type=float, default=141.0, help="per-device memory for `fits` (GB, 1e9 B)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per shape (real devices)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before timing (real devices)")
    parser.add_argument(
        "--a2a",
        choices=("proxy", "emulate"),
        default="proxy",
        help="dry run: ragged all-to-all as a native-shaped stand-in or as the CPU emulation",
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if not args.config:
        raise UserError("--config FILE is required")
    if args.devices is not None and args.devices <= 0:
        raise UserError(f"--devices {args.devices}: expected a positive integer")
    if args.hbm_gb <= 0 or args.steps <= 0 or args.warmup < 0:
        raise UserError("--hbm-gb and --steps must be positive, --warmup non-negative")
    meshes = [parse_mesh(m) for m in args.mesh] or None
    config = config_from_args(args)
    if args.devices is None and meshes:
        args.devices = math.prod(meshes[0].values())
    start = time.perf_counter()
    report = sweep(
        config,
        args.devices,
        args.dry_run,
        meshes,
        args.hbm_gb,
        args.steps,
        args.warmup,
        args.a2a,
        progress=not args.no_progress,
    )
    report["wall_s"] = time.perf_counter() - start
    report["command"] = "python -m maxmoe.sweep " + " ".join(sys.argv[1:] if argv is None else argv)
    print(format_table(report["results"], args.dry_run))
    for s in report["skipped"]:
        print(f"skipped {s['name']}: {s['reason']}")
    notes = sorted({n for r in report["results"] for n in r.get("notes", [])})
    for n in notes:
        print(f"note: {n}")
    if args.dry_run:
        print(
            "GB = 1e9, MB = 1e6 bytes per device; wire = bytes each device sends per step (ring factors, loops x trip count); "
            "x-dom = of which in collectives spanning scale-up domains; AR/AG/RS = all-reduce/all-gather/reduce-scatter; "
            "TFLOP = model FLOPs per device per step"
        )
    print(f"{len(report['results'])} shapes in {report['wall_s']:.0f}s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    if args.plot:
        why = plot(report["results"], args.plot, args.dry_run, args.hbm_gb)
        if why:
            print(f"note: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
