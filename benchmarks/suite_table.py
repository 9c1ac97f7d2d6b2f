"""The table of a gpu_suite.sh run: one row per measurement, printed and written as suite.md and suite.json.

    python benchmarks/suite_table.py RUN_DIR

Reads what each part wrote to RUN_DIR (parts that did not run or were cut off contribute the
rows they finished); the Markdown goes into docs/PERFORMANCE.md without retyping. Also prints
the step's profile breakdown (where its time went, by kernel class) and writes
RUN_DIR/rates.yaml: every kernel rate measured, as entries of maxmoe/kernels/rates.yaml (fill in
the commit) for `auto` and the planner to read.
"""

import json
import sys
from pathlib import Path

HEADER = ("part", "case", "value", "detail")


def load(dest: Path, name: str):
    path = dest / name
    if not path.exists():
        return None
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())


def num(v, fmt):
    return format(v, fmt) if v is not None else "-"


def check_rows(records):
    for r in records or []:
        if "check" in r:
            err = num(r["max_rel_error"], ".1e")
            detail = r["detail"] if r["status"] != "pass" else f"tol {num(r['tolerance'], '.0e')}; {r['detail']}"
            yield (
                "check",
                r["check"],
                f"{r['status']} {err}" if r["max_rel_error"] is not None else r["status"],
                detail,
            )


def gemm_rows(grouped, fp8):
    if grouped:
        if grouped["peak"]:
            yield ("matmul peak", grouped["peak"]["name"], f"{grouped['peak']['tflops']:.1f} TFLOP/s", "")
        for r in grouped["rows"]:
            for part in ("fwd", "fwd_bwd"):
                p = r[part]
                detail = (
                    p["status"]
                    if p["status"] != "ok"
                    else f"{num(p['vs_dense'], '.2f')} x dense, executed/useful FLOPs {num(p['flops_ratio'], '.2f')}"
                )
                value = f"{p['tflops']:.1f} TFLOP/s" if p["tflops"] is not None else "-"
                yield (f"grouped {r['shape']} {part}", r["backend"], value, detail)
    for r in (fp8 or {}).get("rows", []):
        for part in ("fwd", "fwd_bwd"):
            p = r[part]
            detail = p["status"] if p["status"] != "ok" else f"{num(p['vs_bf16'], '.2f')} x bf16"
            value = f"{p['tflops']:.1f} TFLOP/s" if p["tflops"] is not None else "-"
            yield (f"fp8 {r['shape']} {r['kind']} {part}", r["recipe"], value, detail)


def attention_rows(attention):
    for r in (attention or {}).get("rows", []):
        for part in ("fwd", "fwd_bwd"):
            p = r[part]
            ok = p["status"] == "ok"
            detail = f"{num(p['ms'], '.2f')} ms, temp {num(p['temp_gb'], '.2f')} GB" if ok else p["status"]
            value = f"{p['tflops']:.1f} TFLOP/s" if p["tflops"] is not None else "-"
            yield (f"attention {r['case']} {part}", r["impl"], value, detail)


def tile_rows(tiles):
    for r in (tiles or {}).get("rows", []):
        detail = f"{num(r['ms'], '.3f')} ms" if r["status"] == "ok" else r["status"]
        value = f"{r['tflops']:.1f} TFLOP/s" if r["tflops"] is not None else "-"
        tile = f"tile {r['block_m']},{r['block_n']},{r['block_k']} x{r['stages']}"
        yield (f"tiles {r['shape']} {r['gemm']} ({r['k']} -> {r['n']})", tile, value, detail)


def breakdown_rows(step):
    from maxmoe.analysis.trace_breakdown import Breakdown

    for r in (step or {}).get("runs", []):
        if "breakdown" not in r:
            continue
        b = Breakdown.from_dict(r["breakdown"])
        for row in b.rows:
            rate = f", {row.tflops:.1f} model TFLOP/s" if row.tflops is not None else ""
            detail = f"{row.wall_s * 1e3:.1f} ms of {b.step_s * 1e3:.1f} (own {row.kernel_s * 1e3:.1f}){rate}"
            yield (f"breakdown {r['variant']}", row.label, f"{row.share:.1%}", detail)


def step_rows(part, step):
    for r in (step or {}).get("runs", []):
        if "error" in r:
            yield (part, r["variant"], "-", f"failed: {r['error']}")
            continue
        mfu = f"MFU {r['mfu']:.3f}" if r["mfu"] is not None else "MFU n/a"
        perf = (
            f"{r['kernels']}, {r['tflops_per_device']:.1f} TFLOP/s/dev, {mfu}, memory {num(r['memory_total'], '.3g')} B"
        )
        yield (part, r["variant"], f"{r['tokens_per_s']:.0f} tok/s", perf)


def markdown(rows) -> str:
    def cell(text):
        return str(text).replace("|", "\\|")

    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    dest = Path((argv or sys.argv[1:])[0])
    check = load(dest, "check.jsonl")
    grouped, attention, fp8 = (
        load(dest, "grouped_matmul.json"),
        load(dest, "attention.json"),
        load(dest, "fp8_matmul.json"),
    )
    step, buffers = load(dest, "step.json"), load(dest, "step_command_buffers.json")
    failed_file = dest / "failed_parts.txt"
    failed = [line for line in failed_file.read_text().splitlines() if line] if failed_file.exists() else []
    rows = [*check_rows(check), *gemm_rows(grouped, None), *attention_rows(attention), *gemm_rows(None, fp8)]
    rows += [*step_rows("step", step), *breakdown_rows(step), *step_rows("command buffers", buffers)]
    rows += list(tile_rows(load(dest, "tiles.json")))
    rows += [("part failed", line, "-", "") for line in failed]
    preflight = next((r["preflight"] for r in check or [] if "preflight" in r), None)
    first = grouped or attention or fp8 or step or {}
    suite = {
        "preflight": preflight,
        "device_kind": (preflight or first).get("device_kind"),
        "jax": (preflight or first).get("jax"),
        "check": check,
        "grouped_matmul": grouped,
        "attention": attention,
        "fp8_matmul": fp8,
        "step": step,
        "step_command_buffers": buffers,
        "failed_parts": failed,
        "table": [dict(zip(HEADER, r)) for r in rows],
    }
    (dest / "suite.json").write_text(json.dumps(suite, indent=1))
    (dest / "suite.md").write_text(markdown(rows))
    print(f"gpu_suite: {suite['device_kind']}, jax {suite['jax']}; {dest}/suite.json, Markdown in {dest}/suite.md")
    (dest / "rates.yaml").write_text(rate_entries(suite))
    print(f"kernel rates measured: {dest}/rates.yaml (entries of maxmoe/kernels/rates.yaml; fill in DATE and COMMIT)")
    for run in (step or {}).get("runs", []):
        if "breakdown" in run:
            from maxmoe.analysis.trace_breakdown import Breakdown, format_table

            print(format_table(Breakdown.from_dict(run["breakdown"])))
    width = [max(len(str(r[i])) for r in [*rows, HEADER]) for i in range(4)]
    for r in [HEADER, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, width)).rstrip())
    return 0


def rate_entries(suite: dict) -> str:
    """Every kernel rate the run measured, as YAML entries of maxmoe/kernels/rates.yaml's `rates:`."""
    from maxmoe.analysis.flops import peak_tflops

    kind = suite["device_kind"] or ""
    system = next((w.lower() for w in kind.split() if w[:1].isalpha() and w.upper() != "NVIDIA"), "unknown")
    peak = peak_tflops(kind)
    if not peak:
        return f"# no datasheet peak for {kind!r}: its rates are not entries of the table\n"
    lines = []

    def add(part, kernel_class, backend, precision, shape, dims, p, command):
        if p.get("status") != "ok" or not p.get("tflops"):
            return
        fraction = f"{p['tflops'] / peak:.4g}"
        dims_text = ", ".join(f"{k}: {v}" for k, v in dims.items())
        lines.append(
            f"  - {{device_kind: {kind}, system: {system}, class: {kernel_class}, backend: {backend}, "
            f"precision: {precision}, pass: {'fwd+bwd' if part == 'fwd_bwd' else 'fwd'},\n"
            f"     shape: {shape}, dims: {{{dims_text}}}, tflops: {p['tflops']:.4g}, peak_fraction: {fraction},\n"
            f"     date: DATE, commit: COMMIT, command: {json.dumps(command)}}}"
        )

    grouped = suite.get("grouped_matmul") or {}
    for r in grouped.get("rows", []):
        dims = {k: v for k, v in (grouped.get("shapes") or {}).get(r["shape"], {}).items()}
        backend = "xla" if r["backend"] == "dense" else r["backend"]
        kernel_class = "dense_gemm" if r["backend"] == "dense" else "grouped_gemm"
        for part in ("fwd", "fwd_bwd"):
            add(part, kernel_class, backend, "bf16", r["shape"], dims, r[part], grouped.get("command", ""))
    attention = suite.get("attention") or {}
    for r in attention.get("rows", []):
        b, h, t = (int(x.split("=")[1]) for x in r["case"].split())
        for part in ("fwd", "fwd_bwd"):
            add(
                part,
                "attention_core",
                r["impl"],
                "bf16",
                r["shape"],
                {"b": b, "h": h, "t": t},
                r[part],
                attention.get("command", ""),
            )
    fp8 = suite.get("fp8_matmul") or {}
    for r in fp8.get("rows", []):
        kernel_class = "grouped_gemm" if r["kind"] == "grouped" else "dense_gemm"
        kernels = fp8.get("grouped_backend") in ("mosaic_gpu", "tokamax")  # blockwise: maxmoe's Triton kernels
        backend = "triton" if r["recipe"] == "blockwise" and kernels else r.get("backend", "xla")
        for part in ("fwd", "fwd_bwd"):
            add(
                part,
                kernel_class,
                r.get("backend", "xla"),
                r["recipe"],
                f"{r['shape']}_{r['kind']}",
                {},
                r[part],
                fp8.get("command", ""),
            )
    return "\n".join(lines) + "\n" if lines else ""


if __name__ == "__main__":
    sys.exit(main())
