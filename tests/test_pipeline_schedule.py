"""The pipeline's static tables and slot layout, checked by replaying them (pure Python, no compiles).

The oracle is a tick-by-tick replay of what the executor does with the tables: each stage
receives what its ring neighbour produced one tick before and keeps residuals in ring
slots. Tokens naming (micro-batch, chunk, stage) flow through it; every forward must
receive its predecessor's output and every backward its successor's cotangent and its own
forward's slot.
"""

import numpy as np
import pytest

from maxmoe.config import ConfigError, load_config
from maxmoe.parallel.pipeline_schedule import SlotLayout, analytic_bubble, build_schedule, describe

SHAPES = [(1, 1, 3), (2, 1, 4), (2, 2, 4), (2, 2, 8), (4, 1, 4), (4, 2, 8), (2, 3, 6), (8, 2, 16), (2, 3, 5)]


def replay(schedule):
    """Run the tables as the executor does; returns (forwards, backwards, tails) seen per (m, v, p)
    (tails: the micro-batches whose tail stage 0 ran, turnaround 2)."""
    P, V, R = schedule.stages, schedule.virtual, schedule.turnaround
    c = schedule.columns
    tail = schedule.tail_table()
    x_recv = [None] * P  # what the forward permute delivered
    dx_recv = [None] * P  # what the backward permute delivered
    loss_cotangent = []  # post's cotangents on stage P-1, oldest first
    ring = [dict() for _ in range(P)]
    forwards, backwards, tails = set(), set(), set()
    for t in range(schedule.ticks):
        sent_y, sent_dx = [None] * P, [None] * P
        for p in range(P):
            if c["b_valid"][t, p]:
                m, v, slot = int(c["b_micro"][t, p]), int(c["b_chunk"][t, p]), int(c["b_slot"][t, p])
                assert ring[p].pop(slot) == (m, v, p), "backward read another item's residuals"
                if p == P - 1 and v == V - 1:
                    # post ran R ticks ago; the registers in between hold later micro-batches' cotangents.
                    assert loss_cotangent.pop(0) == ("loss", m, t - R), "loss cotangent not waiting"
                    if R == 2:
                        assert dx_recv[p] == ("tail", m), f"tail cotangent of {m} missing: {dx_recv[p]}"
                else:
                    successor = (m, v, p + 1) if p < P - 1 else (m, v + 1, 0)
                    assert dx_recv[p] == ("dx", successor), f"backward {m, v, p} got {dx_recv[p]}"
                backwards.add((m, v, p))
                sent_dx[p] = ("dx", (m, v, p))
            if p == 0 and tail[t, 1]:
                m = int(tail[t, 0])
                assert x_recv[0] == ("y", (m, V - 1, P - 1)), f"tail of {m} got {x_recv[0]}"
                assert sent_dx[0] is None or sent_dx[0][1][1] == 0, "the tail's cotangent displaces a chunk's"
                tails.add(m)
                sent_dx[0] = ("tail", m)
            if c["f_valid"][t, p]:
                m, v, slot = int(c["f_micro"][t, p]), int(c["f_chunk"][t, p]), int(c["f_slot"][t, p])
                if not (p == 0 and v == 0):
                    predecessor = (m, v, p - 1) if p > 0 else (m, v - 1, P - 1)
                    assert x_recv[p] == ("y", predecessor), f"forward {m, v, p} got {x_recv[p]}"
                assert slot not in ring[p] and slot < schedule.slots - 1, "slot in use or the scratch slot"
                ring[p][slot] = (m, v, p)
                forwards.add((m, v, p))
                sent_y[p] = ("y", (m, v, p))
                if p == P - 1 and v == V - 1:
                    loss_cotangent.append(("loss", m, t))
        # The permutes: stage p's output reaches p+1 (forward) and p-1 (backward), around the ring.
        x_recv = [sent_y[(p - 1) % P] for p in range(P)]
        dx_recv = [sent_dx[(p + 1) % P] for p in range(P)]
    assert all(not r for r in ring) and not loss_cotangent, "residuals or cotangents left over"
    return forwards, backwards, tails


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("P, V, M", SHAPES)
def test_tables_replay_every_item_once_in_order(P, V, M, R):
    if R == 2 and P == 1:
        with pytest.raises(ValueError, match="turnaround"):
            build_schedule(P, V, M, R)
        return
    schedule = build_schedule(P, V, M, R)
    forwards, backwards, tails = replay(schedule)
    everything = {(m, v, p) for m in range(M) for v in range(V) for p in range(P)}
    assert forwards == everything and backwards == everything
    assert tails == (set(range(M)) if R == 2 else set())
    assert schedule.columns["f_valid"].sum() == schedule.columns["b_valid"].sum() == M * V * P


@pytest.mark.parametrize("P, V, M", [s for s in SHAPES if s[2] % s[0] == 0 and s[0] > 1])
def test_turnaround_two_keeps_the_bubble_and_holds_one_more_item(P, V, M):
    """The tail's tick moves every backward one tick later: the same forward ticks and bubble,
    one more tick in all, and the stages hold one item more (the last stage two, not one)."""
    one, two = build_schedule(P, V, M), build_schedule(P, V, M, 2)
    np.testing.assert_array_equal(two.columns["f_valid"], np.pad(one.columns["f_valid"], ((0, 1), (0, 0))))
    assert (two.forward_end, two.ticks, two.warmup_end) == (one.forward_end, one.ticks + 1, P * V + 1)
    assert two.bubble == one.bubble == pytest.approx(analytic_bubble(P, V, M), abs=1e-12)
    assert two.in_flight() == min(P * V + P, M * V)
    np.testing.assert_array_equal(two.columns["b_valid"][1:], one.columns["b_valid"])


@pytest.mark.parametrize("P, V, M", [s for s in SHAPES if s[2] % s[0] == 0])
def test_bubble_and_ring_size(P, V, M):
    schedule = build_schedule(P, V, M)
    # Measured from the tables: idle (forward + backward) tick-halves over all of a stage's ticks
    # of the steady length; the analytic formula holds when M is a multiple of P.
    busy = schedule.columns["f_valid"][:, 0].sum()
    assert busy == M * V
    assert schedule.bubble == pytest.approx(analytic_bubble(P, V, M), abs=1e-12)
    assert schedule.bubble == pytest.approx(1 - busy / schedule.forward_end, abs=1e-12)
    # Items in flight (and ring slots, less the scratch slot) bounded by the stages, not by M.
    in_flight = schedule.in_flight()
    assert schedule.slots - 1 == in_flight == min(P * V + P - 1, M * V)
    assert build_schedule(P, V, 4 * M).slots - 1 == build_schedule(P, V, 8 * M).slots - 1 == P * V + P - 1


def test_picture_names_every_item():
    text = describe(build_schedule(2, 2, 4))
    assert text.count("F") == text.count("B") == 2 * 2 * 4
    assert text.splitlines()[0].startswith("stage 0: F0.0/.")


@pytest.mark.parametrize("layers, P, V, front", [(4, 2, 2, 0), (5, 4, 1, 1), (7, 2, 3, 2), (1, 2, 1, 0)])
def test_slot_layout_round_trip(layers, P, V, front):
    slots = SlotLayout(layers, P, V, front)
    a = np.arange(layers * 3, dtype=np.float32).reshape(layers, 3) + 1
    staged = np.asarray(slots.to_stages(a))
    assert staged.shape == (V, P, slots.per_chunk, 3)
    np.testing.assert_array_equal(np.asarray(slots.to_model(staged)), a)
    # Layer l of the model sits in chunk c = v*P + p, slot s with c*S + s = front + l (circular placement).
    for v in range(V):
        for p in range(P):
            for s in range(slots.per_chunk):
                layer = (v * P + p) * slots.per_chunk + s - front
                inside = 0 <= layer < layers
                assert slots.mask()[v, p, s] == inside
                assert slots.layer_at()[v, p, s] == (layer if inside else -1)
                np.testing.assert_array_equal(staged[v, p, s], a[layer] if inside else 0)
    assert slots.pad_back == slots.slots - layers - front >= 0


def test_dense_layers_take_slots_before_the_moe_stack():
    """671B on the H200 plan: 3 dense + 58 MoE layers in 32 stages x 2 slots, 2 empty in front:
    stage 0 holds no layer, stage 1 dense layers 0 and 1, stage 2 dense layer 2 and MoE layer
    0, stage 31 MoE layer 57 and one empty slot."""
    slots = SlotLayout(58, 32, 1, 2, dense=3)
    assert (slots.per_chunk, slots.pad_back) == (2, 1)
    dense, moe = slots.dense_at()[0], slots.layer_at()[0]
    assert dense[:3].tolist() == [[-1, -1], [0, 1], [2, -1]] and (dense[3:] == -1).all()
    assert moe[:3].tolist() == [[-1, -1], [-1, -1], [-1, 0]] and moe[3].tolist() == [1, 2]
    assert moe[31].tolist() == [57, -1]
    a = np.arange(58, dtype=np.float32) + 1
    staged = np.asarray(slots.to_stages(a))
    assert staged[0, 2].tolist() == [0, 1] and staged[0, 31].tolist() == [58, 0]
    np.testing.assert_array_equal(np.asarray(slots.to_model(staged)), a)


TINY = ["model.num_layers=5", "train.batch_size=16"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mesh.pipeline=2", "train.grad_accum=3", "train.batch_size=12"], "must be a multiple of mesh.pipeline=2"),
        (["mesh.pipeline=4", "train.grad_accum=2"], "must be a multiple of mesh.pipeline=4"),
        (["mesh.pipeline=2", "train.grad_accum=2", "model.first_k_dense=5"], "are all dense"),
        (["mesh.pipeline=0"], "mesh.pipeline=0: must be > 0"),
        (["mesh.rules.batch=[pipeline, data]"], "mesh.rules.batch="),
        (["train.pipeline_residuals=all"], "allowed values are vjp, recompute"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as error:
        load_config([], TINY + overrides)
    assert "\n" not in str(error.value)


def test_pipeline_config_accepted():
    config = load_config([], TINY + ["mesh.pipeline=2", "mesh.pipeline_virtual=2", "train.grad_accum=4"])
    assert (config.mesh.pipeline, config.mesh.pipeline_virtual, config.train.pipeline_residuals) == (2, 2, "vjp")
