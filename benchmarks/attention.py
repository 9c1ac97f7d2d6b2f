"""Causal MLA attention (qk head dim 192, v 128) forward+backward per implementation.

    PYTHONPATH=. python benchmarks/attention.py [--case 1,128,4096 --case 8,16,4096] [--impl xla --impl triton ...]
        [--dtype bfloat16] [--repeats 5] [--json OUT]

Each case is B,H,T. Implementations: xla (dense scores, the oracle), chunked (XLA, blocks
of --chunk), triton (jax's Pallas Triton flash kernels), cudnn (cuDNN through
jax.nn.dot_product_attention), tokamax (when installed); one that cannot run here is listed with the reason. Reported:
ms of forward+backward, TFLOP/s on the causal useful FLOPs (forward 2 x B x H x T^2/2 x
(192 + 128); backward 2.5 x forward), and the compiled temp memory.
"""

import argparse
import sys
import time

from results import command_line, rows_writer

IMPLEMENTATIONS = ("xla", "chunked", "triton", "cudnn", "tokamax")
QK, V = 192, 128


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


def run_case(case, names, dtype_name, chunk, repeats, emit=lambda rows: None):
    """Rows for one (B, H, T); `emit(rows so far)` after each implementation's row."""
    import jax
    import jax.numpy as jnp

    b, h, t = case
    dtype = getattr(jnp, dtype_name)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, h, QK), dtype)
    k = jax.random.normal(keys[1], (b, t, h, QK), dtype)
    v = jax.random.normal(keys[2], (b, t, h, V), dtype)
    ct = jax.random.normal(keys[3], (b, t, h, V), dtype)
    useful = 3.5 * 2 * b * h * t * t / 2 * (QK + V)
    platform = jax.devices()[0].platform
    rows = []
    for name in names:
        row = {"case": f"B={b} H={h} T={t}", "impl": name, "ms": None, "tflops": None, "temp_gb": None}
        if name == "tokamax":
            from maxmoe.kernels.grouped_matmul import tokamax_problem

            if tokamax_problem():
                row["status"] = f"not available: {tokamax_problem()}"
                rows.append(row)
                emit(rows)
                continue
        elif name in ("triton", "cudnn") and platform != "gpu":
            row["status"] = f"not run: {name} needs an NVIDIA GPU"
            rows.append(row)
            emit(rows)
            continue
        attend = attention_fn(name, chunk, platform)

        def loss(q, k, v, attend=attend):
            return jnp.sum(attend(q, k, v, QK**-0.5).astype(jnp.float32) * ct)

        try:
            forward_backward = jax.value_and_grad(loss, argnums=(0, 1, 2))
            compiled = jax.jit(forward_backward).trace(q, k, v).lower().compile()
            memory = compiled.memory_analysis()
            jax.block_until_ready(compiled(q, k, v))
            start = time.perf_counter()
            for _ in range(repeats):
                out = compiled(q, k, v)
            jax.block_until_ready(out)
            seconds = (time.perf_counter() - start) / repeats
            row.update(
                ms=seconds * 1e3,
                tflops=useful / seconds / 1e12,
                temp_gb=memory.temp_size_in_bytes / 1e9 if memory else None,
                status="ok",
            )
        except Exception as e:  # noqa: BLE001 - report the failure in the table, go on
            row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        rows.append(row)
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
    head = f"{'case':<20} {'impl':<8} {'f+b ms':>9} {'TFLOP/s':>8} {'temp GB':>8}  status"
    print(head)
    print("-" * len(head))
    for r in rows:
        ms = f"{r['ms']:.2f}" if r["ms"] is not None else "-"
        tf = f"{r['tflops']:.1f}" if r["tflops"] is not None else "-"
        mem = f"{r['temp_gb']:.2f}" if r["temp_gb"] is not None else "-"
        print(f"{r['case']:<20} {r['impl']:<8} {ms:>9} {tf:>8} {mem:>8}  {r['status']}")
    write(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
