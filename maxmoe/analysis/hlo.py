"""Reading compiled programs: collectives in lowered StableHLO, bytes on the wire per tier from HLO.

The one place that parses collectives out of program text (`maxmoe.info --lower`, the dry run
and the benchmarks read programs through it; data dependences: maxmoe.analysis.hlo_deps):
  count_collectives(stablehlo)    collectives of each kind a lowered program writes, custom calls included
  collective_spans(stablehlo, stage_of)  which of them stay inside one pipeline stage, which cross
  collective_bytes(hlo, domains)  bytes each device puts on the wire per step of compiled HLO, by
                                  kind, pass and across scale-up domains (`collective_ops`: per op):
                                  all-gather / all-to-all (P-1)/P of the result, reduce-scatter
                                  (P-1) x it, all-reduce 2 (P-1)/P of it, collective-permute it,
                                  ragged all-to-all (P-1)/P of min(send, receive); x loop trip counts
  dot_flops(hlo)                  dot and convolution FLOPs per device per step: loops x trip
                                  count, each conditional at its most expensive branch
Method: docs/PERFORMANCE.md, "Reading program text: collectives and FLOPs".
"""

from __future__ import annotations

import json
import math
import re

import numpy as np

from maxmoe.analysis.trip_counts import Definitions, inferred_trip_count

STABLEHLO_COLLECTIVES = (
    "ragged_all_to_all",
    "all_to_all",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "collective_permute",
)


def count_collectives(stablehlo_text: str) -> dict[str, int]:
    """Occurrences of each collective op in StableHLO text (custom calls included)."""
    counts = {}
    for name in STABLEHLO_COLLECTIVES:
        pattern = rf"(stablehlo\.{name}\b|@{name}\b|\"{name}\")"
        counts[name] = len(re.findall(pattern, stablehlo_text))
    return counts


_STABLEHLO_GROUPS_RE = re.compile(r"(?:replica_groups|source_target_pairs) = dense<(\[\[.*?\]\])>")


def collective_spans(stablehlo_text: str, stage_of: list[int]) -> dict[str, dict[str, int]]:
    """{op: {"inside": n, "across": n, "mixed": n}}: collectives whose every device group (or
    permute pair) lies in one pipeline stage, spans stages, or some of each.

    stage_of[d] is the stage of device d; an op without explicit groups spans every device.
    """
    spans = {}
    for name in STABLEHLO_COLLECTIVES:
        pattern = re.compile(rf"(stablehlo\.{name}\b|@{name}\b|\"{name}\")")
        counts: dict[str, int] = {}
        for line in stablehlo_text.splitlines():
            if not pattern.search(line):
                continue
            found = _STABLEHLO_GROUPS_RE.search(line)
            groups = json.loads(found.group(1)) if found else [list(range(len(stage_of)))]
            inside = {len({stage_of[d] for d in group}) == 1 for group in groups}
            kind = "mixed" if len(inside) > 1 else "inside" if inside.pop() else "across"
            counts[kind] = counts.get(kind, 0) + 1
        spans[name] = counts
    return spans


# ---------------------------------------------------------------------------------------
# Bytes on the wire, from compiled HLO

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
_PROMOTED_RE = re.compile(r"to_apply=%?[\w.\-]*promoted\b")  # float normalisation widened its reduction
_NAME_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_OP_RE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+(" + "|".join(KINDS) + r")(-start)?\(")
_SHAPE_RE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*[({]")
_CALL_RE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def array_types(text: str) -> list[tuple[str, int]]:
    """(dtype, elements) of each array type written in `text` ('f32[8,4]' -> ('f32', 32)), in order."""
    return [(t, math.prod(int(d) for d in dims.split(",") if d)) for t, dims in _SHAPE_RE.findall(text)]


def shape_bytes(text: str) -> list[int]:
    """Bytes of each array type written in `text` ('f32[8,4]' -> 128), in order."""
    return [DTYPE_BYTES[t] * n for t, n in array_types(text)]


def replica_groups(line: str, num_devices: int) -> list[list[int]]:
    """The device groups of one collective line (explicit, iota or empty = everyone)."""
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


def _call_graph(
    hlo_text: str,
) -> tuple[dict[str, list[str]], dict[str, list[tuple[str, float, int | None]]], str | None]:
    """(lines of each computation, its calls, the entry computation's name).

    A call is (callee, runs per run of the caller, conditional): the loop's trip count for a while
    body or condition (XLA's known one, else `trip_counts.inferred_trip_count`'s), else 1;
    `conditional` is the index of the calling line for the branches of a conditional op, None
    for every other call.
    """
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
    calls: dict[str, list[tuple[str, float, int | None]]] = {name: [] for name in comps}
    defs = None
    for name, lines in comps.items():
        for index, line in enumerate(lines):
            trip = _TRIP_RE.search(line)
            trips = float(trip.group(1)) if trip else None
            if trips is None and " while(" in line:  # XLA:GPU leaves it out of peeled loops: read the loop
                defs = defs or Definitions(comps)
                inferred = inferred_trip_count(line, defs)
                trips = float(inferred) if inferred is not None else None
            for role, callee in _CALL_RE.findall(line):
                factor = trips if (role in ("body", "condition") and trips is not None) else 1.0
                branch = index if role in ("true_computation", "false_computation") else None
                calls[name].append((callee, factor, branch))
            branches = _BRANCHES_RE.search(line)
            if branches:
                calls[name] += [(b.strip().lstrip("%"), 1.0, index) for b in branches.group(1).split(",") if b.strip()]
    return comps, calls, entry


def computation_runs(hlo_text: str) -> tuple[dict[str, list[str]], dict[str, float]]:
    """Lines of each computation and how many times it runs per step (trip counts of while loops).

    Every branch of a conditional counts as run once per run of its caller.
    """
    comps, times, _ = _computation_runs(hlo_text)
    return comps, times


def _computation_runs(hlo_text: str) -> tuple[dict[str, list[str]], dict[str, float], set[str]]:
    """`computation_runs` and the computations reached through a while loop (`in_loop`)."""
    comps, calls, entry = _call_graph(hlo_text)
    times = {name: 0.0 for name in comps}
    looped: set[str] = set()
    if entry is None:
        return comps, {name: 1.0 for name in comps}, looped

    def visit(name, factor, in_loop, depth=0):
        if name not in times or depth > 64:
            return
        times[name] += factor
        if in_loop:
            looped.add(name)
        for callee, f, _ in calls.get(name, ()):
            visit(callee, factor * f, in_loop or f != 1.0 or _is_loop_call(comps[name], callee), depth + 1)

    visit(entry, 1.0, False)
    return comps, times, looped


def _start_results(result_type: str, kind: str) -> list[int]:
    """Bytes of each result an async collective's start produces. XLA:GPU types a start
    `((operands...), results)`; older XLA `(operand, result)` (a permute adds two u32 contexts)."""
    if result_type.startswith("(("):
        depth = 0
        for i, ch in enumerate(result_type):
            depth += (ch == "(") - (ch == ")")
            if depth == 1 and ch == ")":  # the operands' tuple closed: the results follow
                return shape_bytes(result_type[i + 1 :])
    sizes = shape_bytes(result_type)
    if kind == "all-reduce":
        return sizes
    return sizes[1:2] if kind == "collective-permute" else sizes[len(sizes) // 2 :]


def _is_loop_call(lines: list[str], callee: str) -> bool:
    """Whether `callee` is the body or condition of a while op in `lines` (a loop of any trip count)."""
    pattern = re.compile(rf"\b(body|condition)=%?{re.escape(callee)}\b")
    return any(" while(" in line and pattern.search(line) for line in lines)


_DEF_RE_HLO = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\w+\[([\d,]*)\]")
_OPERAND = r"(?:\w+\[[\d,]*\](?:\{[^}]*\})?\s+)?%?([\w.\-]+)"
_MATMUL_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\w+\[([\d,]*)\]\S*\s+(dot|convolution)\(" + _OPERAND + r",\s*" + _OPERAND
)
_LHS_CONTRACTING_RE = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_DIM_LABELS_RE = re.compile(r"dim_labels=\w+_(\w+)->")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _matmul_flops(line: str, shapes: dict[str, list[int]]) -> float:
    """2 x multiply-adds of one dot or convolution line (0 for any other line)."""
    m = _MATMUL_RE.match(line)
    if not m:
        return 0.0
    out, kind, lhs, rhs = _dims(m.group(1)), m.group(2), m.group(3), m.group(4)
    if kind == "dot":
        contracting = _LHS_CONTRACTING_RE.search(line)
        lhs_dims = shapes[lhs]
        per_output = math.prod(lhs_dims[int(i)] for i in _dims(contracting.group(1))) if contracting else 1
    else:  # each output element: the kernel's elements for one output feature
        kernel, labels = shapes[rhs], _DIM_LABELS_RE.search(line).group(1)
        per_output = math.prod(kernel) // kernel[labels.index("o")]
    return 2.0 * math.prod(out) * per_output


def dot_flops(hlo_text: str) -> float:
    """Dot and convolution FLOPs one device runs per step of compiled HLO (`dot_flops_by_pass`, summed)."""
    return sum(dot_flops_by_pass(hlo_text).values())


def dot_flops_by_pass(hlo_text: str) -> dict[str, float]:
    """Dot and convolution FLOPs (2 x multiply-adds) one device runs per step of compiled HLO.

    By pass (`pass_of` of each dot: forward, backward -- a rematerialised forward pass
    recomputed inside the backward counts there -- and other). Loop bodies count their known
    trip count times; a conditional counts its most expensive branch, whichever one runs: SPMD
    pipeline stages tick in lockstep, so a tick lasts as long as its busiest stage. Operand
    shapes come from their definitions in the same computation.
    """
    comps, calls, entry = _call_graph(hlo_text)
    cost: dict[str, dict[str, float]] = {}
    empty = {name: 0.0 for name in PASSES}

    def visit(name: str, depth: int = 0) -> dict[str, float]:
        if name in cost or name not in comps or depth > 64:
            return cost.get(name, empty)
        lines = comps[name]
        shapes = {m.group(1): _dims(m.group(2)) for m in map(_DEF_RE_HLO.match, lines) if m}
        total = dict(empty)
        for line in lines:
            flops = _matmul_flops(line, shapes)
            if flops:
                total[pass_of(line)] += flops
        busiest: dict[int, dict[str, float]] = {}
        for callee, factor, branch in calls[name]:
            flops = {k: v * factor for k, v in visit(callee, depth + 1).items()}
            if branch is None:
                total = {k: total[k] + flops[k] for k in total}
            elif sum(flops.values()) > sum(busiest.get(branch, empty).values()):
                busiest[branch] = flops
        for flops in busiest.values():
            total = {k: total[k] + flops[k] for k in total}
        cost[name] = total
        return total

    return visit(entry) if entry is not None else dict(empty)


_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
PASSES = ("forward", "backward", "other")


def pass_of(line: str) -> str:
    """Which pass of a training step an HLO op belongs to, from the jax op_name in its metadata.

    jax names what it differentiates `jvp(...)` and the backward pass `transpose(jvp(...))`;
    a rematerialised forward pass is recomputed inside the transpose, so it counts as
    backward. Anything else (the optimizer update, ops without metadata) is "other".
    """
    name = _OP_NAME_RE.search(line)
    if name is None:
        return "other"
    if "transpose(" in name.group(1):
        return "backward"
    return "forward" if "jvp(" in name.group(1) else "other"


def collective_ops(hlo_text: str, device_domain: list[int]) -> list[dict]:
    """One row per collective op of compiled HLO: what it moves per device and how often it runs per step.

    Row keys: name (the instruction's), kind, runs (executions per step: enclosing loops' trip counts multiplied),
    bytes_per_run and bytes (= bytes_per_run x runs; ring factors as in the module
    docstring), peers (largest replica group), cross_domain (a group spans scale-up
    domains), dtype (of the result), op_name (jax's, from the metadata; carries
    jax.named_scope names), pass (`pass_of`) and promoted (a reduction XLA:CPU's float
    normalisation runs in f32 for a narrower program type: its reducer is a `_promoted` copy),
    computation (the HLO computation holding it: XLA combines collectives within one) and
    in_loop (it sits in a while loop's body, whatever the trip count: it is not once per step
    even where it runs once).
    """
    comps, times, looped = _computation_runs(hlo_text)
    n = len(device_domain)
    rows = []
    for name, lines in comps.items():
        runs = times.get(name, 1.0)
        if runs == 0:
            continue
        for line in lines:
            m = _OP_RE.match(line)
            if not m:
                continue
            result, kind, started = m.group(1), m.group(2), m.group(3)
            sizes = shape_bytes(result)
            if not sizes:
                continue
            size = sum(_start_results(result, kind) if started else sizes)
            # XLA:GPU's ragged all-to-alls: the send buffer is the first operand (typed in a start's
            # result, else at its definition), and jax's op name is the operand's (the op has none).
            operand = _operand_definition(line, kind, lines) if kind == "ragged-all-to-all" else None
            if kind == "ragged-all-to-all":
                sent = sizes[:1] if started else shape_bytes(operand.split("=", 1)[1])[:1] if operand else []
                size = min([*sent, sizes[-1]])
            named = line if operand is None or _OP_NAME_RE.search(line) else operand
            groups = replica_groups(line, n)
            peers = max(len(g) for g in groups) if kind != "collective-permute" else 2
            factor = {
                "all-reduce": 2 * (peers - 1) / peers,
                "reduce-scatter": peers - 1,
                "collective-permute": 1.0,
            }.get(kind, (peers - 1) / peers)
            op_name = _OP_NAME_RE.search(named)
            rows.append(
                {
                    "name": _NAME_RE.match(line).group(1),
                    "kind": kind,
                    "runs": int(runs),
                    "bytes_per_run": size * factor,
                    "bytes": size * factor * runs,
                    "peers": peers,
                    "cross_domain": any(len({device_domain[i] for i in g if i < n}) > 1 for g in groups),
                    "dtype": _SHAPE_RE.search(result).group(1),
                    "op_name": op_name.group(1) if op_name else "",
                    "promoted": bool(_PROMOTED_RE.search(line)),
                    "pass": pass_of(named),
                    "computation": name,
                    "in_loop": name in looped,
                }
            )
    return rows


def _operand_definition(line: str, kind: str, lines: list[str]) -> str | None:
    """The line among `lines` that defines the first operand of `kind` on `line` (None if none)."""
    operand = re.search(rf"{kind}(?:-start)?\(\s*(?:\w+\[[\d,]*\](?:\{{[^}}]*\}})?\s+)?%?([\w.\-]+)", line)
    if operand:
        pattern = re.compile(rf"^\s*(?:ROOT\s+)?%?{re.escape(operand.group(1))}\s*=")
        return next((other for other in lines if pattern.match(other)), None)
    return None


def collective_bytes(hlo_text: str, device_domain: list[int]) -> dict:
    """Per-device bytes on the wire per step by collective kind, and the part crossing domains.

    `device_domain[i]` is the scale-up domain of the program's device (partition) i.
    Returns {"by_kind": {kind: bytes}, "cross_domain": {kind: bytes}, "ops": {kind: count},
    "by_pass": {pass: {kind: bytes}}} (passes as `pass_of` tells them).
    """
    return summarize_ops(collective_ops(hlo_text, device_domain))


def summarize_ops(rows: list[dict]) -> dict:
    """`collective_bytes`' summary of rows of `collective_ops` (rows may have been corrected first)."""
    by_kind: dict[str, float] = {}
    cross: dict[str, float] = {}
    ops: dict[str, int] = {}
    by_pass: dict[str, dict[str, float]] = {name: {} for name in PASSES}
    for row in rows:
        kind, moved = row["kind"], row["bytes"]
        by_kind[kind] = by_kind.get(kind, 0.0) + moved
        in_pass = by_pass[row["pass"]]
        in_pass[kind] = in_pass.get(kind, 0.0) + moved
        ops[kind] = ops.get(kind, 0) + row["runs"]
        if row["cross_domain"]:
            cross[kind] = cross.get(kind, 0.0) + moved
    return {"by_kind": by_kind, "cross_domain": cross, "ops": ops, "by_pass": by_pass}
