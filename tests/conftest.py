"""Every test runs on CPU with 8 fake devices; the flags must be set before jax starts.

The tests compare numbers, not speed, so XLA:CPU compiles with its cheap LLVM settings (the
dry run's FAST_CPU_COMPILE): the suite spends most of its time compiling small programs, and
this takes about a third off it. Where the installed jaxlib still has XLA:CPU's older loop
emitters (jaxlib 0.10; gone by 0.12), the tests use them: they compile tiny's train step in
about 60% of the MLIR fusion emitters' time (13.2 -> 7.6 s on a 2 x 2 x 2 mesh). A setting
already in XLA_FLAGS is kept.

Many tests (and the jobs they start as subprocesses) compile the same small programs: jax's
persistent compilation cache, shared by the suite's workers and jobs, compiles each once. Its
key is the program, the XLA flags and the jax and jaxlib versions, so a stale entry is never
used; `JAX_COMPILATION_CACHE_DIR` set by the caller wins.
"""

import os
import signal
import socket
import tempfile
from pathlib import Path

import numpy as np
import pytest

from maxmoe.xla_flags import FAST_CPU_COMPILE, as_flags, flag_name, jaxlib_version  # imports no jax

ROOT = Path(__file__).resolve().parents[1]
_DEVICE_COUNT = "xla_force_host_platform_device_count"
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if flag_name(f) != _DEVICE_COUNT]
_EMITTERS = ["xla_cpu_use_fusion_emitters"] if jaxlib_version() < (0, 11) else []
_fast = {**FAST_CPU_COMPILE, **dict.fromkeys(_EMITTERS, False)}
_flags += [f for f in as_flags(_fast) if flag_name(f) not in {flag_name(g) for g in _flags}]
# Compiler options for a program whose test bound was measured on the emitters users compile
# with (a compiled memory size, a last-bit difference between two programs): `jax.jit(...,
# compiler_options=DEFAULT_EMITTERS)`.
DEFAULT_EMITTERS = dict.fromkeys(_EMITTERS, True)
# Compiler options for a program a test runs for many steps (tens of tiny's full-size steps):
# LLVM at level 1 takes about twice the suite's compile time and runs the steps ~2.7x faster
# (tiny's train step on one device, idle: 6.6 -> 12.8 s to compile, 0.64 -> 0.24 s a step).
MANY_STEPS = {"xla_backend_optimization_level": 1}
os.environ["XLA_FLAGS"] = " ".join([*_flags, f"--{_DEVICE_COUNT}=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tempfile.gettempdir()) / "maxmoe-tests-jax-cache"))
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))  # bytes; least recently used go first


# Test files by their CPU time in a full run, heaviest first (a clean clone, a cold compilation
# cache, two idle cores). `--dist loadfile` gives a worker the next file in this order when it
# runs dry (pyproject's `--no-loadscope-reorder` keeps the order), so the long files start first
# and the short ones even out the workers' ends. The files not named follow in their own order.
HEAVY_FIRST = (
    "test_checkpoint.py",
    "test_pipeline.py",
    "test_mesh_parity.py",
    "test_train.py",
    "test_overlap.py",
    "test_context.py",
    "test_two_tier.py",
    "test_gpu_sim.py",
    "test_pipeline_bf16.py",
    "test_first_run.py",
    "test_fp8_training.py",
    "test_fp8_dense.py",
    "test_sweep.py",
    "test_convert.py",
    "test_benchmarks.py",
    "test_lowering.py",
    "test_reliability.py",
    "test_kernels.py",
    "test_notebook.py",
    "test_dispatch.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def job_env(**extra: str) -> dict:
    """The environment of a maxmoe job a test starts as a subprocess: this checkout on the path,
    the suite's XLA flags without the device count (the job's run.cpu_devices decides it)."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": " ".join(_flags), **extra}


def host_init_state(config):
    """A config's step-0 train state as host arrays (the model's init run op by op): the one start
    that every layout of a parity test puts on its own shardings."""
    import jax

    from maxmoe.training.optim import make_optimizer
    from maxmoe.training.step import init_state

    return jax.tree.map(np.asarray, init_state(config, make_optimizer(config.train), jax.random.key(0)))


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (for a jax.distributed coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def interpreted_fp8_kernels(monkeypatch) -> list:
    """Blockwise FP8 as on a GPU target, here: maxmoe's Triton kernels (maxmoe.kernels.fp8_matmul's
    references to them) run in Pallas interpret mode and count as available. Returns the list
    of the kernels' names in call order."""
    from maxmoe.kernels import fp8_matmul
    from maxmoe.kernels.fp8_grouped import blockwise_grouped_gemm, fp8_grouped_wgrad

    calls = []

    def interpreted(kernel):
        def run(*args, **kwargs):
            calls.append(kernel.__name__)
            return kernel(*args, **kwargs, interpret=True)

        return run

    for kernel in (blockwise_grouped_gemm, fp8_grouped_wgrad):
        monkeypatch.setattr(fp8_matmul, kernel.__name__, interpreted(kernel))
    monkeypatch.setattr(fp8_matmul, "triton_lowers_here", lambda: "")
    return calls


@pytest.fixture
def fp8_kernel_contracts(monkeypatch) -> list:
    """Blockwise FP8 as on a GPU target, inside shard_map: maxmoe's two Triton kernels replaced
    by plain jnp programs of their contracts (Pallas' interpreter cannot run under shard_map's
    type check: it slices varying operands with unvarying indices, jax 0.10-0.12). Returns the
    list of the kernels' names in call order."""
    import jax
    import jax.numpy as jnp

    from maxmoe.kernels import fp8_matmul
    from maxmoe.kernels.fp8_grouped import TILE

    calls = []

    def blockwise_grouped_gemm(aq_MK, a_scale_MC, bq_GNK, b_scale_GCN, group_sizes_G, out_dtype=jnp.float32, name=""):
        calls.append("blockwise_grouped_gemm")  # `name`: the kernel's, dense or grouped (one function)
        m, k = aq_MK.shape
        g, n, _ = bq_GNK.shape
        rows = jnp.arange(m)
        group_M = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes_G), rows, side="right"), g - 1)
        a_MCT = aq_MK.astype(jnp.float32).reshape(m, k // TILE, TILE)
        b_GNCT = bq_GNK.astype(jnp.float32).reshape(g, n, k // TILE, TILE)
        partial_MCN = jnp.einsum("mct,gnct,mg->mcn", a_MCT, b_GNCT, jax.nn.one_hot(group_M, g))
        out = jnp.einsum("mcn,mc,mcn->mn", partial_MCN, a_scale_MC, b_scale_GCN[group_M])
        return jnp.where((rows < jnp.sum(group_sizes_G))[:, None], out, 0.0).astype(out_dtype)

    def fp8_grouped_wgrad(xq_DM, dyq_FM, group_sizes_G):
        calls.append("fp8_grouped_wgrad")
        ends = jnp.cumsum(group_sizes_G)
        rows = jnp.arange(xq_DM.shape[1])
        in_group_GM = (rows >= ends[:, None] - group_sizes_G[:, None]) & (rows < ends[:, None])
        return jnp.einsum("dm,fm,gm->gdf", xq_DM.astype(jnp.float32), dyq_FM.astype(jnp.float32), in_group_GM)

    monkeypatch.setattr(fp8_matmul, "blockwise_grouped_gemm", blockwise_grouped_gemm)
    monkeypatch.setattr(fp8_matmul, "fp8_grouped_wgrad", fp8_grouped_wgrad)
    monkeypatch.setattr(fp8_matmul, "triton_lowers_here", lambda: "")
    return calls


def pytest_sessionfinish(session):
    """In a pytest-xdist worker, ignore SIGINT from here on: when the worker's wrap-up (freeing
    compiled programs, collecting garbage) outlasts execnet's 5 s, execnet sends its own process a
    SIGINT, and the KeyboardInterrupt lands in jax's gc callback as a warning that looks like a
    crash at the end of a passing run. The worker finishes its wrap-up either way."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not the main thread: no Python handlers to set
            pass
