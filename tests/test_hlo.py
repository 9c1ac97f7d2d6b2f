"""maxmoe.analysis.hlo: collective counts in StableHLO, replica groups and bytes on the wire in compiled HLO."""

import jax
import jax.numpy as jnp
from jax import lax

from maxmoe.analysis import hlo, hlo_deps

STABLEHLO = """
  %0 = "stablehlo.all_gather"(%arg0) <{all_gather_dim = 0 : i64}> : (tensor<4xi32>) -> tensor<16xi32>
  %1 = stablehlo.custom_call @ragged_all_to_all(%a, %b, %c, %d, %e, %f) : (...) -> tensor<8x4xf32>
  %2 = stablehlo.custom_call @ragged_all_to_all(%a, %b, %c, %d, %e, %f) : (...) -> tensor<8x4xf32>
  %3 = "stablehlo.all_to_all"(%1) : (tensor<8x4xf32>) -> tensor<8x4xf32>
  %4 = "stablehlo.all_reduce"(%3) ({ ... }) : (tensor<8x4xf32>) -> tensor<8x4xf32>
"""


def test_count_collectives_tells_ragged_from_dense_all_to_all():
    assert hlo.count_collectives(STABLEHLO) == {
        "ragged_all_to_all": 2,
        "all_to_all": 1,
        "all_gather": 1,
        "reduce_scatter": 0,
        "all_reduce": 1,
        "collective_permute": 0,
    }


def test_replica_group_formats():
    assert hlo.replica_groups("x, replica_groups={{0,2},{1,3}}, y", 4) == [[0, 2], [1, 3]]
    assert hlo.replica_groups("replica_groups=[2,4]<=[8]", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hlo.replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hlo.replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, x", 8) == [
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
    ]
    assert hlo.replica_groups("no groups", 4) == [[0, 1, 2, 3]]


HLO = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ar = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp(Model))/while/body/checkpoint/rematted_computation/psum"}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ar)
}

ENTRY %main (a: f32[8]) -> f32[16] {
  %a = f32[8]{0} parameter(0)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %ag = f32[16]{0} all-gather(%a), channel_id=2, replica_groups={{0,2},{1,3}}, dimensions={0}, metadata={op_name="jit(step)/jvp(Model)/all_gather" source_file="x.py"}
  ROOT %ag2 = f32[16]{0} all-gather(%a), channel_id=3, replica_groups={{0,2},{1,3}}, dimensions={0}
}
"""


def test_collective_bytes_counts_loops_and_domains():
    wire = hlo.collective_bytes(HLO, device_domain=[0, 0, 1, 1])
    # all-reduce: 32 B x 2 (P-1)/P = 32 B per run, 5 runs; all-gather: 64 B x 1/2.
    assert wire["by_kind"] == {"all-reduce": 160.0, "all-gather": 64.0}
    assert wire["ops"] == {"all-reduce": 5, "all-gather": 2}
    assert wire["cross_domain"] == {"all-gather": 64.0}  # groups {0,2}, {1,3} span both domains
    # Recomputation inside the transpose is backward; an op without jax metadata is "other".
    assert wire["by_pass"] == {
        "forward": {"all-gather": 32.0},
        "backward": {"all-reduce": 160.0},
        "other": {"all-gather": 32.0},
    }


# Hand-written compiled HLO: a loop of 4 trips around a conditional whose branches cost
# 2 x 4 x 8 x 16 = 1,024 FLOPs (one dot) and 2 x 1,024 (the same dot twice, one of them in
# a fusion); after the loop a convolution (1 x 6 x 6 x 3 outputs, each over a 3 x 3 x 2
# kernel per output feature) and a dot with a batch dimension (2 x [3, 5] @ [5, 7]).
MATMULS = """HloModule m

%one (a.1: f32[4,8], b.1: f32[8,16]) -> f32[4,16] {
  %a.1 = f32[4,8]{1,0} parameter(0)
  %b.1 = f32[8,16]{1,0} parameter(1)
  ROOT %d.1 = f32[4,16]{1,0} dot(%a.1, %b.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused (a.3: f32[4,8], b.3: f32[8,16]) -> f32[4,16] {
  %a.3 = f32[4,8]{1,0} parameter(0)
  %b.3 = f32[8,16]{1,0} parameter(1)
  ROOT %d.3 = f32[4,16]{1,0} dot(%a.3, %b.3), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%two (a.2: f32[4,8], b.2: f32[8,16]) -> f32[4,16] {
  %a.2 = f32[4,8]{1,0} parameter(0)
  %b.2 = f32[8,16]{1,0} parameter(1)
  %d.2 = f32[4,16]{1,0} dot(%a.2, %b.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %f.2 = f32[4,16]{1,0} fusion(%a.2, %b.2), kind=kOutput, calls=%fused
}

%body (p: (s32[], f32[4,8], f32[8,16])) -> (s32[], f32[4,8], f32[8,16]) {
  %p = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %c = f32[4,16]{1,0} conditional(%i, %p, %p), branch_computations={%one, %two}
  ROOT %t = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(%i, %x, %y)
}

ENTRY %main (x: f32[4,8], y: f32[8,16], img: f32[1,8,8,2], k: f32[3,3,2,3], u: f32[2,3,5], v: f32[5,7]) -> f32[2,3,7] {
  %x = f32[4,8]{1,0} parameter(0)
  %y = f32[8,16]{1,0} parameter(1)
  %img = f32[1,8,8,2]{3,2,1,0} parameter(2)
  %k = f32[3,3,2,3]{3,2,1,0} parameter(3)
  %u = f32[2,3,5]{2,1,0} parameter(4)
  %v = f32[5,7]{1,0} parameter(5)
  %w = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %conv = f32[1,6,6,3]{3,2,1,0} convolution(%img, %k), window={size=3x3}, dim_labels=b01f_01io->b01f
  ROOT %bd = f32[2,3,7]{2,1,0} dot(%u, %v), lhs_contracting_dims={2}, rhs_contracting_dims={0}
}
"""


def test_dot_flops_multiplies_loops_and_takes_the_busiest_branch():
    per_dot = 2 * 4 * 8 * 16
    conv = 2 * (6 * 6 * 3) * (3 * 3 * 2)
    batched = 2 * (2 * 3 * 7) * 5
    assert hlo.dot_flops(MATMULS) == 4 * 2 * per_dot + conv + batched


def test_dot_flops_of_a_compiled_scan_and_cond():
    """XLA:CPU's own text: fusions around the dots, operands without inline types."""

    def f(x, w, v, p):
        x, _ = lax.scan(lambda c, _: (c @ w, None), x, None, length=3)
        return lax.cond(p > 0, lambda c: (c @ v) @ v.T, lambda c: c @ w, x)

    x, w, v = jnp.ones((4, 8)), jnp.ones((8, 8)), jnp.ones((8, 16))
    text = jax.jit(f).lower(x, w, v, 1).compile().as_text()
    cheap, dear = 2 * 4 * 8 * 8, 2 * (2 * 4 * 8 * 16)  # the branches: c @ w, (c @ v) @ v.T
    assert hlo.dot_flops(text) == 3 * cheap + max(cheap, dear)


# Hand-written StableHLO with known dependences: exchange A1 feeds dot D1, which reaches
# the last exchange A3 through a call; exchange A2 feeds dot D2 inside a shard_map body
# (block arguments by position); a while loop carries D2's result and runs dot D3.
DEPENDENCES = """module @m {
  func.func public @main(%arg0: tensor<4xf32>, %arg1: tensor<4xf32>) -> (tensor<4xf32>) {
    %0 = stablehlo.custom_call @ragged_all_to_all(%arg0, %arg0) : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
    %1 = "chlo.ragged_dot"(%0, %arg1) : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
    %2 = call @helper(%1, %arg1) : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
    %3:2 = sdy.manual_computation(%arg1, %1) in_shardings=[<@mesh, [{}]>] manual_axes={"x"} (%arg2: tensor<4xf32>, %arg3: tensor<4xf32>) {
      %4 = stablehlo.custom_call @ragged_all_to_all(%arg2, %arg2) : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
      %5 = "chlo.ragged_dot"(%4, %arg2) : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
      sdy.return %5, %arg3 : tensor<4xf32>, tensor<4xf32>
    } : (tensor<4xf32>, tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>)
    %6:2 = stablehlo.while(%iterArg = %3#0, %iterArg_0 = %arg0) : tensor<4xf32>, tensor<4xf32>
    cond {
      %c = stablehlo.constant dense<true> : tensor<i1>
      stablehlo.return %c : tensor<i1>
    } do {
      %7 = "chlo.ragged_dot"(%iterArg_0, %arg1) : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
      stablehlo.return %iterArg, %7 : tensor<4xf32>, tensor<4xf32>
    }
    %8 = stablehlo.custom_call @ragged_all_to_all(%2, %6#1) : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
    %9 = stablehlo.custom_call @ragged_all_to_all(%3#1, %arg1) : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
    return %8 : tensor<4xf32>
  }
  func.func private @helper(%arg0: tensor<4xf32>, %arg1: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.add %arg0, %arg1 : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
"""


def test_marker_dependencies_follow_calls_shard_map_bodies_and_loops():
    found = hlo_deps.marker_dependencies(DEPENDENCES)
    defined_on = {i + 1: text.split(" = ")[0].strip() for i, text in enumerate(DEPENDENCES.splitlines())}
    name = {key: defined_on[m.line] for key, m in found.items()}
    deps = {name[key]: {name[d] for d in m.deps} for key, m in found.items()}
    assert {name[k]: m.kind for k, m in found.items()} == {
        "%0": "ragged_all_to_all",
        "%1": "ragged_dot",
        "%4": "ragged_all_to_all",
        "%5": "ragged_dot",
        "%7": "ragged_dot",
        "%8": "ragged_all_to_all",
        "%9": "ragged_all_to_all",
    }
    assert deps["%0"] == set() and deps["%1"] == {"%0"}
    assert deps["%4"] == set() and deps["%5"] == {"%4"}  # block argument %arg2 is operand %arg1: no marker
    # Loop bodies are over-approximated: every carry sees every operand and what the body made.
    assert deps["%7"] == {"%4", "%5", "%7"}
    assert deps["%8"] == {"%0", "%1", "%4", "%5", "%7"}
    assert deps["%9"] == {"%0", "%1"}  # the body returned %arg3, which is operand %1


def test_independent_chains_and_coupling():
    chains, coupled = hlo_deps.independent_chains(hlo_deps.marker_dependencies(DEPENDENCES))
    # %8 depends on dots of both chains ({%1} via %0 and {%5, %7} via %4): one coupled exchange.
    assert sorted(len(c) for c in chains) == [1, 2]
    assert [hlo_deps.marker_dependencies(DEPENDENCES)[m].line for m in coupled] == [19]


# The micro-batch loop as XLA:GPU writes it after peeling and double-buffering (the 671B GB300
# step's, cut down): no known_trip_count; the induction variable starts at copy(copy(0)), the body
# adds 1 in a fusion, the condition compares it with 59 in another; an all-reduce inside. A second
# loop's bound is carried by the loop (a causal attention chunk loop): it counts one run.
PEELED = """HloModule m

%fused_add (param_0.1: s32[]) -> s32[] {
  %param_0.1 = s32[] parameter(0)
  %one = s32[] constant(1), metadata={op_name="jit(train_step)/shard_map"}
  ROOT %add.1 = s32[] add(%param_0.1, %one)
}

%fused_compare (param_0.2: s32[]) -> pred[] {
  %param_0.2 = s32[] parameter(0)
  %bound = s32[] constant(59)
  ROOT %compare.1 = pred[] compare(%param_0.2, %bound), direction=LT
}

%cond (cond_param: (s32[], f32[8])) -> pred[] {
  %cond_param = (s32[], f32[8]{0}) parameter(0), metadata={op_name="x"}
  %gte.c = s32[] get-tuple-element(%cond_param), index=0
  ROOT %loop_compare_fusion = pred[] fusion(%gte.c), kind=kLoop, calls=%fused_compare
}

%body (param.b: (s32[], f32[8])) -> (s32[], f32[8]) {
  %param.b = (s32[], f32[8]{0}) parameter(0)
  %gte.i = s32[] get-tuple-element(%param.b), index=0
  %copy.i = s32[] copy(%gte.i)
  %x = f32[8]{0} get-tuple-element(%param.b), index=1
  %ar = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %next = s32[] fusion(%copy.i), kind=kLoop, calls=%fused_add, metadata={op_name="jit(train_step)/while/body/add"}
  ROOT %t = (s32[], f32[8]{0}) tuple(%next, /*index=1*/%ar)
}

%cond2 (p2: (s32[], s32[], f32[8])) -> pred[] {
  %p2 = (s32[], s32[], f32[8]{0}) parameter(0)
  %i2 = s32[] get-tuple-element(%p2), index=0
  %n2 = s32[] get-tuple-element(%p2), index=1
  ROOT %lt2 = pred[] compare(%i2, %n2), direction=LT
}

%body2 (q: (s32[], s32[], f32[8])) -> (s32[], s32[], f32[8]) {
  %q = (s32[], s32[], f32[8]{0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] get-tuple-element(%q), index=1
  %y = f32[8]{0} get-tuple-element(%q), index=2
  %one2 = s32[] constant(1)
  %j1 = s32[] add(%j, %one2)
  %ar2 = f32[8]{0} all-reduce(%y), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  ROOT %t2 = (s32[], s32[], f32[8]{0}) tuple(%j1, %n, %ar2)
}

ENTRY %main (a: f32[8], n0: s32[]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %n0 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %copy.z = s32[] copy(%zero)
  %copy.zz = s32[] copy(%copy.z)
  %init = (s32[], f32[8]{0}) tuple(%copy.zz, %a)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_induction_variable":{"tuple_index":"0"}}
  %init2 = (s32[], s32[], f32[8]{0}) tuple(%zero, %n0, %a)
  %w2 = (s32[], s32[], f32[8]{0}) while(%init2), condition=%cond2, body=%body2
  ROOT %r = f32[8]{0} get-tuple-element(%w2), index=2
}
"""


def test_a_loop_without_a_known_trip_count_is_counted_from_its_induction_variable():
    """59 runs of the peeled loop's all-reduce (32 B x 2 (P-1)/P = 32 B each), one of the
    loop whose bound the loop carries; the same text with the count written gives the same."""
    wire = hlo.collective_bytes(PEELED, device_domain=[0, 0])
    assert wire["ops"] == {"all-reduce": 60} and wire["by_kind"] == {"all-reduce": 60 * 32.0}
    known = PEELED.replace('"known_induction_variable":{"tuple_index":"0"}', '"known_trip_count":{"n":"59"}')
    assert hlo.collective_bytes(known, device_domain=[0, 0]) == wire
    for start, bound, direction, runs in ((3, 59, "LT", 56), (0, 59, "LE", 60), (60, 59, "LT", 0)):
        text = PEELED.replace("constant(0)", f"constant({start})").replace("constant(59)", f"constant({bound})")
        text = text.replace("direction=LT\n}", f"direction={direction}\n}}", 1)
        assert hlo.collective_bytes(text, device_domain=[0, 0])["ops"] == {"all-reduce": runs + 1}, (start, direction)


# Async collectives as XLA:GPU prints them, `((operands...), results)`, each beside the same collective
# written synchronously: a reduce-scatter (its result 1/4 of its operand), a combined all-gather of
# two arrays, an all-reduce, a collective-permute, an all-to-all; 4 peers.
ASYNC = """HloModule m, is_scheduled=true

ENTRY %main (a: f32[64,16], b: bf16[4,8], c: bf16[2,8], d: f32[32]) -> f32[16,16] {
  %a = f32[64,16]{1,0} parameter(0)
  %b = bf16[4,8]{1,0} parameter(1)
  %c = bf16[2,8]{1,0} parameter(2)
  %d = f32[32]{0} parameter(3)
  %reduce-scatter-start = ((f32[64,16]{1,0}), f32[16,16]{1,0}) reduce-scatter-start(%a), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
  %reduce-scatter-done = f32[16,16]{1,0} reduce-scatter-done(%reduce-scatter-start)
  %reduce-scatter.s = f32[16,16]{1,0} reduce-scatter(%a), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
  %all-gather-start = ((bf16[4,8]{1,0}, bf16[2,8]{1,0}), (bf16[16,8]{1,0}, bf16[8,8]{1,0})) all-gather-start(%b, %c), channel_id=3, replica_groups=[1,4]<=[4], dimensions={0}
  %all-gather-done = (bf16[16,8]{1,0}, bf16[8,8]{1,0}) all-gather-done(%all-gather-start)
  %all-gather.s = (bf16[16,8]{1,0}, bf16[8,8]{1,0}) all-gather(%b, %c), channel_id=4, replica_groups=[1,4]<=[4], dimensions={0}
  %all-reduce-start = ((f32[32]{0}), f32[32]{0}) all-reduce-start(%d), channel_id=5, replica_groups=[1,4]<=[4], to_apply=%add
  %all-reduce-done = f32[32]{0} all-reduce-done(%all-reduce-start)
  %all-reduce.s = f32[32]{0} all-reduce(%d), channel_id=6, replica_groups=[1,4]<=[4], to_apply=%add
  %collective-permute-start = ((f32[32]{0}), f32[32]{0}) collective-permute-start(%d), channel_id=7, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %collective-permute-done = f32[32]{0} collective-permute-done(%collective-permute-start)
  %collective-permute.s = f32[32]{0} collective-permute(%d), channel_id=8, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %all-to-all-start = ((f32[32]{0}), f32[32]{0}) all-to-all-start(%d), channel_id=9, replica_groups=[1,4]<=[4], dimensions={0}
  %all-to-all-done = f32[32]{0} all-to-all-done(%all-to-all-start)
  ROOT %all-to-all.s = f32[32]{0} all-to-all(%d), channel_id=10, replica_groups=[1,4]<=[4], dimensions={0}
}
"""


def test_an_async_collective_counts_its_results_as_the_synchronous_one_does():
    rows = {r["name"]: r for r in hlo.collective_ops(ASYNC, [0, 0, 0, 0])}
    pairs = [("reduce-scatter-start", "reduce-scatter.s"), ("all-gather-start", "all-gather.s")]
    pairs += [(f"{k}-start", f"{k}.s") for k in ("all-reduce", "collective-permute", "all-to-all")]
    for start, sync in pairs:
        assert rows[start]["bytes"] == rows[sync]["bytes"] > 0, (start, rows[start]["bytes"], rows[sync]["bytes"])
    assert rows["reduce-scatter.s"]["bytes"] == 3 * 16 * 16 * 4  # (P-1) x its result
    assert rows["all-gather.s"]["bytes"] == 3 / 4 * (16 + 8) * 8 * 2  # (P-1)/P of both results
