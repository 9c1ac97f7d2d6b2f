"""The on-device kernel check (maxmoe.check) on CPU: rows for what runs here, reasons for what cannot,
and a wrong or crashing kernel recorded as such while the other checks still run."""

import json

import jax.numpy as jnp
import pytest

from maxmoe import check, info
from maxmoe.kernels import fp8_matmul


@pytest.mark.smoke
def test_cpu_rows_pass_or_say_why_not(tmp_path, capsys):
    rows_file = tmp_path / "rows.jsonl"
    # The interpreted Triton checks are the slow ones; --cpu-smoke of gpu_suite.sh runs them all.
    only = ["grouped mosaic_gpu", "attention cudnn", "fp8 tensorwise dense", "fp8 mxfp8 dense"]
    code = info.main(["--check", "--json", str(rows_file), *[a for name in only for a in ("--only", name)]])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out[0].startswith("preflight: ") and "jax " in out[0] and "free memory" in out[0]
    records = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert records[0]["preflight"]["platform"] == "cpu"
    rows = {r["check"]: r for r in records[1:]}
    assert list(rows) == only  # in CHECKS order, each written as it finished
    assert rows["grouped mosaic_gpu"]["status"] == "skip" and "needs a GPU" in rows["grouped mosaic_gpu"]["detail"]
    assert rows["attention cudnn"]["status"] == "skip" and "needs a GPU" in rows["attention cudnn"]["detail"]
    for name in only[2:]:
        assert rows[name]["status"] == "pass", rows[name]
        assert 0 <= rows[name]["max_rel_error"] <= rows[name]["tolerance"] == 1e-4


def test_a_wrong_kernel_fails_and_a_crashing_one_is_recorded_while_the_rest_run(monkeypatch, capsys):
    real = fp8_matmul.fp8_matmul

    def off_by_one_percent(x, w, recipe, kernels=None):
        return real(x, w, recipe, kernels) * jnp.asarray(1.01, x.dtype)

    def crashing():
        raise RuntimeError("kernel launch failed\nsecond line")

    monkeypatch.setattr(fp8_matmul, "fp8_matmul", off_by_one_percent)
    monkeypatch.setitem(check.CHECKS, "attention cudnn", crashing)
    rows = check.run_all(only=["attention cudnn", "fp8 tensorwise dense", "fp8 mxfp8 dense"])
    assert [(r.check, r.status) for r in rows] == [
        ("attention cudnn", "error"),
        ("fp8 tensorwise dense", "fail"),
        ("fp8 mxfp8 dense", "fail"),
    ]
    assert rows[0].detail == "RuntimeError: kernel launch failed"
    assert rows[1].max_rel_error == pytest.approx(0.01, rel=0.05)  # the forward is 1% off; the VJP is untouched
    assert check.main(["--only", "fp8 tensorwise dense"]) == 1
    assert "failed: fp8 tensorwise dense" in capsys.readouterr().out
