"""maxmoe.hlo: collective counts in StableHLO, replica groups and bytes on the wire in compiled HLO."""

from maxmoe import hlo

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
  %ar = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ar)
}

ENTRY %main (a: f32[8]) -> f32[16] {
  %a = f32[8]{0} parameter(0)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %ag = f32[16]{0} all-gather(%a), channel_id=2, replica_groups={{0,2},{1,3}}, dimensions={0}
}
"""


def test_collective_bytes_counts_loops_and_domains():
    wire = hlo.collective_bytes(HLO, device_domain=[0, 0, 1, 1])
    # all-reduce: 32 B x 2 (P-1)/P = 32 B per run, 5 runs; all-gather: 64 B x 1/2.
    assert wire["by_kind"] == {"all-reduce": 160.0, "all-gather": 32.0}
    assert wire["ops"] == {"all-reduce": 5, "all-gather": 1}
    assert wire["cross_domain"] == {"all-gather": 32.0}  # groups {0,2}, {1,3} span both domains
