"""maxmoe.kernels.rates: the committed table of measured kernel rates, and what a bad file gets."""

import textwrap

import pytest

from maxmoe.analysis.assumptions import SYSTEMS
from maxmoe.analysis.flops import fp8_gemm_classes
from maxmoe.config import UserError
from maxmoe.kernels.rates import DEFAULT_RATES, load_rates

GOOD = """\
rates:
  - {device_kind: NVIDIA H200, system: h200, class: grouped_gemm, backend: mosaic_gpu, precision: bf16,
     pass: fwd+bwd, shape: 671b, dims: {rows: 65536, groups: 4, d: 7168, f: 2048}, tflops: 439.7,
     peak_fraction: 0.444, date: 2026-12-04, commit: f240f24, command: "bash benchmarks/gpu_suite.sh"}
steps:
  - {device_kind: NVIDIA H200, system: h200, config: configs/proxy_1gpu.yaml, overrides: [], kernels: a+b,
     tokens_per_s: 25587, tflops_per_device: 181.4, mfu: 0.183, date: 2026-12-04, commit: f240f24, command: x}
"""


def write(tmp_path, text, name="rates.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_the_committed_table_reads_and_its_peak_fractions_are_its_rates_over_the_datasheet_peaks():
    table = load_rates(DEFAULT_RATES)
    assert {r.system for r in table.rates} == {"h200"}
    assert (
        table.find(kernel_class="grouped_gemm", backend="mosaic_gpu", pass_="fwd+bwd", shape="671b")[0].tflops == 439.7
    )
    for r in table.rates:
        # A recipe's dense (grouped) GEMMs run FP8 dots where flops.fp8_gemm_classes says so on the
        # system's architecture; elsewhere bf16 kernels (mxfp8 on Hopper: its dequantised values).
        gemm = {"dense_gemm": "attention", "grouped_gemm": "routed_experts"}.get(r.kernel_class)
        runs_fp8 = r.precision != "bf16" and gemm in fp8_gemm_classes(r.precision, SYSTEMS[r.system].arch)
        peak = SYSTEMS[r.system].peak_tflops("fp8" if runs_fp8 else "bf16")
        assert r.peak_fraction == pytest.approx(r.tflops / peak, abs=6e-4), r
        assert r.date and r.commit and r.command and r.device_kind.startswith("NVIDIA")
    step = table.steps[0]
    assert (step.config, step.overrides, step.tflops_per_device) == ("configs/proxy_1gpu.yaml", (), 181.4)


def test_a_good_file_reads_as_written(tmp_path):
    table = load_rates(write(tmp_path, GOOD))
    (rate,) = table.rates
    assert (rate.kernel_class, rate.backend, rate.precision, rate.pass_, rate.shape) == (
        "grouped_gemm",
        "mosaic_gpu",
        "bf16",
        "fwd+bwd",
        "671b",
    )
    assert dict(rate.dims) == {"rows": 65536, "groups": 4, "d": 7168, "f": 2048}
    assert rate.date == "2026-12-04" and rate.where == "NVIDIA H200, 2026-12-04, f240f24"
    assert table.steps[0].tokens_per_s == 25587


@pytest.mark.parametrize(
    "change, message",
    [
        (("class: grouped_gemm", "class: grouped"), "rates[0]: 'class' 'grouped': expected one of dense_gemm"),
        (("tflops: 439.7", "tflops: -1"), "rates[0]: 'tflops' -1: expected a number in (0, inf]"),
        (("peak_fraction: 0.444", "peak_fraction: 4.4"), "rates[0]: 'peak_fraction' 4.4: expected a number in (0, 1]"),
        (("pass: fwd+bwd", "pass: both"), "rates[0]: 'pass' 'both': expected one of fwd, fwd+bwd"),
        (("commit: f240f24, ", ""), "rates[0]: 'commit' is missing or not text"),
        (("dims: {rows: 65536,", "dims: {rows: many,"), "rates[0]: 'dims'"),
        (("mfu: 0.183", "mfu: 18.3"), "steps[0]: 'mfu' 18.3: expected a number in (0, 1]"),
        (("overrides: []", "overrides: x=1"), "steps[0]: 'overrides' 'x=1': expected a list"),
        (("rates:", "rate:"), "expected a mapping with a 'rates' list"),
        (("{device_kind", "[device_kind"), "not valid YAML"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_file_and_the_entry(tmp_path, change, message):
    path = write(tmp_path, GOOD.replace(*change, 1))
    with pytest.raises(UserError) as e:
        load_rates(path)
    text = str(e.value)
    assert text.startswith(f"rates file {path}") and message in text and "\n" not in text


def test_two_rates_for_one_kernel_and_shape_are_refused(tmp_path):
    first = GOOD.split("steps:")[0]
    entry = first.split("rates:\n")[1]
    path = write(tmp_path, first + entry)
    with pytest.raises(UserError, match=r"rates\[1\]: the same kernel and shape as rates\[0\]"):
        load_rates(path)


def test_a_missing_file_or_a_folder_is_named(tmp_path):
    with pytest.raises(UserError, match="rates file .*nothing.yaml not found"):
        load_rates(tmp_path / "nothing.yaml")
    with pytest.raises(UserError, match="is a folder"):
        load_rates(tmp_path)
