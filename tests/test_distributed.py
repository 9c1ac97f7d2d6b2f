"""jax.distributed initialisation: launcher detection from the environment, argument passing.

No real cluster: jax.distributed.initialize is replaced by a recorder.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from conftest import job_env

from maxmoe import distributed
from maxmoe.config import UserError, load_config

REAL_WAIT = distributed.wait_for_coordinator
LAUNCH_VARS = (
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "JOBSET_NAME",
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "JOB_COMPLETION_INDEX",
)


@pytest.fixture
def calls(monkeypatch):
    """Clean launcher environment; record jax.distributed.initialize and config updates."""
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    recorded = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: recorded.append(("initialize", kwargs)))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(
        distributed, "wait_for_coordinator", lambda address, timeout_s: recorded.append(("wait", address, timeout_s))
    )
    real_update = jax.config.update

    def update(name, value):
        if name == "jax_cpu_collectives_implementation":
            recorded.append(("config", name, value))
        else:
            real_update(name, value)

    monkeypatch.setattr(jax.config, "update", update)
    return recorded


def _dist(*overrides):
    return load_config([], list(overrides)).dist


@pytest.mark.parametrize(
    "env, launcher",
    [
        ({}, None),
        ({"SLURM_NTASKS": "1"}, None),  # a one-task allocation is a single process
        ({"SLURM_NTASKS": "288"}, "slurm"),
        ({"SLURM_NTASKS": "garbage"}, None),
        ({"OMPI_COMM_WORLD_SIZE": "1"}, None),
        ({"OMPI_COMM_WORLD_SIZE": "16"}, "openmpi"),
        ({"JOBSET_NAME": "maxmoe-671b"}, "jobset"),
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, "env"),
    ],
)
def test_detect_launch(env, launcher):
    assert distributed.detect_launch(env) == launcher


def test_auto_without_a_cluster_does_nothing(calls):
    distributed.initialize(_dist("dist.mode=auto"))
    assert calls == []


def test_none_does_nothing_even_under_slurm(calls, monkeypatch):
    monkeypatch.setenv("SLURM_NTASKS", "8")
    distributed.initialize(_dist("dist.mode=none"))
    assert calls == []


def test_auto_under_slurm_lets_jax_detect(calls, monkeypatch):
    monkeypatch.setenv("SLURM_NTASKS", "8")
    distributed.initialize(_dist("dist.mode=auto", "dist.timeout_s=42"))
    assert calls[-1] == ("initialize", {"initialization_timeout": 42})
    assert ("config", "jax_cpu_collectives_implementation", "gloo") in calls  # JAX_PLATFORMS=cpu


def test_auto_on_gpu_leaves_cpu_collectives_alone(calls, monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    distributed.initialize(_dist("dist.mode=auto"))
    assert calls == [("initialize", {"initialization_timeout": 300})]


def test_auto_passes_coordinator_from_environment(calls, monkeypatch):
    monkeypatch.setenv("JOBSET_NAME", "maxmoe")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "maxmoe-workers-0-0.maxmoe:6666")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "72")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "5")
    distributed.initialize(_dist("dist.mode=auto"))
    assert ("wait", "maxmoe-workers-0-0.maxmoe:6666", 300) in calls
    assert calls[-1] == (
        "initialize",
        {
            "coordinator_address": "maxmoe-workers-0-0.maxmoe:6666",
            "num_processes": 72,
            "process_id": 5,
            "initialization_timeout": 300,
        },
    )
    monkeypatch.setenv("JAX_PROCESS_ID", "23")  # an explicit id wins over the pod index
    assert distributed.auto_arguments()["process_id"] == 23


def test_auto_with_partial_environment_lets_jax_fill_the_rest(monkeypatch):
    env = {"JAX_COORDINATOR_ADDRESS": "host:1234"}
    assert distributed.auto_arguments(env) == {}


def test_explicit_passes_the_config(calls):
    distributed.initialize(
        _dist(
            "dist.mode=explicit",
            "dist.coordinator_address=10.1.2.3:5678",
            "dist.num_processes=4",
            "dist.process_id=3",
            "dist.timeout_s=60",
        )
    )
    assert ("wait", "10.1.2.3:5678", 60) in calls  # a worker checks the coordinator first
    assert calls[-1] == (
        "initialize",
        {"coordinator_address": "10.1.2.3:5678", "num_processes": 4, "process_id": 3, "initialization_timeout": 60},
    )


def test_auto_with_a_coordinator_address_is_explicit(calls):
    # No launcher in the environment: the dist.* keys alone say how to start.
    distributed.initialize(_dist("dist.coordinator_address=10.1.2.3:5678", "dist.num_processes=4", "dist.process_id=2"))
    assert ("wait", "10.1.2.3:5678", 300) in calls
    assert calls[-1] == (
        "initialize",
        {"coordinator_address": "10.1.2.3:5678", "num_processes": 4, "process_id": 2, "initialization_timeout": 300},
    )


def test_process_zero_does_not_wait_for_itself(calls):
    distributed.initialize(
        _dist(
            "dist.mode=explicit", "dist.coordinator_address=10.1.2.3:5678", "dist.num_processes=4", "dist.process_id=0"
        )
    )
    assert not [c for c in calls if c[0] == "wait"]


def test_explicit_single_process_needs_no_cpu_collectives(calls):
    distributed.initialize(
        _dist(
            "dist.mode=explicit", "dist.coordinator_address=localhost:5678", "dist.num_processes=1", "dist.process_id=0"
        )
    )
    assert [c[0] for c in calls] == ["initialize"]


def test_already_initialised_is_left_alone(calls, monkeypatch):
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setenv("SLURM_NTASKS", "8")
    distributed.initialize(_dist("dist.mode=auto"))
    assert calls == []


def test_failure_is_a_one_line_user_error(monkeypatch, calls):
    def refuse(**kwargs):
        raise RuntimeError("DEADLINE_EXCEEDED: Barrier timed out\nlong details\nmore details")

    monkeypatch.setattr(jax.distributed, "initialize", refuse)  # e.g. a mismatched process count
    with pytest.raises(UserError) as error:
        distributed.initialize(
            _dist(
                "dist.mode=explicit",
                "dist.coordinator_address=10.9.9.9:1",
                "dist.num_processes=2",
                "dist.process_id=1",
                "dist.timeout_s=5",
            )
        )
    message = str(error.value)
    assert "\n" not in message
    assert "10.9.9.9:1" in message and "DEADLINE_EXCEEDED: Barrier timed out" in message and "5s" in message


def test_unreachable_coordinator_is_a_user_error_not_an_abort(calls, monkeypatch, free_port):
    # In this jaxlib an unreachable coordinator aborts the process from C++ (exit 134), so
    # workers check the address first.
    monkeypatch.setattr(distributed, "wait_for_coordinator", REAL_WAIT)
    port = free_port
    with pytest.raises(UserError, match=f"cannot reach the jax.distributed coordinator at 127.0.0.1:{port}"):
        distributed.initialize(
            _dist(
                "dist.mode=explicit",
                f"dist.coordinator_address=127.0.0.1:{port}",
                "dist.num_processes=2",
                "dist.process_id=1",
                "dist.timeout_s=1",
            )
        )
    assert calls == [("config", "jax_cpu_collectives_implementation", "gloo")]  # never reached initialize


def test_wait_for_coordinator():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        distributed.wait_for_coordinator(f"127.0.0.1:{server.getsockname()[1]}", 5)
    with pytest.raises(UserError, match="is not host:port"):
        distributed.wait_for_coordinator("no-port-here", 1)


_TWO_PROCESS_PROGRAM = """
import sys
import numpy as np
from maxmoe import distributed
from maxmoe.config import load_config
port, pid = sys.argv[1], sys.argv[2]
distributed.initialize(load_config([], ["dist.mode=explicit", f"dist.coordinator_address=127.0.0.1:{port}",
                                        "dist.num_processes=2", f"dist.process_id={pid}", "dist.timeout_s=60"]).dist)
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((jax.device_count(),), ("data",))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")),
                                           np.full((1,), jax.process_index() + 1.0, np.float32))
total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))(x)
print("RESULT", jax.process_index(), jax.process_count(), float(total.addressable_data(0)))
"""


@pytest.mark.slow
def test_two_cpu_processes_really_initialise_and_reduce(free_port):
    """The explicit path end to end: two processes, gloo collectives, a cross-process sum."""
    port = free_port
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",) + LAUNCH_VARS}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")])))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TWO_PROCESS_PROGRAM, str(port), str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    results = sorted(line.split()[1:] for out in outputs for line in out.splitlines() if line.startswith("RESULT"))
    assert all(p.returncode == 0 for p in procs), outputs
    assert results == [["0", "2", "3.0"], ["1", "2", "3.0"]]


def _train_process(port: int, index: int, run_dir: Path, env: dict) -> subprocess.Popen:
    root = Path(__file__).resolve().parents[1]
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "maxmoe.train",
            "--config",
            str(root / "configs" / "tiny.yaml"),
            f"run.dir={run_dir}",
            "data.source=synthetic",
            "model.compute_dtype=float32",
            "train.batch_size=4",
            "train.seq_len=16",
            "train.steps=1000",  # far more than it will run: the signal ends it
            "train.log_every=1",
            "train.eval_every=100000",
            # A small program: one dense and one MoE layer, no MTP (the loop is under test, not the model).
            "model.num_layers=2",
            "model.mtp_num_layers=0",
            "mesh.data=2",
            "mesh.fsdp=true",  # parameters sharded over both processes: each writes its part of a checkpoint
            f"dist.coordinator_address=127.0.0.1:{port}",
            "dist.num_processes=2",
            f"dist.process_id={index}",
            "dist.timeout_s=120",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=root,
    )


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_after_the_same_step_and_saves_it(tmp_path, free_port):
    """Preemption notice on one host only: JAX's sync point makes every process stop at one step."""
    port = free_port
    run_dir = tmp_path / "run"
    env = {k: v for k, v in job_env(JAX_PLATFORMS="cpu").items() if k not in LAUNCH_VARS}
    procs = [_train_process(port, i, run_dir, env) for i in range(2)]
    metrics = run_dir / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 900
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            assert time.monotonic() < deadline, "no training step within 15 minutes"
            time.sleep(0.2)
        signalled_at = len(metrics.read_text().splitlines())
        procs[1].send_signal(signal.SIGTERM)  # the worker, not the process that logs and coordinates
        outputs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    stopped = steps[-1]
    assert steps == list(range(1, stopped + 1)) and stopped >= signalled_at
    assert (
        f"maxmoe: SIGTERM (all 2 processes stop after the same step): saved step {stopped} in "
        f"{run_dir / 'checkpoints'}; exiting"
    ) in outputs[0][0]
    # One complete step folder, written by both processes: each one's own OCDBT part is in it.
    folders = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert folders == [str(stopped)], folders
    state = run_dir / "checkpoints" / str(stopped) / "state"
    assert (state / "ocdbt.process_0").is_dir() and (state / "ocdbt.process_1").is_dir()
    position = json.loads((run_dir / "checkpoints" / str(stopped) / "data" / "metadata").read_text())
    assert position == {"split": "train", "step": stopped}
