"""The table of a gpu_suite.sh run: one row per measurement, printed and written as suite.md and suite.json.

    python benchmarks/suite_table.py RUN_DIR

Reads what each part wrote to RUN_DIR (parts that did not run or were cut off contribute the
rows they finished); the Markdown goes into docs/PERFORMANCE.md without retyping.
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
        ok = r["status"] == "ok"
        detail = f"{num(r['ms'], '.2f')} ms, temp {num(r['temp_gb'], '.2f')} GB" if ok else r["status"]
        value = f"{r['tflops']:.1f} TFLOP/s" if r["tflops"] is not None else "-"
        yield (f"attention {r['case']}", r["impl"], value, detail)


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
    rows += [*step_rows("step", step), *step_rows("command buffers", buffers)]
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
    width = [max(len(str(r[i])) for r in [*rows, HEADER]) for i in range(4)]
    for r in [HEADER, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, width)).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
