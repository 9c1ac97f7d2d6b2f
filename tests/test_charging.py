"""What the planner charges a step, against hand-worked counts: what model.remat runs again, the
chunked loss's head, the kernel that runs (padded attention, ragged_dot's G x), and collectives
that move nothing or little.

671B shapes: D 7168, q latent 1536, kv latent 512, 128 heads of qk 192 (nope 128 + rope 64) and v
128, 3 dense layers (MLP 18432) and 58 MoE layers (256 experts of 2048, top-8, 1 shared), one MTP
depth, 129,280 vocabulary, 4,096 tokens.
"""

import dataclasses
from pathlib import Path

import pytest

from maxmoe.analysis.assumptions import SYSTEMS, Assumptions
from maxmoe.analysis.dry_run import step_workload
from maxmoe.analysis.flops import flops_per_token_by_class, recompute_flops_per_token
from maxmoe.analysis.planner import Collective, collective_seconds, predict, workload_from_ops
from maxmoe.analysis.recompute import recomputed_gemms
from maxmoe.config import load_config
from maxmoe.kernels.choice import resolve_grouped_matmul

ROOT = Path(__file__).resolve().parents[1]
GB300_256 = [str(ROOT / "configs" / n) for n in ("deepseek_v3_671b.yaml", "mesh_256_gb300.yaml")]
D, Q, KV, H, T, F = 7168, 1536, 512, 128, 4096, 2048
TOKENS = 15360 * 4096 / 256  # the shipped GB300 plan's tokens per GPU per step


def rows_of(config, system="gb300", devices=256):
    return {c.name: c for c in step_workload(config, [], devices, 0.0, None, system).compute}


def test_save_moe_runs_again_only_what_its_saved_names_leave():
    """Charging error 1. save_moe keeps the attention output, the dispatch's and combine's rows and
    the experts' gate/up: the backward needs the core's output again (the output projection's
    input), so the core and the projections feeding it run again, but not the output projection;
    the router (its scores) and the shared experts' gate/up (SwiGLU's input), not their down
    projection; in the dense layers the attention likewise and the MLP's gate/up. By hand, per
    token: 61 x (projections but the output's, 2 x 29,720,576 + core 4096 x 128 x 320) + 3 x
    4 x 7168 x 18432 + 58 x (2 x 7168 x 256 + 4 x 7168 x 2048): +9.2% of the model FLOPs, where
    every class whole was charged +14.7%."""
    config = load_config(GB300_256)
    assert config.model.remat == "save_moe"
    projections = 2 * (D * Q + Q * H * 192 + D * (KV + 64) + KV * H * 256)
    hand = 61 * (projections + T * H * 320) + 3 * 4 * D * 18432 + 58 * (2 * D * 256 + 4 * D * F)
    again = recompute_flops_per_token(config.model, T)
    assert sum(again.values()) == pytest.approx(hand, rel=1e-12)
    total = sum(flops_per_token_by_class(config.model, T).values())
    assert sum(again.values()) / total == pytest.approx(0.092, abs=0.001)
    assert "o_proj" not in recomputed_gemms("save_moe", moe=True) and "shared_down" not in recomputed_gemms(
        "save_moe", moe=True
    )
    assert "dense_gate_up" in recomputed_gemms("save_moe", moe=False)


def test_on_one_device_the_combine_rows_are_not_saved():
    """Without a dispatch plan the routed experts' rows are a sort, not a named collective: under
    save_dots_comm (proxy_1gpu) the backward needs the copies the combine weights, so the routed
    down projection runs again (11 MoE layers x 8 experts x 2 x 2048 x 512 per token)."""
    m = load_config([str(ROOT / "configs" / "proxy_1gpu.yaml")]).model
    assert m.remat == "save_dots_comm"
    assert recompute_flops_per_token(m, 4096, expert_parallel=True)["routed_experts"] == 0
    assert recompute_flops_per_token(m, 4096, expert_parallel=False)["routed_experts"] == 11 * 8 * 2 * 2048 * 512


def test_collectives_of_no_bytes_or_one_device_launch_nothing():
    """Charging error 2: 3,540 zero-byte all-reduces over one device (psum of a replicated value)
    beside 3,480 of 16 bytes over 64 devices: one class, 3,480 launches, not 7,020 at 64 peers."""

    def row(size, peers, runs):
        return {"kind": "all-reduce", "runs": runs, "bytes_per_run": size, "bytes": size * runs, "peers": peers,
                "cross_domain": False, "pass": "backward", "computation": "body", "in_loop": True}  # fmt: skip

    w = workload_from_ops([row(0.0, 1, 3540), row(15.75, 64, 3480)], 1e15, 1, 256)
    (reduce,) = w.collectives
    assert (reduce.launches, reduce.peers, reduce.bytes) == (3480, 64, 15.75 * 3480)
    assert collective_seconds(dataclasses.replace(reduce, peers=1), SYSTEMS["gb300"], Assumptions()) == pytest.approx(
        reduce.bytes / (900e9 * 0.8)
    )


def test_a_small_all_reduce_costs_a_trees_latency():
    """Charging error 3: 3,480 all-reduces of 8 bytes over 64 GPUs of an NVLink domain, 2 us a hop:
    up and down a tree of depth log2 64 = 6 is 12 hops, 83.5 ms a step; a ring's 2 x 63 hops
    each would be 0.877 s."""
    reduce = Collective("all-reduce", "scale_up", 8 * 3480 * 2 * 63 / 64, 3480, 64)
    seconds = collective_seconds(reduce, SYSTEMS["gb300"], Assumptions())
    assert seconds == pytest.approx(3480 * 12 * 2e-6 + reduce.bytes / (900e9 * 0.8))
    assert seconds < 0.1


def test_the_chunked_loss_projects_the_head_again():
    """Charging error 4: with train.loss_chunk > 0 the loss's backward projects every vocabulary
    block again: 2 x 2048 x 129,280 per token for the main head and again for the MTP depth,
    32,768 tokens (proxy_1gpu on one GPU); model FLOPs unchanged."""
    files = [str(ROOT / "configs" / "proxy_1gpu.yaml")]
    whole = rows_of(load_config(files, ["train.loss_chunk=0"]), "h200", 1)["head"]
    chunked = rows_of(load_config(files, ["train.loss_chunk=16384"]), "h200", 1)["head"]
    assert chunked.model_flops == whole.model_flops
    assert chunked.executed_flops - whole.executed_flops == pytest.approx(2 * 2048 * 129280 * 2 * 32768, rel=1e-12)


@pytest.mark.parametrize(
    "attention, factor",
    [("triton", 512 / 320), ("cudnn", 1.0), ("tokamax", 1.0), ("chunked", 9 / 8), ("xla", 2.0)],
)
def test_the_attention_core_is_charged_what_its_kernel_runs(attention, factor):
    """Charging error 5: Triton pads v from 128 to the qk head dim 192 and both to 256 (a power
    of two; maxmoe.kernels.attention): (256 + 256) / (192 + 128) = 1.6 x the causal FLOPs; cuDNN
    and tokamax take v as it is; XLA's chunked core runs the 8 diagonal blocks of 512 whole (9/8);
    XLA's attention every score (2 x)."""
    config = load_config(GB300_256, [f"model.attention={attention}"])
    core = rows_of(config)["attention_core"]
    useful = 3 * T * H * 320 * 62 + T * H * 320 * 61  # 62 blocks; save_moe runs 61 forward again
    assert (core.backend, core.overhead) == (attention, pytest.approx(factor))
    assert core.executed_flops == pytest.approx(useful * factor * TOKENS, rel=1e-12)


def test_the_routed_experts_are_charged_the_grouped_kernel_that_runs():
    """Charging error 7: XLA's ragged_dot runs a dense GEMM per local expert over all rows: 256
    experts over 64 expert ranks is 4 groups, 4 x the routed FLOPs (model, and the plan's remat
    runs none of them again); tokamax's kernel runs them once. At one efficiency the routed
    class takes 4 x as long. `auto` is charged as maxmoe.kernels.choice resolves it for a GB300."""
    routed = 6 * 8 * 3 * D * F * (58 + 1)
    rows = {}
    for kernel in ("ragged_dot", "tokamax", "auto"):
        config = load_config(GB300_256, [f"moe.grouped_matmul={kernel}"])
        rows[kernel] = rows_of(config)["routed_experts"]
    assert rows["ragged_dot"].executed_flops == pytest.approx(4 * routed * TOKENS, rel=1e-12)
    assert rows["tokamax"].executed_flops == pytest.approx(routed * TOKENS, rel=1e-12)
    assert rows["auto"].backend == resolve_grouped_matmul("auto", "cuda", "NVIDIA GB300").name
    uniform = Assumptions(compute_efficiency=0.5)
    seconds = {
        k: predict(
            step_workload(load_config(GB300_256, [f"moe.grouped_matmul={k}"]), [], 256, 0.0, None, "gb300"),
            SYSTEMS["gb300"],
            uniform,
        ).compute  # fmt: skip
        for k in ("ragged_dot", "tokamax")
    }
    routed_s = {k: next(r["seconds"] for r in v if r["name"] == "routed_experts") for k, v in seconds.items()}
    assert routed_s["ragged_dot"] == pytest.approx(4 * routed_s["tokamax"])
