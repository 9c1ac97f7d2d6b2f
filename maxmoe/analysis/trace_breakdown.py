"""Where a step's device time goes: a jax.profiler trace read as time per kernel class.

    python -m maxmoe.analysis.trace_breakdown PROFILE_DIR [--steps N] [--hlo FILE] [--json OUT]

Reads the Chrome trace-event JSON jax.profiler writes beside its xplane
(plugins/profile/<run>/<host>.trace.json.gz), with the standard library only. Device events
are, on a GPU, the kernels and copies on the "Stream #" lines of one "/device:GPU:N" process
and, on a CPU, the XLA ops of the host (events naming an hlo_op and an hlo_module). Each goes
to one class of CLASSES by the rules of `classify`. Where events overlap (streams, CPU threads)
each instant is split evenly among those running, so the classes and the idle gaps add up to
the step; a class's TFLOP/s divides its model FLOPs by its kernels' own time.

Legend: us microseconds (the trace's unit), s seconds.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

from maxmoe.analysis.hlo import computation_runs, pass_of
from maxmoe.config import UserError
from maxmoe.parallel.names import ATTENTION_CORE_SCOPE, GROUPED_GEMM_SCOPE

# (key, label) in table order; "idle" is the time no device event runs.
CLASSES = (
    ("grouped_gemm", "grouped GEMM"),
    ("attention_fwd", "attention forward"),
    ("attention_bwd", "attention backward"),
    ("dense_gemm", "dense GEMMs"),
    ("collective", "collectives"),
    ("other", "other fusions"),
    ("copy", "copies and transposes"),
    ("idle", "idle gaps"),
)
LABELS = dict(CLASSES)

COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all")
COLLECTIVE_OPS += ("collective-permute", "collective-broadcast", "send", "recv")
MOVEMENT_OPS = {"copy", "transpose", "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad"}
NEUTRAL_OPS = {"parameter", "tuple", "get-tuple-element", "bitcast", "reshape", "constant", "broadcast"}
NAME_FILLER = {"fusion", "wrapped", "loop", "input", "bitcast", "reshape"}
GEMM_KERNEL_RE = re.compile(r"gemm|xmma|nvjet|cutlass|cublas|matmul", re.IGNORECASE)
ATTENTION_KERNEL_RE = re.compile(r"mha_|fmha|sdpa|flash_[fb]prop|flash_attention", re.IGNORECASE)
BACKWARD_KERNEL_RE = re.compile(r"backward|bprop|bwd", re.IGNORECASE)
MEMCPY_KERNEL_RE = re.compile(r"^mem(cpy|set)", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class HloOp:
    """What the compiled program says of one instruction: opcode, custom-call target, op names
    (its own first, then those of the ops a fusion calls) and the opcodes it runs."""

    opcode: str
    target: str
    op_names: tuple[str, ...]
    opcodes: frozenset[str]


@dataclasses.dataclass(frozen=True)
class Event:
    """One device event: kernel (the event's name), HLO op, jax op name, line, start and end (us)."""

    kernel: str
    hlo_op: str
    op_name: str
    line: str
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Row:
    """One class per step: kernels run, their own time, wall-time share, model FLOPs and rate."""

    key: str
    kernels: float
    kernel_s: float
    wall_s: float
    share: float
    flops: float | None
    tflops: float | None

    @property
    def label(self) -> str:
        return LABELS.get(self.key, self.key)


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """A trace's step: where it was read, which device and program, and one Row per class."""

    source: str
    device: str
    module: str
    steps: int
    step_s: float
    rows: tuple[Row, ...]
    excluded_s: float  # device time of other programs in the same window, left out

    def row(self, key: str) -> Row:
        return next(r for r in self.rows if r.key == key)

    def as_dict(self) -> dict:
        rows = [{**dataclasses.asdict(r), "label": r.label} for r in self.rows]
        return {**{k: v for k, v in dataclasses.asdict(self).items() if k != "rows"}, "rows": rows}

    @classmethod
    def from_dict(cls, d: dict) -> Breakdown:
        """The Breakdown `as_dict` wrote."""
        fields = {f.name for f in dataclasses.fields(Row)}
        rows = tuple(Row(**{k: v for k, v in r.items() if k in fields}) for r in d["rows"])
        return cls(**{**{k: v for k, v in d.items() if k != "rows"}, "rows": rows})


# ---------------------------------------------------------------------------------------
# Reading


def find_trace(path: str | Path) -> Path:
    """The trace JSON at `path`, or the newest *.trace.json(.gz) under a profile directory.

    Raises:
        UserError: when there is none.
    """
    path = Path(path)
    if path.is_file():
        return path
    found = sorted(
        (p for pattern in ("*.trace.json.gz", "*.trace.json") for p in path.rglob(pattern)),
        key=lambda p: p.stat().st_mtime,
    )
    if not found:
        raise UserError(f"no jax.profiler trace (*.trace.json.gz) under {path}")
    return found[-1]


def read_trace(path: str | Path) -> dict:
    """The trace-event JSON of a trace file (gzip or plain) or a profile directory."""
    path = find_trace(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            trace = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not a trace-event JSON file ({type(e).__name__}: {e})") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise UserError(f"{path} has no traceEvents list: not a jax.profiler trace")
    return trace


def device_events(trace: dict, device: int | None = None) -> tuple[str, list[tuple[Event, str]]]:
    """(device name, [(event, hlo_module)]) of one device: a GPU's stream events when the trace
    has GPU processes (`device`: its ordinal, default the lowest), else the CPU's XLA ops."""
    names = {}
    threads = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[e["pid"]] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    gpus = {pid: name for pid, name in names.items() if re.fullmatch(r"/device:GPU:\d+", name)}
    if gpus:
        by_ordinal = {int(name.rsplit(":", 1)[1]): pid for pid, name in gpus.items()}
        ordinal = min(by_ordinal) if device is None else device
        if ordinal not in by_ordinal:
            raise UserError(f"the trace has no /device:GPU:{ordinal}; it has GPUs {sorted(by_ordinal)}")
        pid = by_ordinal[ordinal]

        def wanted(e):
            return e["pid"] == pid and threads.get((pid, e.get("tid")), "").startswith("Stream #")

        label = gpus[pid]
    else:

        def wanted(e):
            args = e.get("args") or {}
            return "hlo_op" in args and "hlo_module" in args

        label = "/host:CPU"
    events = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or "dur" not in e or not wanted(e):
            continue
        args = e.get("args") or {}
        start = float(e["ts"])
        event = Event(
            kernel=str(e.get("name", "")),
            hlo_op=str(args.get("hlo_op", "")),
            op_name=str(args.get("name", "")),  # XLA:GPU's annotation: the op name past the module's prefix
            line=f"{e['pid']}/{e.get('tid')}",
            start=start,
            end=start + float(e["dur"]),
        )
        events.append((event, str(args.get("hlo_module", ""))))
    return label, events


_INSTRUCTION_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\(")
_CALLS_RE = re.compile(r"\bcalls=%?([\w.\-]+)")
_TARGET_RE = re.compile(r'custom_call_target="([^"]*)"')
_KIND_RE = re.compile(r'"kind"\s*:\s*"([^"]*)"')
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')


def hlo_ops(hlo_text: str) -> dict[str, HloOp]:
    """Every instruction of a compiled program's HLO text (`compiled.as_text()`) by name."""
    comps, _ = computation_runs(hlo_text)
    parsed: dict[str, list[tuple[str, str, str, str, str]]] = {}
    for comp, lines in comps.items():
        rows = []
        for line in lines:
            m = _INSTRUCTION_RE.match(line)
            if not m:
                continue
            name, opcode = m.group(1), m.group(2)
            calls = _CALLS_RE.search(line)
            target = _TARGET_RE.search(line) or _KIND_RE.search(line)
            op_name = _OP_NAME_RE.search(line)
            rows.append(
                (
                    name,
                    opcode,
                    target.group(1) if target else "",
                    op_name.group(1) if op_name else "",
                    calls.group(1) if calls else "",
                )
            )
        parsed[comp] = rows

    def inside(comp: str, depth: int = 0) -> tuple[list[str], set[str]]:
        names, opcodes = [], set()
        for _, opcode, _, op_name, calls in parsed.get(comp, ()):
            opcodes.add(opcode)
            if op_name:
                names.append(op_name)
            if calls and depth < 8:
                more_names, more_opcodes = inside(calls, depth + 1)
                names += more_names
                opcodes |= more_opcodes
        return names, opcodes

    ops = {}
    for rows in parsed.values():
        for name, opcode, target, op_name, calls in rows:
            names, opcodes = inside(calls) if opcode == "fusion" and calls else ([], {opcode})
            own = (op_name,) if op_name else ()
            ops[name] = HloOp(opcode, target, own + tuple(n for n in names if n != op_name), frozenset(opcodes))
    return ops


def kernel_names(ops: dict[str, HloOp]) -> dict[str, str]:
    """Instruction names by the name XLA:GPU gives the kernel it emits for one ('.' and '-' as '_':
    loop_add_fusion_3 for loop_add_fusion.3); kernels inside a command buffer (a CUDA graph) carry
    the buffer's HLO op, so their own name is what says which instruction they run."""
    return {re.sub(r"[.\-]", "_", name): name for name in ops}


# ---------------------------------------------------------------------------------------
# Classes


def _base(name: str) -> str:
    return re.sub(r"\.\d+$", "", name)


def _name_tokens(name: str) -> set[str]:
    return set(_base(name).replace("-", "_").split("_")) - NAME_FILLER - {""}


def _in_scope(scope: str, op_names: tuple[str, ...]) -> bool:
    """The op (its own op name, else most of the ops a fusion runs) is under jax scope `scope`."""
    if not op_names:
        return False
    pattern = re.compile(rf"(^|[/(]){re.escape(scope)}([/)]|$)")
    if pattern.search(op_names[0]):
        return True
    return sum(bool(pattern.search(n)) for n in op_names) * 2 > len(op_names)


def classify(event: Event, op: HloOp | None = None) -> str:
    """The class key of a device event, from the first rule that holds.

    1. collective: a collective opcode, an NCCL kernel, or an HLO op named for a collective;
    2. grouped_gemm: under the GROUPED_GEMM_SCOPE scope (maxmoe.kernels.grouped_matmul);
    3. attention_fwd / attention_bwd: under ATTENTION_CORE_SCOPE, or an attention kernel by
       name (Pallas' mha_*, cuDNN's flash fprop/bprop); backward where the kernel says so or
       the op name is jax's backward pass (`transpose(...)`, remat's recompute included);
    4. dense_gemm: a dot or convolution, a fusion running one, a GEMM custom call, or a GEMM
       library kernel by name (cuBLAS, CUTLASS, nvjet, xmma);
    5. copy: a memcpy or memset, or an op (a fusion: all its ops) that only moves data
       (copy, transpose, slices, concatenation, padding);
    6. other: everything else (elementwise and reduction fusions, sorts, scatters, ...).
    `op` is the compiled program's instruction (hlo_ops), when known; without it the op name
    is the trace's own and the opcodes are read from the HLO op's name.
    """
    kernel, hlo = event.kernel, event.hlo_op
    opcode = op.opcode if op else ""
    op_names = op.op_names if op and op.op_names else ((event.op_name,) if event.op_name else ())
    words = hlo.replace("_", "-")
    if opcode.removesuffix("-start").removesuffix("-done") in COLLECTIVE_OPS or "nccl" in kernel.lower():
        return "collective"
    if not op and any(_base(words).removesuffix("-start").removesuffix("-done") == c for c in COLLECTIVE_OPS):
        return "collective"
    if _in_scope(GROUPED_GEMM_SCOPE, op_names):
        return "grouped_gemm"
    if _in_scope(ATTENTION_CORE_SCOPE, op_names) or ATTENTION_KERNEL_RE.search(kernel):
        backward = BACKWARD_KERNEL_RE.search(kernel) or (op_names and pass_of(f'op_name="{op_names[0]}"') == "backward")
        return "attention_bwd" if backward else "attention_fwd"
    opcodes = op.opcodes if op else set()
    target = op.target.lower() if op else ""
    if opcodes & {"dot", "convolution"} or "gemm" in target or "cublas" in target or GEMM_KERNEL_RE.search(kernel):
        return "dense_gemm"
    if MEMCPY_KERNEL_RE.search(kernel):
        return "copy"
    moved = (opcodes - NEUTRAL_OPS) if op else _name_tokens(hlo or kernel)
    if moved and moved <= MOVEMENT_OPS | {"dynamic", "update"}:
        return "copy"
    return "other"


# ---------------------------------------------------------------------------------------
# The step


def breakdown(
    trace: dict,
    *,
    steps: int | None = None,
    hlo_text: str | None = None,
    flops: dict[str, float] | None = None,
    module: str | None = None,
    device: int | None = None,
    source: str = "",
) -> Breakdown:
    """Time per class of one device's events (`device_events`) of one program.

    steps: how many steps the trace holds (default: the CPU events' distinct run ids, else 1);
    hlo_text: the program's compiled HLO (`hlo_ops`), for the classes; flops: model FLOPs per
    step by class key (`model_flops_by_class`); module: the program (its hlo_module, e.g.
    jit_train_step; default the one with the most device time).

    Raises:
        UserError: when the trace has no device event of that program.
    """
    label, tagged = device_events(trace, device)
    time_by_module = Counter()
    for event, mod in tagged:
        time_by_module[mod] += event.end - event.start
    if module is None:
        named = {m: t for m, t in time_by_module.items() if m}
        module = max(named, key=named.get) if named else ""
    events = [e for e, mod in tagged if mod == module]
    if not events:
        raise UserError(f"the trace has no device events of program {module!r} on {label}")
    excluded_s = (sum(time_by_module.values()) - time_by_module[module]) * 1e-6
    if steps is None:
        runs = {json.dumps(e.get("args", {}).get("run_id")) for e in trace["traceEvents"] if _is_run(e, module)}
        steps = max(1, len(runs - {"null"}))
    ops = hlo_ops(hlo_text) if hlo_text else {}
    kernel_us, wall_us, counts = _sweep(events, ops)
    window_us = max(e.end for e in events) - min(e.start for e in events)
    flops = flops or {}
    rows = []
    for key, _ in CLASSES:
        kernel_s, wall_s = kernel_us[key] * 1e-6 / steps, wall_us[key] * 1e-6 / steps
        f = flops.get(key)
        rows.append(
            Row(
                key,
                counts[key] / steps,
                kernel_s,
                wall_s,
                wall_us[key] / window_us if window_us else 0.0,
                f,
                f / kernel_s / 1e12 if f and kernel_s > 0 else None,
            )
        )
    return Breakdown(source, label, module, steps, window_us * 1e-6 / steps, tuple(rows), excluded_s)


def _is_run(e: dict, module: str) -> bool:
    args = e.get("args") or {}
    return e.get("ph") == "X" and args.get("hlo_module") == module and "run_id" in args


def _sweep(events: list[Event], ops: dict[str, HloOp]):
    """Per class: own time (us, innermost on its line), wall time (us, split among the lines
    running at each instant; "idle" where none runs) and event count."""
    by_kernel = kernel_names(ops)
    classes = []
    for e in events:
        op = ops.get(by_kernel.get(e.kernel, e.kernel)) or ops.get(e.hlo_op)
        classes.append(classify(e, op))
    points = []
    for i, e in enumerate(events):
        points.append((e.start, 1, i))
        points.append((e.end, 0, i))
    points.sort()
    stacks: dict[str, list[int]] = defaultdict(list)
    on_top: Counter = Counter()  # class -> lines whose innermost open event is of that class
    kernel_us, wall_us = Counter(), Counter()
    last = points[0][0]
    for time, is_start, i in points:
        dt = time - last
        if dt > 0:
            lines = sum(on_top.values())
            if lines:
                for cls, n in on_top.items():
                    if n:
                        kernel_us[cls] += dt * n
                        wall_us[cls] += dt * n / lines
            else:
                wall_us["idle"] += dt
            last = time
        stack = stacks[events[i].line]
        if stack:
            on_top[classes[stack[-1]]] -= 1
        if is_start:
            stack.append(i)
        elif i in stack:
            stack.remove(i)
        if stack:
            on_top[classes[stack[-1]]] += 1
    return kernel_us, wall_us, Counter(classes)


def model_flops_by_class(model, seq_len: int, tokens: float) -> dict[str, float]:
    """Model FLOPs of `tokens` tokens of training (maxmoe.analysis.flops) by class key: the
    routed experts' GEMMs grouped; the attention core's forward a third, backward two thirds;
    every other GEMM (projections, router, dense and shared MLPs, head) dense."""
    from maxmoe.analysis.flops import flops_per_token_by_class

    by_class = {k: v * tokens for k, v in flops_per_token_by_class(model, seq_len).items()}
    core = by_class.pop("attention_core")
    return {
        "grouped_gemm": by_class.pop("routed_experts"),
        "attention_fwd": core / 3,
        "attention_bwd": core * 2 / 3,
        "dense_gemm": sum(by_class.values()),
    }


# ---------------------------------------------------------------------------------------
# Output


def format_table(b: Breakdown) -> str:
    """The breakdown as a table: class, kernels per step, own ms, wall ms and share, model TFLOP/s."""
    head = f"{'class':<22} {'kernels':>8} {'own ms':>9} {'wall ms':>9} {'share':>7} {'TFLOP/s':>8}"
    lines = [
        f"where the step's time goes: {b.device}, {b.module or '-'}, {b.steps} step(s) of {b.step_s * 1e3:.2f} ms"
        + (f" ({b.excluded_s * 1e3:.1f} ms of other programs left out)" if b.excluded_s > 0 else ""),
        head,
        "-" * len(head),
    ]
    for r in b.rows:
        kernels = f"{r.kernels:.0f}" if r.key != "idle" else "-"
        own = f"{r.kernel_s * 1e3:.2f}" if r.key != "idle" else "-"
        rate = f"{r.tflops:.4g}" if r.tflops is not None else "-"
        lines.append(f"{r.label:<22} {kernels:>8} {own:>9} {r.wall_s * 1e3:9.2f} {r.share:7.1%} {rate:>8}")
    total_flops = sum(r.flops or 0.0 for r in b.rows)
    rate = f"{total_flops / b.step_s / 1e12:.4g}" if total_flops and b.step_s else "-"
    lines.append(f"{'step':<22} {'':>8} {'':>9} {b.step_s * 1e3:9.2f} {1:7.1%} {rate:>8}")
    return "\n".join(lines)


def profile_breakdown(profile_dir: str | Path, **kwargs) -> Breakdown:
    """`breakdown` of the newest trace under a profile directory; its compiled HLO from
    `program.hlo.txt` there when `hlo_text` is not given."""
    path = find_trace(profile_dir)
    if kwargs.get("hlo_text") is None:
        saved = Path(profile_dir) / "program.hlo.txt"
        kwargs["hlo_text"] = saved.read_text() if saved.is_file() else None
    return breakdown(read_trace(path), source=str(path), **kwargs)


def main(argv=None) -> int:
    from maxmoe.cli import _Parser, main_guard

    @main_guard
    def run(argv):
        parser = _Parser(prog="python -m maxmoe.analysis.trace_breakdown", description=__doc__)
        parser.add_argument("trace", help="a trace JSON (.json or .json.gz) or a jax.profiler directory")
        parser.add_argument("--steps", type=int, help="steps the trace holds (default: counted on CPU, else 1)")
        parser.add_argument("--hlo", help="the program's compiled HLO text (default: program.hlo.txt beside it)")
        parser.add_argument("--module", help="the program's hlo_module (default: the busiest)")
        parser.add_argument("--device", type=int, help="the GPU ordinal (default: the lowest)")
        parser.add_argument("--json", help="also write the breakdown here")
        args = parser.parse_args(argv)
        if args.steps is not None and args.steps <= 0:
            raise UserError(f"--steps must be positive; got {args.steps}")
        hlo = None
        if args.hlo:
            if not Path(args.hlo).is_file():
                raise UserError(f"--hlo {args.hlo}: no such file")
            hlo = Path(args.hlo).read_text()
        if not Path(args.trace).exists():
            raise UserError(f"{args.trace}: no such file or directory")
        b = profile_breakdown(args.trace, steps=args.steps, hlo_text=hlo, module=args.module, device=args.device)
        print(format_table(b))
        if args.json:
            Path(args.json).write_text(json.dumps(b.as_dict(), indent=1))
        return 0

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
