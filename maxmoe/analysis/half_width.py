"""Compile a lowered program with float16 standing in for bfloat16, for GPU-like memory figures.

    compiled, replaced = compile_half_width(lowered)     # the dry run's compile

XLA:CPU without bf16 dots (jaxlib 0.10's) widens them to f32 and hoists whole-stack f32 copies
out of loops that a GPU's bf16 program never holds; float16 has bfloat16's width and runs
natively there, so the program with every bf16 type written f16 gets the GPU's buffer
assignment (the values differ; nothing runs). Only where this XLA:CPU widens bf16 dots
(`bf16_dots_widened`; elsewhere the program compiles as lowered, 0 replaced). The substitution
(`f16_text`) is textual on the StableHLO module, debug locations kept: element types only
(`xbf16>`, `<bf16>`), so names, attributes and the FP8 types are untouched.

docs/PERFORMANCE.md, "Mesh sweep: `maxmoe.sweep`" (after "What the CPU program gets wrong") has
the reasoning.
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
