"""What a run must never lose or get wrong: a file the user wrote in run.dir, the last checkpoint
that trained cleanly (a damaged step is refused, and retention keeps the last proven step
while newer ones are unproven), `~` in run.dir, and data that changed since the checkpoint.

Runs in this process, one device, the cheapest model with expert dispatch; the only train
step compiled is the retention test's.
"""

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import test_reliability

import maxmoe
from maxmoe.config import UserError, load_config
from maxmoe.train import main as train_main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
DENSE = {**test_reliability.DENSE, "run.progress": "none"}


def steps_in(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


# --------------------------------------------------------------------------- the user's own files


def test_a_config_file_in_run_dir_is_never_overwritten(tmp_path, monkeypatch, capsys):
    mine = (
        "# my experiment: three steps on all devices\n"
        "model:\n  num_layers: 2\n  first_k_dense: 1\n  mtp_num_layers: 0\n  compute_dtype: float32\n"
        "mesh:\n  data: -1\n"
        "data:\n  source: synthetic\n"
        "train:\n  steps: 3\n  batch_size: 8\n  seq_len: 16\n"
        "run:\n  progress: none\n"
    )
    (tmp_path / "config.yaml").write_text(mine)
    monkeypatch.chdir(tmp_path)
    status = train_main(["--config", "config.yaml", "run.dir=."])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("maxmoe: error: "), (status, err)
    assert "config.yaml" in err[0] and "not written by maxmoe" in err[0], err
    assert (tmp_path / "config.yaml").read_text() == mine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


# --------------------------------------------------------------------------- damaged checkpoints


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A run.dir with complete steps 1 and 2 (the state at init saved under both)."""
    run_dir = tmp_path_factory.mktemp("two") / "run"
    config = load_config(TINY, {**DENSE, "run.dir": str(run_dir), "checkpoint.keep": 5})
    with maxmoe.Trainer(config, jax.devices()[:1]) as trainer:
        for step in (1, 2):
            trainer.step = step
            trainer.save()
    return config


def flip_a_byte(step_dir: Path) -> Path:
    """Flip one byte in the middle of the largest array file of a step (a read that still decodes)."""
    largest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0x40
    largest.write_bytes(bytes(data))
    return largest


def test_a_damaged_checkpoint_is_refused_naming_the_newest_good_step(two_steps, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(two_steps.run.dir, run_dir)
    flip_a_byte(run_dir / "checkpoints" / "2")
    before = sorted(str(p) for p in run_dir.rglob("*"))
    with pytest.raises(UserError) as error:
        maxmoe.Trainer(two_steps.override(f"run.dir={run_dir}"), jax.devices()[:1])
    message = str(error.value)
    assert "\n" not in message
    assert f"{run_dir / 'checkpoints' / '2'}" in message and "damaged" in message, message
    assert "step 1 passes its check" in message, message
    assert sorted(str(p) for p in run_dir.rglob("*")) == before  # nothing deleted or added
    shutil.rmtree(run_dir / "checkpoints" / "2")  # the user's move: step 1 resumes
    with maxmoe.Trainer(two_steps.override(f"run.dir={run_dir}"), jax.devices()[:1]) as trainer:
        assert trainer.step == 1


def test_retention_keeps_the_last_step_that_trained_cleanly(tmp_path, capsys):
    """keep=1 and a save every step; after two finite steps the parameters are poisoned in
    memory, so every later step is non-finite: step 1 (the last step a finite step trained from)
    must outlive the unproven saves, and the stop message must name it."""
    overrides = {**DENSE, "run.dir": str(tmp_path / "run"), "train.steps": 8, "train.max_bad_steps": 2}
    config = load_config(TINY, {**overrides, "checkpoint.every": 1, "checkpoint.keep": 1})
    with maxmoe.Trainer(config, jax.devices()[:1]) as trainer:
        trainer.run(2)
        trainer.checkpointer.wait()
        assert steps_in(tmp_path / "run") == [1, 2]  # 2 is not proven yet: 1 stays
        poisoned = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), trainer.state.params)
        trainer.state = trainer.state.replace(params=poisoned)
        trainer.run()
        assert trainer.stop_reason == "bad_steps"
        last = trainer.step
    assert steps_in(tmp_path / "run") == [1, last]
    err = capsys.readouterr().err
    assert "step 1, the last step that trained cleanly, is kept" in err, err


# --------------------------------------------------------------------------- ~ in run.dir, changed data


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """Step 1 of a run on a text file, run.dir given as ~/run with HOME at a folder of its own."""
    base = tmp_path_factory.mktemp("text")
    corpus = base / "notes.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    (base / "cwd").mkdir()
    overrides = {
        **DENSE,
        "data.source": "auto",
        "data.path": str(corpus),
        "data.cache_dir": str(base / "cache"),
        "run.dir": "~/run",
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(base))
        patch.chdir(base / "cwd")
        config = load_config(TINY, overrides)
        with maxmoe.Trainer(config, jax.devices()[:1]) as trainer:
            trainer.step = 1
            trainer.save()
    return base, config


def test_home_in_run_dir_puts_every_file_under_home(text_run):
    base, config = text_run
    assert config.run.dir == str(base / "run")
    assert steps_in(base / "run") == [1] and (base / "run" / "maxmoe.lock").is_file()
    assert (base / "run" / "config.yaml").is_file()
    assert list((base / "cwd").iterdir()) == []  # no ./~/run


def test_a_data_file_edited_since_the_checkpoint_is_refused(text_run):
    base, config = text_run
    corpus = Path(config.data.path)
    original = corpus.read_text()
    corpus.write_text(original.replace("lazy", "sleepy"))
    try:
        with pytest.raises(UserError) as error:
            maxmoe.Trainer(config, jax.devices()[:1])
        message = str(error.value)
        assert f"data.path={corpus}" in message and "changed since step 1" in message, message
        assert "checkpoint.allow_config_change=true" in message
        allowed = config.override("checkpoint.allow_config_change=true")
        with maxmoe.Trainer(allowed, jax.devices()[:1]) as trainer:  # the user says so: it resumes
            assert trainer.step == 1
    finally:
        corpus.write_text(original)
