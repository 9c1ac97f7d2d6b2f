"""Causal MLA attention (qk head dim 192, v 128) per implementation, forward and forward+backward.

    PYTHONPATH=. python benchmarks/attention.py [--case 1,128,4096 --case 8,16,4096] [--impl cudnn --impl chunked ...]
        [--dtype bfloat16] [--repeats 5] [--json OUT]

Each case is B,H,T: by default the 671B model's heads on one sequence (1,128,4096, shape
"671b_heads") and proxy_1gpu's batch (8,16,4096, "proxy_heads"). Implementations: cudnn (cuDNN
through jax, v at its own head dim), tokamax (when installed), triton (jax's Pallas Triton
kernel, v padded to 192 and both to 256: the padded work is not counted), chunked (XLA, blocks
of --chunk) and xla (dense scores, the oracle); one that cannot run here is listed with the
reason. Reported per pass: ms, TFLOP/s on the model FLOPs (forward: the causal half,
2 x B x H x T^2/2 x (192 + 128); forward+backward 3x that, the convention of
maxmoe.analysis.flops and the rate table) and the compiled temp memory.
"""

import argparse
import sys

from results import command_line, rows_writer, timed

IMPLEMENTATIONS = ("cudnn", "tokamax", "triton", "chunked", "xla")  # kernels before XLA's cores
QK, V = 192, 128
SHAPES = {(1, 128, 4096): "671b_heads", (8, 16, 4096): "proxy_heads"}  # the rate table's shape names
PASSES = (("fwd", 1), ("fwd_bwd", 3))  # model FLOPs: backward counts twice the forward


def parse_case(text):
    b, h, t = (int(x) for x in text.split(","))
    return b, h, t


def attention_fn(name, chunk, platform):
    from maxmoe.kernels.attention import kernel
    from maxmoe.model.attention_ops import chunked_attention, xla_attention

    if name == "xla":
        return xla_attention
    if name == "chunked":
        return lambda q, k, v, s: chunked_attention(q, k, v, s, chunk)
    return lambda q, k, v, s: kernel(name)(q, k, v, s, interpret=platform != "gpu")


def _unavailable(name, platform):
    if name == "tokamax":
        from maxmoe.kernels.grouped_matmul import tokamax_problem

        return f"not available: {tokamax_problem()}" if tokamax_problem() else ""
    if name in ("triton", "cudnn") and platform != "gpu":
        return f"not run: {name} needs an NVIDIA GPU"
    return ""


def run_case(case, names, dtype_name, chunk, repeats, emit=lambda rows: None):
    """Rows for one (B, H, T); `emit(rows so far)` after each pass of each implementation."""
    import jax
    import jax.numpy as jnp

    b, h, t = case
    dtype = getattr(jnp, dtype_name)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, h, QK), dtype)
    k = jax.random.normal(keys[1], (b, t, h, QK), dtype)
    v = jax.random.normal(keys[2], (b, t, h, V), dtype)
    ct = jax.random.normal(keys[3], (b, t, h, V), dtype)
    forward_flops = 2 * b * h * t * t / 2 * (QK + V)
    platform = jax.devices()[0].platform
    rows = []
    for name in names:
        status = _unavailable(name, platform)
        row = {"case": f"B={b} H={h} T={t}", "shape": SHAPES.get(case, f"b{b}_h{h}_t{t}"), "impl": name}
        for part, _ in PASSES:
            row[part] = {"ms": None, "tflops": None, "temp_gb": None, "status": status or "ok"}
        rows.append(row)
        if status:
            emit(rows)
            continue
        attend = attention_fn(name, chunk, platform)

        def forward(q, k, v, attend=attend):
            return attend(q, k, v, QK**-0.5)

        def loss(q, k, v, forward=forward):
            return jnp.sum(forward(q, k, v).astype(jnp.float32) * ct)

        # value_and_grad: the forward runs too, and its time is the pass's as training runs it
        functions = {"fwd": forward, "fwd_bwd": jax.value_and_grad(loss, argnums=(0, 1, 2))}
        for part, factor in PASSES:
            try:
                compiled = jax.jit(functions[part]).trace(q, k, v).lower().compile()
                memory = compiled.memory_analysis()
                seconds = timed(compiled, (q, k, v), repeats)
                row[part] = {
                    "ms": seconds * 1e3,
                    "tflops": factor * forward_flops / seconds / 1e12,
                    "temp_gb": memory.temp_size_in_bytes / 1e9 if memory else None,
                    "status": "ok",
                }
            except Exception as e:  # noqa: BLE001 - report the failure in the table, go on
                message = str(e).splitlines()[0][:120] if str(e) else ""
                row[part]["status"] = f"failed: {type(e).__name__}: {message}"
            emit(rows)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", type=parse_case, help="B,H,T (repeatable)")
    parser.add_argument("--impl", action="append", choices=IMPLEMENTATIONS, help="repeatable; default: all")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--chunk", type=int, default=512, help="chunked: block length")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    import jax

    from maxmoe.runtime import use_compile_cache

    use_compile_cache()  # a rerun loads the programs this one compiled
    cases = args.case or [(1, 128, 4096), (8, 16, 4096)]
    names = args.impl or list(IMPLEMENTATIONS)
    device = jax.devices()[0]
    command = command_line()

    write = rows_writer(args.json, command=command, device_kind=device.device_kind, jax=jax.__version__)

    rows = []
    for case in cases:
        done = list(rows)
        rows += run_case(case, names, args.dtype, args.chunk, args.repeats, lambda new, done=done: write(done + new))
    print(f"$ {command}")
    print(f"jax {jax.__version__}, {device.platform} {device.device_kind}, {args.dtype}, qk {QK} v {V}, causal")
    head = f"{'case':<20} {'impl':<8} {'fwd ms':>9} {'TFLOP/s':>8} {'f+b ms':>9} {'TFLOP/s':>8} {'temp GB':>8}  status"
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = []
        for part, _ in PASSES:
            p = r[part]
            cells.append(f"{p['ms']:9.2f} {p['tflops']:8.1f}" if p["ms"] is not None else f"{'-':>9} {'-':>8}")
        temp = r["fwd_bwd"]["temp_gb"]
        status = (
            r["fwd"]["status"]
            if r["fwd"]["status"] == r["fwd_bwd"]["status"]
            else f"{r['fwd']['status']} / {r['fwd_bwd']['status']}"
        )
        print(
            f"{r['case']:<20} {r['impl']:<8} {cells[0]} {cells[1]} {f'{temp:.2f}' if temp is not None else '-':>8}  {status}"
        )
    write(rows)
    failed = [
        f"{r['case']} {r['impl']} {part}" for r in rows for part, _ in PASSES if r[part]["status"].startswith("failed")
    ]
    if failed:
        print(f"attention: {len(failed)} measurement(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
