"""Grouped matmul (the routed experts' GEMM) backends against one dense matmul of the same FLOPs.

    PYTHONPATH=. python benchmarks/grouped_matmul.py [--rows 32768 --d 2048 --f 512 --groups 64] [--peak 8192]
                                                   [--dtype bfloat16] [--repeats 20] [--json OUT]

Rows M (token copies sorted by expert) x [G, D, F] weights, balanced groups (M/G rows each).
Backends, each reported as measured or with the reason it did not run:
  dense            one [M, D] x [D, F] matmul: same 2 M D F FLOPs, the ceiling to compare with
  ragged_dot       jax.lax.ragged_dot (what maxmoe.parallel.grouped_matmul uses)
  pallas_mgpu      jax.experimental.pallas.ops.gpu.ragged_dot_mgpu (Mosaic GPU kernel; Hopper)
  te_grouped_gemm  transformer_engine.jax grouped GEMM, when transformer-engine is installed
--peak N also times one bf16 N x N x N matmul: the device's practical matmul peak.
Defaults are the proxy_1gpu expert GEMM (32768 tokens x top-8 / 8 ... sized to one device).
"""

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path


def timed(fn, args, repeats):
    """Mean seconds per call after one warm-up (compile) call."""
    import jax

    out = fn(*args)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def matmul_peak(n, dtype, repeats):
    """TFLOP/s of one n x n x n matmul."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    seconds = timed(
        jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(dtype)), (a, b), repeats
    )
    return {"name": f"dense {n}^3", "ms": seconds * 1e3, "tflops": 2 * n**3 / seconds / 1e12, "status": "ok"}


def _pallas_mgpu(x, w, sizes):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    return ragged_dot_mgpu.ragged_dot(
        x, w, group_sizes=sizes, block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1
    )


def _te_grouped(x, w, sizes):
    import transformer_engine.jax as te  # noqa: F401 - presence check; API differs between releases
    from transformer_engine.jax import cpp_extensions

    grouped = getattr(cpp_extensions, "grouped_gemm", None)
    if grouped is None:
        raise RuntimeError("this transformer_engine has no grouped_gemm")
    return grouped(x, w, sizes)


def grouped_backends(rows, d, f, groups, dtype, repeats):
    """Rows of the table for each backend (same FLOPs: 2 rows d f)."""
    import jax
    import jax.numpy as jnp

    flops = 2 * rows * d * f
    x = jax.random.normal(jax.random.key(0), (rows, d), dtype)
    w = jax.random.normal(jax.random.key(1), (groups, d, f), dtype) / d**0.5
    w_dense = w[0]
    sizes = jnp.full((groups,), rows // groups, jnp.int32).at[-1].add(rows - groups * (rows // groups))
    platform = jax.devices()[0].platform
    candidates = [
        (
            "dense",
            lambda: jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype)),
            (x, w_dense),
        ),
        (
            "ragged_dot",
            lambda: jax.jit(
                lambda a, b, s: jax.lax.ragged_dot(a, b, s, preferred_element_type=jnp.float32).astype(dtype)
            ),
            (x, w, sizes),
        ),
        ("pallas_mgpu", lambda: jax.jit(_pallas_mgpu), (x, w, sizes)),
        ("te_grouped_gemm", lambda: jax.jit(_te_grouped), (x, w, sizes)),
    ]
    results = []
    for name, make, args in candidates:
        status = "ok"
        if name == "pallas_mgpu":
            try:
                from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # noqa: F401
            except Exception as e:  # noqa: BLE001 - any import failure means "not available"
                status = f"not available ({type(e).__name__})"
            else:
                if platform != "gpu":
                    status = f"not available (Mosaic GPU kernel; needs an NVIDIA Hopper GPU, not {platform})"
        if name == "te_grouped_gemm":
            try:
                import transformer_engine.jax  # noqa: F401
            except Exception:  # noqa: BLE001
                status = "not installed (transformer_engine.jax)"
        if status != "ok":
            results.append({"name": name, "ms": None, "tflops": None, "status": status})
            continue
        try:
            seconds = timed(make(), args, repeats)
            results.append({"name": name, "ms": seconds * 1e3, "tflops": flops / seconds / 1e12, "status": "ok"})
        except Exception as e:  # noqa: BLE001 - report the failure in the table
            results.append(
                {
                    "name": name,
                    "ms": None,
                    "tflops": None,
                    "status": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}",
                }
            )
    dense = results[0]["tflops"]
    for r in results:
        r["vs_dense"] = r["tflops"] / dense if r["tflops"] and dense else None
    return results


def format_table(rows):
    head = f"{'backend':<18} {'ms':>9} {'TFLOP/s':>9} {'vs dense':>8}  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        ms = f"{r['ms']:9.3f}" if r["ms"] is not None else f"{'-':>9}"
        tf = f"{r['tflops']:9.2f}" if r["tflops"] is not None else f"{'-':>9}"
        vs = f"{r['vs_dense']:8.2f}" if r.get("vs_dense") is not None else f"{'-':>8}"
        lines.append(f"{r['name']:<18} {ms} {tf} {vs}  {r['status']}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32768, help="M: token copies on this device")
    parser.add_argument("--d", type=int, default=2048, help="D: input features (hidden)")
    parser.add_argument("--f", type=int, default=512, help="F: output features (expert MLP)")
    parser.add_argument("--groups", type=int, default=64, help="G: local experts")
    parser.add_argument("--peak", type=int, default=0, help="also time one N^3 matmul (0: skip)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    for name in ("rows", "d", "f", "groups", "repeats"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive")
    import jax
    import jax.numpy as jnp

    dtype = getattr(jnp, args.dtype)
    command = " ".join(
        shlex.quote(a) for a in [f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}", sys.executable] + sys.argv
    )
    device = jax.devices()[0]
    peak = matmul_peak(args.peak, dtype, args.repeats) if args.peak else None
    rows = grouped_backends(args.rows, args.d, args.f, args.groups, dtype, args.repeats)
    print(f"$ {command}")
    print(
        f"jax {jax.__version__}, {device.platform} {device.device_kind}, {args.dtype}, M={args.rows} D={args.d} "
        f"F={args.f} G={args.groups}"
    )
    if peak:
        print(f"matmul peak: {peak['tflops']:.2f} TFLOP/s ({args.peak}^3, {peak['ms']:.3f} ms)")
    print(format_table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": command,
                    "device_kind": device.device_kind,
                    "jax": jax.__version__,
                    "dtype": args.dtype,
                    "peak": peak,
                    "shape": {"rows": args.rows, "d": args.d, "f": args.f, "groups": args.groups},
                    "backends": rows,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
