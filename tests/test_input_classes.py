"""Each entry point against each class of input: type edges, YAML features, path forms, file
kinds, the environment and a full disk. What a bad input does is one line (`maxmoe: error:
...`, exit 2) or the documented behaviour, never a traceback, and nothing written is lost.

The command lines run in this process (their main functions, stderr through capsys); only
a backend jax cannot start needs a process of its own.
"""

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, job_env

from maxmoe import data
from maxmoe.check import main as check_main
from maxmoe.config import UserError, load_config
from maxmoe.convert.__main__ import main as convert_main
from maxmoe.data.__main__ import main as data_main
from maxmoe.generate import generate, generate_text
from maxmoe.generate import main as generate_main
from maxmoe.info import main as info_main
from maxmoe.report import _layer_names, _run_config, read_metrics, run_summary
from maxmoe.report import main as report_main
from maxmoe.sweep import main as sweep_main
from maxmoe.train import main as train_main
from maxmoe.training.checkpoint import latest_step_of
from maxmoe.training.metrics import truncate_after
from maxmoe.training.run_dir import claim_run_dir, write_run_config
from maxmoe.training.trainer import summary

TINY = str(ROOT / "configs" / "tiny.yaml")
HF_FOLDER = ROOT / "tests" / "fixtures" / "hf_tiny_deepseek_v3"


def records(*steps) -> bytes:
    return "".join(json.dumps({"step": s, "loss": 1.0, "lr": 0.1}) + "\n" for s in steps).encode()


def one_line(capsys, status: int, *words: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("maxmoe: error: "), (status, err[-2000:])
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def alias_bomb(levels: int = 9) -> str:
    rows = ["&l0 [x, x, x, x, x, x, x, x, x, x]"]
    rows += [f"&l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "[" + ", ".join(rows) + "]"


def token_folder(path: Path) -> Path:
    rng = np.random.default_rng(0)
    documents = [(f"doc{i}", rng.integers(0, 256, 200)) for i in range(4)]
    data.write_token_folder(path, documents, vocab_size=260, eos_id=257, eval_fraction=0.1, info={"tokenizer": "byte"})
    return path


# --------------------------------------------------------------------------- the command lines, one table


def _files(tmp: Path) -> dict:
    """The inputs the table names, made in `tmp`."""
    (tmp / "dup.yaml").write_text("train:\n  steps: 3\n  steps: 4\n")
    (tmp / "tag.yaml").write_text("train: !!python/object:os.system {}\n")
    (tmp / "two.yaml").write_text("train:\n  steps: 3\n---\ntrain:\n  steps: 4\n")
    (tmp / "bomb.yaml").write_text(f"run:\n  profile_steps: {alias_bomb()}\n")
    os.mkfifo(tmp / "fifo.yaml")
    (tmp / "run").mkdir()
    (tmp / "run" / "config.yaml").write_text(load_config(TINY).to_yaml())
    (tmp / "damaged_run").mkdir()
    (tmp / "damaged_run" / "config.yaml").write_bytes(b"model:\n  hidden_size: \xff\n")
    damaged = token_folder(tmp / "tokens")
    (damaged / "train.bin").write_bytes((damaged / "train.bin").read_bytes()[:-2])  # one token short
    return {"tmp": tmp}


CASES = {
    # train: type edges, YAML features, path forms, file kinds
    "train | type: 1:20 for an integer": (train_main, ["--config", TINY, "train.steps=1:20"], "expected an integer"),
    "train | type: 5,001 digits": (train_main, ["--config", TINY, "train.steps=1" + "0" * 5000], "out of range"),
    "train | type: NUL in a path": (train_main, ["--config", TINY, "run.dir=a\0b"], "NUL"),
    "train | yaml: a key twice": (train_main, ["--config", "{tmp}/dup.yaml"], "train.steps is given twice"),
    "train | yaml: a python tag": (train_main, ["--config", "{tmp}/tag.yaml"], "not valid YAML"),
    "train | yaml: two documents": (train_main, ["--config", "{tmp}/two.yaml"], "not valid YAML"),
    "train | yaml: an alias bomb": (train_main, ["--config", "{tmp}/bomb.yaml"], "more than 100,000 values"),
    "train | path: empty --config": (train_main, ["--config", ""], "an empty path"),
    "train | path: ~ of no user": (train_main, ["--config", TINY, "run.dir=~nosuchuser-maxmoe/x"], "no user"),
    "train | file: a FIFO as --config": (train_main, ["--config", "{tmp}/fifo.yaml"], "not a regular file"),
    # generate, report, data, convert: path forms and file kinds
    "generate | path: empty --run": (generate_main, ["--run", "", "--prompt", "x"], "argument --run: an empty path"),
    "generate | type: --seed past 32 bits": (
        generate_main,
        ["--run", "{tmp}/run", "--prompt", "x", "--seed", str(2**70)],
        "expected 0 to",
    ),
    "generate | file: a run whose config.yaml is not UTF-8": (
        generate_main,
        ["--run", "{tmp}/damaged_run", "--prompt", "x"],
        "its config.yaml cannot be read (not UTF-8 text)",
    ),
    "report | path: empty RUN_DIR": (report_main, [""], "an empty path"),
    "report | file: metrics.jsonl a FIFO": (report_main, ["{tmp}/fifo_run"], "not a regular file"),
    "data stats | path: empty": (data_main, ["stats", ""], "an empty path"),
    "data stats | file: a token file one token short": (data_main, ["stats", "{tmp}/tokens"], "meta.json promises"),
    "data prepare | path: empty --input": (data_main, ["prepare", "--input", "", "--out", "{tmp}/o"], "empty path"),
    "data prepare | file: a device as --input": (
        data_main,
        ["prepare", "--input", "/dev/null", "--out", "{tmp}/o"],
        "not a regular file",
    ),
    "convert | path: empty --hf-dir": (convert_main, ["from-hf", "--hf-dir", "", "--out", "{tmp}/o"], "empty path"),
    # sweep, info: where output goes, arguments of another mode
    "sweep | path: --write-config a folder": (
        sweep_main,
        ["--config", TINY, "--devices", "1", "--write-config", "{tmp}"],
        "is a folder",
    ),
    "sweep | path: --write-config where nothing is written": (
        sweep_main,
        ["--config", TINY, "--devices", "1", "--write-config", "/proc/maxmoe/best.yaml"],
        "--write-config /proc/maxmoe/best.yaml",
    ),
    "info | args: --check with a config": (info_main, ["--check", "--config", TINY], "reads no config"),
    "check | args: a check that does not exist": (check_main, ["--only", "nonexistent"], "invalid choice"),
    "check | path: --json where nothing is written": (
        check_main,
        ["--json", "/proc/maxmoe/rows.jsonl"],
        "--json /proc/maxmoe/rows.jsonl",
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_command_line_inputs_are_one_line(case, tmp_path, capsys):
    main, argv, words = CASES[case]
    _files(tmp_path)
    (tmp_path / "fifo_run").mkdir()
    os.mkfifo(tmp_path / "fifo_run" / "metrics.jsonl")
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    one_line(capsys, main([a.replace("{tmp}", str(tmp_path)) for a in argv]), words)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing made, nothing removed


@pytest.mark.parametrize("flags", ["garbage", "--xla_backend_optimization_level=0 junk", '--xla_dump_to="a b'])
def test_xla_flags_that_xla_would_abort_on_are_one_line_in_every_entry_point(flags, monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", flags)
    for main, argv in ((train_main, ["--config", TINY]), (report_main, ["x"]), (generate_main, ["--prompt", "x"])):
        one_line(capsys, main(argv), "XLA_FLAGS")


JAX_PLATFORMS_CUDA = """
import sys
from maxmoe.generate import main as generate_main
from maxmoe.info import main as info_main
from maxmoe.train import main as train_main
print(train_main(["--config", sys.argv[1], f"run.dir={sys.argv[2]}", "run.progress=none"]),
      info_main(["--config", sys.argv[1]]), generate_main(["--checkpoint", sys.argv[3], "--prompt", "x", "--tokenizer", "byte"]))
import maxmoe
from maxmoe.config import UserError
try:
    maxmoe.Trainer(maxmoe.load_config(sys.argv[1], [f"run.dir={sys.argv[2]}"]))
except UserError as e:
    print(f"api: {e}")
"""


def test_a_backend_jax_cannot_start_is_one_line_in_every_entry_point(tmp_path):
    run_dir = tmp_path / "run"
    job = subprocess.run(
        [sys.executable, "-c", JAX_PLATFORMS_CUDA, TINY, str(run_dir), str(HF_FOLDER)],
        capture_output=True,
        text=True,
        env=job_env(JAX_PLATFORMS="cuda"),
        cwd=ROOT,
        timeout=300,
    )
    out = job.stdout.strip().splitlines()
    assert job.returncode == 0 and out[0] == "2 2 2", (job.stdout, job.stderr[-3000:])
    assert out[1].startswith("api: jax cannot start JAX_PLATFORMS=cuda"), out
    errors = [line for line in job.stderr.splitlines() if line.startswith("maxmoe: error: ")]
    assert len(errors) == 3 and all("JAX_PLATFORMS=cuda" in line for line in errors), job.stderr[-3000:]
    assert "Traceback" not in job.stderr
    assert not run_dir.exists()


# --------------------------------------------------------------------------- a full disk


@contextlib.contextmanager
def disk_of(size: int):
    """Every write past `size` bytes fails inside the block (EFBIG, as a full disk would fail it)."""
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, limits[1]))
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)


def test_a_full_disk_is_one_line_and_leaves_what_was_written(tmp_path):
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_bytes(records(*range(1, 200)))
    write_run_config(tmp_path / "run", "train:\n  steps: 3\n")
    config_yaml = (tmp_path / "run" / "config.yaml").read_text()
    with disk_of(16), pytest.raises(UserError, match="maxmoe.lock: File too large"):
        claim_run_dir(tmp_path / "fresh")
    with disk_of(16), pytest.raises(UserError, match="cannot rewrite .*metrics.jsonl .*it was left as it was"):
        truncate_after(metrics, 100)
    with disk_of(16), pytest.raises(UserError, match="cannot write .*config.yaml .*nothing was changed"):
        write_run_config(tmp_path / "run", "train:\n  steps: 5\n")
    assert metrics.read_bytes() == records(*range(1, 200))
    assert (tmp_path / "run" / "config.yaml").read_text() == config_yaml
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.yaml", "metrics.jsonl"]


# --------------------------------------------------------------------------- the Python API, messages


def test_the_python_api_checks_generate_arguments_as_the_command_line_does():
    model = load_config(TINY).model
    variables = {"params": {}, "router": {}}
    for sampling, message in [
        ({"max_new_tokens": 2.5}, "max_new_tokens=2.5: expected an integer"),
        ({"seed": 2**70}, f"seed={2**70}: expected 0 to {2**32 - 1}"),
        ({"seed": -1}, "seed=-1: expected 0 to"),
        ({"temperature": "hot"}, "temperature='hot': expected a number"),
        ({"top_k": True}, "top_k=True: expected an integer"),
    ]:
        with pytest.raises(UserError, match=message):
            generate_text(model, variables, "abc", **sampling)
    with pytest.raises(UserError, match="seed=-1"):
        generate(model, variables, [1, 2], seed=-1)


def test_init_from_a_hugging_face_folder_says_to_convert_it():
    with pytest.raises(UserError) as error, latest_step_of(HF_FOLDER, f"checkpoint.init_from={HF_FOLDER}"):
        pass
    assert "python -m maxmoe.convert from-hf --hf-dir" in str(error.value)


def test_the_commands_a_run_suggests_are_shell_quoted(tmp_path):
    run_dir = tmp_path / "my run's dir"
    config = load_config(TINY, [f"run.dir={run_dir}"])
    trainer = types.SimpleNamespace(
        config=config,
        run_dir=run_dir,
        _seconds={},
        step=3,
        start_step=0,
        _started=0.0,
        stop_reason=None,
        history=[],
        checkpointer=types.SimpleNamespace(latest_step=lambda: 3),
    )
    quoted = "'" + str(run_dir).replace("'", "'\"'\"'") + "'"
    lines = summary(trainer)
    assert f"--run {quoted} " in lines[-2] and f"-m maxmoe.report {quoted} " in lines[-1], lines


# --------------------------------------------------------------------------- report


def test_report_skips_damaged_metrics_lines_and_says_so_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(records(1) + b'{"step": 2, "lo\n' + b"\xff\xfe\n" + records(3, 4))
    assert [r["step"] for r in read_metrics(run)] == [1, 3, 4]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"maxmoe: warning: {run / 'metrics.jsonl'}: skipped 2 damaged lines (lines 2, 3)"], err
    (run / "metrics.jsonl").write_bytes(records(1, 2) + b'{"step": 3, "lo')  # cut short by a crash: said nothing
    read_metrics(run)
    assert capsys.readouterr().err == ""


def test_report_draws_a_run_whose_config_yaml_is_damaged(tmp_path, capsys):
    """Not UTF-8, a list, sections of the wrong kind, a bad value: the report
    draws without what it cannot read (the title's summary, the layers' names)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(records(1, 2))
    for damaged in (
        b"\xff\xfe",
        b"- a list\n",
        b"model: [1, 2]\ntrain: 5\n",
        b"model:\n  num_layers: x\n",
    ):
        (run / "config.yaml").write_bytes(damaged)
        assert run_summary(read_metrics(run), _run_config(run)) == ""
        assert _layer_names(run, 2) == ["MoE 0", "MoE 1"]
    assert report_main([str(run), "--out", str(tmp_path / "report.svg")]) == 0, capsys.readouterr().err
    assert (tmp_path / "report.svg").is_file() and "Traceback" not in capsys.readouterr().err
