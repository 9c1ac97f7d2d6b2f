"""A run is never lost or trained wrong: signals at set-up, compile and the last save, bad
optimizer settings, run.dir and data that change under a run, resumes with another config.

Signals are landed at exact points by MAXMOE_HOLD (maxmoe.training.preemption.hold): the job
waits at a named point until the test writes to a FIFO, so no test depends on timing.
"""

import dataclasses
import gc
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import job_env

import maxmoe
from maxmoe import data
from maxmoe.config import ConfigError, UserError, load_config
from maxmoe.training import step as step_lib
from maxmoe.training.metrics import truncate_after
from maxmoe.training.optim import make_optimizer
from maxmoe.training.resume import resume_changes
from maxmoe.training.run_dir import LOCK_NAME, claim_run_dir

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
# One dense and one MoE layer, no MTP: the cheapest program with expert dispatch.
DENSE = {
    "model.num_layers": 2,
    "model.first_k_dense": 1,
    "model.mtp_num_layers": 0,
    "model.compute_dtype": "float32",
    "data.source": "synthetic",
    "train.batch_size": 2,
    "train.seq_len": 16,
    "train.steps": 3,
    "train.log_every": 1,
    "run.progress": "plain",
}
WAIT = 300  # seconds a job may take to reach a hold point on a busy machine (a failure, not a pace)


# --------------------------------------------------------------------------- holding a job at a point


class Held:
    """A job started with MAXMOE_HOLD=point:FIFO; `reached()` returns once it waits there."""

    def __init__(self, tmp_path: Path, point: str, argv: list[str]):
        self.fifo = tmp_path / f"hold-{point}"
        os.mkfifo(self.fifo)
        env = job_env(MAXMOE_HOLD=f"{point}:{self.fifo}")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
        self.writer = None
        self.err = b""

    def reached(self) -> None:
        # The FIFO opens for writing only once the job has opened it for reading, i.e. waits at the point.
        deadline = time.monotonic() + WAIT
        while self.writer is None:
            try:
                self.writer = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                assert self.proc.poll() is None, self.finish()
                assert time.monotonic() < deadline, "the job never reached its hold point"
                time.sleep(0.02)

    def stderr_line(self, text: str, timeout: float = 30) -> bool:
        """Whether a stderr line holding `text` comes within `timeout` s (read as it is written)."""
        selector = selectors.DefaultSelector()
        selector.register(self.proc.stderr, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while text.encode() not in self.err and time.monotonic() < deadline:
            if selector.select(timeout=max(0.0, deadline - time.monotonic())):
                chunk = os.read(self.proc.stderr.fileno(), 65536)
                if not chunk:
                    break
                self.err += chunk
        selector.close()
        return text.encode() in self.err

    def release(self) -> None:
        os.close(self.writer)

    def finish(self, timeout: float = 300) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out.decode(), (self.err + err).decode()


def train_argv(run_dir: Path, **overrides) -> list[str]:
    pairs = {**DENSE, "run.dir": str(run_dir), **overrides}
    return [sys.executable, "-m", "maxmoe.train", "--config", TINY, *(f"{k}={v}" for k, v in pairs.items())]


# --------------------------------------------------------------------------- signals


@pytest.mark.slow
def test_sigterm_during_the_last_save_waits_for_it_and_exits_0(tmp_path):
    """Item 1: the handlers stay in place while close() waits for the final asynchronous save."""
    run_dir = tmp_path / "run"
    job = Held(tmp_path, "checkpoint-close", train_argv(run_dir, **{"train.steps": 2, "checkpoint.every": 0}))
    job.reached()  # step 2 trained, its save started, close() about to wait for it
    job.proc.send_signal(signal.SIGTERM)
    job.release()
    code, out, err = job.finish()
    assert code == 0, err  # not -15: the signal was noted, not fatal
    assert "SIGTERM: stopping" in err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2"]  # complete, no tmp folder
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 2]  # two step lines and the final evaluation


@pytest.mark.slow
def test_sigterm_during_set_up_stops_before_a_step_with_status_0(tmp_path):
    run_dir = tmp_path / "run"
    job = Held(tmp_path, "trainer-init", train_argv(run_dir))
    job.reached()
    job.proc.send_signal(signal.SIGTERM)
    job.release()
    code, out, err = job.finish()
    assert code == 0, err  # not -15
    assert "SIGTERM: stopping" in err and "SIGTERM: stopped before training a step" in out
    assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").iterdir())
    assert "compiling the train step" not in out


@pytest.mark.slow
def test_ctrl_c_during_compilation_is_acknowledged_at_once_and_twice_exits(tmp_path):
    """Issue 33 item 4: the compile holds; the first Ctrl-C is answered while it does, the second exits."""
    run_dir = tmp_path / "run"
    job = Held(tmp_path, "compile", train_argv(run_dir))
    job.reached()  # the compile thread waits; the main thread waits for it
    job.proc.send_signal(signal.SIGINT)
    assert job.stderr_line("SIGINT: stopping"), job.err
    job.proc.send_signal(signal.SIGINT)
    code, out, err = job.finish(timeout=60)  # the hold is never released: only the exit ends the job
    assert code == 130, err
    assert "exiting now" in err
    assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").iterdir())


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_in_the_first_second_stops_the_job_before_it_writes_anything(tmp_path, sig):
    """Held as main() starts, before jax is imported: the signal is answered, the job stops with
    status 0 before building anything, and run.dir is never made."""
    run_dir = tmp_path / "run"
    job = Held(tmp_path, "startup", train_argv(run_dir))
    job.reached()
    job.proc.send_signal(sig)
    job.release()
    code, out, err = job.finish(timeout=120)
    name = signal.Signals(sig).name
    assert code == 0, err
    assert f"{name}: stopping" in err and f"{name}: stopped before training a step" in out, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert not run_dir.exists()


def test_sighup_during_training_is_a_stop_like_sigterm():
    """A closed terminal (SIGHUP) must save and stop as SIGTERM does, not kill the job unsaved."""
    from maxmoe.training.preemption import StopSignal

    reached = []
    previous = signal.signal(signal.SIGHUP, lambda *args: reached.append("the handler from before"))
    try:
        stop = StopSignal()
        with stop.installed():
            os.kill(os.getpid(), signal.SIGHUP)
            assert stop.should_stop(1) and stop.requested == "SIGHUP"
        assert reached == []
        os.kill(os.getpid(), signal.SIGHUP)  # the handler from before is back
        assert reached == ["the handler from before"]
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_second_ctrl_c_that_comes_once_the_first_is_acknowledged_is_the_second(monkeypatch):
    """The first handler's line goes out (os.write lets other threads run) before it returns; a
    SIGINT then runs its handler nested inside the first one's and must count as the second."""
    from maxmoe.training import preemption

    stop = preemption.StopSignal()  # a notebook's: the second Ctrl-C raises KeyboardInterrupt
    said, nested = [], []

    def say(text):
        said.append(text)
        if len(said) == 1:  # the acknowledgement is out: the second Ctrl-C lands here
            with pytest.raises(KeyboardInterrupt):
                stop._handle(signal.SIGINT, None)
            nested.append(True)

    monkeypatch.setattr(preemption, "_say", say)
    stop._handle(signal.SIGINT, None)
    assert nested and len(said) == 1 and stop.requested == "SIGINT"


# --------------------------------------------------------------------------- optimizer settings (item 2)


@pytest.mark.parametrize("key", ["b1", "b2"])
def test_adam_betas_of_one_are_refused(key):
    with pytest.raises(ConfigError, match=rf"train.{key}=1.0: must be below 1"):
        load_config(TINY, {f"train.{key}": 1.0})
    assert getattr(load_config(TINY, {f"train.{key}": 0.999}).train, key) == 0.999


def test_a_step_whose_update_is_not_finite_is_skipped_and_counted():
    """Finite loss and gradients, but b1=1 divides by zero in Adam's bias correction: the step is bad."""
    config = load_config(TINY, DENSE)
    bad = dataclasses.replace(config, train=dataclasses.replace(config.train, b1=1.0, warmup_steps=0))
    params = {"w": jnp.arange(1.0, 4.0)}
    for cfg, finite in ((config.replace(train={"warmup_steps": 0}), True), (bad, False)):
        optimizer = make_optimizer(cfg.train)
        state = step_lib.TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            router={},
            opt_state=optimizer.init(params),
            bad_steps=jnp.zeros((), jnp.int32),
            skipped=jnp.zeros((), jnp.int32),
        )
        aux = {"lm_loss": 1.0, "mtp_loss": 0.0, "seq_aux": 0.0, "moe_stats": {}}
        grads = {"w": jnp.array([0.5, -0.5, 0.25])}
        new, metrics = step_lib.apply_gradients(cfg, optimizer, state, jnp.float32(1.0), aux, grads)
        assert np.isfinite(float(metrics["grad_norm"]))
        assert np.isfinite(np.asarray(new.params["w"])).all()
        if finite:
            assert not np.array_equal(new.params["w"], params["w"]) and int(new.bad_steps) == 0
        else:
            np.testing.assert_array_equal(new.params["w"], params["w"])  # kept as they were
            assert (int(new.bad_steps), int(new.skipped)) == (1, 1)
            assert optax.tree.norm(new.opt_state) == optax.tree.norm(state.opt_state)
    # A parameter that is NaN already (loaded so) makes its own update NaN: that alone is no bad step.
    poisoned = {"w": params["w"].at[0].set(jnp.nan)}
    optimizer = make_optimizer(config.train)
    state = state.replace(params=poisoned, opt_state=optimizer.init(poisoned))
    new, _ = step_lib.apply_gradients(config, optimizer, state, jnp.float32(1.0), aux, grads)
    assert int(new.bad_steps) == 0 and np.isfinite(np.asarray(new.params["w"][1:])).all()
    assert not np.array_equal(new.params["w"][1:], params["w"][1:])


# --------------------------------------------------------------------------- run.dir (items 4, 5)


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_untouched(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_NAME).symlink_to(precious)
    with pytest.raises(UserError, match="maxmoe.lock is a symbolic link"):
        claim_run_dir(run_dir)
    assert precious.read_text() == "keep me\n"


@pytest.mark.parametrize(
    ("name", "kind"),
    [("checkpoints", "file"), ("metrics.jsonl", "folder"), ("config.yaml", "folder"), (LOCK_NAME, "folder")],
)
def test_run_dir_entries_of_the_wrong_kind_are_refused_before_anything_runs(tmp_path, name, kind):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if kind == "file":
        (run_dir / name).write_text("mine")
    else:
        (run_dir / name).mkdir()
    with pytest.raises(UserError, match=rf"{name} is not a (regular file|folder); move it away"):
        claim_run_dir(run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == [name]


# --------------------------------------------------------------------------- data (items 3, 7, 9)


def token_folder(path: Path, tokens: int, vocab: int = 260, tokenizer: str = "byte", eval_fraction=0.1) -> Path:
    rng = np.random.default_rng(0)
    documents = [(f"doc{i}", rng.integers(0, min(vocab, 256), tokens // 4)) for i in range(4)]
    info = {"tokenizer": tokenizer}
    data.write_token_folder(path, documents, vocab_size=vocab, eos_id=257, eval_fraction=eval_fraction, info=info)
    return path


def test_a_mixture_of_two_tokenizers_is_refused_whatever_the_vocab_size(tmp_path):
    byte = token_folder(tmp_path / "bytes", 400)
    bpe = token_folder(tmp_path / "bpe", 400, vocab=1000, tokenizer="/models/tokenizer.json")
    config = load_config(
        TINY, {**DENSE, "data.source": "shards", "data.mixture": {str(byte): 1, str(bpe): 1}, "model.vocab_size": 1000}
    )
    with pytest.raises(UserError, match="made with different tokenizers"):
        data.make_dataset(config)


SHRINK = """
import os, sys
from maxmoe import data
from maxmoe.config import UserError, load_config
folder = sys.argv[1]
config = load_config(sys.argv[2], {"data.source": "shards", "data.path": folder, "train.seq_len": 16,
                                   "train.batch_size": 2})
batches = data.make_dataset(config)
next(batches)
os.truncate(os.path.join(folder, "train.bin"), 0)  # another job rewrites the folder under this one
try:
    for _ in range(64):
        next(batches)
except UserError as e:
    print(f"maxmoe: error: {e}", file=sys.stderr)
    sys.exit(2)
"""


def test_a_token_file_that_shrinks_under_a_run_is_an_error_not_a_crash(tmp_path):
    folder = token_folder(tmp_path / "tokens", 40_000)
    job = subprocess.run(
        [sys.executable, "-c", SHRINK, str(folder), TINY], capture_output=True, text=True, env=job_env(), cwd=ROOT
    )
    assert job.returncode == 2, (job.returncode, job.stderr[-2000:])  # SIGBUS would be -7
    assert f"{folder / 'train.bin'} changed while it was being read: 0 bytes now" in job.stderr


@pytest.mark.parametrize("damage", ["missing", "short"])
def test_the_eval_split_is_checked_before_compiling(tmp_path, monkeypatch, damage):
    folder = token_folder(tmp_path / "tokens", 4000)
    meta = json.loads((folder / "meta.json").read_text())
    if damage == "missing":
        (folder / "eval.bin").unlink()
    else:  # fewer eval tokens than one window
        (folder / "eval.bin").write_bytes((folder / "eval.bin").read_bytes()[:20])
        meta["splits"]["eval"]["tokens"] = 10
        (folder / "meta.json").write_text(json.dumps(meta))
    config = load_config(TINY, {**DENSE, "data.source": "shards", "data.path": str(folder), "run.dir": str(tmp_path)})

    def build_programs(*args):
        raise AssertionError("the programs are built before the eval split was checked")

    monkeypatch.setattr("maxmoe.training.trainer.build_programs", build_programs)
    with pytest.raises(UserError, match="eval"):
        maxmoe.Trainer(config, jax.devices()[:1])


# --------------------------------------------------------------------------- metrics.jsonl (item 10)


def records(*steps) -> str:
    return "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps)


@pytest.mark.parametrize(
    ("bad_line", "why"),
    [
        ('{"step": 2, "lo', "not a JSON record"),
        ("[1, 2]", "not a JSON record"),
        ('{"step": "2"}', "not a JSON record"),
        (b"\xff\xfe", "not UTF-8"),
    ],
)
def test_a_damaged_metrics_line_before_the_last_is_one_error_and_the_file_is_kept(tmp_path, bad_line, why):
    metrics = tmp_path / "metrics.jsonl"
    bad = bad_line if isinstance(bad_line, bytes) else bad_line.encode()
    content = records(1).encode() + bad + b"\n" + records(3, 4).encode()
    metrics.write_bytes(content)
    with pytest.raises(UserError, match=rf"metrics.jsonl, line 2: {why}") as error:
        truncate_after(metrics, 3)
    assert "\n" not in str(error.value)
    assert metrics.read_bytes() == content


def test_a_last_metrics_line_cut_short_is_dropped_and_said(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(records(1, 2, 3) + '{"step": 4, "lo')
    note = truncate_after(metrics, 3)
    assert "dropped its last line" in note
    assert metrics.read_text() == records(1, 2, 3)


# --------------------------------------------------------------------------- resume (items 6, 8; issue 33 item 2)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run.dir whose latest checkpoint is step 2 of the DENSE config (no step compiled: the
    state at init is saved under step 2, as a run interrupted there would have left it)."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    config = load_config(TINY, {**DENSE, "run.dir": str(run_dir), "run.progress": "none"})
    with maxmoe.Trainer(config, jax.devices()[:1]) as trainer:
        trainer.step = 2
        trainer.save()
    return config


def resume(config, **overrides):
    return maxmoe.Trainer(config.override(*(f"{k}={v}" for k, v in overrides.items())), jax.devices()[:1])


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"train.seed": 1}, "train.seed: 0 there, 1 here"),
        ({"model.score_func": "softmax"}, "model.score_func: 'sigmoid' there, 'softmax' here"),
        ({"train.batch_size": 4}, "train.batch_size: 2 there, 4 here"),
        ({"model.experts_per_token": 1}, "model.experts_per_token: 2 there, 1 here"),
    ],
)
def test_resuming_with_a_changed_model_or_data_order_is_refused(saved_run, overrides, named):
    written = (Path(saved_run.run.dir) / "config.yaml").read_text()
    with pytest.raises(UserError, match="holds a run .step 2. with another config") as error:
        resume(saved_run, **overrides)
    assert named in str(error.value) and "checkpoint.allow_config_change=true" in str(error.value)
    assert (Path(saved_run.run.dir) / "config.yaml").read_text() == written


def test_safe_changes_resume_and_allowed_changes_are_said(saved_run, capsys):
    with resume(saved_run, **{"train.steps": 5, "train.log_every": 2, "checkpoint.every": 7}) as trainer:
        assert trainer.step == 2
    with resume(saved_run, **{"train.seed": 1, "checkpoint.allow_config_change": "true", "run.progress": "plain"}):
        pass
    assert "changed config (checkpoint.allow_config_change): train.seed: 0 there, 1 here" in capsys.readouterr().out


def test_resume_compares_what_the_config_computes():
    """A run stored with data.source=stdlib (configs written before `auto`) resumes under
    data.source=auto with no path, which reads the same corpus; a source that reads other data is
    a change, and so is a path given to auto."""
    auto = load_config(TINY, {"data.source": "auto"})
    stored = auto.to_dict()
    stored["data"] = {**stored["data"], "source": "stdlib"}
    assert resume_changes(stored, auto) == []
    assert resume_changes(stored, auto.override("data.source=synthetic")) == [
        "data.source: 'stdlib' there, 'synthetic' here"
    ]
    assert "data.source: 'stdlib' there, 'shards' here" in resume_changes(stored, auto.override("data.path=corpus"))
    # Dropless dispatch strategies compute the same numbers (a checkpoint moves between a
    # pipeline, where auto is ragged_a2a, and one device); capacity drops token copies.
    stored["moe"] = {**stored["moe"], "dispatch": "ragged_a2a"}
    assert resume_changes(stored, auto.override("moe.dispatch=allgather")) == []
    assert resume_changes(stored, auto.override("moe.dispatch=capacity")) == [
        "moe.dispatch: 'dropless' there, 'capacity' here"
    ]


def test_resuming_without_clipping_says_the_optimizer_changed(saved_run):
    for allow in ("false", "true"):  # allowed or not, the optimizer's state has other arrays
        with pytest.raises(UserError) as error:
            resume(saved_run, **{"train.clip_norm": 0, "checkpoint.allow_config_change": allow})
        message = str(error.value)
        assert "the optimizer changed: train.clip_norm: 1.0 there, 0.0 here" in message, message
        assert "\n" not in message


def test_init_from_over_a_run_dir_of_another_run_is_refused(saved_run, tmp_path):
    with pytest.raises(UserError, match=r"already holds another run \(step 2, started from scratch\)"):
        resume(saved_run, **{"checkpoint.init_from": str(tmp_path)})


def test_profile_steps_before_the_resume_step_or_past_the_end_are_one_line(saved_run):
    with pytest.raises(UserError, match=r"run.profile_steps=\[1, 2\]: this run resumes at step 2"):
        resume(saved_run, **{"run.profile_steps": "[1,2]"})
    with pytest.raises(ConfigError, match="run.profile_steps"):
        saved_run.override("run.profile_steps=[2,3]")  # the last step of 3 is step 2


def test_a_closed_trainer_touches_nothing(saved_run):
    run_dir = Path(saved_run.run.dir)
    trainer = resume(saved_run, **{"train.steps": 4})
    trainer.close()
    other = resume(saved_run, **{"train.steps": 4})  # another Trainer holds run.dir now
    try:
        trainer.step = 3
        for call in (trainer.save, lambda: trainer.run(1), trainer.evaluate):
            with pytest.raises(UserError, match="is closed"):
                call()
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2"]
    finally:
        other.close()


def test_trainer_run_takes_a_number_of_steps_or_none(saved_run):
    with resume(saved_run, **{"train.steps": 4}) as trainer:
        for steps in ("3", 2.5, -1, True):
            with pytest.raises(UserError, match=r"run\(steps=.*\): expected a number of steps"):
                trainer.run(steps)
        assert trainer.step == 2


# After the failed write, tensorstore's I/O threads find orbax's event loop closed (an unraisable
# exception in those threads; a command-line run drops their stderr, maxmoe.training.checkpoint),
# and the abandoned write coroutines are collected unawaited: both are the failure under test.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_last_checkpoint_stands(saved_run, capfd):
    """A file-size limit makes every write past 4 KiB fail as a full disk would (EFBIG, not ENOSPC)."""
    import resource

    run_dir = Path(saved_run.run.dir)
    trainer = resume(saved_run, **{"train.steps": 4})
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
    try:
        trainer.step = 3
        capfd.readouterr()
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
        with pytest.raises(UserError) as error:
            trainer.save()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
        trainer.close()
    message = str(error.value)
    assert (
        message.startswith("cannot write a checkpoint in ")
        and "the last complete checkpoint, step 2, stands" in message
    ), message
    assert "\n" not in message
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()] == ["2"]
    with resume(saved_run, **{"train.steps": 4}) as again:  # step 2 still restores
        assert again.step == 2
    gc.collect()  # the abandoned writes go now, under this test's warning filters
