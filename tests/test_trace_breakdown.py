"""maxmoe.analysis.trace_breakdown: a hand-written GPU trace's classes, and a trace recorded here on the CPU."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import job_env

from maxmoe.analysis import trace_breakdown as tb
from maxmoe.config import UserError
from maxmoe.kernels.grouped_matmul import grouped_matmul
from maxmoe.model.attention_ops import chunked_attention
from maxmoe.parallel.names import ATTENTION_CORE_SCOPE

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests/fixtures/gpu_trace/h200_two_steps.trace.json"


def test_the_hand_written_gpu_trace_splits_into_the_timeline_it_was_written_from():
    """Per step (make_gpu_trace.py's docstring): 900 us; overlapped time split between the two streams."""
    b = tb.breakdown(tb.read_trace(FIXTURE), steps=2, flops={"grouped_gemm": 2e9, "dense_gemm": 1e9})
    assert (b.device, b.module, b.steps) == ("/device:GPU:0", "jit_train_step", 2)
    assert b.step_s == pytest.approx(900e-6)
    assert b.excluded_s == pytest.approx(100e-6)  # the eval program's kernel
    expected = {  # class: (kernels, own us, wall us)
        "grouped_gemm": (1, 200, 150),
        "attention_fwd": (1, 100, 100),
        "attention_bwd": (1, 200, 200),
        "dense_gemm": (1, 100, 50),
        "collective": (1, 200, 100),
        "other": (1, 50, 50),
        "copy": (2, 100, 100),
        "idle": (0, 0, 150),
    }
    for key, (kernels, own, wall) in expected.items():
        row = b.row(key)
        assert (row.kernels, row.kernel_s * 1e6, row.wall_s * 1e6) == pytest.approx((kernels, own, wall)), key
        assert row.share == pytest.approx(wall / 900), key
    assert b.row("grouped_gemm").tflops == pytest.approx(2e9 / 200e-6 / 1e12)  # FLOPs over its own time
    assert b.row("dense_gemm").tflops == pytest.approx(1e9 / 100e-6 / 1e12)
    assert b.row("collective").tflops is None
    table = tb.format_table(b)
    assert "grouped GEMM" in table and "idle gaps" in table and " 16.7%" in table


def test_the_other_gpu_and_a_missing_one(tmp_path):
    trace = tb.read_trace(FIXTURE)
    other = tb.breakdown(trace, device=1, steps=2)
    assert other.device == "/device:GPU:1" and other.row("attention_fwd").kernel_s == pytest.approx(900e-6)
    with pytest.raises(UserError, match="no /device:GPU:3"):
        tb.breakdown(trace, device=3)
    with pytest.raises(UserError, match="no device events of program 'jit_nothing'"):
        tb.breakdown(trace, module="jit_nothing")
    gz = tmp_path / "plugins/profile/run/host.trace.json.gz"
    gz.parent.mkdir(parents=True)
    gz.write_bytes(gzip.compress(FIXTURE.read_bytes()))
    assert tb.profile_breakdown(tmp_path, steps=2).step_s == pytest.approx(900e-6)


def test_the_command_line_prints_the_table_and_refuses_bad_input_in_one_line(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "maxmoe.analysis.trace_breakdown", *args],
            cwd=REPO,
            env=job_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )

    ok = run(str(FIXTURE), "--steps", "2", "--json", str(tmp_path / "b.json"))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[0].startswith("where the step's time goes: /device:GPU:0, jit_train_step, 2 step(s)")
    assert json.loads((tmp_path / "b.json").read_text())["rows"][0]["label"] == "grouped GEMM"
    (tmp_path / "bad.json").write_text("{not json")
    for args in ([str(tmp_path / "missing")], [str(tmp_path / "bad.json")], [str(FIXTURE), "--steps", "0"]):
        bad = run(*args)
        assert bad.returncode == 2 and bad.stderr.startswith("maxmoe: error: ") and len(bad.stderr.splitlines()) == 1


def test_rules_on_compiled_instructions():
    def op(opcode, *op_names, opcodes=None, target=""):
        return tb.HloOp(opcode, target, op_names, frozenset(opcodes or {opcode}))

    event = tb.Event("k", "x.1", "", "line", 0.0, 1.0)
    assert tb.classify(event, op("all-gather-start")) == "collective"
    assert tb.classify(event, op("fusion", "jit(f)/jvp(m)/dot_general", opcodes={"dot", "add"})) == "dense_gemm"
    assert tb.classify(event, op("custom-call", "jit(f)/m/dot", target="__cublas$gemm")) == "dense_gemm"
    assert tb.classify(event, op("fusion", "a/transpose", opcodes={"transpose", "copy", "bitcast"})) == "copy"
    assert tb.classify(event, op("fusion", "a/add", opcodes={"transpose", "add"})) == "other"
    scoped = "jit(f)/transpose(jvp(m))/attention/attention_core/dot_general"
    assert tb.classify(event, op("fusion", scoped, opcodes={"dot"})) == "attention_bwd"
    assert tb.classify(event, op("fusion", scoped.replace("transpose(jvp(m))", "jvp(m)"))) == "attention_fwd"
    assert tb.classify(event, op("fusion", "jit(f)/jvp(grouped_gemm)/ragged_dot", opcodes={"dot"})) == "grouped_gemm"
    # without the program: the trace's own names
    assert tb.classify(tb.Event("ncclDevKernel_AllReduce", "", "", "l", 0, 1)) == "collective"
    assert tb.classify(tb.Event("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma", "", "", "l", 0, 1)) == (
        "attention_bwd"
    )
    assert tb.classify(tb.Event("input_concatenate_fusion", "concatenate_fusion.2", "", "l", 0, 1)) == "copy"


def test_a_trace_recorded_on_the_cpu(tmp_path):
    """Two steps of a program with a grouped GEMM, a scoped attention core and a dense GEMM; the
    classes' own times are the trace's own event durations, counted again here by a plain loop."""

    def loss(x, w, dense, q, k, v):
        y = grouped_matmul(x, w, jnp.array([48, 16], jnp.int32), backend="ragged_dot")
        with jax.named_scope(ATTENTION_CORE_SCOPE):
            a = chunked_attention(q, k, v, 0.1, 16)
        return jnp.sum(y) + jnp.sum(a) + jnp.sum(jnp.tanh(x @ dense))

    keys = jax.random.split(jax.random.key(0), 6)
    args = (
        jax.random.normal(keys[0], (64, 32)),
        jax.random.normal(keys[1], (2, 32, 32)),
        jax.random.normal(keys[2], (32, 48)),
        *(jax.random.normal(keys[3 + i], (1, 32, 2, 16)) for i in range(3)),
    )
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5))).trace(*args).lower().compile()
    jax.block_until_ready(compiled(*args))
    jax.profiler.start_trace(str(tmp_path))
    for _ in range(2):
        out = compiled(*args)
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    trace = tb.read_trace(tmp_path)
    b = tb.breakdown(trace, hlo_text=compiled.as_text())
    assert b.device == "/host:CPU" and b.steps == 2  # counted from the CPU events' run ids
    assert sum(r.wall_s for r in b.rows) == pytest.approx(b.step_s)
    for key in ("grouped_gemm", "attention_fwd", "attention_bwd", "dense_gemm"):
        assert b.row(key).kernels > 0, (key, tb.format_table(b))
    # the oracle: on each thread, the time covered by the program's XLA ops (a while loop's op
    # holds its body's: each instant counts once), added up over threads, and the ops counted
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and (e.get("args") or {}).get("hlo_module")]
    events = [e for e in events if e["args"]["hlo_module"] == b.module and "hlo_op" in e["args"]]
    covered = 0.0
    for tid in {e["tid"] for e in events}:
        end = -1.0
        for e in sorted((e for e in events if e["tid"] == tid), key=lambda e: e["ts"]):
            start, stop = e["ts"], e["ts"] + e["dur"]
            covered += max(0.0, stop - max(start, end))
            end = max(end, stop)
    assert sum(r.kernel_s for r in b.rows) * b.steps == pytest.approx(covered * 1e-6, rel=1e-6)
    assert sum(r.kernels for r in b.rows) * b.steps == len(events)


def test_a_training_run_prints_where_its_profiled_steps_went(tmp_path):
    """`python -m maxmoe.train ... run.profile_steps=[1,2]`: the breakdown of the two traced steps
    on the console and in profile/breakdown.json, the compiled program beside the trace."""
    run_dir = tmp_path / "run"
    overrides = ["model.num_layers=2", "model.mtp_num_layers=0", "train.steps=3", "train.batch_size=2"]
    overrides += ["train.seq_len=32", "run.cpu_devices=1", f"run.dir={run_dir}", "run.profile_steps=[1,2]"]
    result = subprocess.run(
        [sys.executable, "-m", "maxmoe.train", "--config", str(REPO / "configs/tiny.yaml"), *overrides],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "where the step's time goes: /host:CPU, jit_train_step, 2 step(s)" in out, out[-3000:]
    for label in ("grouped GEMM", "attention backward", "idle gaps"):
        assert any(line.startswith(label) for line in out.splitlines()), label
    saved = tb.Breakdown.from_dict(json.loads((run_dir / "profile/breakdown.json").read_text()))
    assert (run_dir / "profile/program.hlo.txt").exists() and saved.steps == 2
    assert saved.row("grouped_gemm").kernels > 0 and saved.row("attention_fwd").kernels > 0
    assert saved.row("dense_gemm").tflops > 0  # model FLOPs over the dense GEMMs' own time


COMMAND_BUFFER_HLO = """HloModule jit_train_step

%fused_transpose (p: f32[4,8]) -> f32[8,4] {
  %p = f32[4,8]{1,0} parameter(0)
  ROOT %t = f32[8,4]{1,0} transpose(%p), dimensions={1,0}, metadata={op_name="jit(step)/jvp(m)/transpose"}
}

%command_buffer (a: f32[4,8]) -> f32[8,4] {
  %a = f32[4,8]{1,0} parameter(0)
  ROOT %loop_transpose_fusion.2 = f32[8,4]{1,0} fusion(%a), kind=kLoop, calls=%fused_transpose
}

ENTRY %main (x: f32[4,8]) -> f32[8,4] {
  %x = f32[4,8]{1,0} parameter(0)
  ROOT %call.1 = f32[8,4]{1,0} call(%x), to_apply=%command_buffer
}
"""


def test_a_kernel_inside_a_command_buffer_is_classed_by_its_own_name():
    """In a CUDA graph every kernel carries the buffer's HLO op (call.1); the kernel's name is its
    instruction's (loop_transpose_fusion.2, a transpose): a copy, not another fusion."""
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Kernel)"}},
        {"ph": "X", "pid": 1, "tid": 7, "ts": 0.0, "dur": 10.0, "name": "loop_transpose_fusion_2",
         "args": {"hlo_op": "call.1", "hlo_module": "jit_train_step"}},
    ]  # fmt: skip
    trace = {"traceEvents": events}
    assert tb.breakdown(trace).row("other").kernels == 1  # without the program: the HLO op's name says nothing
    b = tb.breakdown(trace, hlo_text=COMMAND_BUFFER_HLO)
    assert b.row("copy").kernels == 1 and b.row("copy").kernel_s == pytest.approx(10e-6)
