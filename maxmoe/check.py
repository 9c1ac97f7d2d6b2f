"""`python -m maxmoe.check` (or `python -m maxmoe.info --check`): the kernels this device runs, against XLA.

    python -m maxmoe.check [--json rows.jsonl] [--only CHECK ...] [--preflight]

Prints a preflight line (device, compute capability, jax, CUDA and cuDNN versions, the Mosaic
GPU toolchain, free memory), then one row per check (`CHECKS`) as soon as it is measured,
appended to --json: every kernel `auto` can choose (grouped GEMMs, attention cores, FP8 GEMMs),
forward value and both gradients against an XLA oracle on the same inputs, max relative error
against a tolerance. A check that cannot run here says why; one that fails or crashes is
recorded and the next one runs. Off a GPU, Triton kernels run in Pallas interpret mode in
float32. Exit status 0 when no check failed, 1 otherwise.

docs/KERNELS.md, "Checking a machine's kernels" has each check's case and oracle.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4}  # bf16 inputs: a few ulps of bf16 after long sums
GROUP_SIZES = (300, 0, 500, 100)  # 900 of 1,024 rows: uneven, one empty group, 124 rows past the groups
ROWS, MODEL_DIM, EXPERT_DIM = 1024, 256, 192
ATTENTION = dict(batch=1, seq=256, heads=2, qk=192, v=128)


class Unavailable(Exception):
    """The check cannot run on this host; the message says why."""


@dataclasses.dataclass
class Row:
    """One check's outcome."""

    check: str
    status: str  # pass, fail, needs a GPU / not installed ..., error
    max_rel_error: float | None = None
    tolerance: float | None = None
    detail: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        err = "-" if self.max_rel_error is None else f"{self.max_rel_error:.2e}"
        tol = "-" if self.tolerance is None else f"{self.tolerance:.0e}"
        return f"{self.check:<28} {self.status:<6} max rel err {err:>8} (tol {tol}) {self.detail}".rstrip()


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def compute_dtype():
    """bf16 on a GPU (what the kernels run in training); float32 off it (interpret mode, exact oracles)."""
    return jnp.bfloat16 if on_gpu() else jnp.float32


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def value_and_grads(fn, *args):
    """fn(*args) and the gradients of sum(fn * fixed cotangent) in every argument, jitted."""
    out_shape = jax.eval_shape(fn, *args)
    cotangent = jax.random.normal(jax.random.key(7), out_shape.shape, jnp.float32)

    def loss(*a):
        out = fn(*a)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)
    return (out, *grads)


def compare(names, got, want) -> tuple[float, str]:
    errors = [relative_error(g, w) for g, w in zip(got, want)]
    worst = max(errors)
    return worst, ", ".join(f"{n} {e:.1e}" for n, e in zip(names, errors))


# ----------------------------------------------------------------------------------------
# The checks: each returns (outputs' names, kernel's outputs, oracle's outputs) or raises Unavailable.


def _grouped_inputs(dtype):
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (ROWS, MODEL_DIM), jnp.float32).astype(dtype)
    w = (jax.random.normal(keys[1], (len(GROUP_SIZES), MODEL_DIM, EXPERT_DIM)) / MODEL_DIM**0.5).astype(dtype)
    return x, w, jnp.asarray(GROUP_SIZES, jnp.int32)


def grouped_check(backend: str):
    from maxmoe.kernels.grouped_matmul import grouped_matmul, tokamax_problem

    if backend == "tokamax" and tokamax_problem():
        raise Unavailable(tokamax_problem())
    if not on_gpu():
        raise Unavailable("needs a GPU (the kernel has no interpret mode)")
    from maxmoe.config import ConfigError
    from maxmoe.kernels.choice import resolve_grouped_matmul, target

    try:
        resolve_grouped_matmul(backend, *target())
    except ConfigError as e:  # e.g. Mosaic GPU's wgmma kernel on a GPU that is not Hopper
        raise Unavailable(str(e)) from None
    x, w, sizes = _grouped_inputs(jnp.bfloat16)
    got = value_and_grads(lambda x, w: grouped_matmul(x, w, sizes, backend=backend), x, w)
    want = value_and_grads(
        lambda x, w: grouped_matmul(x.astype(jnp.float32), w.astype(jnp.float32), sizes, backend="ragged_dot"), x, w
    )
    past = np.asarray(got[0][sum(GROUP_SIZES) :], np.float32)
    if np.any(past):
        raise AssertionError(f"rows past the groups are not zero (max |value| {np.max(np.abs(past)):.3g})")
    return ("y", "dx", "dw"), got, want


def attention_check(name: str):
    from maxmoe.kernels import attention
    from maxmoe.kernels.grouped_matmul import tokamax_problem
    from maxmoe.model.attention_ops import xla_attention

    if name == "tokamax" and tokamax_problem():
        raise Unavailable(tokamax_problem())
    if name == "triton" and attention.triton_available():
        raise Unavailable(attention.triton_available())
    if name != "triton" and not on_gpu():
        raise Unavailable("needs a GPU")
    a = ATTENTION
    keys = jax.random.split(jax.random.key(1), 3)
    dtype = compute_dtype()
    q = jax.random.normal(keys[0], (a["batch"], a["seq"], a["heads"], a["qk"])).astype(dtype)
    k = jax.random.normal(keys[1], (a["batch"], a["seq"], a["heads"], a["qk"])).astype(dtype)
    v = jax.random.normal(keys[2], (a["batch"], a["seq"], a["heads"], a["v"])).astype(dtype)
    scale = a["qk"] ** -0.5
    kernel = functools.partial(attention.kernel(name), scale=scale, interpret=not on_gpu())
    got = value_and_grads(kernel, q, k, v)
    want = value_and_grads(
        lambda q, k, v: xla_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), scale),
        q,
        k,
        v,
    )
    return ("out", "dq", "dk", "dv"), got, want


def blockwise_dense_check():
    from maxmoe.kernels.attention import triton_available
    from maxmoe.kernels.fp8_grouped import blockwise_grouped_gemm, fp8_grouped_wgrad
    from maxmoe.kernels.fp8_matmul import BlockwiseKernels, fp8_matmul

    if triton_available():
        raise Unavailable(triton_available())
    interpret = not on_gpu()
    kernels = BlockwiseKernels(
        functools.partial(blockwise_grouped_gemm, interpret=interpret),
        functools.partial(fp8_grouped_wgrad, interpret=interpret),
    )
    x, w, _ = _grouped_inputs(compute_dtype())
    got = value_and_grads(lambda x, w: fp8_matmul(x, w, "blockwise", kernels), x[:256], w[0])
    want = value_and_grads(lambda x, w: fp8_matmul(x, w, "blockwise"), x[:256], w[0])
    return ("y", "dx", "dw"), got, want


def blockwise_grouped_check():
    from maxmoe.kernels.choice import resolve_grouped_matmul, target
    from maxmoe.kernels.fp8_matmul import fp8_grouped_matmul

    if not on_gpu():
        raise Unavailable("needs a GPU (the grouped path runs its kernels only beside a GPU grouped GEMM)")
    backend = resolve_grouped_matmul("auto", *target()).name
    if backend == "ragged_dot":
        raise Unavailable("auto runs XLA's blockwise program here (no GPU grouped GEMM): nothing to compare")
    x, w, sizes = _grouped_inputs(jnp.bfloat16)
    got = value_and_grads(lambda x, w: fp8_grouped_matmul(x, w, sizes, "blockwise", backend), x, w)
    want = value_and_grads(lambda x, w: fp8_grouped_matmul(x, w, sizes, "blockwise", "ragged_dot"), x, w)
    return ("y", "dx", "dw"), got, want


def dequantised_dense_check(recipe: str):
    """The recipe's three GEMMs against float32 products of their operands rounded as the recipe's table says."""
    from maxmoe.kernels.fp8_matmul import GEMMS, fp8_matmul
    from maxmoe.kernels.fp8_quant import round_trip

    x, w, _ = _grouped_inputs(compute_dtype())
    x, w = x[:256], w[0]
    got = value_and_grads(lambda x, w: fp8_matmul(x, w, recipe), x, w)
    cotangent = jax.random.normal(jax.random.key(7), got[0].shape, jnp.float32).astype(x.dtype)
    mx = recipe == "mxfp8"

    def product(a, b, gemm):
        a_dtype, a_block, b_dtype, b_block = GEMMS[recipe][gemm]
        a = round_trip(a.astype(jnp.float32), a_dtype, a_block, power_of_two=mx)
        b = round_trip(b.astype(jnp.float32), b_dtype, b_block, power_of_two=mx)
        return jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST)

    want = (product(x, w, "forward"), product(cotangent, w.T, "dgrad"), product(x.T, cotangent, "wgrad"))
    return ("y", "dx", "dw"), got, want


CHECKS: dict[str, Callable] = {
    "grouped mosaic_gpu": functools.partial(grouped_check, "mosaic_gpu"),
    "grouped tokamax": functools.partial(grouped_check, "tokamax"),
    "attention triton": functools.partial(attention_check, "triton"),
    "attention cudnn": functools.partial(attention_check, "cudnn"),
    "attention tokamax": functools.partial(attention_check, "tokamax"),
    "fp8 blockwise dense": blockwise_dense_check,
    "fp8 blockwise grouped": blockwise_grouped_check,
    "fp8 tensorwise dense": functools.partial(dequantised_dense_check, "tensorwise"),
    "fp8 mxfp8 dense": functools.partial(dequantised_dense_check, "mxfp8"),
}


def run_check(name: str, check: Callable) -> Row:
    """One check as a row; an exception becomes a failed row, never the end of the run."""
    start = time.perf_counter()
    tolerance = TOLERANCE[jnp.dtype(compute_dtype()).name]
    try:
        names, got, want = check()
        worst, detail = compare(names, got, want)
        status = "pass" if worst <= tolerance else "fail"
        row = Row(name, status, worst, tolerance, detail)
    except Unavailable as e:
        row = Row(name, "skip", detail=str(e))
    except Exception as e:  # noqa: BLE001 - a crashing kernel is a result to report; the next check runs
        row = Row(name, "error", tolerance=tolerance, detail=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    row.seconds = round(time.perf_counter() - start, 2)
    return row


# ----------------------------------------------------------------------------------------
# Preflight: what this machine is.


def _cuda_versions() -> dict:
    from jax._src import lib

    versions = getattr(lib, "cuda_versions", None)
    if versions is None:
        return {"cuda": None, "cudnn": None}

    def version(fn):
        try:
            return getattr(versions, fn)()
        except Exception:  # noqa: BLE001 - no CUDA runtime here
            return None

    return {"cuda": version("cuda_runtime_get_version"), "cudnn": version("cudnn_get_version")}


def _mosaic_toolchain() -> str:
    """Where Mosaic GPU's PTX compiler comes from: ptxas on PATH or in the nvidia-cuda-nvcc wheel, nvJitLink."""
    found = []
    if shutil.which("ptxas"):
        found.append("ptxas (PATH)")
    try:
        import nvidia.cuda_nvcc as nvcc  # the CUDA wheel jax[cuda] installs

        if any(os.path.exists(os.path.join(p, "bin", "ptxas")) for p in nvcc.__path__):
            found.append("ptxas (nvidia-cuda-nvcc)")
    except ImportError:
        pass
    try:
        import nvidia.nvjitlink  # noqa: F401

        found.append("nvjitlink")
    except ImportError:
        pass
    return ", ".join(found) or "none"


def preflight() -> dict:
    """Device kind, compute capability, jax / jaxlib / CUDA / cuDNN versions, Mosaic toolchain, free memory."""
    import jaxlib

    device = jax.devices()[0]
    stats = {}
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory statistics
        pass
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0) if stats else None
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "compute_capability": getattr(device, "compute_capability", None),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        **_cuda_versions(),
        "mosaic_toolchain": _mosaic_toolchain(),
        "free_memory_gb": None if free is None else round(free / 1e9, 1),
    }


def preflight_line(info: dict) -> str:
    cc = info["compute_capability"] or "-"
    free = "-" if info["free_memory_gb"] is None else f"{info['free_memory_gb']} GB"
    return (
        f"preflight: {info['devices']} x {info['device_kind']} ({info['platform']}, compute capability {cc}), "
        f"jax {info['jax']} / jaxlib {info['jaxlib']}, CUDA {info['cuda'] or '-'}, cuDNN {info['cudnn'] or '-'}, "
        f"Mosaic GPU toolchain: {info['mosaic_toolchain']}, free memory {free}"
    )


def run_all(json_path: str | None = None, only: list[str] | None = None, out=None) -> list[Row]:
    """Print the preflight line and one row per check as it finishes; append each to `json_path` (JSON lines)."""
    out = out or sys.stdout
    info = preflight()
    print(preflight_line(info), file=out, flush=True)
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    sink = open(json_path, "a") if json_path else None  # noqa: SIM115 - closed below, written row by row
    try:
        if sink:
            sink.write(json.dumps({"preflight": info}) + "\n")
            sink.flush()
        rows = []
        for name, check in CHECKS.items():
            if only and name not in only:
                continue
            row = run_check(name, check)
            rows.append(row)
            print(row.line(), file=out, flush=True)
            if sink:
                sink.write(json.dumps(dataclasses.asdict(row)) + "\n")
                sink.flush()
    finally:
        if sink:
            sink.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command line: run every check; exit 1 if any failed or crashed, 2 on bad arguments (one line)."""
    from maxmoe.cli import main_guard

    return main_guard(_main)(argv)


def _main(argv: list[str] | None) -> int:
    from maxmoe.cli import _Parser, check_output_file, path_argument  # usage errors: one `maxmoe: error:` line

    parser = _Parser(prog="python -m maxmoe.check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", type=path_argument, help="append the preflight and each row to this file (JSON lines)"
    )
    parser.add_argument("--only", action="append", choices=list(CHECKS), help="run only this check (repeatable)")
    parser.add_argument("--preflight", action="store_true", help="print the preflight line only")
    args = parser.parse_args(argv)
    if args.json:
        check_output_file(Path(args.json), "--json")  # before a minute of checks, not after
    if args.preflight:
        print(preflight_line(preflight()))
        return 0
    rows = run_all(args.json, args.only)
    bad = [r.check for r in rows if r.status in ("fail", "error")]
    print(f"check: {len(rows) - len(bad)} of {len(rows)} ran clean" + (f"; failed: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
