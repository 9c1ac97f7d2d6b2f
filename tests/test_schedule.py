"""The learning-rate schedule of a continued run: no silent jump when train.steps is raised.

A finished run continued with more steps keeps its schedule's span (the rate stays at its
final value) unless train.schedule_steps stretches it, and a resumed run whose rate changes
says so. The Trainer test also shows the persistent compilation cache's hit on the console.
"""

import dataclasses
import math
from pathlib import Path

import jax
import pytest

import maxmoe
from maxmoe import runtime
from maxmoe.config import load_config
from maxmoe.training.checkpoint import Checkpointer
from maxmoe.training.optim import continued_schedule, learning_rate_schedule

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
# One dense layer, no MTP, synthetic tokens: a Trainer that compiles quickly (the schedule is the point).
SMALL = {
    **{"model.compute_dtype": "float32", "model.num_layers": 1, "model.first_k_dense": 1, "model.mtp_num_layers": 0},
    **{"data.source": "synthetic", "train.batch_size": 4, "train.seq_len": 16, "train.steps": 3, "train.log_every": 1},
}
TRAIN = load_config(TINY, {"train.steps": 300, "train.warmup_steps": 30, "train.lr": 3e-3}).train
PEAK, FLOOR = 3e-3, 3e-4  # train.min_lr_ratio 0.1


def rate(train, step: int) -> float:
    return float(learning_rate_schedule(train)(step))


def saved(train) -> dict:
    """The train section as a checkpoint stores it."""
    return dataclasses.asdict(train)


def test_schedule_spans_schedule_steps_then_stays_at_its_floor():
    assert rate(TRAIN, 29) == pytest.approx(PEAK)  # the last warmup step reaches the peak
    assert rate(TRAIN, 30 + 135) == pytest.approx((PEAK + FLOOR) / 2)  # half way down the cosine
    assert rate(TRAIN, 300) == pytest.approx(FLOOR)
    longer = dataclasses.replace(TRAIN, steps=600)
    assert rate(longer, 300) == pytest.approx(FLOOR + (PEAK - FLOOR) * 0.5 * (1 + math.cos(math.pi * 270 / 570)))
    kept = dataclasses.replace(longer, schedule_steps=300)
    assert [rate(kept, s) for s in (300, 450, 599)] == pytest.approx([FLOOR] * 3)
    assert rate(kept, 100) == rate(TRAIN, 100)


def test_a_finished_run_continued_keeps_its_span_and_says_so():
    more = dataclasses.replace(TRAIN, steps=600)
    train, note = continued_schedule(more, saved(TRAIN), 300)
    assert train.schedule_steps == 300 and rate(train, 300) == pytest.approx(FLOOR)
    assert "continuing a finished run (step 300 of 300) to 600 steps" in note
    assert "stays at its final 0.0003" in note and "train.schedule_steps=600 stretches it" in note
    # Resumed later (the continuation saved schedule_steps=300): still the kept span, no jump.
    again, note = continued_schedule(more, saved(train), 450)
    assert again.schedule_steps == 300 and note is None
    # Finished again and continued further: the span it kept stays.
    further, note = continued_schedule(dataclasses.replace(more, steps=900), saved(train), 600)
    assert further.schedule_steps == 300 and "keeps its 300 steps" in note


def test_stretching_is_a_choice_and_a_changed_rate_is_said():
    stretch = dataclasses.replace(TRAIN, steps=600, schedule_steps=600)
    train, note = continued_schedule(stretch, saved(TRAIN), 300)
    assert train == stretch
    assert note == (
        f"maxmoe: the learning-rate schedule now spans 600 steps (it spanned 300): the rate at step 300 "
        f"moves from 0.0003 to {rate(stretch, 300):.3g}"
    )
    # Raised before the end: the schedule follows train.steps (as before), said with the rates.
    raised = dataclasses.replace(TRAIN, steps=600)
    train, note = continued_schedule(raised, saved(TRAIN), 200)
    assert train == raised and f"moves from {rate(TRAIN, 200):.3g} to {rate(raised, 200):.3g}" in note


def test_nothing_to_say_when_the_schedule_does_not_change():
    assert continued_schedule(TRAIN, None, 0) == (TRAIN, None)  # a fresh start
    assert continued_schedule(TRAIN, saved(TRAIN), 100) == (TRAIN, None)  # a plain resume
    assert continued_schedule(TRAIN, saved(TRAIN), 300) == (TRAIN, None)  # finished, not raised
    fewer = dataclasses.replace(TRAIN, steps=200)
    assert continued_schedule(fewer, saved(TRAIN), 300)[0] == fewer


@pytest.fixture
def own_compile_cache(tmp_path):
    """A compilation cache of the test's own that keeps every program; the suite's afterwards."""
    minimum = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    yield str(tmp_path / "jax-cache")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", minimum)
    runtime.use_compile_cache("auto")


def test_a_continued_trainer_keeps_the_final_rate_and_loads_cached_programs(tmp_path, capsys, own_compile_cache):
    run = str(tmp_path / "run")
    overrides = {**SMALL, "train.warmup_steps": 1, "run.progress": "plain", "run.dir": run}
    overrides["run.compile_cache"] = own_compile_cache
    with maxmoe.Trainer(load_config(TINY, overrides), devices=jax.devices()[:1]) as first:
        first.run()
    floor = first.config.train.lr * first.config.train.min_lr_ratio
    assert first.history[2]["lr"] > 2 * floor  # step 3 of 3 runs at count 2 of the 3-step cosine
    capsys.readouterr()
    with maxmoe.Trainer(load_config(TINY, {**overrides, "train.steps": 5}), devices=jax.devices()[:1]) as second:
        second.run()
    out = capsys.readouterr().out
    assert "continuing a finished run (step 3 of 3) to 5 steps" in out
    assert [r["lr"] for r in second.history if "loss" in r] == pytest.approx([floor, floor])
    assert "compiled the eval step in" in out and "(cache hit)" in out.split("compiled the eval step in")[1]
    assert "schedule_steps: 3" in (tmp_path / "run" / "config.yaml").read_text()
    step, stored = Checkpointer(second.config, tmp_path / "run").saved_config()
    assert step == 5 and stored["train"]["schedule_steps"] == 3


def test_a_cached_program_left_without_its_access_time_does_not_stop_the_cache(own_compile_cache):
    # A process killed between jax's two writes leaves a program without its access time; jax's
    # size-limited cache then adds nothing more (it reads every entry's access time first).
    folder = Path(own_compile_cache)
    folder.mkdir(parents=True)
    (folder / "jit_f-0123-cache").write_bytes(b"a program")
    assert runtime.use_compile_cache(own_compile_cache) == folder
    assert (folder / "jit_f-0123-atime").is_file()
    hits = runtime.compile_cache_hits()
    x = jax.numpy.arange(5.0)
    jax.jit(lambda v: v * 3 + 1).lower(x).compile()
    added = [p.name for p in folder.glob("jit__lambda-*-cache")]
    assert added and runtime.compile_cache_hits() == hits
    jax.clear_caches()  # the in-memory cache: the next compile looks in the folder
    jax.jit(lambda v: v * 3 + 1).lower(x).compile()
    assert runtime.compile_cache_hits() == hits + 1
