"""All-reduces of compiled HLO whose results are only ever sliced: reduce-scatters on a GPU.

XLA's SPMD partitioner writes the reduction of a sharded weight's gradient as an all-reduce
of the whole gradient followed by a dynamic slice of each device's shard. XLA:GPU's
reduce-scatter creator pass rewrites that pair into one reduce-scatter (half the bytes on the
wire); XLA:CPU, which the dry run compiles for, keeps the pair, and its float normalisation
also runs a bf16 all-reduce in f32 between two converts. `sliced_elements` finds, for each
element of each all-reduce's result, whether every use of it reaches a dynamic slice of
1 / (group size) of its elements, through get-tuple-element, bitcast, copy, convert and
reshape, and into and out of fusions; and the dtype that slice has, which is what the GPU
program reduces in.
"""

from __future__ import annotations

import re

from maxmoe.analysis.hlo import DTYPE_BYTES, array_types, computation_runs, replica_groups

_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_PARAM_INDEX_RE = re.compile(r"^(\d+)\)")
_TUPLE_INDEX_RE = re.compile(r"\bindex=(\d+)")
CALLS_RE = re.compile(r"\bcalls=%?([\w.\-]+)")
_PASS_THROUGH = ("bitcast", "copy", "convert", "reshape")
_MAX_DEPTH = 12


class _Instr:
    __slots__ = ("name", "result", "op", "operands", "line", "root", "index")

    def __init__(self, match: re.Match, line: str):
        self.root = bool(match.group(1))
        self.name, self.result, self.op = match.group(2), match.group(3), match.group(4)
        self.operands = re.findall(r"%([\w.\-]+)", _operand_text(match.group(5)))
        self.line = line
        number = _PARAM_INDEX_RE.match(match.group(5)) if self.op == "parameter" else None
        self.index = int(number.group(1)) if number else None


def _operand_text(rest: str) -> str:
    """The text of an instruction's operand list: up to the parenthesis that closes it."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i]
    return rest


class _Computation:
    def __init__(self, lines: list[str]):
        self.instrs: dict[str, _Instr] = {}
        for line in lines:
            m = _INSTR_RE.match(line)
            if m:
                self.instrs[m.group(2)] = _Instr(m, line)
        self.users: dict[str, list[_Instr]] = {}
        for instr in self.instrs.values():
            for operand in dict.fromkeys(instr.operands):
                self.users.setdefault(operand, []).append(instr)
        self.parameters = {i.index: i for i in self.instrs.values() if i.index is not None}


def parse_computations(hlo_text: str) -> dict[str, _Computation]:
    """Every computation of compiled HLO, its instructions by name, their users and parameters."""
    comps, _ = computation_runs(hlo_text)
    return {name: _Computation(lines) for name, lines in comps.items()}


def sliced_elements(
    hlo_text: str, num_devices: int, parsed: dict | None = None
) -> dict[str, list[tuple[int, str, str | None]]]:
    """For each all-reduce of compiled HLO (by instruction name, as maxmoe.analysis.hlo.collective_ops'
    rows name them): per result element, (elements, its dtype, the dtype its slices hold: the
    narrowest on the way; None where some use is not a 1/P dynamic slice). `parsed`: the
    text's parse_computations, where the caller has it."""
    parsed = parsed or parse_computations(hlo_text)
    out = {}
    for comp in parsed.values():
        for instr in comp.instrs.values():
            if instr.op != "all-reduce":
                continue
            peers = max(len(g) for g in replica_groups(instr.line, num_devices))
            arrays = array_types(instr.result)
            if len(arrays) == 1:
                dtype, elements = arrays[0]
                below = _slice_dtype(parsed, [(comp, instr.name)], elements, peers)
                out[instr.name] = [(elements, dtype, _through(dtype, below))]
                continue
            parts = []
            for index, (dtype, elements) in enumerate(arrays):
                gtes = [
                    u
                    for u in comp.users.get(instr.name, [])
                    if u.op == "get-tuple-element" and int(_TUPLE_INDEX_RE.search(u.line).group(1)) == index
                ]
                uses = [(comp, g.name) for g in gtes]
                below = _slice_dtype(parsed, uses, elements, peers) if uses else None
                parts.append((elements, dtype, _through(dtype, below)))
            out[instr.name] = parts
    return out


def _through(dtype: str, below: str | None) -> str | None:
    return below and _narrowest((dtype, below))


def _narrowest(dtypes) -> str:
    return min(dtypes, key=lambda t: DTYPE_BYTES.get(t, 8))


def _slice_dtype(parsed, values, elements: int, peers: int, depth: int = 0, outer=()) -> str | None:
    """The narrowest dtype on the way from `values` ((computation, name) pairs) to the
    1/peers dynamic slices every use of them reaches (the widest such over the uses), or None
    if some use reaches something else. `outer`: the fusion calls a value is inside, innermost
    last, so that a value that is a fusion's result continues at that fusion's users."""
    if peers < 2 or depth > _MAX_DEPTH:
        return None
    found = []
    for comp, name in values:
        users = comp.users.get(name, [])
        if not users:
            instr = comp.instrs.get(name)
            if not (instr is not None and instr.root and outer):
                return None
            outer_comp, fusion = outer[-1]
            found.append(_slice_dtype(parsed, [(outer_comp, fusion)], elements, peers, depth + 1, outer[:-1]))
        for user in users:
            own, count = (array_types(user.result) or [(None, 0)])[0]
            if user.op == "dynamic-slice" and user.operands[0] == name:
                found.append(own if count * peers == elements else None)
            elif user.op in _PASS_THROUGH:
                below = _slice_dtype(parsed, [(comp, user.name)], elements, peers, depth + 1, outer)
                found.append(_through(own, below))
            elif user.op == "fusion" and CALLS_RE.search(user.line):
                callee = parsed.get(CALLS_RE.search(user.line).group(1))
                params = [
                    callee.parameters.get(i) if callee else None for i, o in enumerate(user.operands) if o == name
                ]
                if not params or None in params:
                    return None
                inner = [(callee, p.name) for p in params]
                found.append(_slice_dtype(parsed, inner, elements, peers, depth + 1, outer + ((comp, user.name),)))
            else:
                return None
            if found[-1] is None:
                return None
    return max(found, key=lambda t: DTYPE_BYTES.get(t, 8)) if found else None
