"""Collectives of compiled HLO that XLA:CPU runs wider than the program's values.

XLA:CPU's float normalisation runs a bf16 all-gather or all-to-all in f32: it converts the
operand up before the collective and the result down after it, and the two converts of a
weight that is already bf16 leave `convert(convert(w, bf16), f32)` feeding an f32
all-gather. The values on the wire are bf16 values (the program's, and the GPU's, which has
bf16 collectives), so the GPU moves half the bytes. `narrowed_operands` finds, for every
operand of each data-moving collective (all-gather, all-to-all, collective-permute and their
async starts), the narrowest float type its values passed through on the way: back from the
operand through ops that keep values (bitcast, copy, convert, reshape, transpose, slices,
broadcast), into fusions through their root and out through their parameters. A value that
passed through bf16 is a bf16 value whatever it is widened to after. Reductions are
`maxmoe.analysis.hlo_slices`' and `maxmoe.analysis.hlo.collective_ops`' `promoted` flag.
"""

from __future__ import annotations

from maxmoe.analysis.hlo import DTYPE_BYTES, array_types
from maxmoe.analysis.hlo_slices import CALLS_RE, parse_computations

MOVING = ("all-gather", "all-to-all", "collective-permute")
_KEEP_VALUES = ("bitcast", "copy", "convert", "reshape", "transpose", "slice", "dynamic-slice", "broadcast")
_FLOATS = ("f8e4m3fn", "f8e5m2", "bf16", "f16", "f32", "f64")
_MAX_DEPTH = 24


def narrowed_operands(hlo_text: str, parsed: dict | None = None) -> dict[str, list[tuple[int, str, str]]]:
    """For each data-moving collective (by instruction name, as maxmoe.analysis.hlo.collective_ops'
    rows name them) with some operand narrower than compiled: per operand, (bytes as compiled,
    its compiled dtype, the narrowest float dtype its values passed through). `parsed`: the
    text's maxmoe.analysis.hlo_slices.parse_computations, where the caller has it."""
    parsed = parsed or parse_computations(hlo_text)
    out = {}
    for comp in parsed.values():
        for instr in comp.instrs.values():
            if instr.op.removesuffix("-start") not in MOVING:
                continue
            sources = [comp.instrs.get(operand) for operand in instr.operands]
            arrays = [array_types(source.result) if source is not None else [] for source in sources]
            if any(len(a) != 1 for a in arrays):
                continue  # an operand this cannot size: counted as compiled
            parts = [
                (elements * DTYPE_BYTES[dtype], dtype, _narrowest_on_the_way(parsed, comp, source.name, ()))
                for source, [(dtype, elements)] in zip(sources, arrays)
            ]
            if any(_width(narrow) < _width(dtype) for _, dtype, narrow in parts):
                out[instr.name] = parts
    return out


def _width(dtype: str) -> int:
    return DTYPE_BYTES.get(dtype, 8)


def _narrowest_on_the_way(parsed, comp, name: str, callers, depth: int = 0) -> str | None:
    """The narrowest float dtype of `name`'s value and of the values it was copied, converted,
    reshaped or sliced from (`callers`: the fusion calls `comp` is inside, innermost last);
    None for a value that is not one array."""
    instr = comp.instrs.get(name)
    arrays = array_types(instr.result) if instr is not None else []
    if len(arrays) != 1:
        return None
    own = arrays[0][0]
    if own not in _FLOATS or depth > _MAX_DEPTH:
        return own
    if instr.op in _KEEP_VALUES and instr.operands:
        below = _narrowest_on_the_way(parsed, comp, instr.operands[0], callers, depth + 1)
    elif instr.op == "fusion" and CALLS_RE.search(instr.line):
        callee = parsed.get(CALLS_RE.search(instr.line).group(1))
        root = next((i for i in callee.instrs.values() if i.root), None) if callee else None
        below = _narrowest_on_the_way(parsed, callee, root.name, (*callers, (comp, instr)), depth + 1) if root else own
    elif instr.op == "parameter" and callers and instr.index is not None:
        outer, fusion = callers[-1]
        operand = fusion.operands[instr.index] if instr.index < len(fusion.operands) else None
        below = _narrowest_on_the_way(parsed, outer, operand, callers[:-1], depth + 1) if operand else own
    else:
        return own
    return below if below in _FLOATS and _width(below) < _width(own) else own
