"""Reading compiled programs: collectives in lowered StableHLO, bytes on the wire per tier from HLO.

Two texts, two questions:

  count_collectives(stablehlo)   how many collectives of each kind a lowered program
                                 writes (`jit(f).trace(...).lower(...).as_text()`), custom
                                 calls included: the CUDA lowering's ragged all-to-all.
  collective_bytes(hlo, domains) bytes each device puts on the wire per step, by kind and
                                 for the part whose replica groups span more than one
                                 scale-up domain, from the compiled HLO
                                 (`compiled.as_text()`): all-gather / all-to-all (P-1)/P of
                                 the result, reduce-scatter (P-1) x its result, all-reduce
                                 2 (P-1)/P of it (ring), collective-permute its result; ops
                                 inside loops multiplied by the loop's known trip count.

This is the one place that parses collectives out of program text; `maxmoe.info --lower`,
the sweep's dry run and the benchmarks all read programs through it.
"""

from __future__ import annotations

import math
import re

import numpy as np

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
_OP_RE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+(" + "|".join(KINDS) + r")(-start)?\(")
_SHAPE_RE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*[({]")
_CALL_RE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def shape_bytes(text: str) -> list[int]:
    """Bytes of each array type written in `text` ('f32[8,4]' -> 128), in order."""
    return [DTYPE_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _SHAPE_RE.findall(text)]


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


def computation_runs(hlo_text: str) -> tuple[dict[str, list[str]], dict[str, float]]:
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
    comps, times = computation_runs(hlo_text)
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
            sizes = shape_bytes(result)
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
