"""maxmoe.analysis.planner against hand-worked cases.

A made-up system keeps the arithmetic readable: 1,000 TFLOP/s bf16, 100 GB of HBM at 1 TB/s,
500 GB/s NVLink and 100 GB/s scale-out per GPU. Unless a case says otherwise, compute runs
at efficiency 0.5 and links at full bandwidth with no latency, so 1e15 FLOP take 2 s.
"""

import dataclasses
from pathlib import Path

import pytest
from planner_system import IDEAL, SYSTEM, gemm

from maxmoe.analysis.dry_run import as_on_gpu, pipeline_report, step_workload
from maxmoe.analysis.flops import flops_per_token, pipeline_piece_flops_per_token
from maxmoe.analysis.planner import (
    GB,
    KINDS,
    SYSTEMS,
    Assumptions,
    Collective,
    Workload,
    collective_seconds,
    optimizer_bytes,
    pipeline_compute_scale,
    predict,
    report,
    retention,
    scale_replicas,
    workload_from_ops,
)
from maxmoe.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def workload(*collectives, flops=1e15, compute=None, **kwargs):
    return Workload(flops, 1_000_000, 8, collectives, compute=compute or (gemm(flops),), **kwargs)


def test_pure_compute():
    p = predict(workload(), SYSTEM, IDEAL)
    assert p.step_s == pytest.approx(2.0)
    assert p.tokens_per_s == pytest.approx(500_000)
    assert p.tflops_per_gpu == pytest.approx(500.0)  # 1e15 FLOP in 2 s
    assert p.mfu == pytest.approx(0.5)
    assert p.bound == "compute" and p.fits


def test_fp8_peak_halves_compute_time():
    p = predict(workload(compute=(gemm(1e15, "fp8"),)), SYSTEM, IDEAL)
    assert p.step_s == pytest.approx(1.0)  # 1e15 / (2e15 x 0.5)
    assert p.mfu == pytest.approx(0.5)  # against the FP8 peak the GEMMs run at: 0.5 s of peak in 1 s
    assert p.mfu_bf16_peak == pytest.approx(1.0)  # 1,000 TFLOP/s against the bf16 peak


def test_fp8_gemms_run_at_the_fp8_peak_and_the_rest_at_bf16():
    # Half of 1e15 FLOP in FP8 GEMMs: 0.5e15 / 1e15 + 0.5e15 / 2e15 = 0.75 s of peak, 1.5 s at 0.5.
    p = predict(workload(compute=(gemm(0.5e15, "fp8"), gemm(0.5e15))), SYSTEM, IDEAL)
    assert p.step_s == pytest.approx(1.5)
    assert p.tflops_per_gpu == pytest.approx(1000 / 1.5)
    assert p.mfu == pytest.approx(0.75 / 1.5)  # 0.75 s at the peaks of each class's precision
    assert p.mfu_bf16_peak == pytest.approx(1 / 1.5)
    assert p.contributions["compute"] == pytest.approx(1.5)


@pytest.mark.parametrize(
    "recipe, system, routed_fp8",
    [("none", "h200", None), ("blockwise", "h200", True), ("tensorwise", "h200", False), ("mxfp8", "h200", None)]
    + [("mxfp8", "gb300", False), ("blockwise", "gb300", True)],
)
def test_dry_run_workload_credits_fp8_only_where_fp8_runs(recipe, system, routed_fp8):
    """671B on 256 devices: the FP8 GEMMs' share of the FLOPs, by hand from the architecture
    numbers (attention projections, dense MLPs, shared + 8 routed experts, main model and MTP).
    None: no FP8 at all (mxfp8 on Hopper runs its dequantised values in bf16); False: every
    class but the routed experts, whose grouped kernels run bf16 under tensorwise and mxfp8."""
    files = [str(ROOT / "configs" / n) for n in ("deepseek_v3_671b.yaml", "mesh_256_h200.yaml")]
    config = load_config(files, [f"model.fp8={recipe}", "model.remat=none", "train.loss_chunk=0"])
    w = step_workload(config, [], 256, 0.0, None, system)
    tokens = config.train.batch_size * config.train.seq_len
    assert w.flops_per_device == pytest.approx(flops_per_token(config.model, config.train.seq_len) * tokens / 256)
    d, q, kv, h = 7168, 1536, 512, 128
    attention = d * q + q * h * 192 + d * (kv + 64) + kv * h * 256 + h * 128 * d
    dense = 6 * ((61 + 1) * attention + 3 * 3 * d * 18432 + (58 + 1) * 1 * 3 * d * 2048)  # 61 layers + MTP
    routed = 6 * (58 + 1) * 8 * 3 * d * 2048
    fp8 = 0 if routed_fp8 is None else dense + (routed if routed_fp8 else 0)
    in_fp8 = sum(c.model_flops for c in w.compute if c.peak == "fp8")
    assert in_fp8 == pytest.approx(fp8 * tokens / 256, rel=1e-12)
    assert sum(c.model_flops for c in w.compute) == pytest.approx(w.flops_per_device, rel=1e-12)
    # remat none, whole logits: nothing runs twice; only the kernels' overheads add to the executed
    assert all(c.executed_flops == pytest.approx(c.model_flops * c.overhead, rel=1e-12) for c in w.compute)
    uniform = Assumptions(compute_efficiency=0.5)
    bf16 = dataclasses.replace(w, compute=tuple(dataclasses.replace(c, peak="bf16") for c in w.compute))
    assert (predict(w, SYSTEMS[system], uniform).step_s < predict(bf16, SYSTEMS[system], uniform).step_s) == (
        routed_fp8 is not None
    )


def test_once_per_step_cross_domain_traffic_is_exposed():
    # 100 GB at 100 GB/s = 1 s outside the loop: nothing to hide behind, 2 + 1 s.
    p = predict(workload(Collective("reduce-scatter", "scale_out", 100 * GB, 1, 4, "step")), SYSTEM, IDEAL)
    assert p.step_s == pytest.approx(3.0)
    assert p.contributions["cross-domain traffic"] == pytest.approx(1.0)
    assert p.bound == "compute"
    # 300 GB: 3 s, more than the 2 s of compute: the traffic bounds the step.
    p = predict(workload(Collective("reduce-scatter", "scale_out", 300 * GB, 1, 4, "step")), SYSTEM, IDEAL)
    assert p.step_s == pytest.approx(5.0)
    assert p.bound == "cross-domain traffic"


def test_overlapped_traffic_costs_its_exposed_part_until_it_outlasts_compute():
    # 500 GB over NVLink at 500 GB/s = 1 s in the loop, 90% hidden: 2 + 0.1 s.
    p = predict(workload(Collective("all-gather", "scale_up", 500 * GB, 10, 8)), SYSTEM, IDEAL)
    assert p.step_s == pytest.approx(2.1)
    # 2,500 GB = 5 s in the backward pass: 4.5 s hidden is longer than the backward's 4/3 s of
    # compute (2/3 of 2 s): the backward takes 4.5 s, the forward 2/3 s, plus 0.5 s exposed.
    p = predict(workload(Collective("all-gather", "scale_up", 2500 * GB, 10, 8)), SYSTEM, IDEAL)
    assert p.step_s == pytest.approx(2 / 3 + 4.5 + 0.5)
    assert p.contributions["scale-up traffic"] == pytest.approx(0.5 + 4.5 - 4 / 3)  # exposed + beyond compute
    assert p.bound == "scale-up traffic"


def test_the_expert_all_to_all_is_exposed_and_named():
    p = predict(workload(Collective("all-to-all", "scale_up", 1500 * GB, 100, 64)), SYSTEM, IDEAL)
    assert p.step_s == pytest.approx(5.0)  # 2 + 1,500 / 500
    assert p.bound == "expert all-to-all"


def test_latency_counts_hops():
    a = Assumptions(latency_s=(("scale_up", 10e-6), ("scale_out", 10e-6)))
    gather = Collective("all-gather", "scale_out", 0.0, 10, 4, "step")
    reduce = Collective("all-reduce", "scale_out", 0.0, 10, 4, "step")
    a2a = Collective("all-to-all", "scale_up", 0.0, 10, 64)
    assert collective_seconds(gather, SYSTEM, a) == pytest.approx(10 * 3 * 10e-6)  # P - 1 hops
    assert collective_seconds(reduce, SYSTEM, a) == pytest.approx(10 * 4 * 10e-6)  # a tree: log2 4 up, log2 4 down
    assert collective_seconds(a2a, SYSTEM, a) == pytest.approx(10 * 10e-6)  # every peer at once


def test_link_efficiency_divides_bandwidth():
    links = tuple(((tier, k), 0.8 if tier == "scale_up" else 0.5) for tier in ("scale_up", "scale_out") for k in KINDS)
    a = Assumptions(link_efficiency=links, latency_s=(("scale_up", 0.0), ("scale_out", 0.0)))
    out = Collective("all-gather", "scale_out", 100 * GB, 1, 2, "step")
    up = Collective("all-gather", "scale_up", 400 * GB, 1, 2)
    assert collective_seconds(out, SYSTEM, a) == pytest.approx(2.0)  # 100 / (100 x 0.5)
    assert collective_seconds(up, SYSTEM, a) == pytest.approx(1.0)  # 400 / (500 x 0.8)


def test_throughput_per_gpu_falls_as_cross_domain_bytes_grow():
    for phase in ("step", "loop"):
        tflops = [
            predict(workload(Collective("reduce-scatter", "scale_out", b * GB, 6, 4, phase)), SYSTEM).tflops_per_gpu
            for b in (0, 10, 100, 1000, 10_000)
        ]
        assert all(x > y for x, y in zip(tflops[1:], tflops[2:])), (phase, tflops)
        assert tflops[1] <= tflops[0] and tflops[-1] < tflops[0] / 5, (phase, tflops)
    # Default link assumptions, once per step (exposed): 3 ring hops of 5 us, and 10 GB at
    # 100 GB/s x 0.85 link efficiency, after 2 s of compute (compute efficiency 0.5).
    uniform = Assumptions(compute_efficiency=0.5)
    p = predict(workload(Collective("reduce-scatter", "scale_out", 10 * GB, 1, 4, "step")), SYSTEM, uniform)
    assert p.step_s == pytest.approx(2.0 + 3 * 5e-6 + 10 / 85)


def test_retention_from_4_to_16_replicas():
    # R = 4: a reduce-scatter of a 100 GB buffer moves 3/4 x 100 = 75 GB: 0.75 s, step 2.75 s.
    # R = 16: 15/16 x 100 = 93.75 GB: 0.9375 s, step 2.9375 s. Per GPU: 2.75 / 2.9375.
    small = workload(Collective("reduce-scatter", "scale_out", 75 * GB, 1, 4, "step"))
    large = scale_replicas(small, 4)
    assert large.devices == 32 and large.tokens_per_step == 4_000_000
    assert large.collectives[0].bytes == pytest.approx(93.75 * GB) and large.collectives[0].peers == 16
    assert retention(small, large, SYSTEM, IDEAL) == pytest.approx(2.75 / 2.9375)
    assert report(small, SYSTEM, IDEAL)["retention_at_32_devices"] == pytest.approx(2.75 / 2.9375)


def test_memory_that_does_not_fit_bounds_the_step():
    p = predict(workload(memory_bytes=120 * GB), SYSTEM, IDEAL)
    assert not p.fits and p.bound == "memory (does not fit)"


def test_optimizer_hbm_time_is_added():
    # 1e12 params over 56 devices: 28 B each = 500 GB read and written at 1 TB/s = 0.5 s.
    assert optimizer_bytes(1e12, 56) == pytest.approx(500 * GB)
    p = predict(workload(optimizer_bytes=500 * GB), SYSTEM, IDEAL)
    assert p.step_s == pytest.approx(2.5) and p.contributions["memory"] == pytest.approx(0.5)


def test_hlo_rows_group_by_tier_kind_and_phase():
    def row(kind, runs, size, peers, cross):
        return {"kind": kind, "runs": runs, "bytes": size, "peers": peers, "cross_domain": cross}

    rows = [
        row("all-gather", 1, 8.0, 4, True),
        row("all-gather", 1, 4.0, 4, True),
        row("reduce-scatter", 1, 6.0, 4, True),
        row("all-to-all", 12, 24.0, 8, False),
        row("all-to-all", 12, 24.0, 8, False),
        row("all-gather", 1, 1.0, 2, False),
    ]
    w = workload_from_ops(rows, 1e12, 100, 8)
    got = {(c.tier, c.kind, c.phase, c.pass_): (c.bytes, c.launches, c.peers) for c in w.collectives}
    assert got == {  # rows without in_loop and pass: looped when they run more than once; backward
        ("scale_out", "all-gather", "step", "backward"): (12.0, 2, 4),
        ("scale_out", "reduce-scatter", "step", "backward"): (6.0, 1, 4),
        ("scale_up", "all-to-all", "loop", "backward"): (48.0, 24, 8),
        ("scale_up", "all-gather", "step", "backward"): (1.0, 1, 2),
    }


def test_dry_run_counts_what_the_gpu_moves():
    config = load_config([str(ROOT / "configs" / "tiny.yaml")], ["model.compute_dtype=bfloat16"])

    def row(name, kind, dtype, op_name, cross=True, promoted=False):
        return {"name": name, "kind": kind, "runs": 1, "bytes": 8.0, "bytes_per_run": 8.0, "peers": 4,
                "cross_domain": cross, "dtype": dtype, "op_name": op_name, "pass": "other",
                "promoted": promoted}  # fmt: skip

    # maxmoe.analysis.hlo_widened.narrowed_operands of the HLO: (operand bytes, compiled, narrowest on the way)
    narrowed = {
        "ag": [(8, "f32", "bf16")],  # a bf16 weight copy XLA:CPU gathers in f32
        "a2a": [(4, "f32", "bf16"), (4, "f32", "f32")],  # a combined op, one operand bf16 values
        "fp8": [(8, "f16", "f8e4m3fn")],  # moe.fp8_dispatch's e4m3 rows, sent as f16
        "ar": [(8, "f32", "bf16")],  # a reduction: its reducer says, not its operand
    }
    rows, notes = as_on_gpu(
        [
            row("ag", "all-gather", "f32", "jit(train_step)/compute_copy/sharding_constraint"),
            row("ag32", "all-gather", "f32", "jit(train_step)/float32_copy/sharding_constraint"),  # f32 values
            row("a2a", "all-to-all", "f32", "jit(train_step)/moe", cross=False),
            row("fp8", "all-to-all", "f16", "jit(train_step)/moe", cross=False),
            row("z1", "all-reduce", "f32", "jit(train_step)/(reduce_sum:reduce_to_zero1/reduce_sum:reduce_to_zero1)"),
            row("ar", "all-reduce", "f32", "jit(train_step)/reduce_sum", promoted=True),
            row("sum", "all-reduce", "f32", "jit(train_step)/reduce_sum"),  # a scalar, stays an all-reduce
        ],
        config,
        narrowed=narrowed,
    )
    assert [(r["kind"], r["dtype"], r["bytes"]) for r in rows] == [
        ("all-gather", "bf16", 4.0),
        ("all-gather", "f32", 8.0),
        ("all-to-all", "bf16", 6.0),
        ("all-to-all", "f8e4m3fn", 4.0),
        ("reduce-scatter", "f32", 4.0),
        ("all-reduce", "bf16", 4.0),
        ("all-reduce", "f32", 8.0),
    ]
    assert len(notes) == 3


def test_system_table():
    for s in SYSTEMS.values():
        assert s.peak_fp8_tflops == pytest.approx(2 * s.peak_bf16_tflops, rel=1e-3)
        assert s.domain_gpus in (8, 72)
    assert SYSTEMS["gb300"].scale_out_gb_s == pytest.approx(800 / 8)  # ConnectX-8, 800 Gb/s
    assert SYSTEMS["h100"].scale_out_gb_s == pytest.approx(400 / 8)  # ConnectX-7, 400 Gb/s
    assert SYSTEMS["gb300"].scale_up_gb_s == pytest.approx(1800 / 2)  # NVLink 5: 1.8 TB/s both ways


PIECES = {"dense_layer": 1.5, "moe_layer": 1.0, "head": 2.0, "mtp": 3.0}


def test_pipeline_of_equal_chunks_costs_the_bubble_only():
    # 2 stages x 1 chunk, 4 MoE layers each, no dense layers, head or MTP: work 4 and 4.
    out = pipeline_compute_scale({**PIECES, "head": 0.0, "mtp": 0.0}, [[0, 0]], [[4, 4]], bubble=0.2)
    assert out["stage_imbalance"] == pytest.approx(1.0)
    assert out["compute_scale"] == pytest.approx(1.25)  # 1 / (1 - 0.2)


def test_pipeline_places_mtp_on_the_first_stage_and_the_head_on_the_last():
    # 4 stages x 1 chunk of 2 slots, 2 dense + 3 MoE layers, 2 empty slots in front:
    # [e e | d0 d1 | m0 m1 | m2 e]. Work: stage 0: MTP 3; stage 1: 2 x 1.5 = 3; stage 2: 2;
    # stage 3: 1 + head 2 = 3. Mean 11 / 4 = 2.75, busiest 3 (stage 0 first); bubble 0.25.
    out = pipeline_compute_scale(PIECES, [[0, 2, 0, 0]], [[0, 0, 2, 1]], bubble=0.25)
    assert out["stage_imbalance"] == pytest.approx(3 / 2.75)
    assert out["compute_scale"] == pytest.approx(3 / 2.75 / 0.75)
    assert out["busiest_chunk"] == [0, 0] and out["chunk_work"] == [[3.0, 3.0, 2.0, 3.0]]


def test_pipeline_extra_work_sits_on_the_first_and_last_chunk():
    # 2 stages x 2 chunks [V][P]: MTP on (v0, p0), the head on (v1, p1).
    # Work: v0: 1.5 + 1 + 3 = 5.5, 2; v1: 2, 2 + 2 = 4. Mean 13.5 / 4; busiest 5.5.
    out = pipeline_compute_scale(PIECES, [[1, 0], [0, 0]], [[1, 2], [2, 2]], bubble=0.1)
    assert out["stage_imbalance"] == pytest.approx(5.5 / 3.375)
    assert out["compute_scale"] == pytest.approx(5.5 / 3.375 / 0.9)


def test_pipeline_pieces_are_the_model_flops_with_what_runs_again():
    """Without recompute and with whole logits the pieces add up to flops_per_token; remat full
    runs every layer's GEMMs forward again but the down projections of the dense MLP and the
    shared experts (+1/3 less those), the chunked loss the head's (+1/3), MTP neither."""
    m = load_config([ROOT / "configs/deepseek_v3_671b.yaml"]).model
    plain = pipeline_piece_flops_per_token(dataclasses.replace(m, remat="none"), 4096, loss_chunk=0)
    total = 3 * plain["dense_layer"] + 58 * plain["moe_layer"] + plain["head"] + plain["mtp"]
    assert total == pytest.approx(flops_per_token(m, 4096), rel=1e-12)
    full = pipeline_piece_flops_per_token(dataclasses.replace(m, remat="full"), 4096, loss_chunk=16384)
    down = {"dense_layer": 2 * 7168 * 18432, "moe_layer": 2 * 7168 * 2048, "head": 0}
    for piece in ("dense_layer", "moe_layer", "head"):
        assert full[piece] == pytest.approx(4 / 3 * plain[piece] - down[piece], rel=1e-12)
    assert full["mtp"] - plain["mtp"] == pytest.approx(full["head"] - plain["head"], rel=1e-12)


def test_h200_plan_stages_are_balanced():
    """configs/mesh_256_h200.yaml, by hand (GFLOP per token at 4,096 tokens, executed, remat full):
    a MoE layer 6 x (187,105,280 attention + 396,361,728 active experts + 1,835,008 router
    parameters) + 503.3 core = 4.0151, x 4/3 less the shared expert's down projection (2 x 7168 x
    2048, not run again) = 5.3241; a dense layer's MLP has the active experts' 396,361,728
    parameters with no router: 4.0041, x 4/3 less its down projection (2 x 7168 x 18432) = 5.0746;
    the head 6 x 7168 x 129,280 = 5.5601, x 4/3 (chunked loss) = 7.4134; MTP 12 x 7168^2 = 0.6166
    + 4.0151 + 7.4134 = 12.0451. Total 3 x 5.0746 + 58 x 5.3241 + 7.4134 + 12.0451 = 343.483 over
    32 stages: 10.734. 2 empty slots in front: stage 0 MTP alone (12.045), stage 1 two dense
    layers, stage 2 the last dense and MoE layer 0, stages 3-30 two MoE layers (10.648), stage 31
    MoE layer 57 and the head (12.738): 1.187 x the mean."""
    config = load_config(
        [ROOT / "configs/deepseek_v3_671b.yaml", ROOT / "configs/mesh_256_h200.yaml"], ["run.cpu_devices=256"]
    )
    report = pipeline_report(config)
    assert report["slots_per_chunk"] == 2 and report["padding_slots"] == 3
    assert report["busiest_chunk"] == [0, 31]
    assert report["stage_imbalance"] == pytest.approx(12.7376 / 10.7338, rel=2e-4)
    assert report["stage_imbalance"] <= 1.3
    work = report["chunk_work"][0]  # in executed MoE layers
    assert work[0] == pytest.approx(12.0451 / 5.3241, rel=2e-4) and work[3:31] == pytest.approx([2.0] * 28)
    assert report["bubble"] == pytest.approx(31 / (192 + 31))


def test_pipeline_bubble_is_a_step_part():
    # 1e15 FLOP = 2 s of compute; imbalance 1.5 adds 1 s to the stages' timeline, and 2 s of
    # hideable backward traffic hides under the backward's 2 s of timeline (2/3 of 3 s) but would
    # not under its 1.33 s of work.
    traffic = Collective("all-gather", "scale_up", 1000 * GB, 10, 8, "loop")
    a = dataclasses.replace(IDEAL, overlap=((("scale_up", "all-gather", "loop"), 1.0),))
    p = predict(workload(traffic, stage_imbalance=1.5), SYSTEM, a)
    assert p.contributions["compute"] == pytest.approx(2.0)
    assert p.contributions["stage imbalance"] == pytest.approx(1.0)
    assert p.contributions["scale-up traffic"] == pytest.approx(0.0)
    assert p.step_s == pytest.approx(3.0)
    assert p.tflops_per_gpu == pytest.approx(1e15 / 3.0 / 1e12)
    p = predict(workload(bubble=2 / 3), SYSTEM, IDEAL)
    assert p.bound == "pipeline bubble" and p.step_s == pytest.approx(6.0)


def test_h200_plan_in_fp8_weighs_each_class_at_its_rate():
    """The same plan with model.fp8=blockwise on an H200, every class at efficiency 0.5 (FP8 peak
    2 x bf16's) and XLA's chunked core (n = 8 blocks of 512: 9/8 of the causal FLOPs run):
    attention projections, dense MLPs and experts at the FP8 peak, the core, router, head and
    MTP's projection at bf16's. In bf16 GFLOP per token: a MoE layer (1.1226 + 2.3782) / 2 +
    0.5033 x 9/8 + 0.0110 = 2.3276, and its recompute (0.3742 + 0.7927 - 0.0294) / 2 + 0.1678 x
    9/8 + 0.0037 = 0.7612: 3.0888; a dense layer 2.3166 + 0.6401 = 2.9567; the head 7.4134 as in
    bf16; MTP 0.6166 + 2.3276 + 7.4134 = 10.3576. Total 3 x 2.9567 + 58 x 3.0888 + 7.4134 +
    10.3576 = 205.794 over 32: 6.4311. Stage 31 (MoE layer 57 and the head): 10.5023, 1.633 x the
    mean; the head and MTP do not shrink with FP8, the layers do."""
    config = load_config(
        [ROOT / "configs/deepseek_v3_671b.yaml", ROOT / "configs/mesh_256_h200.yaml"],
        ["run.cpu_devices=256", "model.fp8=blockwise", "model.attention=chunked"],
    )
    on_h200 = pipeline_report(config, "h200", Assumptions(compute_efficiency=0.5))
    assert on_h200["busiest_chunk"] == [0, 31]
    assert on_h200["stage_imbalance"] == pytest.approx(10.5023 / 6.4311, rel=2e-4)
    assert on_h200["chunk_work"][0][0] == pytest.approx(10.3576 / 3.0888, rel=2e-4)
    assert pipeline_report(config)["stage_imbalance"] == pytest.approx(12.7376 / 10.7338, rel=2e-4)  # FLOPs alone


def test_dry_run_reports_the_chunks_of_its_slot_layout():
    # 1 dense + 4 MoE layers, 2 stages x 2 chunks, 1 empty slot in front: 2 slots per chunk,
    # chunk v*P + p holds slots 2c, 2c+1 of [empty, D0, L0, L1, L2, L3, empty, empty]:
    # dense [V][P] = [[1, 0], [0, 0]], MoE [[0, 2], [2, 0]].
    config = load_config(
        [ROOT / "configs/tiny.yaml"],
        [
            "model.num_layers=5",
            "mesh.pipeline=2",
            "mesh.pipeline_virtual=2",
            "mesh.pipeline_pad_front=1",
            "train.grad_accum=4",
            "run.cpu_devices=2",
        ],
    )
    report = pipeline_report(config)
    pieces = pipeline_piece_flops_per_token(config.model, config.train.seq_len, config.train.loss_chunk)
    want = pipeline_compute_scale(pieces, [[1, 0], [0, 0]], [[0, 2], [2, 0]], report["bubble"])
    assert report["compute_scale"] == pytest.approx(want["compute_scale"])
    assert report["stage_imbalance"] == pytest.approx(want["stage_imbalance"])
    assert report["ring_slots"] == 2 * 2 + 2  # MTP's tail: one item more than P*V + P - 1
