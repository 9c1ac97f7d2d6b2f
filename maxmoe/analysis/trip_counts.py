"""Trip counts of while loops whose HLO line does not carry one, read from the loop's own ops.

XLA writes `known_trip_count` into a while's backend config where its analysis found one; after
XLA:GPU peels and double-buffers a loop it often leaves it out. `inferred_trip_count` reads the
count the way XLA's own analysis would for the loops jax writes: an induction variable that
starts at a constant, moves by a constant each run of the body and is compared with a constant
(`i < 59`). Through copies, bitcasts, converts and single-op fusions; anything else (a bound
carried by the loop, as causal attention's chunk loops have): None, and the caller counts one run.
"""

from __future__ import annotations

import math
import re

_DEF_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?:\(.*?\)|\S+)\s+([\w\-]+)\((.*)$")
_ARG_RE = re.compile(r"%([\w.\-]+)")
_CONST_RE = re.compile(r"\bconstant\((-?\d+)\)")
_INDEX_RE = re.compile(r"\bindex=(\d+)")
_CALLS_RE = re.compile(r"\bcalls=%?([\w.\-]+)")
_DIRECTION_RE = re.compile(r"\bdirection=(\w+)")
_WHILE_RE = re.compile(r"\bwhile\(%?([\w.\-]+)\),\s*condition=%?([\w.\-]+),\s*body=%?([\w.\-]+)")
_PASS_THROUGH = ("copy", "bitcast", "convert", "reshape")


class Definitions:
    """Each instruction's line by name (HLO names are unique in a module), and each computation's
    root and parameters."""

    def __init__(self, comps: dict[str, list[str]]):
        self.lines: dict[str, str] = {}
        self.root: dict[str, str] = {}
        self.params: dict[str, dict[int, str]] = {}
        for comp, body in comps.items():
            params = self.params.setdefault(comp, {})
            for line in body:
                m = _DEF_RE.match(line)
                if not m:
                    continue
                name, op, rest = m.groups()
                self.lines[name] = line
                if line.lstrip().startswith("ROOT"):
                    self.root[comp] = name
                if op == "parameter":
                    params[int(rest.split(")", 1)[0])] = name


def _parse(defs: Definitions, name: str):
    """(op, operand names, line) of instruction `name`, or None."""
    line = defs.lines.get(name)
    if line is None:
        return None
    op, rest = _DEF_RE.match(line).group(2, 3)
    return op, _ARG_RE.findall(rest.split(")", 1)[0]), line


def _fusion_params(defs: Definitions, line: str, args: list[str], iv, bound: dict, depth: int):
    """(the fusion's computation, its parameters bound to the affine values of `args`), or None."""
    callee = _CALLS_RE.search(line)
    if callee is None or callee.group(1) not in defs.root:
        return None
    comp = callee.group(1)
    inner = {}
    for i, arg in enumerate(args):
        value = _affine(defs, arg, iv, bound, depth + 1)
        if i in defs.params[comp] and value is not None:
            inner[defs.params[comp][i]] = value
    return comp, inner


def _affine(defs: Definitions, name: str, iv: tuple[str, int] | None, bound: dict, depth: int = 0):
    """`name`'s value as (a, b): a x the induction variable + b; None where it is not one.
    `iv`: (the loop's tuple parameter, the induction variable's index in it); `bound`: fusion
    parameters bound to their arguments' values."""
    if name in bound:
        return bound[name]
    parsed = _parse(defs, name) if depth <= 32 else None
    if parsed is None:
        return None
    op, args, line = parsed
    if op == "constant":
        m = _CONST_RE.search(line)
        return (0, int(m.group(1))) if m else None
    if op == "get-tuple-element":
        index = _INDEX_RE.search(line)
        return (1, 0) if iv is not None and args == [iv[0]] and index and int(index.group(1)) == iv[1] else None
    if op in _PASS_THROUGH and len(args) == 1:
        return _affine(defs, args[0], iv, bound, depth + 1)
    if op in ("add", "subtract") and len(args) == 2:
        a, b = (_affine(defs, x, iv, bound, depth + 1) for x in args)
        if a is None or b is None:
            return None
        sign = 1 if op == "add" else -1
        return (a[0] + sign * b[0], a[1] + sign * b[1])
    if op == "fusion":
        fused = _fusion_params(defs, line, args, iv, bound, depth)
        return None if fused is None else _affine(defs, defs.root[fused[0]], None, fused[1], depth + 1)
    return None


def _comparison(defs: Definitions, name: str, iv: tuple[str, int] | None, bound: dict, depth: int = 0):
    """(direction, lhs, rhs) of the compare the condition's root is (directly or in a fusion),
    each side affine in the induction variable; None otherwise."""
    parsed = _parse(defs, name) if depth <= 4 else None
    if parsed is None:
        return None
    op, args, line = parsed
    if op == "compare" and len(args) == 2:
        direction = _DIRECTION_RE.search(line)
        sides = [_affine(defs, a, iv, bound) for a in args]
        return (direction.group(1), *sides) if direction and None not in sides else None
    if op == "fusion":
        fused = _fusion_params(defs, line, args, iv, bound, depth)
        return None if fused is None else _comparison(defs, defs.root[fused[0]], None, fused[1], depth + 1)
    return None


def inferred_trip_count(while_line: str, defs: Definitions) -> int | None:
    """Runs of the body of the while op on `while_line` (see the module docstring), or None."""
    m = _WHILE_RE.search(while_line)
    if m is None:
        return None
    init_tuple, condition, body = m.groups()
    tuple_line = defs.lines.get(init_tuple, "")
    tm = _DEF_RE.match(tuple_line)
    if not tm or tm.group(2) != "tuple" or condition not in defs.root or body not in defs.root:
        return None
    inits = _ARG_RE.findall(tm.group(3).split(")", 1)[0])
    body_root = _DEF_RE.match(defs.lines[defs.root[body]])
    if body_root is None or body_root.group(2) != "tuple":
        return None
    nexts = _ARG_RE.findall(body_root.group(3).split(")", 1)[0])
    cond_param, body_param = defs.params[condition].get(0), defs.params[body].get(0)
    for index, (init, nxt) in enumerate(zip(inits, nexts)):
        start = _affine(defs, init, None, {})
        step = _affine(defs, nxt, (body_param, index), {})
        if start is None or start[0] != 0 or step is None or step[0] != 1 or step[1] == 0:
            continue
        test = _comparison(defs, defs.root[condition], (cond_param, index), {})
        if test is None:
            continue
        trips = _count(test, start[1], step[1])
        if trips is not None:
            return trips
    return None


def _count(test: tuple, start: int, step: int) -> int | None:
    """Runs of `iv = start; while test(iv): iv += step` for a test linear in iv on one side."""
    direction, (a1, b1), (a2, b2) = test
    flip = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}
    if a1 == 0 and a2 != 0:
        direction, (a1, b1), (a2, b2) = flip.get(direction, direction), (a2, b2), (a1, b1)
    if a1 != 1 or a2 != 0 or direction not in flip:
        return None
    limit = b2 - b1  # iv <direction> limit
    if direction in ("LT", "LE") and step > 0:
        end = limit if direction == "LT" else limit + 1
        return max(0, math.ceil((end - start) / step))
    if direction in ("GT", "GE") and step < 0:
        end = limit if direction == "GT" else limit - 1
        return max(0, math.ceil((start - end) / -step))
    return None
