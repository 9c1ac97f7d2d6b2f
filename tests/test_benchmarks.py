"""benchmarks/: the GPU suite's --cpu-smoke pipeline end to end, and the grouped matmul table."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, "PYTHONPATH": str(REPO), "PYTHON": sys.executable, "OUT": str(tmp_path)}


def run_suite(tmp_path, *args, timeout):
    return subprocess.run(
        ["bash", "benchmarks/gpu_suite.sh", *args],
        cwd=REPO,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_gpu_suite_cpu_smoke(tmp_path):
    proc = run_suite(tmp_path, "--cpu-smoke", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert suite["failed_parts"] == [], suite["failed_parts"]
    cases = {(row["part"], row["case"]) for row in suite["table"]}
    for part in ("fwd", "fwd_bwd"):
        assert (f"grouped small {part}", "ragged_dot") in cases and (f"grouped small {part}", "mosaic_gpu") in cases
    for gemm in ("dense", "grouped"):
        for recipe in ("bf16", "tensorwise"):
            assert (f"fp8 small {gemm} fwd_bwd", recipe) in cases
    for impl in ("xla", "chunked", "triton", "cudnn"):
        assert ("attention B=1 H=2 T=64", impl) in cases
    steps = [row for row in suite["table"] if row["part"] == "step"]
    assert {row["case"] for row in steps} == {
        "-",
        "model.attention=xla moe.grouped_matmul=dense_loop train.loss_chunk=0",
    }
    remat = {row["case"] for row in suite["table"] if row["part"] == "remat"}
    assert remat == {"model.remat=full", "model.remat=save_dots_comm"}
    assert suite["grouped_matmul"]["peak"]["tflops"] > 0
    # XLA's ragged_dot executes G x the useful FLOPs (8 groups, half the rows valid: 16 x)
    ragged = next(r for r in suite["grouped_matmul"]["rows"] if r["backend"] == "ragged_dot")
    assert ragged["fwd"]["flops_ratio"] > 8
    # the table is the last thing printed, ranked steps last
    assert proc.stdout.strip().splitlines()[-1].startswith("step")


def test_gpu_suite_rejects_unknown_arguments(tmp_path):
    proc = run_suite(tmp_path, "--bogus", timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr
