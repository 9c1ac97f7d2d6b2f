"""Checkpoints and fault tolerance of `python -m maxmoe.train`, on CPU with configs/tiny.yaml in float32.

Every job here is a separate process, as a restarted job would be. They share one JAX
persistent compilation cache (a folder of this module's temporary dir), so the program
of a mesh is compiled once per session; a cached executable is the very program that was
compiled, so bitwise comparisons across processes stay meaningful.

One straight 8-step run (checkpoints at 4 and 8) is the reference for everything else:
- SIGKILL while an async save is being written -> resume from the last complete step, bitwise equal;
- resume in a new process from step 4 (a copy without its step 8 folder) -> bitwise equal steps;
  SIGTERM -> exit 0 and a checkpoint; resume on data=2,expert=2,tensor=2;
- a NaN in one embedding row used only by step 5's batch -> step 5 skipped, state unchanged;
- NaN parameters from checkpoint.init_from -> stop after train.max_bad_steps, exit 1, one line;
- resume=false over a run, a garbled latest step, a checkpoint of another model or of one with a
  part more (MTP) -> exit 2, one line naming the difference, nothing touched.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import job_env

from maxmoe import data
from maxmoe.config import load_config
from maxmoe.parallel.layout import build_layout
from maxmoe.training import checkpoint
from maxmoe.training import step as step_lib
from maxmoe.training.optim import make_optimizer
from maxmoe.training.programs import build_programs
from maxmoe.training.run_dir import LOCK_NAME

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
STEPS = 8
# Every job runs on mesh data=8 (one compiled program for all of them) except the resharded resume.
BASE = (
    "model.compute_dtype=float32",
    "data.source=synthetic",
    "train.log_every=1",
    "train.batch_size=8",
    "train.seq_len=32",
    f"train.steps={STEPS}",
    "train.eval_every=1000",
    "run.cpu_devices=8",
    "mesh.data=8",
)
MESH_2x2x2 = ("mesh.data=2", "mesh.expert=2", "mesh.tensor=2")
TIMEOUT = 900


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The environment of every job: this checkout on the path, one shared compilation cache."""
    return job_env(
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


def command(run_dir, overrides):
    return [sys.executable, "-m", "maxmoe.train", "--config", TINY, *BASE, f"run.dir={run_dir}", *overrides]


def run(env, run_dir, *overrides) -> subprocess.CompletedProcess:
    return subprocess.run(
        command(run_dir, overrides), capture_output=True, text=True, env=env, cwd=ROOT, timeout=TIMEOUT
    )


def start(env, run_dir, *overrides) -> subprocess.Popen:
    return subprocess.Popen(
        command(run_dir, overrides), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )


def ok(result) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def records(run_dir) -> list[dict]:
    """The training (not eval) lines of metrics.jsonl, checked to hold each step once."""
    lines = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if "loss" in x]
    steps = [x["step"] for x in train]
    assert steps == sorted(set(steps)), f"duplicated or unordered step lines: {steps}"
    return train


def losses(run_dir) -> dict[int, float]:
    return {x["step"]: x["loss"] for x in records(run_dir)}


def complete_steps(run_dir) -> list[int]:
    folder = Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def in_progress(run_dir) -> list[str]:
    folder = Path(run_dir) / "checkpoints"
    return [p.name for p in folder.iterdir() if checkpoint.STEP_TMP_SUFFIX in p.name] if folder.is_dir() else []


def data_position(run_dir, step) -> dict:
    # The JSON item as orbax's JsonCheckpointHandler writes it.
    return json.loads((Path(run_dir) / "checkpoints" / str(step) / "data" / "metadata").read_text())


def copy_run(source, target, keep_steps) -> Path:
    """A copy of a run folder holding only the checkpoint steps `keep_steps`."""
    shutil.copytree(source, target)
    for step in complete_steps(target):
        if step not in keep_steps:
            shutil.rmtree(Path(target) / "checkpoints" / str(step))
    return Path(target)


def snapshot(folder) -> dict[str, str]:
    """Hashes of every file, but the run.dir lock: each job writes its pid there, even one that stops at once."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file() and p.name != LOCK_NAME
    }


def one_error_line(result, *words):
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maxmoe: error: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def wait_until(predicate, process, what, timeout=TIMEOUT):
    """Poll `predicate` every few ms while `process` runs; fail if it ends or time runs out first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if process.poll() is not None:
            out, err = process.communicate()
            pytest.fail(f"the job ended (exit {process.returncode}) before {what}\n{out}\n{err}")
        time.sleep(0.005)
    process.kill()
    pytest.fail(f"timed out waiting for {what}")


def tiny_config(run_dir, *overrides):
    return load_config([TINY], [*BASE, f"run.dir={run_dir}", *overrides])


def abstract_state(config):
    return step_lib.abstract_state(config, make_optimizer(config.train))


def read_checkpoint(run_dir, step, *overrides):
    """(state, data position) of one step folder of a run, on the default device."""
    config = tiny_config(run_dir, *overrides)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), abstract_state(config))
    saver = checkpoint.Checkpointer(config, Path(run_dir))
    saver._open()  # noqa: SLF001 - a test reads a chosen step, not the latest
    restored = saver._manager.restore(
        step,
        args=ocp.args.Composite(  # noqa: SLF001
            state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()
        ),
    )
    saver.close()
    return restored["state"], restored["data"]


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # NaN == NaN here


# --------------------------------------------------------------------------- the reference


@pytest.fixture(scope="module")
def straight(tmp_path_factory, env):
    """8 steps in one process on mesh data=8, checkpoints every 4 steps."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    ok(run(env, run_dir, "checkpoint.every=4"))
    assert complete_steps(run_dir) == [4, 8]
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    assert [data_position(run_dir, s) for s in (4, 8)] == [{"split": "train", "step": s} for s in (4, 8)]
    return run_dir


# --------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_sigkill_during_an_async_save_resumes_from_the_last_complete_step(straight, env, tmp_path):
    run_dir = tmp_path / "run"
    job = start(env, run_dir, "checkpoint.every=1")
    killed_with = None
    try:
        while killed_with is None:
            wait_until(lambda: in_progress(run_dir) and complete_steps(run_dir), job, "an async save in flight")
            os.kill(job.pid, signal.SIGSTOP)  # freeze, then make sure the save is still half-written
            if in_progress(run_dir):
                killed_with = (in_progress(run_dir), complete_steps(run_dir))
                os.kill(job.pid, signal.SIGKILL)
            else:
                os.kill(job.pid, signal.SIGCONT)
    finally:
        job.kill()
        job.communicate()
    partial, complete = killed_with
    assert in_progress(run_dir) == partial and complete_steps(run_dir) == complete
    last = complete[-1]
    assert last < STEPS

    out = ok(run(env, run_dir, "checkpoint.every=1"))
    assert f"steps {last}->{STEPS}" in out
    assert losses(run_dir) == losses(straight)
    assert STEPS in complete_steps(run_dir)
    assert data_position(run_dir, STEPS) == {"split": "train", "step": STEPS}


@pytest.mark.slow
def test_sigterm_saves_and_the_run_resumes_on_another_mesh(straight, env, tmp_path):
    # Resume the straight run's step 4 (on data=8, like it) and stop it with SIGTERM mid-run.
    run_dir = copy_run(straight, tmp_path / "run", keep_steps=[4])
    metrics = run_dir / "metrics.jsonl"  # as if it had stopped at 4: new lines are this job's
    metrics.write_text("".join(x + "\n" for x in metrics.read_text().splitlines() if json.loads(x)["step"] <= 4))
    job = start(env, run_dir)
    try:
        wait_until(lambda: max(losses(run_dir)) > 4, job, "a step after the resume")
        os.kill(job.pid, signal.SIGSTOP)  # so the signal surely lands before the last step
        reached = max(losses(run_dir))
        assert reached < STEPS - 1, "the job ran too fast to be interrupted mid-run"
        os.kill(job.pid, signal.SIGTERM)
        os.kill(job.pid, signal.SIGCONT)
        out, err = job.communicate(timeout=TIMEOUT)
    finally:
        job.kill()
    assert job.returncode == 0, f"exit {job.returncode}\n{out}\n{err}"
    stopped = max(losses(run_dir))
    assert stopped in (reached, reached + 1), (reached, stopped)  # it finished the step in flight
    assert f"maxmoe: SIGTERM: saved step {stopped} in {run_dir / 'checkpoints'}" in out
    assert complete_steps(run_dir)[-1] == stopped and not in_progress(run_dir)
    assert data_position(run_dir, stopped) == {"split": "train", "step": stopped}
    # The resume in a new process, same mesh and train.steps (the LR schedule depends on it):
    # steps 5 on are the straight run's, bitwise; the moved folder's checkpoint names where it is now.
    assert f"steps 4->{STEPS}" in out
    reference = losses(straight)
    assert {s: x for s, x in losses(run_dir).items() if s > 4} == {s: reference[s] for s in range(5, stopped + 1)}
    saved = json.loads((run_dir / "checkpoints" / str(stopped) / "config" / "metadata").read_text())
    assert saved["train"]["steps"] == STEPS and saved["run"]["dir"] == str(run_dir)

    # Saved on data=8, restored straight into the shardings of data=2 x expert=2 x tensor=2.
    out = ok(run(env, run_dir, *MESH_2x2x2))
    assert f"steps {stopped}->{STEPS}" in out and "mesh data=2 x expert=2 x tensor=2" in out
    resumed = losses(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    # fp32 sums in another order on another layout (the same tolerance as the mesh-parity test).
    np.testing.assert_allclose(resumed[stopped + 1], reference[stopped + 1], rtol=1e-4)
    np.testing.assert_allclose(
        [resumed[s] for s in range(5, STEPS + 1)], [reference[s] for s in range(5, STEPS + 1)], rtol=1e-4
    )


def _token_only_in(batches, first, elsewhere):
    """A token id (not 0, the MTP pad) in the inputs of batches[first], in no later batch nor `elsewhere`."""
    inputs = [set(np.unique(b[:, :-1]).tolist()) for b in batches]
    later = set().union(*inputs[first + 1 :], *(set(np.unique(b).tolist()) for b in elsewhere))
    candidates = sorted(inputs[first] - later - {0})
    assert candidates, "no token is unique to that batch; pick another seed"
    return candidates[0]


@pytest.mark.slow
def test_a_nan_gradient_skips_that_update_and_training_continues(straight, env, tmp_path):
    # Poison the embedding row of a token that only step 5's batch uses: step 5's loss and
    # gradient are NaN; steps 6-8 and the final evaluation (one batch) never read that row.
    overrides = ("checkpoint.every=1", "checkpoint.keep=10", "train.eval_batches=1")
    config = tiny_config(tmp_path / "run", *overrides)
    batches = [next(it) for it in [data.make_dataset(config)] for _ in range(STEPS)]
    token = _token_only_in(batches, first=4, elsewhere=list(data.make_dataset(config, split="eval")))
    state, position = read_checkpoint(straight, 4)
    table = state.params["embed"]["embedding"]
    poisoned = state.replace(
        params={**state.params, "embed": {**state.params["embed"], "embedding": table.at[token].set(jnp.nan)}}
    )
    saver = checkpoint.Checkpointer(config, tmp_path / "run")
    saver.save(4, poisoned, position, force=True)
    saver.close()

    out = ok(run(env, tmp_path / "run", *overrides))
    lines = {x["step"]: x for x in records(tmp_path / "run")}
    assert lines[5]["loss"] is None  # NaN is written as null
    # The console says so on the step's line and once more at the end.
    assert f"step      5/{STEPS}  loss nan" in out and "skipped 1 non-finite" in out
    assert (
        f"maxmoe: 1 of the {STEPS - 4} steps of this run had a non-finite loss or gradient norm and were skipped "
        f"(skipped_steps in {tmp_path / 'run' / 'metrics.jsonl'})"
    ) in out
    assert all(np.isfinite(lines[s]["loss"]) and lines[s]["grad_norm"] > 0 for s in range(6, STEPS + 1))
    assert [lines[s]["skipped_steps"] for s in range(5, STEPS + 1)] == [1, 1, 1, 1]

    after_5, _ = read_checkpoint(tmp_path / "run", 5)
    after_6, _ = read_checkpoint(tmp_path / "run", 6)
    # The skipped update leaves everything but the loop-step counter as it was.
    assert_trees_equal(
        (after_5.params, after_5.router, after_5.opt_state, after_5.step),
        (poisoned.params, poisoned.router, poisoned.opt_state, poisoned.step + 1),
    )
    assert (int(after_5.bad_steps), int(after_5.skipped)) == (1, 1)
    assert int(after_6.step) == int(poisoned.step) + 2 and (int(after_6.bad_steps), int(after_6.skipped)) == (0, 1)
    moved = jax.tree.leaves(
        jax.tree.map(lambda a, b: not np.array_equal(a, b, equal_nan=True), after_6.params, after_5.params)
    )
    assert all(moved)
    untouched = np.delete(np.asarray(after_6.params["embed"]["embedding"]), token, axis=0)
    assert np.isfinite(untouched).all()


@pytest.mark.slow
def test_consecutive_bad_steps_stop_the_run_with_one_line_and_a_checkpoint(straight, env, tmp_path):
    # checkpoint.init_from parameters that are all NaN in the embedding: every step is bad.
    config = tiny_config(tmp_path / "run")
    state, _ = read_checkpoint(straight, 8)
    params = {**state.params, "embed": {"embedding": jnp.full_like(state.params["embed"]["embedding"], jnp.nan)}}
    checkpoint.save_params(tmp_path / "nan_params", params, state.router, config)

    result = run(env, tmp_path / "run", f"checkpoint.init_from={tmp_path / 'nan_params'}", "train.max_bad_steps=2")
    assert result.returncode == 1, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    # Steps 1 and 2 are bad; the loop notices while step 3 is in flight and saves it.
    assert lines[0] == (
        f"maxmoe: stopping: 2 consecutive steps had a non-finite loss or gradient norm and were "
        f"skipped; step 3 in {tmp_path / 'run' / 'checkpoints'} holds the parameters from before them; "
        f"no step saved before them has trained cleanly"
    )
    assert complete_steps(tmp_path / "run") == [3]
    assert [x["skipped_steps"] for x in records(tmp_path / "run")] == [1, 2, 3]
    saved, position = read_checkpoint(tmp_path / "run", 3)
    assert position == {"split": "train", "step": 3} and int(saved.skipped) == 3 and int(saved.step) == 3
    assert_trees_equal(saved.params, params)  # no update was applied


def test_load_params_restores_onto_another_mesh(straight, tmp_path):
    config = tiny_config(tmp_path, "mesh.data=2", "mesh.expert=2", "mesh.tensor=2")
    programs = build_programs(config, build_layout(config))
    shardings = programs.state_shardings
    loaded = checkpoint.load_params(str(straight), programs.abstract_state)
    reference, _ = read_checkpoint(straight, 8)
    assert_trees_equal(loaded, {"params": reference.params, "router": reference.router})
    for array, sharding in zip(
        jax.tree.leaves(loaded), jax.tree.leaves({"params": shardings.params, "router": shardings.router})
    ):
        assert array.sharding.is_equivalent_to(sharding, array.ndim)
    assert any(len(a.sharding.device_set) == 8 and not a.sharding.is_fully_replicated for a in jax.tree.leaves(loaded))

    # save_params -> load_params round trip (the HF converter's path into checkpoint.init_from).
    checkpoint.save_params(tmp_path / "converted", reference.params, reference.router, config)
    assert_trees_equal(checkpoint.load_params(str(tmp_path / "converted"), programs.abstract_state), loaded)


@pytest.mark.parametrize("case", ["resume_off", "garbled", "truncated", "other_model", "fewer_parts"])
def test_a_run_dir_that_cannot_be_resumed_exits_2_and_touches_nothing(straight, env, tmp_path, case):
    run_dir = copy_run(straight, tmp_path / "run", keep_steps=[4, 8])
    latest = run_dir / "checkpoints" / "8"
    overrides, words = [], ["checkpoints/8"]
    if case == "resume_off":
        overrides, words = ["checkpoint.resume=false"], ["is not empty", "checkpoint.resume=false"]
    elif case == "garbled":  # every array byte range fails its checksum
        for path in (latest / "state").rglob("*"):
            if path.is_file() and path.parent.name == "d":
                data_bytes = bytearray(path.read_bytes())
                data_bytes[len(data_bytes) // 4 :] = bytes(b ^ 0x5A for b in data_bytes[len(data_bytes) // 4 :])
                path.write_bytes(bytes(data_bytes))
        words.append("cannot be read")
    elif case == "truncated":
        for path in latest.rglob("*"):
            if path.is_file():
                path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
        words.append("cannot be read")
    elif case == "other_model":
        overrides = ["model.hidden_size=32"]
        words += ["does not fit this model", "model.hidden_size: 64 there, 32 here"]
    else:  # a model with a part less (no MTP): named, not blamed on an unreadable checkpoint
        overrides = ["model.mtp_num_layers=0"]
        words += ["does not fit this model: it has params/mtp_0/", "which this model lacks"]
        words += ["model.mtp_num_layers: 1 there, 0 here"]
    before = snapshot(run_dir)
    one_error_line(run(env, run_dir, *overrides), *words)
    assert snapshot(run_dir) == before
