"""Compile a lowered program with float16 standing in for bfloat16, for GPU-like memory figures.

XLA:CPU has no bf16 dot: its float normalisation converts each bf16 dot operand to f32, and
loop-invariant code motion then hoists those converts out of loops as whole-stack f32 copies
-- of the residuals a remat policy saves for the backward pass, and of the bf16 weights a
layer scan reads -- which sit beside the bf16 stacks they copy. A GPU runs bf16 dots natively
and holds neither. XLA:CPU does run f16 dots and collectives natively, and float16 has
bfloat16's width, so the same program with every bf16 type written f16 gets the buffer
assignment the GPU's bf16 program would (the values differ; nothing runs). Turning code
motion off instead removes the copies but also leaves weight gathers inside loops, which
understates memory (docs/dev/perf-log.md, 2026-12-04).

Only where this XLA:CPU widens bf16 dots (`bf16_dots_widened`: jaxlib 0.10's does; 0.12's
runs them in bf16 and needs no stand-in). The substitution is textual on the StableHLO
module, debug locations kept (the dry run reads jax's op names from them): element types
only (`xbf16>`, `<bf16>`), so names, attributes and the FP8 types are untouched.
"""

from __future__ import annotations

import functools
import re

BF16_TYPE = re.compile(r"(?<=[x<])bf16(?=>)")


def f16_text(stablehlo: str) -> tuple[str, int]:
    """`stablehlo` with every bf16 element type written f16, and how many were replaced."""
    return BF16_TYPE.subn("f16", stablehlo)


@functools.lru_cache(maxsize=1)
def bf16_dots_widened() -> bool:
    """Whether XLA:CPU computes a bf16 dot in f32 (its compiled dot's result is f32)."""
    import jax
    import jax.numpy as jnp

    x = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    text = jax.jit(jnp.matmul).lower(x, x).compile().as_text()
    return re.search(r"= f32\[64,64\]\S* dot\(", text) is not None


def compile_half_width(lowered, compiler_options=None):
    """(compiled program, bf16 types replaced): `lowered` (a jax `Lowered`) compiled with f16 for
    bf16 where XLA:CPU widens bf16 dots; as lowered (0 replaced) where it does not or the
    program holds no bf16. `lowered` then holds the f16 module: compile it only through here."""
    from jax._src.lib.mlir import ir

    if not bf16_dots_widened():
        return lowered.compile(compiler_options=compiler_options), 0
    text, replaced = f16_text(lowered.as_text(debug_info=True))
    if replaced:
        computation = lowered._lowering  # the only way to compile another module with jax's arguments
        with computation._hlo.context:
            computation._hlo = ir.Module.parse(text)
        computation._executable = None
    return lowered.compile(compiler_options=compiler_options), replaced
