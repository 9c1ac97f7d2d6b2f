#!/usr/bin/env bash
# One-GPU kernel suite, each part under its own timeout (whole suite < 10 minutes on one H200, 9 on one GPU):
#   1. grouped matmul (90 s): bf16 matmul peak; every backend, forward and forward+backward, at the
#      proxy_1gpu shape and the 671B per-GPU shape, half the buffer rows valid
#   2. attention (90 s): forward+backward per implementation at (B=1, H=128, T=4096), (B=8, H=16, T=4096)
#   3. FP8 GEMMs (60 s): each model.fp8 recipe against bf16, a 671B dense projection and grouped GEMM
#   4. proxy_1gpu training step (210 s): tokens/s and MFU per kernel combination, best first (each
#      variant's row is written as soon as it is measured, so a timeout keeps the finished ones);
#      model.fp8=tensorwise and blockwise last (blockwise's expert GEMMs: maxmoe's Triton kernels)
#   5. remat (90 s): the same step under the other remat policies (the config's save_dots_comm is
#      part 4's first row; on one GPU nothing is exchanged, so save_comm would equal full)
#   6. dispatch (150 s, only with 2 or more GPUs): benchmarks/dispatch.py over all of them, forward
#      + backward per remat policy, moe.overlap=batch_split and moe.a2a_chunks on the real ragged
#      all-to-all
# Needs only the core dependencies (jax's own Pallas kernels); run from the repository root:
#
#     bash benchmarks/gpu_suite.sh               # one NVIDIA GPU
#     bash benchmarks/gpu_suite.sh --cpu-smoke   # the same pipeline, tiny sizes on CPU (seconds)
#
# Prints one table last and writes suite.json plus each part's JSON to $OUT if set, else
# runs/gpu_suite/. A part that times out or fails leaves its rows out and says so; the others
# still report. PYTHON overrides the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
DEST=${OUT:-runs/gpu_suite}
mkdir -p "$DEST"

if [[ "${1:-}" == "--cpu-smoke" ]]; then
  export JAX_PLATFORMS=cpu
  # LLVM optimisation only changes how fast the CPU code runs; skipping it halves compile time.
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
  GROUPED=(--shape small --peak 128 --repeats 2 --backend ragged_dot --backend mosaic_gpu)
  ATTENTION=(--case 1,2,64 --chunk 16 --repeats 2 --dtype float32)
  FP8=(--shape small --recipe tensorwise --repeats 2)
  STEP=(--config configs/tiny.yaml --steps 2 --warmup 1 train.batch_size=2 train.seq_len=32 model.num_layers=2
        model.mtp_num_layers=0 data.source=synthetic run.cpu_devices=1 xla.profile=none)
  VARIANTS=(--variant "" --variant "model.attention=xla moe.grouped_matmul=dense_loop train.loss_chunk=0")
  REMAT=(--variant "model.remat=full" --variant "model.remat=save_dots_comm")
  LIMITS=(300 300 300 300 300 0)
elif [[ $# -gt 0 ]]; then
  echo "usage: bash benchmarks/gpu_suite.sh [--cpu-smoke]" >&2
  exit 2
else
  GROUPED=(--shape proxy --shape 671b --valid 0.5 --peak 8192 --repeats 10 --backend ragged_dot --backend mosaic_gpu
           --backend tokamax)
  ATTENTION=(--repeats 5)
  FP8=(--shape 671b --repeats 10)
  STEP=(--config configs/proxy_1gpu.yaml --steps 6 --warmup 2)
  # auto = mosaic_gpu + triton + chunked loss on an H200; then one change at a time; last the
  # program before the kernels (XLA ragged_dot, dense attention, whole logits), which may not fit.
  VARIANTS=(--variant "" --variant "model.attention=cudnn" --variant "moe.grouped_matmul=ragged_dot"
            --variant "moe.grouped_matmul=ragged_dot model.attention=xla train.loss_chunk=0"
            --variant "model.fp8=tensorwise" --variant "model.fp8=blockwise")
  REMAT=(--variant "model.remat=full" --variant "model.remat=save_moe")
  LIMITS=(90 90 60 210 90 150)
fi

status=()
run_part() {  # name, limit, command...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s)" >&2
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >&2
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    status+=("$name: exit $rc$([[ $rc -eq 124 ]] && echo ' (timed out)')")
  fi
}

run_part "grouped matmul" "${LIMITS[0]}" "$PY" benchmarks/grouped_matmul.py "${GROUPED[@]}" --json "$DEST/grouped_matmul.json"
run_part "attention" "${LIMITS[1]}" "$PY" benchmarks/attention.py "${ATTENTION[@]}" --json "$DEST/attention.json"
run_part "fp8 matmul" "${LIMITS[2]}" "$PY" benchmarks/fp8_matmul.py "${FP8[@]}" --json "$DEST/fp8_matmul.json"
run_part "training step" "${LIMITS[3]}" "$PY" benchmarks/step.py "${STEP[@]}" --label proxy "${VARIANTS[@]}" \
  --json "$DEST/step.json"
run_part "remat" "${LIMITS[4]}" "$PY" benchmarks/step.py "${STEP[@]}" --label remat "${REMAT[@]}" \
  --json "$DEST/step_remat.json"
GPUS=$( (nvidia-smi -L 2>/dev/null || true) | grep -c "^GPU" || true)
if [[ "${LIMITS[5]}" -gt 0 && "$GPUS" -ge 2 ]]; then
  run_part "dispatch" "${LIMITS[5]}" env JAX_PLATFORMS=cuda "$PY" benchmarks/dispatch.py --devices "$GPUS" \
    --chunks 32 --repeats 5
fi

printf '%s\n' "${status[@]:-}" > "$DEST/failed_parts.txt"
"$PY" - "$DEST" <<'PYEOF'
import json, sys
from pathlib import Path

dest = Path(sys.argv[1])
def load(name):
    path = dest / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None

def num(v, fmt):
    return format(v, fmt) if v is not None else "-"

grouped, attention, fp8 = load("grouped_matmul"), load("attention"), load("fp8_matmul")
step, remat = load("step"), load("step_remat")
failed = [line for line in (dest / "failed_parts.txt").read_text().splitlines() if line]
rows = []
if grouped:
    if grouped["peak"]:
        rows.append(("matmul peak", grouped["peak"]["name"], f"{grouped['peak']['tflops']:.1f} TFLOP/s", ""))
    for r in grouped["rows"]:
        for part in ("fwd", "fwd_bwd"):
            p = r[part]
            detail = p["status"] if p["status"] != "ok" else (
                f"{num(p['vs_dense'], '.2f')} x dense, executed/useful FLOPs {num(p['flops_ratio'], '.2f')}")
            value = f"{p['tflops']:.1f} TFLOP/s" if p["tflops"] is not None else "-"
            rows.append((f"grouped {r['shape']} {part}", r["backend"], value, detail))
if attention:
    for r in attention["rows"]:
        detail = f"{num(r['ms'], '.2f')} ms, temp {num(r['temp_gb'], '.2f')} GB" if r["status"] == "ok" else r["status"]
        value = f"{r['tflops']:.1f} TFLOP/s" if r["tflops"] is not None else "-"
        rows.append((f"attention {r['case']}", r["impl"], value, detail))
if fp8:
    for r in fp8["rows"]:
        for part in ("fwd", "fwd_bwd"):
            p = r[part]
            detail = p["status"] if p["status"] != "ok" else f"{num(p['vs_bf16'], '.2f')} x bf16"
            value = f"{p['tflops']:.1f} TFLOP/s" if p["tflops"] is not None else "-"
            rows.append((f"fp8 {r['shape']} {r['kind']} {part}", r["recipe"], value, detail))


def step_rows(part, runs, detail):
    """One row per timed training step: tokens/s, and `detail` of the run beside TFLOP/s and MFU."""
    for r in runs:
        if "error" in r:
            rows.append((part, r["variant"], "-", f"failed: {r['error']}"))
            continue
        mfu = f"MFU {r['mfu']:.3f}" if r["mfu"] is not None else "MFU n/a"
        rows.append((part, r["variant"], f"{r['tokens_per_s']:.0f} tok/s",
                     detail(r, f"{r['tflops_per_device']:.1f} TFLOP/s/dev, {mfu}")))


step_rows("remat", remat["runs"] if remat else [], lambda r, perf: f"{perf}, memory {num(r['memory_total'], '.3g')} B")
step_rows("step", step["runs"] if step else [], lambda r, perf: f"{r['kernels']}, {perf}")
for line in failed:
    rows.append(("part failed", line, "-", ""))
first = grouped or attention or fp8 or step or {}
suite = {"device_kind": first.get("device_kind"), "jax": first.get("jax"), "grouped_matmul": grouped,
         "attention": attention, "fp8_matmul": fp8, "step": step, "remat": remat, "failed_parts": failed,
         "table": [dict(zip(("part", "case", "value", "detail"), r)) for r in rows]}
(dest / "suite.json").write_text(json.dumps(suite, indent=1))
print(f"gpu_suite: {suite['device_kind']}, jax {suite['jax']}; JSON in {dest}/suite.json")
width = [max(len(r[i]) for r in rows + [("part", "case", "value", "detail")]) for i in range(4)]
for r in [("part", "case", "value", "detail")] + rows:
    print("  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip())
PYEOF
