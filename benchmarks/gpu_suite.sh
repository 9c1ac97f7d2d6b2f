#!/usr/bin/env bash
# One-GPU performance suite: matmul peak, grouped-matmul backends, proxy_1gpu training throughput
# under each XLA flag profile (none, auto = the GPU's own profile) and remat choice (full,
# save_matmuls). Needs only the core dependencies; run from the repository root:
#
#     bash benchmarks/gpu_suite.sh               # one NVIDIA GPU, under 8 minutes
#     bash benchmarks/gpu_suite.sh --cpu-smoke   # the same pipeline, tiny sizes on CPU (seconds)
#
# Prints one table last and writes suite.json plus each part's JSON to $OUT if set, else
# runs/gpu_suite/. PYTHON overrides the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
DEST=${OUT:-runs/gpu_suite}
mkdir -p "$DEST"

if [[ "${1:-}" == "--cpu-smoke" ]]; then
  export JAX_PLATFORMS=cpu
  # LLVM optimisation only changes how fast the CPU code runs; skipping it halves compile time.
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
  PEAK=(--peak 128 --repeats 2)
  GROUPED=(--rows 256 --d 64 --f 32 --groups 8 --repeats 2)
  STEP=(--config configs/tiny.yaml --steps 2 --warmup 1 train.batch_size=2 train.seq_len=32 model.num_layers=2
        model.mtp_num_layers=0 data.source=synthetic run.cpu_devices=1)
  PROFILES=(none auto)
elif [[ $# -gt 0 ]]; then
  echo "usage: bash benchmarks/gpu_suite.sh [--cpu-smoke]" >&2
  exit 2
else
  PEAK=(--peak 8192 --repeats 20)
  GROUPED=(--rows 32768 --d 2048 --f 512 --groups 64 --repeats 20)
  STEP=(--config configs/proxy_1gpu.yaml --steps 8 --warmup 2)
  PROFILES=(none auto)
fi

echo "== matmul peak and grouped matmul backends" >&2
"$PY" benchmarks/grouped_matmul.py "${PEAK[@]}" "${GROUPED[@]}" --json "$DEST/grouped_matmul.json" >&2
for profile in "${PROFILES[@]}"; do
  echo "== training step, xla.profile=$profile" >&2
  "$PY" benchmarks/step.py "${STEP[@]}" "xla.profile=$profile" --label "profile=$profile" \
    --variant "model.remat=full" --variant "model.remat=save_matmuls" --json "$DEST/step_$profile.json" >&2
done

"$PY" - "$DEST" "${PROFILES[@]}" <<'PYEOF'
import json, sys
from pathlib import Path
dest, profiles = Path(sys.argv[1]), sys.argv[2:]
grouped = json.loads((dest / "grouped_matmul.json").read_text())
steps = [json.loads((dest / f"step_{p}.json").read_text()) for p in profiles]
rows = []
peak = grouped["peak"]
rows.append(("matmul peak", f"{grouped['dtype']} {peak['name']}", f"{peak['tflops']:.2f} TFLOP/s", ""))
for b in grouped["backends"]:
    value = f"{b['tflops']:.2f} TFLOP/s" if b["tflops"] is not None else "-"
    extra = f"{b['vs_dense']:.2f} x dense" if b.get("vs_dense") else b["status"]
    rows.append(("grouped matmul", b["name"], value, extra))
for s in steps:
    for r in s["runs"]:
        mfu = f"MFU {r['mfu']:.3f}" if r["mfu"] is not None else "MFU n/a"
        rows.append((f"step {r['label']}", r["variant"], f"{r['tokens_per_s']:.0f} tok/s",
                     f"{r['tflops_per_device']:.2f} TFLOP/s/dev, {mfu}"))
suite = {"device_kind": grouped["device_kind"], "jax": grouped["jax"], "grouped_matmul": grouped, "steps": steps,
         "table": [dict(zip(("part", "case", "value", "detail"), r)) for r in rows]}
(dest / "suite.json").write_text(json.dumps(suite, indent=1))
print(f"gpu_suite: {grouped['device_kind']}, jax {grouped['jax']}; JSON in {dest}/suite.json")
width = [max(len(r[i]) for r in rows) for i in range(4)]
for r in [("part", "case", "value", "detail")] + rows:
    print("  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip())
PYEOF
