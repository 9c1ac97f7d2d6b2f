"""What the planner charges, against hand-worked cases: combined launches, executed and FP8 FLOPs,
link efficiency per kind, hidden traffic per pass, the binding term, bubble and imbalance apart,
assumptions by name (`sweep --assume`, `--replan`) and the system's memory for `fits`.

The made-up system of tests/planner_system.py: 1,000 TFLOP/s bf16 (2,000 fp8), 100 GB of HBM at
1 TB/s, 500 GB/s NVLink and 100 GB/s scale-out per GPU; compute at efficiency 0.5, so 1e15 FLOP
take 2 s.
"""

import dataclasses
import json
from pathlib import Path

import pytest
from planner_system import IDEAL, SYSTEM, gemm

from maxmoe import sweep
from maxmoe.analysis import assumptions as assumptions_lib
from maxmoe.analysis.dry_run import combine_thresholds, step_workload
from maxmoe.analysis.flops import (
    PEAK_TFLOPS_BF16,
    context_flops_per_token,
    flops_per_token_by_class,
    recompute_flops_per_token,
)
from maxmoe.analysis.hlo import collective_ops, dot_flops_by_pass
from maxmoe.analysis.planner import (
    GB,
    SYSTEMS,
    Assumptions,
    Collective,
    Workload,
    collective_seconds,
    combine_bins,
    predict,
    workload_from_ops,
)
from maxmoe.config import load_config

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def workload(*collectives, flops=1e15, compute=None, **kwargs):
    return Workload(flops, 1_000_000, 8, collectives, compute=compute or (gemm(flops),), **kwargs)


def row(kind, size, peers=4, runs=10, computation="body", pass_="backward", cross=False, in_loop=True):
    """A collective_ops row whose result is `size` bytes (bytes_per_run: the ring's share of it)."""
    factor = {"all-gather": (peers - 1) / peers, "reduce-scatter": peers - 1, "all-reduce": 2 * (peers - 1) / peers}
    moved = size * factor.get(kind, (peers - 1) / peers)
    return {"kind": kind, "runs": runs, "bytes_per_run": moved, "bytes": moved * runs, "peers": peers,
            "cross_domain": cross, "pass": pass_, "computation": computation, "in_loop": in_loop}  # fmt: skip


def test_launches_are_counted_after_xla_gpu_combining():
    # Three 1 GB gathers and one 3 GB gather of one loop body, threshold 2 GB, packed in order:
    # [1 + 1], [1], [3]: 3 launches per run, 10 runs. Another body's gather is not merged with
    # them; all-to-alls are never combined (one launch per op and run).
    rows = [row("all-gather", s * GB) for s in (1, 1, 1, 3)]
    rows += [row("all-gather", 1 * GB, computation="other_body"), row("all-to-all", 1 * GB), row("all-to-all", 1 * GB)]
    w = workload_from_ops(rows, 1e15, 100, 8, combine_bytes={"all-gather": 2 * GB})
    launches = {c.kind: c.launches for c in w.collectives}
    assert launches == {"all-gather": 3 * 10 + 10, "all-to-all": 2 * 10}
    assert combine_bins([1, 1, 1, 3], 2) == 3 and combine_bins([1, 1, 1, 3], 0) == 4
    # Without combining (XLA:CPU's program, as the planner counted before): 5 launches per run.
    uncombined = workload_from_ops(rows, 1e15, 100, 8)
    assert {c.kind: c.launches for c in uncombined.collectives}["all-gather"] == 50
    # The latency charged follows: 40 launches x 3 ring hops x 2 us.
    gather = next(c for c in w.collectives if c.kind == "all-gather")
    a = dataclasses.replace(IDEAL, latency_s=(("scale_up", 2e-6), ("scale_out", 5e-6)))
    assert collective_seconds(gather, SYSTEM, a) == pytest.approx(40 * 3 * 2e-6 + gather.bytes / (500 * GB))


def test_combine_thresholds_are_the_profiles():
    assert combine_thresholds("gb300") == {k: 2 * 1024 * MIB for k in ("all-gather", "reduce-scatter", "all-reduce")}
    assert combine_thresholds("h200") == {k: 512 * MIB for k in ("all-gather", "reduce-scatter", "all-reduce")}
    assert combine_thresholds(None) == {}


def test_a_collective_inside_a_loop_is_a_loop_collective_even_when_it_runs_once():
    # grad_accum = 1 and one layer: the loop body runs once, but its gather sits beside compute.
    w = workload_from_ops([row("all-gather", GB, runs=1), row("all-gather", GB, runs=1, in_loop=False)], 1e15, 1, 8)
    assert sorted(c.phase for c in w.collectives) == ["loop", "step"]


def test_in_loop_and_dot_flops_by_pass_from_hlo():
    text = """HloModule m

body {
  p = (s32[], f32[8,4]) parameter(0)
  x = f32[8,4] get-tuple-element(p), index=1
  w = f32[4,4] constant({...})
  d = f32[8,4] dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/transpose(jvp(g))/dot"}
  ag = f32[8,4] all-gather(x), replica_groups={{0,1}}, dimensions={0}
  i = s32[] get-tuple-element(p), index=0
  ROOT t = (s32[], f32[8,4]) tuple(i, d)
}

cond {
  p = (s32[], f32[8,4]) parameter(0)
  ROOT c = pred[] constant(true)
}

ENTRY main {
  a = f32[8,4] parameter(0)
  w = f32[4,4] constant({...})
  f = f32[8,4] dot(a, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/jvp(g)/dot"}
  z = s32[] constant(0)
  t = (s32[], f32[8,4]) tuple(z, f)
  l = (s32[], f32[8,4]) while(t), condition=cond, body=body, backend_config={"known_trip_count":{"n":"1"}}
  ROOT ag2 = f32[8,4] all-gather(a), replica_groups={{0,1}}, dimensions={0}
}
"""
    rows = {r["name"]: r for r in collective_ops(text, [0, 0])}
    assert rows["ag"]["in_loop"] and rows["ag"]["runs"] == 1 and rows["ag"]["computation"] == "body"
    assert not rows["ag2"]["in_loop"]
    per_dot = 2 * 8 * 4 * 4
    assert dot_flops_by_pass(text) == {"forward": per_dot, "backward": per_dot, "other": 0.0}


def test_executed_flops_set_the_time_and_model_flops_the_throughput():
    # 1.3e15 executed (30% recompute) of 1e15 model FLOPs: 2.6 s; 1e15 / 2.6 s per GPU.
    p = predict(workload(compute=(gemm(1e15, executed=1.3e15),)), SYSTEM, IDEAL)
    assert p.step_s == pytest.approx(2.6)
    assert p.tflops_per_gpu == pytest.approx(1000 / 2.6)
    assert p.executed_tflops_per_gpu == pytest.approx(1300 / 2.6)
    assert p.mfu == pytest.approx(1.0 / 2.6)  # model FLOPs at the bf16 peak: 1 s


def test_remat_full_runs_the_scanned_layers_forward_again():
    """671B, remat full: a forward again of every GEMM of the main model's layers (not the head, not
    MTP) whose output the backward reads -- all but the down projections of the dense MLPs and the
    shared experts, whose outputs only enter sums -- by hand from the architecture numbers: +30.3%
    (the compiled dots of 2026-12-04: +30.6%). save_comm keeps the combine's rows: the routed
    experts' down projection does not run again either."""
    config = load_config([str(ROOT / "configs" / "deepseek_v3_671b.yaml")], ["model.remat=full"])
    d, q, kv, h, t, f = 7168, 1536, 512, 128, 4096, 2048
    attention = 2 * (d * q + q * h * 192 + d * (kv + 64) + kv * h * 256 + h * 128 * d) + t * h * (192 + 128)
    full = 61 * attention + 3 * 4 * d * 18432 + 58 * (2 * d * 256 + 8 * 6 * d * f + 4 * d * f)
    again = recompute_flops_per_token(config.model, t)
    assert sum(again.values()) == pytest.approx(full, rel=1e-12)
    total = sum(flops_per_token_by_class(config.model, t).values())
    assert sum(again.values()) / total == pytest.approx(0.303, abs=0.001)
    # In the planner's rows, useful FLOPs (executed over the kernel's overhead): model + remat +
    # the chunked loss's head projections again (main head and one MTP depth, 2 D V each).
    w = step_workload(config, [], 256, 0.0, None, "gb300")
    useful = sum(c.executed_flops / c.overhead for c in w.compute)
    tokens = config.train.batch_size * t / 256
    assert useful == pytest.approx((total + full + 2 * 2 * d * 129280) * tokens, rel=1e-12)
    comm = load_config([str(ROOT / "configs" / "deepseek_v3_671b.yaml")], ["model.remat=save_comm"])
    assert sum(recompute_flops_per_token(comm.model, t).values()) == pytest.approx(full - 58 * 8 * 2 * d * f)


def test_context_parallelism_charges_the_latent_cores_up_projections():
    """mesh.context = 2: each device up-projects both halves' latents to keys and values inside the
    core, forward, again backward, and both gradients: 8 x 2 u per token and attention block
    (u = 512 x 128 x (128 + 128)), plus 2 x 2 u where remat full runs a scanned layer's core
    again; the projection it replaces (6 u, 2 u more recomputed) leaves the attention class and
    its FP8 credit. Model FLOPs stay."""
    u = 512 * 128 * 256
    files = [str(ROOT / "configs" / "deepseek_v3_671b.yaml")]
    for remat, up, projection in (("none", 8 * 2 * 62, 6 * 62), ("full", 8 * 2 * 62 + 2 * 2 * 61, 6 * 62 + 2 * 61)):
        m = load_config(files, [f"model.remat={remat}"]).model
        assert context_flops_per_token(m, 2) == {"latent_up": up * u, "attention": -projection * u}
        assert context_flops_per_token(m, 1) == {}
    # In the planner's workload (remat full, the last case): the same per token, times the
    # tokens a device runs in a step.
    overrides = ["model.remat=full", "model.fp8=mxfp8", "mesh.data=4", "mesh.expert=32"]
    plain = load_config(files, overrides)
    split = load_config(files, overrides + ["mesh.context=2", "train.grad_accum=12"])
    tokens = plain.train.batch_size * plain.train.seq_len / 256
    a, b = step_workload(plain, [], 256, 0.0, None, "gb300"), step_workload(split, [], 256, 0.0, None, "gb300")
    assert b.flops_per_device == a.flops_per_device

    def executed(w, rows):
        return sum(c.executed_flops for c in w.compute if rows(c))

    moved = ("attention", "latent_up")
    assert executed(b, lambda c: c.name in moved) - executed(a, lambda c: c.name in moved) == pytest.approx(
        (up - projection) * u * tokens
    )
    in_fp8 = executed(b, lambda c: c.peak == "fp8") - executed(a, lambda c: c.peak == "fp8")
    assert in_fp8 == pytest.approx(-projection * u * tokens)  # mxfp8: attention is FP8


def test_recomputed_fp8_gemms_run_at_the_fp8_peak():
    # 1e15 model FLOPs, half of them FP8; the recompute adds 0.2e15, 0.1e15 of it FP8:
    # (0.6 / 1000 + 0.6 / 2000) / 1e12 / 0.5 = 1.8 s.
    w = workload(compute=(gemm(0.5e15, executed=0.6e15), gemm(0.5e15, "fp8", executed=0.6e15)))
    assert predict(w, SYSTEM, IDEAL).step_s == pytest.approx(1.8)


def test_link_efficiency_per_kind():
    a = Assumptions(latency_s=(("scale_up", 0.0), ("scale_out", 0.0)))
    a2a = Collective("all-to-all", "scale_up", 540 * GB, 1, 64)
    gather = Collective("all-gather", "scale_up", 720 * GB, 1, 64)
    gb300 = SYSTEMS["gb300"]
    assert collective_seconds(a2a, gb300, a) == pytest.approx(1.0)  # 540 / (900 x 0.6)
    assert collective_seconds(gather, gb300, a) == pytest.approx(1.0)  # 720 / (900 x 0.8)
    ragged = dataclasses.replace(a2a, kind="ragged-all-to-all")
    assert collective_seconds(ragged, gb300, a) == pytest.approx(1.0)


def test_hidden_traffic_must_fit_under_its_pass():
    # 1.5e15 FLOP: 3 s of compute, 1 s forward (a third), 2 s backward. A forward gather of
    # 1.5 s, all hidden, fits under 3 s but not under the forward's 1 s: 0.5 s extra.
    a = dataclasses.replace(IDEAL, overlap=((("scale_up", "all-gather", "loop"), 1.0),))
    gather = Collective("all-gather", "scale_up", 750 * GB, 10, 8, "loop", "forward")
    p = predict(workload(gather, flops=1.5e15), SYSTEM, a)
    assert p.step_s == pytest.approx(3.5)
    assert p.bound == "compute"  # the critical path: compute 2 s, traffic 1.5 s
    # 2.5 s in the forward pass: the traffic holds 2.5 s of the 4.5 s path, compute 2 s.
    gather = dataclasses.replace(gather, bytes=1250 * GB)
    p = predict(workload(gather, flops=1.5e15), SYSTEM, a)
    assert p.step_s == pytest.approx(4.5)
    assert p.critical["scale-up traffic"] == pytest.approx(2.5) and p.critical["compute"] == pytest.approx(2.0)
    assert p.bound == "scale-up traffic"


def test_bound_names_hidden_traffic_that_outlasts_compute():
    # The audit's case: 3 s of compute, 4 s of hidden backward traffic (beside 2 s of backward
    # compute): the step is 1 + 4 s; compute's 3 s is the largest step part, but the traffic binds.
    a = dataclasses.replace(IDEAL, overlap=((("scale_up", "reduce-scatter", "loop"), 1.0),))
    traffic = Collective("reduce-scatter", "scale_up", 2000 * GB, 100, 8, "loop", "backward")
    p = predict(workload(traffic, flops=1.5e15), SYSTEM, a)
    assert p.step_s == pytest.approx(5.0)
    assert p.contributions["compute"] == pytest.approx(3.0) and p.contributions["scale-up traffic"] == pytest.approx(
        2.0
    )
    assert p.bound == "scale-up traffic"
    assert p.exposed_fraction == pytest.approx(2.0 / 5.0)


def test_last_micro_batch_traffic_must_fit_under_that_micro_batch():
    # mesh.zero1_reduce=per_layer: 3 s of compute, the backward's 2 s over 4 micro-batches; the
    # per-layer cross-domain reduce-scatters run beside the last one's 0.5 s of backward only.
    a = dataclasses.replace(
        IDEAL, overlap=tuple((("scale_out", k, "loop"), 1.0) for k in ("all-gather", "reduce-scatter"))
    )
    flops = {"flops": 1.5e15}
    last = Collective("reduce-scatter", "scale_out", 40 * GB, 10, 4, "loop", "backward", window=0.25)
    assert predict(workload(last, **flops), SYSTEM, a).step_s == pytest.approx(3.0)  # 0.4 s fits
    last = dataclasses.replace(last, bytes=80 * GB)  # 0.8 s beside 0.5 s: 0.3 s more
    p = predict(workload(last, **flops), SYSTEM, a)
    assert p.step_s == pytest.approx(3.3)
    assert p.critical["cross-domain traffic"] == pytest.approx(0.8) and p.critical["compute"] == pytest.approx(2.5)
    # Spread over the whole backward the same 0.8 s would fit under 2 s.
    whole = dataclasses.replace(last, window=1.0)
    assert predict(workload(whole, **flops), SYSTEM, a).step_s == pytest.approx(3.0)
    # The fabric's whole-pass traffic takes its share of the last window: a 0.8 s gather spread
    # over the backward puts 0.2 s there, beside 0.4 s of the last one's: 0.6 s in 0.5 s.
    last = dataclasses.replace(last, bytes=40 * GB)
    gather = Collective("all-gather", "scale_out", 80 * GB, 10, 4, "loop", "backward")
    assert predict(workload(last, gather, **flops), SYSTEM, a).step_s == pytest.approx(3.1)
    # From the dry run's rows: the ZeRO-1 reduction's scope inside a loop marks the last micro-batch.
    rs = {**row("reduce-scatter", GB, runs=2, cross=True), "op_name": "jit(train_step)/moe/reduce_to_zero1/x"}
    w = workload_from_ops(
        [rs, {**rs, "in_loop": False}, row("all-gather", GB, cross=True)], 1e15, 1, 8, micro_batches=4
    )
    assert sorted((c.kind, c.phase, c.window) for c in w.collectives) == [
        ("all-gather", "loop", 1.0),
        ("reduce-scatter", "loop", 0.25),
        ("reduce-scatter", "step", 1.0),
    ]


def test_stage_imbalance_is_reported_apart_from_the_bubble():
    # 2 s of work; bubble 0.2 -> timeline 2.5 s; busiest chunk 1.5 x the mean -> 3.75 s.
    p = predict(workload(bubble=0.2, stage_imbalance=1.5), SYSTEM, IDEAL)
    assert p.contributions["pipeline bubble"] == pytest.approx(0.5)
    assert p.contributions["stage imbalance"] == pytest.approx(1.25)
    assert p.step_s == pytest.approx(3.75) and p.bound == "compute"


def test_batch_split_overlap_is_credited_only_with_independent_chains():
    a2a = Collective("all-to-all", "scale_up", 500 * GB, 100, 8, "loop", "backward")
    a = dataclasses.replace(IDEAL, a2a_batch_split_overlap=0.8)
    assert predict(workload(a2a), SYSTEM, a).step_s == pytest.approx(3.0)  # 2 + 1 s exposed
    p = predict(workload(a2a, a2a_independent_chains=True), SYSTEM, a)
    assert p.step_s == pytest.approx(2.2)  # 0.8 s under the backward's 4/3 s, 0.2 s exposed


def test_assume_sets_one_constant_by_name():
    a = assumptions_lib.assume(Assumptions(), "link_efficiency.scale_up.all-to-all=0.3")
    a = assumptions_lib.assume(a, "latency_s.scale_out=1e-5")
    a = assumptions_lib.assume(a, "overlap.scale_out.reduce-scatter.step=0.5")
    values = assumptions_lib.values(a)
    assert values["link_efficiency.scale_up.all-to-all"] == 0.3 and values["latency_s.scale_out"] == 1e-5
    assert a.overlap_of("scale_out", "reduce-scatter", "step") == 0.5
    a2a = Collective("all-to-all", "scale_up", 540 * GB, 1, 64)
    zero = dataclasses.replace(a, latency_s=(("scale_up", 0.0), ("scale_out", 0.0)))
    assert collective_seconds(a2a, SYSTEMS["gb300"], zero) == pytest.approx(540 / (900 * 0.3))
    table = assumptions_lib.table(a)
    assert all(entry["source"] for entry in table.values())
    for bad in ("nonsense=1", "compute_efficiency=2", "compute_efficiency=x", "latency_s.moon=1", "compute_efficiency"):
        with pytest.raises(ValueError):
            assumptions_lib.assume(Assumptions(), bad)


def test_peaks_are_written_once():
    assert PEAK_TFLOPS_BF16 == {name: s.peak_bf16_tflops for name, s in SYSTEMS.items()}


def stored_result(memory_gb: float) -> dict:
    """A dry-run result as the sweep's JSON stores it: 200 all-to-alls of 4.5 GB per device."""
    rows = [row("all-to-all", 4.5 * GB * 64 / 63, peers=64, runs=100, pass_=p) for p in ("forward", "backward")]
    return {"mesh": {"pipeline": 1, "data": 1, "expert": 8, "tensor": 1}, "name": "data=1,expert=8,tensor=1",
            "devices": 8, "memory": {"total": memory_gb * GB}, "pipeline": None, "planner_rows": rows}  # fmt: skip


def test_sweep_replans_a_stored_dry_run_under_assume(tmp_path, capsys):
    stored = tmp_path / "in.json"
    stored.write_text(json.dumps({"results": [stored_result(200.0)]}))
    tiny = str(ROOT / "configs" / "tiny.yaml")
    outs = []
    for i, extra in enumerate(([], ["--assume", "link_efficiency.scale_up.all-to-all=0.3"])):
        out = tmp_path / f"out{i}.json"
        args = ["--config", tiny, "--replan", str(stored), "--system", "gb300", "--json", str(out)]
        assert sweep.main(args + ["--assume", "latency_s.scale_up=0"] + extra) == 0
        outs.append(json.loads(out.read_text()))
    capsys.readouterr()
    base, slow = (o["results"][0]["prediction"] for o in outs)
    # 900 GB of all-to-all at 900 GB/s: x 0.6 -> 1.667 s; x 0.3 -> 3.333 s; exposed either way.
    assert base["contributions"]["expert all-to-all"] == pytest.approx(900 / 540)
    assert slow["contributions"]["expert all-to-all"] == pytest.approx(900 / 270)
    assert slow["step_s"] - base["step_s"] == pytest.approx(900 / 270 - 900 / 540)
    recorded = outs[1]["assumptions"]["link_efficiency.scale_up.all-to-all"]
    assert recorded["value"] == 0.3 and "NVL72" in recorded["source"]
    assert outs[1]["results"][0]["prediction"]["assumptions"]["latency_s.scale_up"]["value"] == 0.0
    # fits: judged by the system's memory unless --hbm-gb says otherwise (200 GB: GB300 yes, H200 no).
    assert outs[0]["hbm_gb"] == 279.0 and outs[0]["results"][0]["fits"]
    out = tmp_path / "h200.json"
    assert sweep.main(["--config", tiny, "--replan", str(stored), "--system", "h200", "--json", str(out)]) == 0
    assert not json.loads(out.read_text())["results"][0]["fits"]


def test_replan_of_a_bad_file_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    tiny = str(ROOT / "configs" / "tiny.yaml")
    assert sweep.main(["--config", tiny, "--replan", str(bad), "--system", "gb300"]) == 2
    assert sweep.main(["--config", tiny, "--replan", str(bad), "--assume", "moon=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("maxmoe: error:") for line in err)


def test_brace_count_ignores_string_literals():
    from maxmoe.analysis.hlo_deps import _brace_net

    line = '%1 = stablehlo.custom_call @k(%0) {backend_config = "{{{\\"}", module = "}"} : f32'
    assert _brace_net(line) == 0
    assert _brace_net("%2 = stablehlo.while(%x) {") == 1


@pytest.fixture(scope="module")
def eight_devices():
    import jax

    return jax.devices()[:8]


@pytest.mark.parametrize("overlap, chains", [("none", False), ("batch_split", True)])
def test_batch_split_chains_are_read_from_the_cuda_lowering(eight_devices, overlap, chains):
    """The planner's credit for the all-to-all's overlap: a MoE layer on the GPU kernel backend
    (Mosaic GPU's grouped GEMM, a custom call holding a serialised kernel) lowers to two
    independent chains under batch_split, one chain without it."""
    from maxmoe.analysis.lowering import a2a_independent_chains

    config = load_config(
        [str(ROOT / "configs" / "tiny.yaml")],
        ["mesh.data=2", "mesh.expert=4", "train.batch_size=8", "train.seq_len=16", "model.compute_dtype=bfloat16"]
        + ["model.hidden_size=128", "model.moe_mlp_dim=64", f"moe.overlap={overlap}"],
    )
    assert a2a_independent_chains(config, eight_devices) is chains


def test_replan_ranks_by_predicted_throughput_and_writes_the_winner(tmp_path, capsys):
    # Two stored shapes: one moves 4x the all-to-all bytes (slower), one does not fit GB300's 279 GB.
    slow = stored_result(100.0)
    slow["planner_rows"] = [
        {**r, "bytes": 4 * r["bytes"], "bytes_per_run": 4 * r["bytes_per_run"]} for r in slow["planner_rows"]
    ]
    slow.update(mesh={"pipeline": 1, "data": 2, "expert": 4, "tensor": 1}, name="data=2,expert=4,tensor=1")
    big = {**stored_result(300.0), "mesh": {"pipeline": 1, "data": 8, "expert": 1, "tensor": 1}, "name": "data=8"}
    stored = tmp_path / "in.json"
    stored.write_text(json.dumps({"results": [slow, big, stored_result(100.0)]}))
    out, written = tmp_path / "out.json", tmp_path / "best.yaml"
    tiny = str(ROOT / "configs" / "tiny.yaml")
    args = ["--config", tiny, "--replan", str(stored), "--system", "gb300", "--json", str(out)]
    assert sweep.main(args + ["--write-config", str(written)]) == 0
    capsys.readouterr()
    names = [r["name"] for r in json.loads(out.read_text())["results"]]
    assert names == ["data=1,expert=8,tensor=1", "data=2,expert=4,tensor=1", "data=8"]
    best = load_config([str(written)])
    assert (best.mesh.data, best.mesh.expert, best.mesh.tensor) == (1, 8, 1)
    assert best.model == load_config([tiny]).model


def test_the_planners_table_shows_throughput_memory_and_bound(tmp_path, capsys):
    stored = tmp_path / "in.json"
    stored.write_text(json.dumps({"results": [stored_result(200.0)]}))
    tiny = str(ROOT / "configs" / "tiny.yaml")
    assert sweep.main(["--config", tiny, "--replan", str(stored), "--system", "gb300"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if "TFLOP/s/GPU" in line)
    assert "mem GB" in lines[head] and lines[head].endswith("bound")
    assert "200.0  yes" in lines[head + 1] and lines[head + 1].endswith("expert all-to-all")
