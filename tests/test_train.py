"""The training step and the `python -m maxmoe.train` job on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import job_env

from maxmoe.config import load_config
from maxmoe.model.transformer import build_model
from maxmoe.training.optim import learning_rate_schedule, make_optimizer
from maxmoe.training.step import init_state, make_train_step

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def run_train(*overrides, timeout=600):
    env = job_env()
    return subprocess.run(
        [sys.executable, "-m", "maxmoe.train", "--config", TINY, *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )


def read_metrics(run_dir):
    lines = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "loss" in x], [x for x in lines if "eval_loss" in x]


# Small float32 runs on random tokens for in-process step tests.
SMALL = [
    "model.compute_dtype=float32",
    "data.source=synthetic",
    "train.batch_size=8",
    "train.seq_len=32",
    "train.warmup_steps=0",
]
# test_loss_falls_on_a_repeated_batch's config; the grad-accumulation check's one-batch step is
# the same program (compiled once a session).
REPEATED = SMALL + ["train.steps=40"]


def fixed_batch(config, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(
        rng.integers(0, config.model.vocab_size, (config.train.batch_size, config.train.seq_len + 1)), jnp.int32
    )


def repeat_steps(config, optimizer, state, metric, steps=30):
    """Train `steps` steps on one fixed batch; the final state and the metric after each step."""
    step = jax.jit(make_train_step(config, optimizer))
    batch = fixed_batch(config)
    values = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        values.append(float(metrics[metric]))
    return state, values


@pytest.mark.slow
@pytest.mark.smoke
def test_loss_falls_on_a_repeated_batch():
    config = load_config([TINY], REPEATED)
    optimizer = make_optimizer(config.train)
    state = init_state(config, optimizer, jax.random.key(0))
    state, losses = repeat_steps(config, optimizer, state, "loss")
    assert np.isfinite(losses).all()
    # Random tokens: the only way down is memorising the batch.
    assert losses[-1] < 0.5 * losses[0], losses


def test_a_model_without_moe_layers_trains():
    """first_k_dense = num_layers and no MTP: no MoE layer, so no router statistics. One step's
    loss is the cross-entropy of the model's logits, computed here with numpy's log-softmax."""
    config = load_config([TINY], SMALL + ["model.num_layers=2", "model.first_k_dense=2", "model.mtp_num_layers=0"])
    optimizer = make_optimizer(config.train)
    state = init_state(config, optimizer, jax.random.key(0))
    assert not jax.tree.leaves(state.router)
    batch = fixed_batch(config)
    (logits, mtp), _ = build_model(config.model).apply(
        {"params": state.params, "router": state.router}, batch[:, :-1], mutable=["moe_stats"]
    )
    assert not mtp
    logits = np.asarray(logits, np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp, np.asarray(batch[:, 1:])[..., None], -1).mean()
    state, metrics = jax.jit(make_train_step(config, optimizer))(state, batch)
    # The step's float32 cross-entropy of the same float32 logits against float64's: the two
    # differ by float32 rounding of the sums (~1e-7 relative), far below any wrong term's size.
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-6)
    assert float(metrics["seq_aux"]) == 0.0 and np.isfinite(float(metrics["grad_norm"]))


@pytest.mark.slow
def test_router_bias_moves_toward_balance():
    config = load_config([TINY], SMALL + ["train.lr=1e-9", "moe.bias_update_rate=0.01", "moe.seq_aux_alpha=0"])
    optimizer = make_optimizer(config.train)
    state = init_state(config, optimizer, jax.random.key(0))
    # Skewed initial routing: a head start for expert 0 that beats any score difference
    # (initial scores are sigmoid(small) ~ 0.5 +- 0.05). The updates need ~15 steps to undo it.
    state = state.replace(router=jax.tree.map(lambda b: b.at[..., 0].set(0.3), state.router))
    state, imbalance = repeat_steps(config, optimizer, state, "moe_imbalance")
    # Every token's copies include expert 0: its load is N of 2N copies over 8 experts.
    assert imbalance[0] == pytest.approx(4.0), imbalance[0]
    assert max(imbalance[-5:]) < 0.5 * imbalance[0], imbalance
    bias = state.router["moe_layers"]["moe"]["router"]["bias"]
    # The over-loaded expert's head start (0.3) is mostly gone.
    assert (bias[:, 0] - bias[:, 1:].mean(-1) < 0.1).all(), bias


def test_learning_rate_schedules():
    for schedule in ("cosine", "wsd", "constant"):
        config = load_config(
            [TINY],
            [
                f"train.schedule={schedule}",
                "train.steps=100",
                "train.warmup_steps=10",
                "train.lr=1.0",
                "train.min_lr_ratio=0.1",
                "train.decay_fraction=0.2",
            ],
        )
        lr = learning_rate_schedule(config.train)
        assert float(lr(0)) == pytest.approx(0.1)
        assert float(lr(9)) == pytest.approx(1.0)
        if schedule == "cosine":
            assert float(lr(99)) == pytest.approx(0.1, abs=1e-3)
        elif schedule == "wsd":
            assert float(lr(50)) == pytest.approx(1.0)  # stable phase
            assert float(lr(100)) == pytest.approx(0.1, abs=1e-6)
        else:
            assert float(lr(99)) == pytest.approx(1.0)


@pytest.mark.slow
def test_grad_accumulation_matches_one_batch():
    one = load_config([TINY], REPEATED)
    four = load_config([TINY], REPEATED + ["train.grad_accum=4"])
    optimizer = make_optimizer(one.train)
    state = init_state(one, optimizer, jax.random.key(1))
    batch = fixed_batch(one, seed=3)
    a, ma = jax.jit(make_train_step(one, optimizer))(state, batch)
    b, mb = jax.jit(make_train_step(four, optimizer))(state, batch)
    # Losses are per-token means over equal micro-batches, so their mean is the full-batch loss.
    np.testing.assert_allclose(float(ma["lm_loss"]), float(mb["lm_loss"]), rtol=1e-5)
    # The norm sums squares of gradients accumulated in another order: looser than the loss.
    np.testing.assert_allclose(float(ma["grad_norm"]), float(mb["grad_norm"]), rtol=1e-4)


@pytest.mark.parametrize(
    "override, words",
    [
        ("train.steps=-1", "train.steps"),
        ("data.source=nowhere", "data.source"),
        ("data.source=shards", "data.path"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, override, words):
    result = run_train(f"run.dir={tmp_path / 'run'}", override, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maxmoe: error:") and words in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_missing_shards_folder_exits_2(tmp_path):
    result = run_train(
        f"run.dir={tmp_path / 'run'}", "data.source=shards", f"data.path={tmp_path / 'missing'}", timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


# The job on one device: the oracle of the multi-process run below, and the run whose outputs
# (config, flags, TensorBoard events, a profile) are checked.
JOB = ["model.compute_dtype=float32", "train.steps=3", "train.log_every=1", "train.eval_every=1000"]


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one")
    single = run_train(
        f"run.dir={run_dir}",
        "run.cpu_devices=1",
        "mesh.data=1",
        "mesh.expert=1",
        "mesh.tensor=1",
        "run.tensorboard=true",
        "run.profile_steps=[1,2]",
        *JOB,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_a_run_writes_its_config_flags_events_and_profile(one_device_run):
    assert list((one_device_run / "tensorboard").glob("events.out.tfevents.*"))
    assert list((one_device_run / "profile").rglob("*.xplane.pb"))
    assert (one_device_run / "config.yaml").exists() and (one_device_run / "xla_flags.txt").exists()
    # the GPU memory share the process ran with (xla.memory_fraction's default) is recorded beside the flags
    assert (one_device_run / "allocator.env").read_text() == "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95\n"


@pytest.mark.slow
def test_two_processes_on_a_mesh_match_one_device(one_device_run, tmp_path, free_port):
    """2 processes x 4 CPU devices (gloo over loopback) on a 2 x 2 x 2 mesh, `data` across the
    processes, against the job on one device."""
    base = [f"run.dir={tmp_path}", "run.cpu_devices=4", "mesh.data=2", "mesh.expert=2", "mesh.tensor=2", *JOB]
    dist = ["dist.mode=explicit", f"dist.coordinator_address=127.0.0.1:{free_port}", "dist.num_processes=2"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "maxmoe.train", "--config", TINY, *base, *dist, f"dist.process_id={i}"],
            env=job_env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    one, _ = read_metrics(one_device_run)
    mesh, _ = read_metrics(tmp_path)
    assert [x["step"] for x in one] == [x["step"] for x in mesh] == [1, 2, 3]
    # 1e-4 relative, as required: the mesh reduces in another order than one device.
    np.testing.assert_allclose([x["loss"] for x in mesh], [x["loss"] for x in one], rtol=1e-4)
