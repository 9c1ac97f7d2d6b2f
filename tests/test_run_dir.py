"""run.dir before anything compiles: created, checked writable, locked for one job at a time."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import job_env

from maxmoe.config import UserError
from maxmoe.training.metrics import truncate_after
from maxmoe.training.run_dir import LOCK_NAME, RunDirLock, claim_run_dir, prepare_run_dir

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def test_a_new_run_dir_is_created_with_its_parents(tmp_path):
    assert prepare_run_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())  # the probe is gone


def test_a_regular_file_on_the_way_is_named(tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("x")
    for run_dir in (blocker, blocker / "run", blocker / "deeper" / "run"):
        with pytest.raises(UserError) as error:
            prepare_run_dir(run_dir)
        assert str(error.value) == f"run.dir={run_dir}: {blocker} is a file, not a folder"
    assert blocker.read_text() == "x"


def test_an_unwritable_run_dir_is_named(tmp_path):
    if os.geteuid() == 0:  # root writes through any mode bits; sysfs refuses even root
        run_dir = Path("/sys/maxmoe-test-run")
        if not Path("/sys").is_dir():
            pytest.skip("no unwritable folder for root on this system")
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        run_dir = locked / "run"
    with pytest.raises(UserError) as error:
        prepare_run_dir(run_dir)
    message = str(error.value)
    assert message.startswith(f"run.dir={run_dir}: cannot write there") and "\n" not in message, message


def test_a_second_lock_names_the_holder_and_the_first_is_unaffected(tmp_path):
    first = claim_run_dir(tmp_path)
    holder = json.loads((tmp_path / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(UserError) as error:
        RunDirLock(tmp_path).acquire()  # flock: another open file description conflicts, even in one process
    assert str(error.value).startswith(
        f"run.dir {tmp_path} is in use by process {os.getpid()} on {socket.gethostname()}"
    )
    assert json.loads((tmp_path / LOCK_NAME).read_text()) == holder  # the loser wrote nothing
    first.release()
    second = RunDirLock(tmp_path)
    second.acquire()  # released: free again
    second.release()


def test_metrics_rewrite_uses_a_temporary_file_of_its_own(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    mine = tmp_path / "metrics.tmp"  # a name the rewrite once used for itself
    mine.write_text("keep me")
    truncate_after(metrics, 2)
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2]
    assert mine.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "metrics.tmp"]


# A short run of a small program (one dense and one MoE layer, no MTP): the run.dir is under test, not the model.
SMALL_RUN = (
    "data.source=synthetic",
    "model.compute_dtype=float32",
    "model.num_layers=2",
    "model.mtp_num_layers=0",
    "train.batch_size=4",
    "train.seq_len=16",
    "train.steps=3",
    "train.log_every=1",
    "train.eval_every=100000",
)


def train_command(*overrides):
    return [sys.executable, "-m", "maxmoe.train", "--config", TINY, *SMALL_RUN, *overrides]


def train_env():
    env = job_env()
    return env


def run_train(*overrides, timeout=300):
    return subprocess.run(
        train_command(*overrides), capture_output=True, text=True, env=train_env(), timeout=timeout, cwd=ROOT
    )


def test_a_second_job_on_the_same_run_dir_stops_at_once_and_the_first_finishes(tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        train_command(f"run.dir={run_dir}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=train_env(),
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 300
        while f'"pid": {first.pid}' not in (
            (run_dir / LOCK_NAME).read_text() if (run_dir / LOCK_NAME).exists() else ""
        ):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first job never took the lock"
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)  # holds the lock, cannot finish meanwhile
        second = run_train(f"run.dir={run_dir}")
        first.send_signal(signal.SIGCONT)
        out, err = first.communicate(timeout=900)
    finally:
        first.kill()
    assert second.returncode == 2
    assert second.stderr.startswith(
        f"maxmoe: error: run.dir {run_dir} is in use by process {first.pid} on {socket.gethostname()} (since "
    )
    # Its only other output is the line every run starts with, before jax is imported.
    assert second.stderr.count("\n") == 1 and second.stdout == f"maxmoe: run.dir {run_dir}: starting jax ...\n"
    assert first.returncode == 0, err
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2, 3]  # every line of the first job, once
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["3"]


def test_train_refuses_a_run_dir_under_a_file_with_one_line(tmp_path):
    blocker = tmp_path / "results"
    blocker.write_text("x")
    result = run_train(f"run.dir={blocker / 'run'}")
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"maxmoe: error: run.dir={blocker / 'run'}: {blocker} is a file, not a folder\n"
