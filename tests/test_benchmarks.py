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
        for part in ("fwd", "fwd_bwd"):
            assert (f"attention B=1 H=2 T=64 {part}", impl) in cases
    steps = {row["case"] for row in suite["table"] if row["part"] == "step"}
    assert steps == {"-", "model.remat=full"}
    assert {row["case"] for row in suite["table"] if row["part"] == "command buffers"} == {"-"}
    assert suite["grouped_matmul"]["peak"]["tflops"] > 0
    # XLA's ragged_dot executes G x the useful FLOPs (8 groups, half the rows valid: 16 x)
    ragged = next(r for r in suite["grouped_matmul"]["rows"] if r["backend"] == "ragged_dot")
    assert ragged["fwd"]["flops_ratio"] > 8
    # where the auto step's time went: the table printed, and a row per class summing to the step
    assert any(line.startswith("where the step's time goes: /host:CPU, jit_train_step, 3 step(s)") for line in lines)
    shares = [row for row in suite["table"] if row["part"] == "breakdown -"]
    assert [row["case"] for row in shares][-1] == "idle gaps" and len(shares) == 8
    assert sum(float(row["value"].rstrip("%")) for row in shares) == pytest.approx(100, abs=0.5)
    assert (tmp_path / "profile" / "breakdown.json").exists() and (tmp_path / "profile" / "program.hlo.txt").exists()
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


def test_gpu_suite_exits_non_zero_when_a_part_fails(tmp_path):
    """A part whose process fails (here: XLA refuses an unknown flag) is a failed part: its row in
    the table, a line on stderr, and exit status 1."""
    env = {**_env(tmp_path), "XLA_FLAGS": "--xla_no_such_flag=1"}
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_suite.sh", "--cpu-smoke", "--only", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "gpu_suite: 1 part(s) failed: 1. grouped matmul: exit" in proc.stderr
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert suite["failed_parts"] and suite["failed_parts"][0].startswith("1. grouped matmul: exit")


def test_suite_rate_entries_are_entries_of_the_rate_table(tmp_path):
    """The rates a GPU run measured, written by suite_table in rates.yaml's format, load as that table."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from suite_table import rate_entries

    from maxmoe.kernels.rates import load_rates

    ok = {"ms": 1.0, "tflops": 412.5, "status": "ok"}
    missing = {"ms": None, "tflops": None, "status": "not run: needs a GPU"}
    suite = {
        "device_kind": "NVIDIA H200",
        "grouped_matmul": {
            "command": "bash benchmarks/gpu_suite.sh --only 1",
            "shapes": {"671b": {"rows": 65536, "groups": 4, "d": 7168, "f": 2048}},
            "rows": [{"shape": "671b", "backend": "mosaic_gpu", "fwd": ok, "fwd_bwd": ok}],
        },
        "attention": {
            "command": "bash benchmarks/gpu_suite.sh --only 2",
            "rows": [
                {"case": "B=1 H=128 T=4096", "shape": "671b_heads", "impl": "cudnn", "fwd": ok, "fwd_bwd": ok},
                {
                    "case": "B=1 H=128 T=4096",
                    "shape": "671b_heads",
                    "impl": "tokamax",
                    "fwd": missing,
                    "fwd_bwd": missing,
                },
            ],
        },
        "fp8_matmul": {"grouped_backend": "mosaic_gpu", "command": "x", "rows": []},
    }
    text = rate_entries(suite).replace("DATE", "2026-12-05").replace("COMMIT", "abc1234")
    (tmp_path / "rates.yaml").write_text("rates:\n" + text)
    table = load_rates(tmp_path / "rates.yaml")
    assert len(table.rates) == 4  # two passes each of the grouped and the cuDNN rows; tokamax did not run
    cudnn = table.find(kernel_class="attention_core", backend="cudnn", pass_="fwd+bwd")[0]
    assert (cudnn.shape, cudnn.system, cudnn.tflops, dict(cudnn.dims)) == (
        "671b_heads",
        "h200",
        412.5,
        {"b": 1, "h": 128, "t": 4096},
    )
    assert cudnn.peak_fraction == pytest.approx(412.5 / 989.4, rel=1e-3)
