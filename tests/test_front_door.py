"""What a new user meets on the way in: the small notes a command owes and the traces it must not leave.

`model.vocab_size=auto` says the size it took; a refused run leaves no lock file (nor the
run.dir it made); `data prepare` counts the document it cuts between train and eval once;
the sweep's tables fit a terminal and say what is predicted, and `--plot` draws a replan.
"""

import json
from pathlib import Path

import jax
import pytest

import maxmoe
from maxmoe import data, sweep
from maxmoe.analysis.sweep_table import format_table, parse_columns
from maxmoe.config import UserError, load_config
from maxmoe.data.__main__ import main as data_main
from maxmoe.train import main as train_main
from maxmoe.training.run_dir import LOCK_NAME

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
HGX = str(Path(__file__).resolve().parents[1] / "configs" / "hgx_8gpu.yaml")  # 131,072 tokens a step


def test_vocab_size_auto_says_the_size_it_took(tmp_path, capsys):
    auto = load_config(TINY, {"model.vocab_size": "auto"})
    assert data.vocab_size_note(auto, data.resolve_vocab_size(auto)) == (
        "maxmoe: model.vocab_size=auto: 260, the vocabulary of the built-in byte corpus"
    )
    assert data.vocab_size_note(load_config(TINY), load_config(TINY)) is None
    # The command says it before the run starts (here one that is then refused: nothing compiles).
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    argv = ["--config", TINY, "model.vocab_size=auto", "checkpoint.resume=false", f"run.dir={run}"]
    assert train_main(argv) == 2
    captured = capsys.readouterr()
    assert "maxmoe: model.vocab_size=auto: 260, the vocabulary of the built-in byte corpus\n" in captured.out
    assert "checkpoint.resume=false" in captured.err
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


def test_a_refused_run_leaves_no_lock_and_no_run_dir_it_made(tmp_path):
    (tmp_path / "text.txt").write_text("some text to train on " * 50)
    tokens = tmp_path / "tokens"
    assert data_main(["prepare", "--input", str(tmp_path / "text.txt"), "--out", str(tokens)]) == 0
    # The data's vocabulary (260) is larger than the model's: refused after run.dir is locked.
    too_small = {"model.vocab_size": 256, "data.path": str(tokens), "run.progress": "none"}
    fresh, one = tmp_path / "new" / "run", jax.devices()[:1]
    with pytest.raises(UserError, match="model.vocab_size=256"):
        maxmoe.Trainer(load_config(TINY, {**too_small, "run.dir": str(fresh)}), devices=one)
    assert fresh.parent.is_dir() and not fresh.exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("kept")
    with pytest.raises(UserError, match="model.vocab_size=256"):
        maxmoe.Trainer(load_config(TINY, {**too_small, "run.dir": str(mine)}), devices=one)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    # A lock file that was there before (an earlier run's) stays where it was.
    (mine / LOCK_NAME).write_text("{}\n")
    with pytest.raises(UserError, match="model.vocab_size=256"):
        maxmoe.Trainer(load_config(TINY, {**too_small, "run.dir": str(mine)}), devices=one)
    assert (mine / LOCK_NAME).is_file()


def test_prepare_counts_the_document_cut_between_the_splits_once(tmp_path, capsys):
    texts = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (20 + i) for i in range(12)]
    (tmp_path / "in").mkdir()
    for i, text in enumerate(texts):
        (tmp_path / "in" / f"doc{i:02d}.txt").write_text(text)
    out = tmp_path / "tokens"
    argv = ["prepare", "--input", str(tmp_path / "in" / "*.txt"), "--out", str(out), "--eval-fraction", "0.2"]
    assert data_main(argv) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"] == 12 and meta["cut_documents"] == 1
    parts = meta["splits"]["train"]["documents"] + meta["splits"]["eval"]["documents"]
    assert parts == 13  # the cut document is a part of each split's file
    lines = capsys.readouterr().out.splitlines()
    train = next(line for line in lines if line.strip().startswith("train"))
    held = next(line for line in lines if line.strip().startswith("eval"))
    shown = [int(line.split("tokens")[1].split()[0]) for line in (train, held)]
    assert sum(shown) == 12, lines
    assert train.endswith("documents (one cut: its tail is in eval)")
    assert held.endswith("documents and the tail of the one cut")
    assert lines[-1] == "  12 documents in all"


GB = 1e9


def dry_run_result(name: str, total_gb: float) -> dict:
    """A dry-run result as the sweep prints it (every column's field)."""
    memory = {"argument": 20 * GB, "output": 20 * GB, "alias": 20 * GB, "temp": (total_gb - 20) * GB}
    a2a = {"forward": {"all-to-all": 3 * GB}, "backward": {"all-to-all": 6 * GB}}
    return {
        **{"name": name, "memory": {**memory, "total": total_gb * GB}, "fits": total_gb < 80, "compile_s": 31.5},
        **{"collective_total": 12 * GB, "forward_total": 4 * GB, "backward_total": 8 * GB, "cross_domain_total": 0},
        **{"collectives": {"all-to-all": 9 * GB, "all-gather": 3 * GB}, "collectives_by_pass": a2a},
        "flops_per_device": 146e12,
    }


def test_the_dry_run_table_fits_a_terminal_unless_all_columns_are_asked_for(capsys):
    results = [dry_run_result("data=1,expert=8,tensor=1", 71.34), dry_run_result("data=2,expert=4,tensor=1", 90.5)]
    compact = format_table(results, dry_run=True).splitlines()
    assert max(map(len, compact)) <= 110 and "total GB" in compact[0] and "alias GB" not in compact[0]
    assert compact[2].split()[1:] == ["data=1,expert=8,tensor=1", "20.00", "51.34", "71.34", "yes", "12.00"] + [
        "0.00",
        "9.00",
        "146",
        "31.5",
    ]
    full = format_table(results, dry_run=True, columns=parse_columns("all")).splitlines()
    assert len(full[0]) > 150 and "alias GB" in full[0] and "a2a bwd" in full[0]
    chosen = format_table(results, dry_run=True, columns=parse_columns("total,fits")).splitlines()
    assert chosen[0].split() == ["#", "mesh", "(data,expert,tensor)", "total", "GB", "fits"]
    with pytest.raises(UserError, match="--columns 'totl': expected all or names from arg,"):
        parse_columns("totl")
    assert sweep.main(["--config", TINY, "--devices", "8", "--dry-run", "--columns", "totl"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("maxmoe: error: --columns 'totl'")
    timed = {"name": "data=8,expert=1,tensor=1", "tokens_per_s": 143938.2, "tflops_per_device": 276.0}
    timed.update(mfu=None, step_s=0.91, compile_s=40.0)
    assert " 143,938 " in format_table([timed], dry_run=False).splitlines()[2]


def test_a_replan_is_called_predicted_and_plotted(tmp_path, capsys):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [
        {"kind": "all-to-all", "runs": 100, "bytes_per_run": 4.5 * GB * 7 / 8, "bytes": 450 * GB * 7 / 8, "peers": 8}
        | {"cross_domain": False, "pass": p, "computation": "body", "in_loop": True}
        for p in ("forward", "backward")
    ]
    stored = {"mesh": {"pipeline": 1, "data": 1, "expert": 8, "tensor": 1}, "name": "data=1,expert=8,tensor=1"}
    stored.update(devices=8, memory={"total": 60 * GB}, pipeline=None, planner_rows=rows)
    (tmp_path / "in.json").write_text(json.dumps({"results": [stored]}))
    drawn = []
    save = Figure.savefig
    Figure.savefig = lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k))[1]
    try:
        out = tmp_path / "replan.png"
        args = ["--config", HGX, "--replan", str(tmp_path / "in.json"), "--system", "h100", "--plot", str(out)]
        assert sweep.main(args) == 0
    finally:
        Figure.savefig = save
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("predicted by the planner") and "not measured" in printed[0]
    tokens = printed[2].split()[4]
    assert "," in tokens and float(tokens.replace(",", "")) > 1000, printed[2]
    assert out.is_file() and printed[-1] == f"maxmoe: wrote {out}"
    (fig,) = drawn
    title = fig._suptitle
    assert (
        title.get_text()
        == "mesh shapes for 8 devices (1 shape), dry run:\nper-device memory, predicted TFLOP/s per GPU"
    )
    box = title.get_window_extent(FigureCanvasAgg(fig).get_renderer())
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height  # not clipped
    assert [ax.get_ylabel() for ax in fig.axes] == ["memory per device (GB)", "predicted TFLOP/s per GPU (h100)"]
