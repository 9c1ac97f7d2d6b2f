"""`auto` on a GPU chooses by the committed table of measured kernel rates (maxmoe/kernels/rates.yaml)."""

from pathlib import Path

import yaml

from maxmoe.kernels.choice import resolve_attention, resolve_grouped_matmul
from maxmoe.kernels.rates import DEFAULT_RATES


def table_with(tmp_path: Path, *entries: dict, name: str = "rates.yaml") -> Path:
    """The committed table plus `entries` (each a rate of the committed format), written to tmp_path."""
    doc = yaml.safe_load(DEFAULT_RATES.read_text())
    doc["rates"] += list(entries)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def rate(backend: str, kernel_class: str, shape: str, tflops: float, device_kind: str = "NVIDIA H200") -> dict:
    return {
        "device_kind": device_kind,
        "system": device_kind.split()[-1].lower(),
        "class": kernel_class,
        "backend": backend,
        "precision": "bf16",
        "pass": "fwd+bwd",
        "shape": shape,
        "dims": {},
        "tflops": tflops,
        "peak_fraction": tflops / 989.4,
        "date": "2026-12-05",
        "commit": "0000000",
        "command": "a test's entry",
    }


def test_a_changed_table_changes_the_grouped_choice(tmp_path):
    committed = resolve_grouped_matmul("auto", "cuda", "NVIDIA H200")
    assert committed.name == "mosaic_gpu"
    assert "measured fastest, 440 TFLOP/s fwd+bwd at 671b" in committed.reason and "rates.yaml" in committed.reason
    faster = table_with(tmp_path, rate("ragged_dot", "grouped_gemm", "671b", 500.0))
    changed = resolve_grouped_matmul("auto", "cuda", "NVIDIA H200", rates=faster)
    assert changed.name == "ragged_dot" and "against mosaic_gpu 440" in changed.reason
    assert str(faster) in changed.reason
    # the proxy shape decides only where the 671B shape has no usable rate
    proxy_only = table_with(tmp_path, rate("ragged_dot", "grouped_gemm", "proxy", 900.0), name="proxy.yaml")
    assert resolve_grouped_matmul("auto", "cuda", "NVIDIA H200", rates=proxy_only).name == "mosaic_gpu"


def test_a_changed_table_changes_the_attention_choice(tmp_path):
    """On this host only chunked can be built for CUDA (cuDNN needs cuDNN, tokamax is absent), so
    the measured choice is chunked; a table without its rate leaves the fixed preference."""
    committed = resolve_attention("auto", "cuda", "NVIDIA H200")
    assert committed.name == "chunked" and "chunked measured fastest, 87 TFLOP/s" in committed.reason
    assert "cudnn: cuDNN attention cannot be built in this process" in committed.reason
    doc = yaml.safe_load(DEFAULT_RATES.read_text())
    doc["rates"] = [r for r in doc["rates"] if r["class"] != "attention_core"]
    (tmp_path / "none.yaml").write_text(yaml.safe_dump(doc))
    unmeasured = resolve_attention("auto", "cuda", "NVIDIA H200", rates=tmp_path / "none.yaml")
    assert unmeasured.name == "chunked" and "no measured rate to choose by" in unmeasured.reason


def test_rates_stand_for_their_generation_and_only_it(tmp_path):
    h100 = resolve_grouped_matmul("auto", "cuda", "NVIDIA H100 80GB HBM3")
    assert h100.name == "mosaic_gpu" and h100.reason.startswith("NVIDIA H200: ")  # a Hopper's rates
    unknown = resolve_grouped_matmul("auto", "cuda", "")
    assert unknown.name == "mosaic_gpu" and unknown.reason.startswith("NVIDIA H200: ")
    b200 = table_with(tmp_path, rate("ragged_dot", "grouped_gemm", "671b", 900.0, "NVIDIA H100"))
    blackwell = resolve_grouped_matmul("auto", "cuda", "NVIDIA B200", rates=b200)
    assert blackwell.name == "ragged_dot" and "G x the useful FLOPs" in blackwell.reason  # no Blackwell rate
    own = table_with(tmp_path, rate("ragged_dot", "grouped_gemm", "671b", 100.0, "NVIDIA H100"), name="h100.yaml")
    # H100's own rate (ragged_dot only) is preferred to H200's mosaic_gpu
    assert resolve_grouped_matmul("auto", "cuda", "NVIDIA H100", rates=own).name == "ragged_dot"
