"""maxmoe.analysis.hlo_slices: all-reduces whose results are only sliced, and how the dry run counts them."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from maxmoe.analysis import hlo
from maxmoe.analysis.dry_run import as_on_gpu
from maxmoe.analysis.hlo_slices import sliced_elements
from maxmoe.config import load_config

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")

# Compiled-HLO shapes of XLA:CPU's weight-gradient reduction: a combined all-reduce in f32
# (float normalisation of a bf16 one), one element converted to bf16 in a fusion and then
# sliced to 1/8 in another (through a convert back to f32 inside it), the other element used
# whole; and an all-reduce sliced to 1/4 only, over 8 devices.
HLO = """HloModule m

%wrapped (p.0: f32[16,4]) -> bf16[16,4] {
  %p.0 = f32[16,4]{1,0} parameter(0)
  ROOT %c.0 = bf16[16,4]{1,0} convert(%p.0)
}

%slice (p.1: bf16[16,4], i.1: s32[]) -> bf16[2,4] {
  %p.1 = bf16[16,4]{1,0} parameter(0)
  %i.1 = s32[] parameter(1)
  %f.1 = f32[16,4]{1,0} convert(%p.1)
  %z.1 = s32[] constant(0)
  %ds.1 = f32[2,4]{1,0} dynamic-slice(%f.1, %i.1, %z.1), dynamic_slice_sizes={2,4}
  ROOT %c.1 = bf16[2,4]{1,0} convert(%ds.1)
}

ENTRY %main (g: f32[16,4], h: f32[8], id: s32[]) -> (bf16[2,4], f32[8], f32[4,4]) {
  %g = f32[16,4]{1,0} parameter(0)
  %h = f32[8]{0} parameter(1)
  %id = s32[] parameter(2)
  %z = s32[] constant(0)
  %ar = (f32[16,4]{1,0}, f32[8]{0}) all-reduce(%g, %h), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add.clone_promoted
  %g0 = f32[16,4]{1,0} get-tuple-element(%ar), index=0
  %g1 = f32[8]{0} get-tuple-element(%ar), index=1
  %w = bf16[16,4]{1,0} fusion(%g0), kind=kLoop, calls=%wrapped
  %s = bf16[2,4]{1,0} fusion(%w, %id), kind=kLoop, calls=%slice
  %n = f32[8]{0} negate(%g1)
  %ar2 = f32[16,4]{1,0} all-reduce(%g), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %ds2 = f32[4,4]{1,0} dynamic-slice(%ar2, %id, %z), dynamic_slice_sizes={4,4}
  ROOT %t = (bf16[2,4]{1,0}, f32[8]{0}, f32[4,4]{1,0}) tuple(%s, %n, %ds2)
}
"""


def test_sliced_elements_follow_converts_and_fusions():
    assert sliced_elements(HLO, 8) == {"ar": [(64, "f32", "bf16"), (8, "f32", None)], "ar2": [(64, "f32", None)]}


def test_as_on_gpu_counts_the_sliced_part_as_a_reduce_scatter():
    rows = hlo.collective_ops(HLO, [0] * 8)
    assert [(r["name"], r["promoted"]) for r in rows] == [("ar", True), ("ar2", False)]
    config = load_config([TINY], ["model.compute_dtype=bfloat16"])
    gpu, notes = as_on_gpu(rows, config, sliced_elements(HLO, 8))
    ring, half = 2 * 7 / 8, 7 / 8
    assert [(r["name"], r["kind"], r["dtype"], r["bytes"]) for r in gpu] == [
        ("ar", "all-reduce", "bf16", 8 * 2 * ring),  # the element used whole; its reducer is bf16's
        ("ar", "reduce-scatter", "bf16", 64 * 2 * half),  # was 64 x 4 B x 2 (P - 1) / P
        ("ar2", "all-reduce", "f32", 64 * 4 * ring),  # sliced to 1/4 of 8 devices: not a shard
    ]
    assert any("reduce-scatter" in note for note in notes)


def test_a_compiled_fsdp_weight_gradient_is_one_bf16_reduce_scatter_on_the_gpu():
    """XLA:CPU's own program: a bf16 matmul's weight sharded over 8 devices, the batch too."""
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    sharded = NamedSharding(mesh, P("data", None))

    def loss(w, x):
        return (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32).sum()

    w, x = np.ones((64, 32), np.float32), np.ones((16, 64), np.float32)
    step = jax.jit(jax.grad(loss), in_shardings=(sharded, sharded), out_shardings=sharded)
    text = step.lower(w, x).compile().as_text()
    config = load_config([TINY], ["model.compute_dtype=bfloat16"])
    gpu, _ = as_on_gpu(hlo.collective_ops(text, [0] * 8), config, sliced_elements(text, 8))
    gradient = 64 * 32
    assert [(r["kind"], r["dtype"], r["bytes"]) for r in gpu if r["bytes"] >= gradient] == [
        ("reduce-scatter", "bf16", gradient * 2 * 7 / 8)
    ]
