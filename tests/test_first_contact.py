"""What a new user meets after the quickstart: own text through data.path, run folders per config,
the console (compiles announced, honest step times, a line per interval, a closing summary),
and one-line answers to the usual first mistakes."""

import contextlib
import gzip
import io
import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import jax
import numpy as np
import pytest
from conftest import job_env

from maxmoe import Trainer
from maxmoe.config import UserError, load_config
from maxmoe.data import EOS_ID, data_folders, load_tokens, make_dataset, read_meta
from maxmoe.data.__main__ import main as data_main
from maxmoe.data.documents import read_documents
from maxmoe.data.text_cache import input_files, token_folder_for
from maxmoe.train import main as train_main
from maxmoe.training import trainer as trainer_lib

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
# One MoE layer, no MTP, short windows: the cheapest model with expert dispatch.
SMALL = {
    "model.compute_dtype": "float32",
    "model.num_layers": 1,
    "model.first_k_dense": 0,
    "model.mtp_num_layers": 0,
    "train.batch_size": 8,
    "train.seq_len": 32,
    "train.log_every": 1,
    "run.progress": "none",
}
WORDS = ["alpha", "beta", "gamma", "delta"]


def write_corpus(path: Path, lines: int = 400, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    text = "\n".join(" ".join(rng.choice(WORDS, 8)) for _ in range(lines)).encode()
    path.write_bytes(text)
    return text


# --------------------------------------------------------------------------- data.path: text to tokens, cached


@pytest.mark.smoke
def test_a_text_file_becomes_its_bytes_and_is_tokenised_once(tmp_path, capsys):
    text = write_corpus(tmp_path / "notes.txt")
    cache = str(tmp_path / "cache")
    folder = token_folder_for(str(tmp_path / "notes.txt"), cache_dir=cache)
    said = capsys.readouterr().out
    assert "tokenising 1 file(s)" in said and str(folder) in said
    train, _ = load_tokens(folder, "train")
    held, _ = load_tokens(folder, "eval")
    # One document: its head trains and its tail (5%) is held out, each part followed by EOS.
    assert train[-1] == EOS_ID and held[-1] == EOS_ID
    assert bytes(np.concatenate([train[:-1], held[:-1]]).astype(np.uint8)) == text
    assert len(held) - 1 == round(0.05 * len(text))
    stamp = (folder / "meta.json").stat().st_mtime_ns
    assert token_folder_for(str(tmp_path / "notes.txt"), cache_dir=cache) == folder  # a second run: reused
    assert capsys.readouterr().out == "" and (folder / "meta.json").stat().st_mtime_ns == stamp
    write_corpus(tmp_path / "notes.txt", seed=1)  # edited content: a folder of its own
    assert token_folder_for(str(tmp_path / "notes.txt"), cache_dir=cache) != folder
    assert token_folder_for(str(folder), cache_dir=cache) == folder  # a token folder is used as it is


@pytest.mark.smoke
def test_globs_and_folders_of_documents(tmp_path):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.txt").write_bytes(b"first document")
    with gzip.open(docs / "sub" / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "second"}) + "\n" + json.dumps({"text": "third one"}) + "\n")
    (docs / "notes.bin").write_bytes(b"\x00not text")  # not a document suffix: a folder leaves it out
    cache = str(tmp_path / "cache")
    from_folder = read_meta(token_folder_for(str(docs), cache_dir=cache))
    counts = {s: (e["tokens"], e["documents"]) for s, e in from_folder["splits"].items()}
    assert sum(t for t, _ in counts.values()) == len("first document") + len("second") + len("third one") + 4
    assert from_folder["inputs"] == [str(docs / "a.txt"), str(docs / "sub" / "b.jsonl.gz")]
    from_glob = read_meta(token_folder_for(str(docs / "**" / "*.jsonl.gz"), cache_dir=cache))
    assert from_glob["inputs"] == [str(docs / "sub" / "b.jsonl.gz")]
    for bad, words in [(tmp_path / "missing.txt", "no such file or folder"), (tmp_path / "x*.txt", "no files match")]:
        with pytest.raises(UserError, match=words):
            token_folder_for(str(bad), cache_dir=cache)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="not a token folder"):
        token_folder_for(str(tmp_path / "empty"), cache_dir=cache)


def test_tokenising_shows_progress(tmp_path, capsys, monkeypatch):
    from maxmoe.data import text_cache

    monkeypatch.setattr(text_cache, "_PROGRESS_EVERY_S", 0.0)  # a line per document instead of every 2 s
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": "x" * 10}) + "\n" for _ in range(2)))
    token_folder_for(str(tmp_path / "*.jsonl"), cache_dir=str(tmp_path / "cache"))
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("maxmoe:   ")]
    assert [line.split(" (")[0] for line in progress] == [
        f"maxmoe:   {10 * n:,} tokens, {n} {'document' if n == 1 else 'documents'}, file {1 + (n - 1) // 2} of 2"
        for n in range(1, 5)
    ]


def test_a_path_that_exists_is_that_file_and_globs_follow_each_folder_once(tmp_path):
    (tmp_path / "book[1].txt").write_text("the book with brackets")
    (tmp_path / "book1.txt").write_text("another book")
    assert input_files(str(tmp_path / "book[1].txt")) == [str(tmp_path / "book[1].txt")]
    assert input_files(str(tmp_path / "book[12].txt")) == [str(tmp_path / "book1.txt")]  # no such file: a glob
    corpus, other = tmp_path / "corpus", tmp_path / "other"
    (corpus / "sub").mkdir(parents=True)
    other.mkdir()
    for path in (corpus / "b.txt", corpus / "sub" / "a.txt", other / "c.txt"):
        path.write_text(path.stem)
    (corpus / "sub" / "loop").symlink_to(corpus)  # a loop back to the top
    (corpus / "link").symlink_to(other)  # a linked folder: read once
    expected = [str(corpus / "b.txt"), str(corpus / "link" / "c.txt"), str(corpus / "sub" / "a.txt")]
    assert input_files(str(corpus / "**" / "*.txt")) == expected
    assert input_files(str(corpus)) == expected


def test_jsonl_text_is_read_as_written_or_refused(tmp_path):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"text": "caf\xc3\xa9"}\n{"text": "b"}\n')
    assert [text for _, text in read_documents(str(bom))] == ["caf\u00e9", "b"]
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(UserError, match=r"latin.jsonl:2: not UTF-8 text"):
        list(read_documents(str(latin)))
    packed = tmp_path / "latin.jsonl.gz"
    packed.write_bytes(gzip.compress(latin.read_bytes()))
    with pytest.raises(UserError, match=r"latin.jsonl.gz:2: not UTF-8 text"):
        list(read_documents(str(packed)))


@pytest.mark.smoke
def test_data_path_under_a_source_that_ignores_it_is_one_line(capsys, tmp_path):
    for source in ("stdlib", "synthetic"):
        args = ["--config", TINY, f"data.path={tmp_path}/notes.txt", f"data.source={source}", "--print-config"]
        assert train_main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("maxmoe: error: data.path=") and f"data.source={source}" in err[0]
    assert load_config(TINY, {"data.path": "x.txt"}).data.kind == "shards"  # auto: the path is read
    assert load_config(TINY).data.kind == "stdlib"


@pytest.fixture(scope="module")
def stdlib_run(tmp_path_factory):
    """Four steps on the built-in corpus in this process, evaluated at steps 2 and 4, and timings
    taken here: one evaluation, and one step to completion with the run's compiled program."""
    run_dir = tmp_path_factory.mktemp("stdlib") / "run"
    overrides = {**SMALL, "train.steps": 4, "train.eval_every": 2, "train.eval_batches": 16, "run.dir": str(run_dir)}
    with Trainer(load_config(TINY, overrides), devices=jax.devices()[:1]) as trainer:
        start = time.perf_counter()
        trainer.run()
        loop = time.perf_counter() - start
        start = time.perf_counter()
        trainer.evaluate()
        one_eval = time.perf_counter() - start
        steps = []
        for _ in range(3):
            batch = trainer._to_device(next(trainer.train_data))
            start = time.perf_counter()
            trainer.state, metrics = trainer._train_step(trainer.state, batch)
            jax.block_until_ready(metrics)
            steps.append(time.perf_counter() - start)
        seen = dict(history=trainer.history, loop=loop, one_eval=one_eval, one_step=min(steps), run_dir=run_dir)
    # A new run started from this one's weights says so (the parameter init compiles; nothing trains).
    started = {**overrides, "checkpoint.init_from": str(run_dir), "run.dir": str(run_dir.parent / "tuned")}
    console = io.StringIO()
    programs = trainer.programs  # the same model on the same device: its compiled init is reused
    with (
        mock.patch.object(trainer_lib, "build_programs", lambda config, layout: programs),
        contextlib.redirect_stdout(console),
        Trainer(load_config(TINY, {**started, "run.progress": "plain"}), devices=jax.devices()[:1]),
    ):
        pass
    seen["init_from console"] = console.getvalue().splitlines()
    return seen


def test_a_run_says_which_weights_it_started_from(stdlib_run):
    lines = stdlib_run["init_from console"]
    assert f"maxmoe: initialised from {stdlib_run['run_dir']}, step 4" in lines  # the four steps of that run
    assert not any("initialised at random" in line for line in lines)
    assert "maxmoe: compiling the parameter initialisation ..." in lines


def test_step_times_are_steps_to_completion_without_eval(stdlib_run):
    times = [r["step_time_s"] for r in stdlib_run["history"] if "loss" in r]
    assert len(times) == 4
    # Timing the dispatch alone would read far below one step measured to completion here.
    assert min(times) >= 0.3 * stdlib_run["one_step"], (times, stdlib_run["one_step"])
    # Two evaluations of 16 batches ran inside the loop; none of their time is in the step times.
    assert sum(times) <= stdlib_run["loop"] - 2 * 0.5 * stdlib_run["one_eval"], stdlib_run


# --------------------------------------------------------------------------- run folders, hints, stats


@pytest.mark.smoke
def test_run_dir_defaults_to_one_folder_per_config(tmp_path):
    (tmp_path / "exp-a.yaml").write_text("train:\n  steps: 5\n")
    (tmp_path / "overlay.yaml").write_text("train:\n  lr: 0.001\n")
    (tmp_path / "v3").mkdir()
    (tmp_path / "v3" / "config.yaml").write_text("train:\n  steps: 5\n")  # what convert from-hf writes
    assert load_config(tmp_path / "exp-a.yaml").run.dir == "runs/exp-a"
    assert load_config([tmp_path / "exp-a.yaml", tmp_path / "overlay.yaml"]).run.dir == "runs/exp-a+overlay"
    assert load_config(tmp_path / "v3" / "config.yaml").run.dir == "runs/v3"
    assert load_config(tmp_path / "exp-a.yaml", ["run.dir=elsewhere"]).run.dir == "elsewhere"
    assert load_config(TINY).run.dir == "runs/tiny"


@pytest.mark.smoke
def test_an_option_for_a_config_key_gets_a_hint(capsys):
    assert train_main(["--config", TINY, "--steps", "50"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("train.steps=50"), err
    assert train_main(["--config", TINY, "--seq-len=64"]) == 2
    assert capsys.readouterr().err.strip().endswith("train.seq_len=64")


@pytest.mark.smoke
def test_data_stats_takes_the_folder(tmp_path, capsys):
    write_corpus(tmp_path / "notes.txt")
    folder = token_folder_for(str(tmp_path / "notes.txt"), cache_dir=str(tmp_path / "cache"))
    capsys.readouterr()
    assert data_main(["stats", str(folder)]) == 0
    out = capsys.readouterr().out
    meta = read_meta(folder)
    assert f"{meta['splits']['train']['tokens']:>14,} tokens" in out and "vocab 260" in out
    assert data_main(["stats", "--path", str(folder)]) == 0 and capsys.readouterr().out == out


# --------------------------------------------------------------------------- the console in a terminal

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_in_pty(args: list[str], timeout: float) -> tuple[list[tuple[float, str]], int]:
    """(seconds since start, line) of everything a command writes to a terminal, and its exit status."""
    leader, follower = pty.openpty()
    start = time.perf_counter()
    job = subprocess.Popen(args, stdin=follower, stdout=follower, stderr=follower, env=job_env(), cwd=ROOT)
    os.close(follower)
    chunks, text = [], b""
    try:
        while time.perf_counter() - start < timeout:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    data = os.read(leader, 65536)
                except OSError:  # the terminal closed: the job is done
                    break
                if not data:
                    break
                chunks.append((time.perf_counter() - start, data))
            elif job.poll() is not None:
                break
    finally:
        status = job.wait(timeout=60)
        os.close(leader)
    lines, partial = [], ""
    for at, data in chunks:
        text = partial + ANSI.sub("", data.decode(errors="replace"))
        *done, partial = re.split(r"\r\n|\n|\r", text)
        lines += [(at, line) for line in done]
    return lines + [(chunks[-1][0] if chunks else 0.0, partial)], status


def test_data_path_trains_on_that_text_and_the_terminal_console_tells_the_run(tmp_path, stdlib_run, capsys):
    """`data.path=corpus.txt` in a terminal: the text is tokenised once and trained on; the
    console announces each compile, keeps a line per interval above the bar, ends with a summary."""
    write_corpus(tmp_path / "corpus.txt", lines=2000)
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    overrides = {
        **SMALL,
        "train.steps": 4,
        "train.log_every": 2,
        "train.eval_every": 4,
        "run.progress": "auto",
        "data.path": str(tmp_path / "corpus.txt"),
        "data.cache_dir": str(cache),
    }
    args = [sys.executable, "-m", "maxmoe.train", "--config", TINY, f"run.dir={run_dir}"]
    lines, status = run_in_pty(args + [f"{k}={v}" for k, v in overrides.items()], timeout=400)
    text = [line for _, line in lines]
    assert status == 0, "\n".join(text)
    assert lines[0][0] < 5 and text[0] == f"maxmoe: run.dir {run_dir}: starting jax ...", lines[:2]
    # The text, tokenised into one cached folder, is what the run read: batches drawn from the
    # same config hold nothing but the corpus's bytes and EOS, and a second start reuses the folder.
    config = load_config(TINY, {**overrides, "run.dir": str(run_dir)})
    (folder,) = cache.glob("text-*")
    assert any(line.startswith(f"maxmoe: data.path={tmp_path / 'corpus.txt'}: tokenising 1 file") for line in text)
    assert any(line.startswith("maxmoe: 1 cpu device(s)") and f"({folder}), steps 0->4" in line for line in text)
    batches = np.concatenate([next(make_dataset(config)) for _ in range(4)])
    assert set(np.unique(batches)) <= set((tmp_path / "corpus.txt").read_bytes()) | {EOS_ID}
    assert data_folders(config) == [(folder, 1.0)] and "tokenising" not in capsys.readouterr().out
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    stdlib_eval = next(r["eval_loss"] for r in stdlib_run["history"] if r["step"] == 4 and "eval_loss" in r)
    assert abs(history[-1]["eval_loss"] - stdlib_eval) > 0.05, (history[-1], stdlib_eval)
    for what in ("the parameter initialisation", "the train step", "the eval step"):
        assert f"maxmoe: compiling {what} ..." in text
    assert "maxmoe: initialised at random (train.seed=0)" in text
    # The live bar redraws its own line; each logged interval is a line of its own above it.
    kept = [line for line in text if line.startswith("step ")]
    assert [line.split()[1] for line in kept] == ["2/4", "4/4", "4"], kept
    summary = text[text.index(next(line for line in text if line.startswith("maxmoe: done: steps 0->4 of 4"))) :]
    assert f"{4 * 8 * 32:,} tokens in" in summary[0]
    assert summary[1] == f"maxmoe: final loss {history[-2]['loss']:.4f}, eval_loss {history[-1]['eval_loss']:.4f}"
    assert summary[2].startswith(f"maxmoe: {run_dir}/: checkpoints/ (step 4), metrics.jsonl, config.yaml")
    assert f"-m maxmoe.generate --run {run_dir}" in summary[3] and f"-m maxmoe.report {run_dir}" in summary[4]


# --------------------------------------------------------------------------- pictures


def test_report_names_the_run_and_its_numbers(tmp_path):
    from maxmoe import report

    run_dir = tmp_path / "tmpabc123" / "my-run"
    run_dir.mkdir(parents=True)
    config = load_config(TINY)
    (run_dir / "config.yaml").write_text(config.to_yaml())
    records = [
        {
            "step": s,
            "loss": 3.0,
            "lm_loss": 2.5,
            "mtp_loss": 1.5,
            "lr": 1e-3,
            "tokens_per_s": 2048.0,
            "step_time_s": 1.0,
        }
        for s in (10, 20, 30)
    ] + [{"step": 20, "eval_loss": 2.4}, {"step": 30, "eval_loss": 2.6}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    fig = report.figure(run_dir)
    title = fig._suptitle.get_text().splitlines()
    params = f"{report.count_params(config.model)['params_total']:,} parameters"
    assert title[0] == "my-run" and params in title[1]  # the run's name, not the folder it sits in
    assert "batch 16 x 128, 61,440 tokens to step 30; 0m30s in train steps" in title[1]  # 3 intervals of 10 x 1 s
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "train MTP loss" in legend
    assert "eval loss (final 2.600; best 2.400 at step 20)" in legend
    assert f"uniform over 260 tokens ({np.log(260):.2f})" in legend


def test_sweep_plot_has_a_title_a_memory_scale_of_its_own_and_says_where(tmp_path, capsys, monkeypatch):
    from matplotlib.figure import Figure

    from maxmoe import sweep

    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k))[1])

    results = [
        {"name": f"data={d},expert={e},tensor=1", "memory": {"total": m}, "collectives": {"all-to-all": 2e6}}
        for d, e, m in ((8, 1, 40e6), (4, 2, 30e6), (2, 4, 25e6))
    ]
    out = tmp_path / "plots" / "sweep.png"
    assert sweep.plot(results, str(out), dry_run=True, hbm_gb=141.0) is None
    assert out.is_file() and capsys.readouterr().out == f"maxmoe: wrote {out}\n"
    (fig,) = drawn
    memory = fig.axes[0]
    assert fig._suptitle.get_text().startswith("mesh shapes for 8 devices (3 shapes), dry run")
    assert memory.get_ylabel() == "memory per device (MB)" and 40 <= memory.get_ylim()[1] < 100  # bars, not HBM
    assert [t.get_text() for t in memory.get_legend().get_texts()] == ["HBM 141 GB (off scale)"]
