"""The train step lowered for CUDA on this CPU host uses the real ragged all-to-all."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from maxmoe.config import load_config
from maxmoe.hlo import STABLEHLO_COLLECTIVES, count_collectives
from maxmoe.lowering import lower_train_step

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.mark.smoke
def test_cuda_lowering_uses_native_ragged_all_to_all():
    config = load_config([TINY], ["mesh.data=2", "mesh.expert=4", "train.batch_size=8", "train.seq_len=16"])
    text = lower_train_step(config, "cuda").as_text()
    counts = count_collectives(text)
    # 3 MoE layers (2 in the scanned stack, 1 MTP), each dispatch + combine, forward and backward;
    # the scanned stack appears once in the program.
    assert counts["ragged_all_to_all"] >= 4, counts
    # The CPU emulation moves float row blocks with all_to_all; the native program moves
    # only int32 offsets that way (the collective's backward needs the peers' offsets).
    float_all_to_all = [
        line
        for line in text.splitlines()
        if "all_to_all" in line and "ragged" not in line and re.search(r"x(f32|bf16|f16)>", line)
    ]
    assert not float_all_to_all, float_all_to_all[:3]


def test_cpu_lowering_emulates():
    config = load_config([TINY], ["mesh.data=2", "mesh.expert=4", "train.batch_size=8", "train.seq_len=16"])
    counts = count_collectives(lower_train_step(config, "cpu").as_text())
    assert counts["ragged_all_to_all"] == 0 and counts["all_to_all"] > 0, counts


def test_info_lower_cuda_prints_counts():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "maxmoe.info",
            "--config",
            TINY,
            "run.cpu_devices=8",
            "mesh.data=2",
            "mesh.expert=4",
            "--lower",
            "cuda",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    counts = dict(line.split(": ") for line in result.stdout.strip().splitlines())
    assert set(counts) == set(STABLEHLO_COLLECTIVES)
    assert int(counts["ragged_all_to_all"]) >= 2


def test_cuda_lowering_runs_the_kernels_and_no_ragged_dot():
    """The tiny step for an H200 (bf16, sizes multiples of 64): Mosaic GPU grouped GEMMs, flash attention."""
    from maxmoe.mesh import build_layout

    config = load_config(
        [TINY],
        ["mesh.data=2", "mesh.expert=4", "train.batch_size=8", "train.seq_len=16"]
        + ["model.compute_dtype=bfloat16", "model.hidden_size=128", "model.moe_mlp_dim=64"],
    )
    layout = build_layout(config, platform="cuda", device_kind="NVIDIA H200")
    assert layout.grouped_matmul.name == "mosaic_gpu"
    text = lower_train_step(config, "cuda").as_text()
    # Forward (gate+up, down), dx and dw of each, in the scanned MoE layer and the MTP layer.
    assert len(re.findall(r"custom_call @mosaic_gpu_v2", text)) >= 12
    assert not re.findall(r"(chlo|stablehlo)\.ragged_dot", text)
    if layout.attention.name == "triton":  # jax 0.10 lowers Triton without a GPU; newer jax falls back to chunked
        assert re.findall(r"xla\.gpu\.triton", text)
    else:
        assert layout.attention.name == "chunked" and "without a GPU" in layout.attention.reason
