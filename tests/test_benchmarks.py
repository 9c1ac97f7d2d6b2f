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


def test_gpu_suite_cpu_smoke(tmp_path):
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_suite.sh", "--cpu-smoke"],
        cwd=REPO,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    suite = json.loads((tmp_path / "suite.json").read_text())
    cases = {(row["part"], row["case"]) for row in suite["table"]}
    for profile in ("none", "auto"):
        for remat in ("full", "save_matmuls"):
            assert (f"step profile={profile}", f"model.remat={remat}") in cases
    assert ("grouped matmul", "ragged_dot") in cases and ("grouped matmul", "pallas_mgpu") in cases
    assert suite["grouped_matmul"]["peak"]["tflops"] > 0
    # the table is the last thing printed
    assert proc.stdout.strip().splitlines()[-1].startswith("step profile=auto")


def test_gpu_suite_rejects_unknown_arguments(tmp_path):
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_suite.sh", "--bogus"],
        cwd=REPO,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "usage" in proc.stderr
