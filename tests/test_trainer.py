"""The notebook API in one process: configs checked on every copy, the Trainer, signals handed back.

The Trainer is also what `python -m maxmoe.train` runs, so test_train.py and
test_checkpoint.py test its loop through the command line; here: what only the in-process
API can show.
"""

import json
import os
import signal
from pathlib import Path

import jax
import numpy as np
import pytest

import maxmoe
from maxmoe import runtime
from maxmoe.config import ConfigError, UserError, load_config
from maxmoe.training import trainer as trainer_lib

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
SMALL = {
    "model.compute_dtype": "float32",
    "data.source": "synthetic",
    "train.batch_size": 8,
    "train.seq_len": 32,
    "train.steps": 3,
    "train.log_every": 1,
    "run.progress": "none",
}


# --------------------------------------------------------------------------- configs


def test_config_copies_are_validated():
    config = load_config(TINY, SMALL)
    assert config == load_config([TINY], [f"{k}={v}" for k, v in SMALL.items()])
    assert config.replace(train={"steps": 7}).train.steps == 7
    assert config.override("train.steps=7", "mesh.data=2") == config.replace(train={"steps": 7}, mesh={"data": 2})
    with pytest.raises(ConfigError, match="train.steps"):
        config.replace(train={"steps": 0})
    with pytest.raises(ConfigError, match="expected an integer"):
        config.replace(train={"steps": "many"})
    with pytest.raises(ConfigError, match="not divisible by train.grad_accum"):  # a cross-field check
        config.replace(train={"batch_size": 12, "grad_accum": 5})
    with pytest.raises(ConfigError, match="did you mean 'train.steps'"):
        config.replace(train={"stepz": 3})
    with pytest.raises(ConfigError, match="did you mean 'train'"):
        config.replace(trian={"steps": 3})
    section = config.train.__class__(steps=-4)  # a section object built around the checks
    with pytest.raises(ConfigError, match="train.steps=-4"):
        config.replace(train=section)
    with pytest.raises(ConfigError, match="train.steps"):
        config.override("train.steps=-1")


def test_host_devices_asked_for_after_jax_started_are_a_clear_error(tmp_path):
    assert len(jax.devices()) == 8  # the backend is up (conftest: 8 host devices)
    runtime.set_host_device_count(8)  # what it has: fine
    with pytest.raises(UserError, match=r"run.cpu_devices=4 comes too late.*8 device\(s\).*devices\(\)\[:4\]"):
        runtime.set_host_device_count(4)
    config = load_config(TINY, {**SMALL, "run.cpu_devices": 16, "run.dir": str(tmp_path / "run")})
    with pytest.raises(UserError, match="run.cpu_devices=16 comes too late"):
        maxmoe.Trainer(config)
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- the Trainer

# One dense and one MoE layer, no MTP: the smallest model with expert dispatch (cheap to compile).
MOE = {**SMALL, "model.num_layers": 2, "model.first_k_dense": 1, "model.mtp_num_layers": 0}
MESH_2x4 = {"mesh.data": 2, "mesh.expert": 4}  # experts exchanged over 4 devices


class SignalOnBatch:
    """A batch iterator that sends this process `signum` when batch number `at` (1-based) is drawn."""

    def __init__(self, inner, at, signum):
        self.inner, self.at, self.signum, self.drawn = inner, at, signum, 0

    def __next__(self):
        self.drawn += 1
        if self.drawn == self.at:
            os.kill(os.getpid(), self.signum)  # delivered to the main thread before the step runs
        return next(self.inner)

    def get_state(self):
        return self.inner.get_state()

    def set_state(self, state):
        self.inner.set_state(state)


def sentinel(signum, frame):  # a handler the trainer must put back
    raise AssertionError("the sentinel handler ran")


@pytest.fixture(scope="module")
def interrupted_on_eight(tmp_path_factory):
    """A 3-step run on 8 devices, interrupted by SIGINT while step 2 runs, then run to the end."""
    run_dir = tmp_path_factory.mktemp("eight") / "run"
    config = load_config(TINY, {**MOE, **MESH_2x4, "run.dir": str(run_dir)})
    seen = {}
    previous = {sig: signal.signal(sig, sentinel) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with maxmoe.Trainer(config) as trainer:
            seen["mesh"] = trainer.layout.shape
            trainer.train_data = SignalOnBatch(trainer.train_data, 2, signal.SIGINT)
            seen["first"] = trainer.run()
            seen["stopped"] = (trainer.stop_reason, trainer.step)
            seen["checkpoints"] = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
            seen["handlers during"] = [signal.getsignal(sig) for sig in previous]
            seen["load"] = trainer.expert_load
            seen["rest"] = trainer.run()
            seen["finished"] = (trainer.stop_reason, trainer.step)
            seen["evaluate"] = trainer.evaluate()  # the same state and batches as the run's last evaluation
            seen["history"] = trainer.history
        seen["handlers after"] = [signal.getsignal(sig) for sig in previous]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    seen["written"] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return seen


@pytest.mark.slow
def test_sigint_in_a_run_saves_that_step_and_gives_the_handlers_back(interrupted_on_eight):
    seen = interrupted_on_eight
    assert seen["mesh"] == {"data": 2, "expert": 4, "tensor": 1}
    # Step 2 was in flight when the signal came: it finished, was saved, and run() returned.
    assert seen["stopped"] == ("SIGINT", 2) and [r["step"] for r in seen["first"]] == [1, 2]
    assert seen["checkpoints"] == ["2"]
    assert seen["handlers during"] == seen["handlers after"] == [sentinel, sentinel]
    assert seen["finished"] == (None, 3) and [r["step"] for r in seen["rest"]] == [3]
    assert seen["written"] == seen["history"]
    assert [r["step"] for r in seen["history"]] == [1, 2, 3, 3] and seen["history"][-1]["eval_loss"] == seen["evaluate"]


def test_expert_loads_per_layer(interrupted_on_eight):
    load = interrupted_on_eight["load"]  # [MoE layers, experts] at step 2
    assert load.shape == (1, 8)
    np.testing.assert_array_equal(load.sum(-1), 8 * 32 * 2)  # batch x seq x top-2: every token copy, exact counts
    assert interrupted_on_eight["first"][-1]["moe_imbalance"] == pytest.approx(load.max() / load.mean(), rel=1e-6)


def test_train_in_process_on_one_device_after_eight_gives_the_same_losses(interrupted_on_eight, tmp_path):
    config = load_config(TINY, {**MOE, "run.dir": str(tmp_path / "run")})
    before = {sig: signal.signal(sig, sentinel) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert trainer_lib.train(config, devices=jax.devices()[:1]) == 0
        # The acceptance check: in-process train() leaves the handlers it found.
        assert signal.getsignal(signal.SIGINT) is sentinel and signal.getsignal(signal.SIGTERM) is sentinel
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 3]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["3"]
    one = [x["loss"] for x in lines if "loss" in x]
    eight = [x["loss"] for x in interrupted_on_eight["history"] if "loss" in x]
    # 1e-4 relative, as the mesh-parity tests: the 2x4 mesh reduces in another order.
    np.testing.assert_allclose(eight, one, rtol=1e-4)
    np.testing.assert_allclose(interrupted_on_eight["evaluate"], lines[-1]["eval_loss"], rtol=1e-4)
