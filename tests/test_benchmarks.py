"""benchmarks/: the GPU suite's --cpu-smoke pipeline end to end, and the grouped matmul table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import job_env

REPO = Path(__file__).resolve().parents[1]


def _env(tmp_path):
    return job_env(PYTHON=sys.executable, OUT=str(tmp_path))  # the suite's compile flags, no device count


def run_suite(tmp_path, *args, timeout):
    return subprocess.run(
        ["bash", "benchmarks/gpu_suite.sh", *args],
        cwd=REPO,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_gpu_suite_cpu_smoke(tmp_path):
    proc = run_suite(tmp_path, "--cpu-smoke", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("preflight: 1 x cpu (cpu, compute capability -), jax ")
    assert lines[1].startswith("limits: one-GPU parts 0-5 sum to 400 s on a GPU")
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert suite["failed_parts"] == [], suite["failed_parts"]
    assert suite["preflight"]["platform"] == "cpu"
    checks = {row["case"]: row for row in suite["table"] if row["part"] == "check"}
    for name in ("attention triton", "fp8 blockwise dense", "fp8 tensorwise dense", "fp8 mxfp8 dense"):
        assert checks[name]["value"].startswith("pass"), checks[name]
    for name in ("grouped mosaic_gpu", "attention cudnn", "fp8 blockwise grouped"):
        assert checks[name]["value"] == "skip" and "needs a GPU" in checks[name]["detail"], checks[name]
    cases = {(row["part"], row["case"]) for row in suite["table"]}
    for part in ("fwd", "fwd_bwd"):
        assert (f"grouped small {part}", "ragged_dot") in cases and (f"grouped small {part}", "mosaic_gpu") in cases
    for gemm in ("dense", "grouped"):
        for recipe in ("bf16", "tensorwise"):
            assert (f"fp8 small {gemm} fwd_bwd", recipe) in cases
    for impl in ("xla", "chunked", "triton", "cudnn"):
        assert ("attention B=1 H=2 T=64", impl) in cases
    steps = {row["case"] for row in suite["table"] if row["part"] == "step"}
    assert steps == {"-", "model.remat=full"}
    assert {row["case"] for row in suite["table"] if row["part"] == "command buffers"} == {"-"}
    assert suite["grouped_matmul"]["peak"]["tflops"] > 0
    # XLA's ragged_dot executes G x the useful FLOPs (8 groups, half the rows valid: 16 x)
    ragged = next(r for r in suite["grouped_matmul"]["rows"] if r["backend"] == "ragged_dot")
    assert ragged["fwd"]["flops_ratio"] > 8
    # the table is the last thing printed, and the same rows are in suite.md
    assert lines[-1].startswith("command buffers")
    markdown = (tmp_path / "suite.md").read_text().splitlines()
    assert markdown[0] == "| part | case | value | detail |" and len(markdown) == len(suite["table"]) + 2


def test_gpu_suite_rejects_unknown_arguments(tmp_path):
    proc = run_suite(tmp_path, "--bogus", timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_gpu_suite_only_reruns_the_chosen_parts(tmp_path):
    """--only 1: the preflight line and the limits, then part 1 alone, and a table of its rows."""
    proc = run_suite(tmp_path, "--cpu-smoke", "--only", "1", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = [line for line in proc.stderr.splitlines() if line.startswith("== ")]
    assert parts == ["== 1. grouped matmul (limit 300 s)"]
    assert proc.stdout.startswith("preflight: ")
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert {row["part"].split()[0] for row in suite["table"]} == {"matmul", "grouped"}
