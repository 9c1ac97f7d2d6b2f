"""moe: expert dispatch and load balancing, and the checks of what the dispatch can run."""

from __future__ import annotations

import dataclasses

from maxmoe.config.errors import ConfigError
from maxmoe.config.fields import field

DISPATCH_STRATEGIES = ("ragged_a2a", "allgather", "capacity")  # maxmoe.parallel.dispatch
GROUPED_MATMUL_BACKENDS = ("ragged_dot", "mosaic_gpu", "tokamax", "dense_loop")  # maxmoe.kernels.grouped_matmul
MOE_OVERLAPS = ("none", "batch_split")  # maxmoe.parallel.dispatch


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Expert dispatch and load balancing."""

    dispatch: str = field(
        "auto",
        choices=("auto",) + DISPATCH_STRATEGIES,
        doc="how tokens reach experts: ragged all-to-all (dropless), all-gather, or fixed capacity; auto: ragged_a2a",
    )
    capacity_factor: float = field(1.25, gt=0, doc="capacity dispatch: slots per expert / even share")
    buffer_factor: float = field(0.0, ge=0, doc="0: dropless receive buffers; >0 bounds them")
    grouped_matmul: str = field(
        "auto",
        choices=("auto",) + GROUPED_MATMUL_BACKENDS,
        doc="grouped GEMM backend for the experts; auto: on NVIDIA GPUs the one measured fastest there "
        "(maxmoe/kernels/rates.yaml), else mosaic_gpu on Hopper, tokamax where installed (Blackwell "
        "without it: refused); ragged_dot off the GPU (maxmoe.kernels.choice)",
    )
    overlap: str = field(
        "none", choices=MOE_OVERLAPS, doc="batch_split: each shard's tokens as two independent dispatch halves"
    )
    a2a_chunks: int = field(1, gt=0, doc="ragged_a2a: slices per (source, destination) block of each all-to-all")
    emulate_ragged_a2a: str = field(
        "auto", choices=("auto", "true", "false"), doc="auto: emulate where the backend lacks ragged all-to-all"
    )
    fp8_dispatch: bool = field(
        False,
        doc="with model.fp8: the dispatch all-to-all moves rows in e4m3 plus scales (about half the bytes); "
        "the combine stays in the compute dtype",
    )
    bias_update_rate: float = field(
        0.001, ge=0, doc="aux-loss-free balancing: router bias step per training step (DeepSeek-V3: 0.001)"
    )
    seq_aux_alpha: float = field(0.0001, ge=0, doc="sequence-wise balance loss weight (DeepSeek-V3: 0.0001)")


def check_moe(config) -> None:
    """What the dispatch strategy can run: FP8 experts need a grouped GEMM (capacity dispatch has
    none); FP8 rows on the wire need FP8 experts and the ragged all-to-all."""
    m, moe = config.model, config.moe
    if m.fp8 != "none" and moe.dispatch == "capacity":
        raise ConfigError(
            f"model.fp8={m.fp8} runs the experts' grouped GEMM in FP8; moe.dispatch=capacity has no grouped "
            f"GEMM: set moe.dispatch=ragged_a2a (or allgather), or model.fp8=none"
        )
    if moe.fp8_dispatch and (m.fp8 == "none" or moe.dispatch not in ("auto", "ragged_a2a")):
        raise ConfigError(
            f"moe.fp8_dispatch=true sends FP8 rows to FP8 experts over the ragged all-to-all: set model.fp8 "
            f"and moe.dispatch=ragged_a2a (or auto), or moe.fp8_dispatch=false; got model.fp8={m.fp8}, "
            f"moe.dispatch={moe.dispatch}"
        )
