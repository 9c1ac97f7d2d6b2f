"""FP8 GEMMs (`model.fp8` recipes) against bf16: a dense projection and the experts' grouped GEMM.

    PYTHONPATH=. python benchmarks/fp8_matmul.py [--shape 671b] [--recipe tensorwise ...]
        [--repeats 10] [--json OUT]

Shapes (dense: [M, K] x [K, N]; grouped: M rows, the first half in balanced groups, [G, D, F]):
  671b    dense M=16,384 K=7,168 N=2,048 (one GPU's tokens through a 671B projection);
          grouped M=65,536 G=4 D=7,168 F=2,048 (one GPU of the 671B plan)
  small   dense M=256 K=256 N=128; grouped M=256 G=8 D=128 F=64 (the CPU smoke test)
Per recipe (bf16 is the plain matmul / the bf16 grouped GEMM): ms and TFLOP/s on the useful
FLOPs (2 M K N forward, 3 x that forward+backward), and the ratio to bf16. The FP8 rows run
`maxmoe.kernels.fp8_matmul` as training does: quantisation of every operand included. The
grouped rows, bf16 and FP8, run on the grouped backend `moe.grouped_matmul=auto` picks here
(`--grouped-backend` to name one): on Hopper mosaic_gpu, under which blockwise's GEMMs, dense
and grouped, run maxmoe's Pallas Triton kernels (maxmoe.kernels.fp8_grouped) as in
training; under ragged_dot XLA's program.
"""

import argparse
import sys

from grouped_matmul import gemm_table
from results import command_line, rows_writer, timed

SHAPES = {
    "671b": {"dense": dict(m=16384, k=7168, n=2048), "grouped": dict(rows=65536, groups=4, d=7168, f=2048)},
    "small": {"dense": dict(m=256, k=256, n=128), "grouped": dict(rows=256, groups=8, d=128, f=64)},
}
RECIPES = ("bf16", "tensorwise", "blockwise", "mxfp8")


def _functions(kind, recipe, backend):
    """(forward, forward+backward) of fn(a, b, sizes, cotangent) for one GEMM kind and recipe."""
    import jax
    import jax.numpy as jnp

    from maxmoe.kernels.fp8_matmul import blockwise_kernels, fp8_grouped_matmul, fp8_matmul
    from maxmoe.kernels.grouped_matmul import grouped_matmul

    def forward(a, b, sizes, ct):
        del ct
        if kind == "dense":
            # one device: the dense GEMMs may call blockwise's kernel directly, as training does per shard
            return a @ b if recipe == "bf16" else fp8_matmul(a, b, recipe, blockwise_kernels(backend))
        if recipe == "bf16":
            return grouped_matmul(a, b, sizes, backend=backend)
        return fp8_grouped_matmul(a, b, sizes, recipe, backend)

    def loss(a, b, sizes, ct):
        return jnp.sum(forward(a, b, sizes, ct).astype(jnp.float32) * ct)

    # value_and_grad: these GEMMs are linear, so jax.grad alone lets XLA drop the forward (the row
    # would time dx and dw while crediting 3x the forward's FLOPs).
    return jax.jit(forward), jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def run_shape(name, shape, recipes, repeats, emit=lambda rows: None, backend="ragged_dot"):
    """Rows of the table for one shape: dense then grouped, one row per recipe; `emit(rows so far)`
    after each, so that a run cut short by a timeout keeps what it measured."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 6)
    dense, grouped = shape["dense"], shape["grouped"]
    m, k, n = dense["m"], dense["k"], dense["n"]
    cases = {
        "dense": (
            (
                jax.random.normal(keys[0], (m, k), jnp.bfloat16),
                (jax.random.normal(keys[1], (k, n)) / k**0.5).astype(jnp.bfloat16),
                jnp.zeros((1,), jnp.int32),
                jax.random.normal(keys[2], (m, n), jnp.float32),
            ),
            2 * m * k * n,
        )
    }
    rows_, g, d, f = grouped["rows"], grouped["groups"], grouped["d"], grouped["f"]
    valid = rows_ // 2 // g * g
    cases["grouped"] = (
        (
            jax.random.normal(keys[3], (rows_, d), jnp.bfloat16),
            (jax.random.normal(keys[4], (g, d, f)) / d**0.5).astype(jnp.bfloat16),
            jnp.full((g,), valid // g, jnp.int32),
            jax.random.normal(keys[5], (rows_, f), jnp.float32),
        ),
        2 * valid * d * f,
    )
    out = []
    base = {kind: {} for kind in cases}
    # Recipe-major (bf16 first, the others in the order given), so a run cut short by its time
    # limit has each recipe it reached for both GEMMs.
    for recipe in recipes:
        for kind, (args, useful) in cases.items():
            row = {"shape": name, "kind": kind, "recipe": recipe, "useful_gflop": useful / 1e9}
            if kind == "grouped":
                row["backend"] = backend
            forward, forward_backward = _functions(kind, recipe, backend)
            for part, fn, factor in (("fwd", forward, 1), ("fwd_bwd", forward_backward, 3)):
                try:
                    seconds = timed(fn, args, repeats)
                    tflops = factor * useful / seconds / 1e12
                    row[part] = {"ms": seconds * 1e3, "tflops": tflops, "status": "ok"}
                except Exception as e:  # noqa: BLE001 - report the failure in the table, go on
                    message = str(e).splitlines()[0][:120] if str(e) else ""
                    row[part] = {"ms": None, "tflops": None, "status": f"failed: {type(e).__name__}: {message}"}
                if recipe == "bf16":
                    base[kind][part] = row[part]["tflops"]
                tf = row[part]["tflops"]
                row[part]["vs_bf16"] = tf / base[kind][part] if tf and base[kind].get(part) else None
            out.append(row)
            emit(out)
    return out


def format_table(rows):
    labels = [("shape", "shape", 6), ("kind", "gemm", 8), ("recipe", "recipe", 11)]
    return gemm_table(rows, labels, [("vs_bf16", "x bf16", 6)])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable; default 671b")
    parser.add_argument("--recipe", action="append", choices=RECIPES[1:], help="repeatable; default: all")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", help="write the results here")
    from maxmoe.config import GROUPED_MATMUL_BACKENDS, ConfigError

    parser.add_argument(
        "--grouped-backend",
        default="auto",
        choices=("auto",) + GROUPED_MATMUL_BACKENDS,
        help="moe.grouped_matmul for the grouped rows",
    )
    args = parser.parse_args(argv)
    if args.repeats <= 0:
        parser.error("--repeats must be positive")
    import jax

    from maxmoe.runtime import use_compile_cache

    use_compile_cache()  # a rerun loads the programs this one compiled
    recipes = ["bf16"] + (args.recipe or list(RECIPES[1:]))
    command = command_line()
    device = jax.devices()[0]
    from maxmoe.kernels.choice import resolve_grouped_matmul, target

    try:
        backend = resolve_grouped_matmul(args.grouped_backend, *target(), "bfloat16").name
    except ConfigError as e:  # a backend that cannot run here
        parser.error(str(e))

    write = rows_writer(
        args.json, command=command, device_kind=device.device_kind, jax=jax.__version__, grouped_backend=backend
    )

    rows = []
    for name in args.shape or ["671b"]:
        done = list(rows)
        rows += run_shape(name, SHAPES[name], recipes, args.repeats, lambda new, done=done: write(done + new), backend)
    header = f"jax {jax.__version__}, {device.platform} {device.device_kind}, operands bf16, grouped backend {backend}"
    print(f"$ {command}\n{header}\n{format_table(rows)}")
    write(rows)
    failed = [f"{r['kind']} {r['recipe']} {p}" for r in rows for p in ("fwd", "fwd_bwd") if r[p]["status"] != "ok"]
    if failed:
        print(f"fp8 matmul: {len(failed)} measurement(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
