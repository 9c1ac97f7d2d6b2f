"""Grouped-matmul backends (the routed experts' GEMM), forward and forward+backward, against a dense matmul.

    PYTHONPATH=. python benchmarks/grouped_matmul.py [--shape proxy --shape 671b] [--valid 0.5]
        [--backend ragged_dot --backend mosaic_gpu ...] [--peak 8192] [--repeats 10] [--json OUT]

Shapes (rows M x [G, D, F] weights, the first `--valid` fraction of the rows in balanced groups,
the rest padding, as in a dispatch receive buffer):
  proxy   M=262,144 (proxy_1gpu: 8 x 4096 tokens x top-8), G=64, D=2048, F=512
  671b    M=65,536 (one GPU of the 671B plan: buffer 2 x 4096 x 8), G=4, D=7168, F=2048
  small   M=256, G=8, D=64, F=64 (the CPU smoke test)
  custom  --rows --groups --d --f
Per backend and shape: ms, TFLOP/s on the useful FLOPs (2 x valid rows x D x F forward, 3x that
forward+backward), and executed/useful FLOPs from XLA's `compiled.cost_analysis()` (custom
calls such as Pallas kernels are not counted by XLA: shown as "-"). `dense` is one
[valid rows, D] x [D, F] matmul of the same useful FLOPs: the ceiling. Backends are the
ones of `maxmoe.kernels.grouped_matmul` (through maxmoe's own interface); one that cannot
run here is listed with the reason. --peak N also times one bf16 N^3 matmul. --tiles sweeps the
Mosaic GPU forward kernel's tiles (TILE_CANDIDATES) on each shape's forward and dx GEMMs and prints
the fastest as entries of maxmoe.kernels.mosaic_ragged_dot.TILES.
"""

import argparse
import sys

from results import command_line, rows_writer, timed

SHAPES = {
    "proxy": dict(rows=262144, groups=64, d=2048, f=512),
    "671b": dict(rows=65536, groups=4, d=7168, f=2048),
    "small": dict(rows=256, groups=8, d=64, f=64),
}
BACKENDS = ("dense", "ragged_dot", "mosaic_gpu", "tokamax", "dense_loop")
# (block_m, block_n, block_k, stages) the tile sweep tries; the first is pick_blocks' rule.
TILE_CANDIDATES = ((128, 128, 64, 4), (128, 256, 64, 4), (128, 256, 64, 3), (128, 128, 128, 3), (64, 128, 64, 4))


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


def _functions(backend, dtype):
    """(forward, forward+backward) of one backend: fn(x, w, sizes, cotangent)."""
    import jax
    import jax.numpy as jnp

    from maxmoe.kernels.grouped_matmul import grouped_matmul

    if backend == "dense":

        def forward(x, w, sizes, ct):
            del sizes, ct
            return jnp.dot(x, w[0], preferred_element_type=jnp.float32).astype(dtype)
    else:

        def forward(x, w, sizes, ct):
            del ct
            return grouped_matmul(x, w, sizes, backend=backend)

    def loss(x, w, sizes, ct):
        return jnp.sum(forward(x, w, sizes, ct).astype(jnp.float32) * ct)

    # value_and_grad: the GEMM is linear, so jax.grad alone would let XLA drop the forward and the
    # row would time dx and dw only while crediting 3x the forward's FLOPs.
    return jax.jit(forward), jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _unavailable(backend, platform, dtype_name):
    if backend == "mosaic_gpu":
        from maxmoe.kernels.choice import resolve_grouped_matmul, target

        choice = resolve_grouped_matmul("auto", *target(), dtype_name)
        if choice.name != "mosaic_gpu":
            return f"not available: {choice.reason}"
    if backend == "tokamax":
        from maxmoe.kernels.grouped_matmul import tokamax_problem

        if tokamax_problem():
            return f"not available: {tokamax_problem()}"
    if backend == "dense_loop" and platform != "cpu":
        return "skipped: the G x FLOPs oracle"
    return ""


def run_shape(name, shape, valid, backends, dtype_name, repeats, emit=lambda rows: None):
    """Rows of the table for one shape; `emit(rows so far)` after each backend's row."""
    import jax
    import jax.numpy as jnp

    dtype = getattr(jnp, dtype_name)
    m, g, d, f = shape["rows"], shape["groups"], shape["d"], shape["f"]
    valid_rows = max(g, int(m * valid) // g * g)
    sizes = jnp.full((g,), valid_rows // g, jnp.int32)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, d), dtype)
    w = (jax.random.normal(keys[1], (g, d, f), jnp.float32) / d**0.5).astype(dtype)
    ct = jax.random.normal(keys[2], (m, f), jnp.float32)
    useful = 2 * valid_rows * d * f
    platform = jax.devices()[0].platform
    rows = []
    for backend in backends:
        row = {"shape": name, "backend": backend, "useful_gflop": useful / 1e9, "valid_rows": valid_rows, "rows": m}
        status = _unavailable(backend, platform, dtype_name)
        args = (x[:valid_rows], w, sizes, ct[:valid_rows]) if backend == "dense" else (x, w, sizes, ct)
        for part in ("fwd", "fwd_bwd"):
            row[part] = {"ms": None, "tflops": None, "flops_ratio": None, "status": status or "ok"}
        if not status:
            forward, forward_backward = _functions(backend, dtype)
            for part, fn, factor in (("fwd", forward, 1), ("fwd_bwd", forward_backward, 3)):
                try:
                    compiled = fn.trace(*args).lower().compile()
                    cost = compiled.cost_analysis()
                    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
                    executed = (cost or {}).get("flops")
                    seconds = timed(compiled, args, repeats)
                    row[part] = {
                        "ms": seconds * 1e3,
                        "tflops": factor * useful / seconds / 1e12,
                        # Custom calls (Pallas kernels) are invisible to XLA's count.
                        "flops_ratio": executed / (factor * useful) if executed and backend != "mosaic_gpu" else None,
                        "status": "ok",
                    }
                except Exception as e:  # noqa: BLE001 - report the failure in the table, go on
                    message = str(e).splitlines()[0][:120] if str(e) else ""
                    row[part]["status"] = f"failed: {type(e).__name__}: {message}"
        rows.append(row)
        emit(rows)
    dense = {part: rows[0][part]["tflops"] for part in ("fwd", "fwd_bwd")} if backends[0] == "dense" else {}
    for row in rows:
        for part in ("fwd", "fwd_bwd"):
            tf, ref = row[part]["tflops"], dense.get(part)
            row[part]["vs_dense"] = tf / ref if tf and ref else None
    return rows


def sweep_tiles(name, shape, valid, repeats, emit=lambda rows: None):
    """Rows of the tile sweep for one shape: each candidate on the forward GEMM [D -> F] and the
    dx GEMM [F -> D] (transposed weights), the forward kernel alone, TFLOP/s on the valid rows."""
    import jax
    import jax.numpy as jnp

    from maxmoe.kernels.mosaic_ragged_dot import Blocks, mosaic_kernels

    m, g, d, f = shape["rows"], shape["groups"], shape["d"], shape["f"]
    valid_rows = max(g, int(m * valid) // g * g)
    sizes = jnp.full((g,), valid_rows // g, jnp.int32)
    rows = []
    for gemm, k, n, transpose in (("fwd", d, f, False), ("dx", f, d, True)):
        x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(1), (g, n, k) if transpose else (g, k, n), jnp.bfloat16)
        for bm, bn, bk, stages in TILE_CANDIDATES:
            row = {"shape": name, "gemm": gemm, "k": k, "n": n, "transpose_rhs": transpose}
            row.update(block_m=bm, block_n=bn, block_k=bk, stages=stages, ms=None, tflops=None)
            if k % bk or n % bn:
                row["status"] = "skipped: the tile does not divide the GEMM"
            else:
                kernels = mosaic_kernels({(k, n, transpose): Blocks(bm, bn, bk, stages)})
                try:
                    fn = jax.jit(
                        lambda x, w, s, kernels=kernels, t=transpose: kernels.forward(x, w, s, transpose_rhs=t)
                    )
                    seconds = timed(fn.trace(x, w, sizes).lower().compile(), (x, w, sizes), repeats)
                    row.update(ms=seconds * 1e3, tflops=2 * valid_rows * k * n / seconds / 1e12, status="ok")
                except Exception as e:  # noqa: BLE001 - a tile the kernel refuses is a row, not the end
                    row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
            rows.append(row)
            emit(rows)
    return rows


def best_tiles(rows) -> list[str]:
    """The fastest tile per GEMM as TILES entries (Python), with the rate it reached."""
    best = {}
    for r in rows:
        key = (r["k"], r["n"], r["transpose_rhs"])
        if r["tflops"] is not None and r["tflops"] > best.get(key, {"tflops": -1})["tflops"]:
            best[key] = r
    return [
        f"    ({k}, {n}, {t}): Blocks({r['block_m']}, {r['block_n']}, {r['block_k']}, {r['stages']}),"
        f"  # {r['shape']} {r['gemm']}: {r['tflops']:.0f} TFLOP/s"
        for (k, n, t), r in best.items()
    ]


def gemm_table(rows, labels, ratios):
    """A forward and a forward+backward column group per row: ms, TFLOP/s, then the ratios.

    labels: (key, header, width) of the left-aligned columns naming a row; ratios: (key,
    header, width) of each group's ratio columns, two decimals. Absent values print as "-".
    """

    def cell(value, spec, width):
        return f"{format(value, spec) if value is not None else '-':>{width}}"

    def group(title):
        return [(title, 9), ("TFLOP/s", 8)] + [(header, width) for _, header, width in ratios]

    head = " ".join(
        [f"{header:<{width}}" for _, header, width in labels]
        + [f"{header:>{width}}" for title in ("fwd ms", "f+b ms") for header, width in group(title)]
    )
    head += "  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [f"{r[key]:<{width}}" for key, _, width in labels]
        for part in (r["fwd"], r["fwd_bwd"]):
            cells += [cell(part["ms"], "9.3f", 9), cell(part["tflops"], "8.1f", 8)]
            cells += [cell(part.get(key), f"{width}.2f", width) for key, _, width in ratios]
        f, b = r["fwd"]["status"], r["fwd_bwd"]["status"]
        lines.append(" ".join(cells) + f"  {f if f == b else f'{f} / {b}'}")
    return "\n".join(lines)


def format_table(rows):
    return gemm_table(
        rows,
        [("shape", "shape", 6), ("backend", "backend", 11)],
        [("vs_dense", "x dense", 7), ("flops_ratio", "exec/use", 8)],
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES) + ["custom"], help="repeatable")
    parser.add_argument("--rows", type=int, default=32768, help="custom: M")
    parser.add_argument("--groups", type=int, default=64, help="custom: G")
    parser.add_argument("--d", type=int, default=2048, help="custom: D")
    parser.add_argument("--f", type=int, default=512, help="custom: F")
    parser.add_argument("--valid", type=float, default=0.5, help="fraction of the rows that hold tokens")
    parser.add_argument("--backend", action="append", choices=BACKENDS, help="repeatable; default: all")
    parser.add_argument("--peak", type=int, default=0, help="also time one N^3 matmul (0: skip)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tiles", action="store_true", help="sweep the Mosaic GPU forward kernel's tiles instead")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not 0 < args.valid <= 1:
        parser.error("--valid must be in (0, 1]")
    if min(args.rows, args.groups, args.d, args.f, args.repeats) <= 0:
        parser.error("sizes and --repeats must be positive")
    import jax
    import jax.numpy as jnp

    from maxmoe.runtime import use_compile_cache

    use_compile_cache()  # a rerun loads the programs this one compiled
    shapes = {}
    for name in args.shape or ["proxy", "671b"]:
        shapes[name] = SHAPES.get(name) or dict(rows=args.rows, groups=args.groups, d=args.d, f=args.f)
    backends = args.backend or list(BACKENDS)
    backends = ["dense"] + [b for b in backends if b != "dense"]
    command = command_line()
    device = jax.devices()[0]
    peak = matmul_peak(args.peak, getattr(jnp, args.dtype), args.repeats) if args.peak else None
    rows = []

    write = rows_writer(
        args.json,
        command=command,
        device_kind=device.device_kind,
        jax=jax.__version__,
        dtype=args.dtype,
        valid=args.valid,
        peak=peak,
        shapes=shapes,
    )

    write(rows)
    if args.tiles:
        return tile_sweep(shapes, args, write, command)
    for name, shape in shapes.items():
        done = list(rows)
        rows += run_shape(
            name, shape, args.valid, backends, args.dtype, args.repeats, lambda new, done=done: write(done + new)
        )
    print(f"$ {command}")
    print(f"jax {jax.__version__}, {device.platform} {device.device_kind}, {args.dtype}, valid rows {args.valid:.0%}")
    for name, s in shapes.items():
        print(f"  {name}: M={s['rows']} G={s['groups']} D={s['d']} F={s['f']}")
    if peak:
        print(f"matmul peak: {peak['tflops']:.2f} TFLOP/s ({args.peak}^3, {peak['ms']:.3f} ms)")
    print(format_table(rows))
    write(rows)
    failed = [
        f"{r['shape']} {r['backend']} {p}"
        for r in rows
        for p in ("fwd", "fwd_bwd")
        if r[p]["status"].startswith("failed")
    ]
    if failed:
        print(f"grouped matmul: {len(failed)} measurement(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def tile_sweep(shapes, args, write, command) -> int:
    """--tiles: the sweep's rows per shape, the table, and the fastest tiles as TILES entries."""
    from maxmoe.kernels.choice import resolve_grouped_matmul, target

    choice = resolve_grouped_matmul("auto", *target())
    if choice.name != "mosaic_gpu":
        print(f"$ {command}\ntile sweep: the Mosaic GPU kernels cannot run here ({choice.reason})")
        return 0
    rows = []
    for name, shape in shapes.items():
        done = list(rows)
        rows += sweep_tiles(name, shape, args.valid, args.repeats, lambda new, done=done: write(done + new))
    print(f"$ {command}")
    head = f"{'shape':<6} {'gemm':<4} {'k':>6} {'n':>6} {'tile m,n,k,stages':<18} {'ms':>9} {'TFLOP/s':>8}  status"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        tile = f"{r['block_m']},{r['block_n']},{r['block_k']},{r['stages']}"
        ms, tf = (f"{r['ms']:9.3f}", f"{r['tflops']:8.1f}") if r["ms"] is not None else (f"{'-':>9}", f"{'-':>8}")
        print(f"{r['shape']:<6} {r['gemm']:<4} {r['k']:>6} {r['n']:>6} {tile:<18} {ms} {tf}  {r['status']}")
    print("fastest, as maxmoe.kernels.mosaic_ragged_dot.TILES entries:\n" + "\n".join(best_tiles(rows)))
    write(rows)
    return 1 if any(r["status"].startswith("failed") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
