"""maxmoe.analysis.hlo_widened: collectives XLA:CPU runs wider than their values, and how the dry run counts them."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from maxmoe.analysis import hlo
from maxmoe.analysis.dry_run import as_on_gpu
from maxmoe.analysis.hlo_widened import narrowed_operands
from maxmoe.config import load_config

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")

# Compiled-HLO shapes of XLA:CPU's float normalisation: a bf16 weight copy stored in f32,
# sliced out of a stack and converted down and up again inside a fusion before an f32
# all-gather; the same gather of values that were computed after the bf16 convert (not
# bf16 values); an e4m3 payload sent as f16 by an all-to-all through a reshape; a combined
# all-gather of one bf16 and one f32 operand, reached through a fusion's parameter.
HLO = """HloModule m

%widen (p.0: f32[3,2,4], i.0: s32[]) -> f32[2,4] {
  %p.0 = f32[3,2,4]{2,1,0} parameter(0)
  %i.0 = s32[] parameter(1)
  %z.0 = s32[] constant(0)
  %ds.0 = f32[1,2,4]{2,1,0} dynamic-slice(%p.0, %i.0, %z.0, %z.0), dynamic_slice_sizes={1,2,4}
  %b.0 = bf16[1,2,4]{2,1,0} convert(%ds.0)
  %f.0 = f32[1,2,4]{2,1,0} convert(%b.0)
  ROOT %r.0 = f32[2,4]{1,0} bitcast(%f.0)
}

%scaled (p.1: f32[2,4]) -> f32[2,4] {
  %p.1 = f32[2,4]{1,0} parameter(0)
  %b.1 = bf16[2,4]{1,0} convert(%p.1)
  %f.1 = f32[2,4]{1,0} convert(%b.1)
  ROOT %m.1 = f32[2,4]{1,0} multiply(%f.1, %f.1)
}

%pass (p.2: f32[2,4]) -> f32[2,4] {
  ROOT %p.2 = f32[2,4]{1,0} parameter(0)
}

ENTRY %main (w: f32[3,2,4], x: f32[2,4], q: f8e4m3fn[8,4], id: s32[]) -> (f32[16,4], f32[16,4], f16[32], (f32[16,4], f32[16,4])) {
  %w = f32[3,2,4]{2,1,0} parameter(0)
  %x = f32[2,4]{1,0} parameter(1)
  %q = f8e4m3fn[8,4]{1,0} parameter(2)
  %id = s32[] parameter(3)
  %wf = f32[2,4]{1,0} fusion(%w, %id), kind=kLoop, calls=%widen
  %ag = f32[16,4]{1,0} all-gather(%wf), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %xs = f32[2,4]{1,0} fusion(%x), kind=kLoop, calls=%scaled
  %ag2 = f32[16,4]{1,0} all-gather(%xs), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %h = f16[8,4]{1,0} convert(%q)
  %hr = f16[32]{0} reshape(%h)
  %a2a = f16[32]{0} all-to-all(%hr), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %wp = f32[2,4]{1,0} fusion(%wf), kind=kLoop, calls=%pass
  %ag3 = (f32[16,4]{1,0}, f32[16,4]{1,0}) all-gather(%wp, %x), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %t = (f32[16,4], f32[16,4], f16[32], (f32[16,4], f32[16,4])) tuple(%ag, %ag2, %a2a, %ag3)
}
"""


def test_narrowed_operands_follow_converts_slices_and_fusions():
    assert narrowed_operands(HLO) == {
        "ag": [(32, "f32", "bf16")],
        "a2a": [(64, "f16", "f8e4m3fn")],
        "ag3": [(32, "f32", "bf16"), (32, "f32", "f32")],
    }


def test_as_on_gpu_counts_them_at_their_values_width():
    config = load_config([TINY], ["model.compute_dtype=bfloat16"])
    rows = hlo.collective_ops(HLO, [0] * 8)
    gpu, notes = as_on_gpu(rows, config, narrowed=narrowed_operands(HLO))
    gathered, sent = 16 * 4 * 7 / 8, 32 * 7 / 8  # result elements x (P - 1) / P
    assert [(r["name"], r["dtype"], r["bytes"]) for r in gpu] == [
        ("ag", "bf16", gathered * 2),
        ("ag2", "f32", gathered * 4),  # values computed in f32 after the bf16 round trip
        ("a2a", "f8e4m3fn", sent * 1),
        ("ag3", "bf16", 2 * gathered * 3),  # one operand at 2 B, one at 4 B
    ]
    assert len(notes) == 1


def test_a_compiled_fsdp_bf16_weight_gather_is_bf16_on_the_gpu():
    """XLA:CPU's own program: a bf16 copy of a weight sharded over 8 devices, gathered for a matmul."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    rows_sharded = NamedSharding(mesh, P("data", None))

    def forward(w, x):
        w = jax.lax.with_sharding_constraint(w.astype(jnp.bfloat16), rows_sharded)
        return x.astype(jnp.bfloat16) @ w

    w, x = np.ones((64, 32), np.float32), np.ones((16, 64), np.float32)
    step = jax.jit(forward, in_shardings=(rows_sharded, rows_sharded), out_shardings=rows_sharded)
    text = step.lower(w, x).compile().as_text()
    compiled = [r for r in hlo.collective_ops(text, [0] * 8) if r["kind"] == "all-gather"]
    assert [r["dtype"] for r in compiled] == ["f32"]  # XLA:CPU's float normalisation
    config = load_config([TINY], ["model.compute_dtype=bfloat16"])
    gpu, _ = as_on_gpu(compiled, config, narrowed=narrowed_operands(text))
    assert [(r["dtype"], r["bytes"]) for r in gpu] == [("bf16", 64 * 32 * 2 * 7 / 8)]
