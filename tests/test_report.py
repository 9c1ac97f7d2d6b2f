"""`python -m maxmoe.report`: one PNG from a run folder's metrics.jsonl."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from maxmoe import report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(folder: Path, per_layer: bool) -> list[dict]:
    """A run folder with 6 logged steps, evals at 3 and 6, and a config with 2 MoE layers + 1 MTP."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(
        yaml.safe_dump({"model": {"num_layers": 3, "first_k_dense": 1, "mtp_num_layers": 1}})
    )
    records = []
    for step in range(1, 7):
        record = {
            "step": step,
            "loss": 6.0 - 0.5 * step,
            "lm_loss": 5.0 - 0.4 * step,
            "grad_norm": 1.0 / step,
            "lr": 1e-3 * step,
            "tokens_per_s": 1000.0 + step,
            "mfu": None,
            "moe_imbalance": 4.0 - 0.4 * step,
        }
        if per_layer:
            record[report.LAYER_IMBALANCE_KEY] = [4.0 - 0.4 * step, 2.0, 1.0 + 0.1 * step]
        records.append(record)
        if step % 3 == 0:
            records.append({"step": step, "eval_loss": 4.5 - 0.3 * step})
    lines = [json.dumps(r) for r in records] + ['{"step": 7, "loss": 1.']  # a line cut short by a crash
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return records


def test_report_writes_a_png_with_per_layer_loads(tmp_path):
    records = write_run(tmp_path / "run", per_layer=True)
    assert report.main([str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "report.png").read_bytes()[:8] == PNG_MAGIC
    assert report.read_metrics(tmp_path / "run") == records
    steps, matrix, per_layer = report.layer_imbalance(records)
    assert per_layer and steps == [1, 2, 3, 4, 5, 6]
    np.testing.assert_array_equal(matrix, np.array([r[report.LAYER_IMBALANCE_KEY] for r in records if "loss" in r]).T)
    assert report._layer_names(tmp_path / "run", 3) == ["layer 1", "layer 2", "MTP 1"]  # noqa: SLF001
    fig = report.figure(tmp_path / "run")
    (heatmap,) = [image.get_array() for ax in fig.axes for image in ax.images]
    np.testing.assert_array_equal(np.asarray(heatmap), matrix)


def test_report_falls_back_to_loads_then_to_the_scalar(tmp_path):
    records = write_run(tmp_path / "run", per_layer=False)
    loads = [(step, np.array([[4.0, 0, 0, 0], [1, 1, 1, 1]]) * step) for step in (2, 4)]
    steps, matrix, per_layer = report.layer_imbalance(records, loads)
    assert per_layer and steps == [2, 4]
    np.testing.assert_allclose(matrix, [[4.0, 4.0], [1.0, 1.0]])  # max / mean per layer
    steps, matrix, per_layer = report.layer_imbalance(records)
    assert not per_layer and steps == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(matrix, [[4.0 - 0.4 * s for s in steps]])
    out = report.write_report(records, tmp_path / "elsewhere.png")
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_a_model_without_moe_layers_gets_no_heatmap(tmp_path):
    """A dense model logs empty per-layer lists (and a scalar of 1): no heatmap row, a title that says so."""
    records = write_run(tmp_path / "run", per_layer=True)
    for r in records:
        if "loss" in r:
            r[report.LAYER_IMBALANCE_KEY], r["moe_imbalance"] = [], 1.0
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    steps, matrix, per_layer = report.layer_imbalance(records)
    assert steps == [] and matrix.size == 0
    fig = report.figure(tmp_path / "run")
    assert not [image for ax in fig.axes for image in ax.images]
    assert "no MoE layer" in fig.axes[-1].get_title()
    assert report.main([str(tmp_path / "run")]) == 0
    # Records without any load figure: no heatmap either, and no claim about the model.
    bare = [{k: v for k, v in r.items() if k not in (report.LAYER_IMBALANCE_KEY, "moe_imbalance")} for r in records]
    assert "no MoE layer" not in report.figure(bare).axes[-1].get_title()


@pytest.mark.parametrize("case", ["no_folder", "no_metrics", "unwritable"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case):
    args = [str(tmp_path / "missing")]
    if case == "no_metrics":
        (tmp_path / "empty").mkdir()
        args = [str(tmp_path / "empty")]
    elif case == "unwritable":
        write_run(tmp_path / "run", per_layer=False)
        args = [str(tmp_path / "run"), "--out", str(tmp_path / "no" / "such" / "dir" / "r.png")]
    assert report.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("maxmoe: error: "), err


def test_without_matplotlib_the_error_says_what_to_install(tmp_path, capsys, monkeypatch):
    write_run(tmp_path / "run", per_layer=False)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert report.main([str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'maxmoe[plot]'" in err[0], err
