#!/usr/bin/env bash
# One-GPU suite: a preflight line, then each part under its own time limit. The one-GPU parts'
# limits sum to 400 s (printed first), so with machine start-up the suite and a rerun of its
# slowest parts fit in fifteen minutes; `--only` reruns chosen parts. Within a part the rows
# least known come first (the first H200 run, 2026-12-04, spent cold compiles on rows it
# already had and timed out before the kernels' rows).
#   0. check (45 s): every kernel `auto` can choose here against its XLA oracle, value and both
#      gradients (maxmoe.check, also `python -m maxmoe.info --check`)
#   1. grouped matmul (55 s): bf16 matmul peak; each backend, forward and forward+backward
#      (value_and_grad: the forward runs too) at the proxy_1gpu and 671B per-GPU shapes
#   2. attention (60 s): forward and forward+backward per implementation at the 671B heads
#      (B=1, H=128, T=4096) and proxy_1gpu's (B=8, H=16, T=4096), model FLOPs: cudnn, tokamax and
#      triton before XLA's chunked and dense cores
#   3. FP8 GEMMs (55 s): each model.fp8 recipe against bf16, a 671B dense projection and grouped
#      GEMM; blockwise (maxmoe's Triton kernels, the slowest to run) last
#   4. proxy_1gpu training step (140 s): tokens/s and MFU, one process, most valuable first: auto,
#      then a jax.profiler trace of 3 more auto steps read as where the time goes (device time per
#      kernel class: $OUT/profile/breakdown.json), model.attention=cudnn, model.fp8=tensorwise,
#      model.remat=full, model.fp8=blockwise (about a minute: 8,497 tokens/s on the first H200)
#   5. command buffers on (45 s): auto again with --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL
#      (a process flag, hence its own process)
#   6. dispatch (150 s, only with 2 or more GPUs; not in the 400 s): benchmarks/dispatch.py
#   7. grouped GEMM tiles (120 s, only when named in --only; not in the 400 s): the Mosaic GPU
#      forward kernel's tile sweep at both shapes, printed as entries of its TILES table
# Left out because the dry run says they cannot fit one 141 GB GPU at the proxy shape: XLA's
# ragged_dot (its dense rewrite: 565 GB) and xla attention with train.loss_chunk=0 (~190 GB).
# Every part writes each row as soon as it is measured; a part that times out keeps its rows. The
# suite exits 1 when a part failed (a measurement that errored, a timeout), after the table.
#
#     bash benchmarks/gpu_suite.sh                  # one NVIDIA GPU
#     bash benchmarks/gpu_suite.sh --only 0,4       # rerun parts 0 and 4
#     bash benchmarks/gpu_suite.sh --cpu-smoke      # the same pipeline, tiny sizes on CPU
#
# Prints the step's breakdown and one table last and writes it to $OUT (default runs/gpu_suite) as
# suite.md (Markdown, for docs/PERFORMANCE.md) and suite.json, beside each part's JSON, and every
# kernel rate measured as entries of maxmoe/kernels/rates.yaml in $OUT/rates.yaml. Compiled programs are cached in
# $OUT/jax_cache, so a rerun skips the compiles the first try finished. PYTHON overrides the
# interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
DEST=${OUT:-runs/gpu_suite}
mkdir -p "$DEST"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$DEST/jax_cache}

SMOKE=0
ONLY=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu-smoke) SMOKE=1 ;;
    --only) ONLY=",${2:-},"; shift ;;
    *) echo "usage: bash benchmarks/gpu_suite.sh [--cpu-smoke] [--only PART,...]  (parts 0-7)" >&2; exit 2 ;;
  esac
  shift
done
wanted() { [[ -z "$ONLY" || "$ONLY" == *",$1,"* ]]; }

# GPU run
GPU_CHECK=()
GPU_GROUPED=(--shape proxy --shape 671b --valid 0.5 --peak 8192 --repeats 10 --backend mosaic_gpu --backend tokamax)
GPU_ATTENTION=(--impl cudnn --impl tokamax --impl triton --impl chunked --impl xla --repeats 3)
GPU_FP8=(--shape 671b --repeats 5 --recipe tensorwise --recipe mxfp8 --recipe blockwise)
GPU_STEP=(--config configs/proxy_1gpu.yaml --steps 6 --warmup 2)
GPU_VARIANTS=(--variant "" --variant "model.attention=cudnn" --variant "model.fp8=tensorwise"
              --variant "model.remat=full" --variant "model.fp8=blockwise")
GPU_COMMAND_BUFFERS=(--variant "")
GPU_LIMITS=(45 55 60 55 140 45 150 120)
GPU_TILES=(--shape 671b --shape proxy --repeats 5 --tiles)
# end of GPU run

if [[ $SMOKE -eq 1 ]]; then
  export JAX_PLATFORMS=cpu
  # LLVM optimisation only changes how fast the CPU code runs; skipping it halves compile time.
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
  CHECK=()
  GROUPED=(--shape small --peak 128 --repeats 2 --backend ragged_dot --backend mosaic_gpu)
  ATTENTION=(--case 1,2,64 --chunk 16 --repeats 2 --dtype float32)
  FP8=(--shape small --recipe tensorwise --repeats 2)
  STEP=(--config configs/tiny.yaml --steps 2 --warmup 1 train.batch_size=2 train.seq_len=32 model.num_layers=2
        model.mtp_num_layers=0 data.source=synthetic run.cpu_devices=1 xla.profile=none)
  VARIANTS=(--variant "" --variant "model.remat=full")
  COMMAND_BUFFERS=(--variant "")
  TILES=(--shape small --repeats 1 --tiles)
  LIMITS=(300 300 300 300 300 300 0 300)
else
  export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}  # the GEMM parts' big buffers
  CHECK=("${GPU_CHECK[@]}") GROUPED=("${GPU_GROUPED[@]}") ATTENTION=("${GPU_ATTENTION[@]}") FP8=("${GPU_FP8[@]}")
  STEP=("${GPU_STEP[@]}") VARIANTS=("${GPU_VARIANTS[@]}") COMMAND_BUFFERS=("${GPU_COMMAND_BUFFERS[@]}") TILES=("${GPU_TILES[@]}")
  LIMITS=("${GPU_LIMITS[@]}")
fi

"$PY" -m maxmoe.check --preflight | tee "$DEST/preflight.txt"
gpu_sum=0; for i in 0 1 2 3 4 5; do gpu_sum=$((gpu_sum + GPU_LIMITS[i])); done
run_sum=0; for i in 0 1 2 3 4 5; do run_sum=$((run_sum + LIMITS[i])); done
echo "limits: one-GPU parts 0-5 sum to ${gpu_sum} s on a GPU (${GPU_LIMITS[*]:0:6} s), this run ${run_sum} s; dispatch ${GPU_LIMITS[6]} s and tiles ${GPU_LIMITS[7]} s apart"

status=()
run_part() {  # number, name, limit, command...
  local part=$1 name=$2 limit=$3
  shift 3
  wanted "$part" || return 0
  echo "== $part. $name (limit ${limit} s)" >&2
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >&2
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    status+=("$part. $name: exit $rc$([[ $rc -eq 124 ]] && echo ' (timed out)')")
  fi
}

rm -f "$DEST/check.jsonl"
run_part 0 "check" "${LIMITS[0]}" "$PY" benchmarks/gpu_check.py "${CHECK[@]}" --json "$DEST/check.jsonl"
run_part 1 "grouped matmul" "${LIMITS[1]}" "$PY" benchmarks/grouped_matmul.py "${GROUPED[@]}" --json "$DEST/grouped_matmul.json"
run_part 2 "attention" "${LIMITS[2]}" "$PY" benchmarks/attention.py "${ATTENTION[@]}" --json "$DEST/attention.json"
run_part 3 "fp8 matmul" "${LIMITS[3]}" "$PY" benchmarks/fp8_matmul.py "${FP8[@]}" --json "$DEST/fp8_matmul.json"
rm -rf "$DEST/profile"
run_part 4 "training step" "${LIMITS[4]}" "$PY" benchmarks/step.py "${STEP[@]}" --label proxy "${VARIANTS[@]}" \
  --json "$DEST/step.json" --profile "$DEST/profile"
run_part 5 "command buffers" "${LIMITS[5]}" env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL" \
  "$PY" benchmarks/step.py "${STEP[@]}" --label command_buffers "${COMMAND_BUFFERS[@]}" --json "$DEST/step_command_buffers.json"
GPUS=$( (nvidia-smi -L 2>/dev/null || true) | grep -c "^GPU" || true)
if [[ "${LIMITS[6]}" -gt 0 && "$GPUS" -ge 2 ]]; then
  run_part 6 "dispatch" "${LIMITS[6]}" env JAX_PLATFORMS=cuda "$PY" benchmarks/dispatch.py --devices "$GPUS" \
    --chunks 32 --repeats 5
fi

if [[ -n "$ONLY" && "$ONLY" == *",7,"* ]]; then  # the tile sweep runs only when asked for
  run_part 7 "grouped GEMM tiles" "${LIMITS[7]}" "$PY" benchmarks/grouped_matmul.py "${TILES[@]}" --json "$DEST/tiles.json"
fi

printf '%s\n' "${status[@]:-}" > "$DEST/failed_parts.txt"
"$PY" benchmarks/suite_table.py "$DEST" || status+=("table: benchmarks/suite_table.py failed")
if [[ ${#status[@]} -gt 0 ]]; then
  echo "gpu_suite: ${#status[@]} part(s) failed: ${status[*]}" >&2
  exit 1
fi
