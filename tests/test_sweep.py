"""maxmoe.sweep and maxmoe.analysis.dry_run: mesh enumeration, the analytic all-to-all model, and a dry
run on 8 fake CPU devices whose all-to-all bytes grow with the expert axis as (EP-1)/EP."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import job_env

from maxmoe import sweep
from maxmoe.analysis import dry_run
from maxmoe.config import load_config

REPO = Path(__file__).resolve().parents[1]


def test_factorisations_cover_every_shape():
    shapes = sweep.factorisations(8)
    assert len(shapes) == 10
    assert all(s["pipeline"] == 1 and s["data"] * s["expert"] * s["tensor"] == 8 for s in shapes)
    assert len({tuple(s.values()) for s in shapes}) == 10
    # With stages: every (data, expert, tensor) of 8 / P devices per pipeline size P.
    staged = sweep.factorisations(8, (1, 2, 4, 8))
    assert len(staged) == 10 + 6 + 3 + 1
    assert all(s["pipeline"] * s["data"] * s["expert"] * s["tensor"] == 8 for s in staged)


def test_bubble_baseline_keeps_devices_and_micro_batch_rows():
    overrides = ["model.num_layers=5", "train.grad_accum=8", "train.batch_size=32"]
    staged = sweep.with_mesh(
        load_config(["configs/tiny.yaml"], overrides), {"pipeline": 2, "data": 2, "expert": 2, "tensor": 1}
    )
    base = dry_run.bubble_baseline(staged)
    sizes = {a: getattr(base.mesh, a) for a in ("pipeline", "data", "expert", "tensor")}
    assert sizes == {"pipeline": 1, "data": 4, "expert": 2, "tensor": 1}
    assert base.train.batch_size == 32 and base.train.grad_accum == 4
    staged_sizes = {a: getattr(staged.mesh, a) for a in sizes}
    assert dry_run.tokens_per_shard(base, sizes) == dry_run.tokens_per_shard(staged, staged_sizes) == 128


def test_parse_mesh():
    assert sweep.parse_mesh("data=2,expert=4") == {"pipeline": 1, "data": 2, "context": 1, "expert": 4, "tensor": 1}
    assert sweep.parse_mesh("pipeline=2,expert=4")["pipeline"] == 2
    assert sweep.parse_mesh("data=2,context=2,expert=2")["context"] == 2
    assert sweep.mesh_name(sweep.parse_mesh("data=2,expert=4")) == "data=2,expert=4,tensor=1"
    for bad in ("data=2,stages=4", "data=x", "data=0", "expert"):
        with pytest.raises(sweep.UserError):
            sweep.parse_mesh(bad)


def test_bad_input_is_one_line_exit_2(capsys):
    assert sweep.main(["--config", "configs/tiny.yaml", "--devices", "8", "--mesh", "data=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("maxmoe: error:")
    assert sweep.main(["--devices", "8"]) == 2


def test_candidate_shapes_skip_what_does_not_divide():
    import jax

    config = load_config(["configs/tiny.yaml"], [])
    kept, skipped = sweep.candidate_shapes(config, jax.devices()[:8])
    assert {sweep.mesh_name(s) for s, _ in skipped} == {"data=1,expert=1,tensor=8"}  # 4 heads
    assert len(kept) == 9
    domain = load_config(["configs/tiny.yaml"], ["mesh.scale_up_domain=2"])
    kept, skipped = sweep.candidate_shapes(domain, jax.devices()[:8])
    assert all(s["expert"] * s["tensor"] <= 2 for s, _ in kept)
    assert any("scale-up domain" in why for _, why in skipped)


def test_a_shape_a_rule_cannot_divide_is_listed_as_refused_with_its_line():
    import jax

    config = load_config(["configs/tiny.yaml"], ["mesh.rules.vocab=[data]"])
    kept, skipped = sweep.candidate_shapes(config, jax.devices()[:8])
    reasons = {sweep.mesh_name(s): why for s, why in skipped}
    assert reasons["data=8,expert=1,tensor=1"] == (
        "params/embed/embedding [260, 64]: dimension 0 (vocab) of size 260 cannot be split 8 ways by "
        "mesh.rules.vocab -> data=8; change that rule or the mesh"
    )
    assert {sweep.mesh_name(s) for s, _ in kept} == {
        sweep.mesh_name(s) for s in sweep.factorisations(8) if sweep.mesh_name(s) not in reasons
    }
    assert len(kept) == 8  # data=4 splits 260 into 65 rows each: allowed


def test_native_a2a_model_scales_as_ep_minus_one_over_ep():
    config = load_config(["configs/tiny.yaml"], ["model.compute_dtype=bfloat16", "model.remat=none"])
    by_ep = {
        ep: sum(dry_run.native_a2a_bytes(config, {"data": 8 // ep, "expert": ep, "tensor": 1}).values())
        for ep in (1, 2, 4, 8)
    }
    assert by_ep[1] == 0
    for ep in (4, 8):
        assert by_ep[ep] / by_ep[2] == pytest.approx(((ep - 1) / ep) / 0.5)
    # tiny: 2 MoE layers + 1 MTP, no remat: 12 calls of 256 tokens x 2 x 64 x 2 B x 1/2
    assert by_ep[2] == 12 * 256 * 2 * 64 * 2 * 0.5


def test_native_a2a_model_follows_the_remat_policy():
    sizes = {"data": 2, "expert": 4, "tensor": 1}
    by_policy = {
        remat: dry_run.native_a2a_bytes(load_config(["configs/tiny.yaml"], [f"model.remat={remat}"]), sizes)
        for remat in ("none", "full", "save_matmuls", "save_comm", "save_dots_comm")
    }
    # tiny: 2 scanned MoE layers + 1 MTP, dispatch and combine each: 6 calls forward, their 6
    # transposes backward, and 4 more backward where the scanned layers' forward is recomputed.
    for remat, passes in by_policy.items():
        assert passes["forward"] == by_policy["none"]["forward"]
        recomputed = 4 if remat in ("full", "save_matmuls") else 0
        assert passes["backward"] == pytest.approx(passes["forward"] * (6 + recomputed) / 6)


@pytest.fixture(scope="module")
def dry_runs_by_policy():
    import jax

    out = {}
    # 1,024 tokens: enough that the step's peak sits in the backward pass, where save_comm's kept
    # receive buffers live (at 512 tokens the peak lies outside the backward pass and is the same
    # under both).
    for remat in ("full", "save_comm"):
        overrides = ["model.compute_dtype=bfloat16", f"model.remat={remat}", "train.batch_size=8", "train.seq_len=128"]
        config = load_config(["configs/tiny.yaml"], overrides)
        sizes = {"data": 2, "expert": 4, "tensor": 1}
        (_, mesh), *_ = sweep.candidate_shapes(config, jax.devices()[:8], [sizes])[0]
        out[remat] = dry_run.dry_run_shape(sweep.with_mesh(config, sizes), sizes, mesh, hbm_gb=1.0)
    return out


@pytest.mark.slow
def test_dry_run_splits_collectives_by_pass_and_shows_recomputed_all_to_alls(dry_runs_by_policy):
    full, save_comm = dry_runs_by_policy["full"], dry_runs_by_policy["save_comm"]
    for r in (full, save_comm):
        measured = {p: r["collectives_by_pass"][p].get("all-to-all", 0.0) for p in ("forward", "backward")}
        assert measured == pytest.approx(r["native_a2a_bytes_by_pass"], rel=0.02)
        assert r["forward_total"] == pytest.approx(sum(r["collectives_by_pass"]["forward"].values()))
    forward = save_comm["collectives_by_pass"]["forward"]["all-to-all"]
    assert save_comm["collectives_by_pass"]["backward"]["all-to-all"] == pytest.approx(forward, rel=0.02)
    assert full["collectives_by_pass"]["backward"]["all-to-all"] == pytest.approx(forward * 10 / 6, rel=0.02)
    # Keeping the receive buffers costs memory: temp grows under save_comm.
    assert save_comm["memory"]["temp"] > full["memory"]["temp"]


@pytest.mark.slow
def test_dry_run_all_to_all_bytes_follow_the_expert_axis(tmp_path):
    out = tmp_path / "sweep.json"
    env = job_env()  # the suite's compile flags; the sweep sets its own device count
    cmd = [
        sys.executable,
        "-m",
        "maxmoe.sweep",
        "--config",
        "configs/tiny.yaml",
        "--devices",
        "8",
        "--dry-run",
        "--mesh",
        "data=4,expert=2",
        "--mesh",
        "data=2,expert=4",
        "--mesh",
        "data=1,expert=8",
        "--json",
        str(out),
        "--no-progress",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    results = {r["mesh"]["expert"]: r for r in report["results"]}
    assert set(results) == {2, 4, 8}
    for r in results.values():
        assert r["memory"]["total"] > 0 and isinstance(r["fits"], bool) and r["collective_total"] > 0
        # the stand-in moves exactly what the analytic native model says
        assert r["collectives"]["all-to-all"] == pytest.approx(r["native_a2a_bytes"], rel=0.02)
    for ep in (4, 8):
        ratio = results[ep]["collectives"]["all-to-all"] / results[2]["collectives"]["all-to-all"]
        assert ratio == pytest.approx(((ep - 1) / ep) / 0.5, rel=0.02)
    assert "data=4,expert=2,tensor=1" in proc.stdout
