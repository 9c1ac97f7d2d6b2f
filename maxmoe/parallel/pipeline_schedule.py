"""What runs where and when in the pipeline: the circular 1F1B tick tables and the layer slots.

    schedule = build_schedule(stages=P, virtual=V, micro=M, turnaround=R)   # tables [ticks, P]
    layout = SlotLayout(layers, stages, virtual, pad_front, dense)          # layers -> V x P x S slots

Chunk c = v*P + p lives on stage p (circular placement): every hop goes to the next stage on a
ring, and every input was produced by its neighbour exactly one tick before, so one collective
permute per direction per tick carries the activations. A stage runs at most one forward and
one backward per tick; the last chunk's backward follows its forward after the turnaround R (1,
or 2 with a tail on stage 0). `build_schedule` checks every dependency and the slot reuse. With
M a multiple of P the bubble is (P - 1) / (M*V + P - 1) whatever R (`analytic_bubble`), and the
residual ring holds min(P*V + P - 1, M*V) items (one more with a tail), bounded by the stages.

docs/SHARDING.md, "Pipeline stages" ("Ticks") has the tick formulas, the phases and why.
Axis legend: P stages, V chunks per stage, M micro-batches, S layer slots per chunk.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np


def forward_tick(m: int, v: int, p: int, stages: int, virtual: int) -> int:
    """Tick of the forward of micro-batch m, chunk v, on stage p."""
    return (m // stages) * stages * virtual + v * stages + (m % stages) + p


def backward_tick(m: int, v: int, p: int, stages: int, virtual: int, turnaround: int = 1) -> int:
    """Tick of the backward of micro-batch m, chunk v, on stage p (turnaround: ticks from the
    last chunk's forward to its backward)."""
    group = (m // stages) * stages * virtual
    return stages * virtual + group + (virtual - 1 - v) * stages + (m % stages) + stages - 1 - p + turnaround - 1


def analytic_bubble(stages: int, virtual: int, micro: int) -> float:
    """(P - 1) / (M*V + P - 1): the idle fraction of a stage's time (M a multiple of P)."""
    return (stages - 1) / (micro * virtual + stages - 1)


# Columns of Schedule.tables(): forward micro-batch, chunk, ring slot, valid; the same for the backward.
TABLE_COLUMNS = ("f_micro", "f_chunk", "f_slot", "f_valid", "b_micro", "b_chunk", "b_slot", "b_valid")


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """Static per-(tick, stage) tables, int arrays [ticks, P] named as in TABLE_COLUMNS.

    Where a stage idles (`*_valid` 0) the entries are harmless placeholders: micro-batch 0,
    chunk 0, and the scratch slot `slots - 1` that no live item uses.
    """

    stages: int
    virtual: int
    micro: int
    warmup_end: int  # first tick with a backward
    forward_end: int  # one past the last tick with a forward
    ticks: int
    slots: int  # ring slots per stage, the scratch slot included
    columns: dict
    turnaround: int = 1  # ticks from the last chunk's forward to its backward (2: a tail on stage 0)

    @property
    def bubble(self) -> float:
        """Idle fraction of a stage's forward + backward time, every chunk costing the same."""
        return 1.0 - self.micro * self.virtual / self.forward_end

    def tables(self) -> np.ndarray:
        """int32 [ticks, P, 8]: the columns stacked (what the executor indexes per tick and stage)."""
        return np.stack([self.columns[name] for name in TABLE_COLUMNS], axis=-1).astype(np.int32)

    def tail_table(self) -> np.ndarray:
        """int32 [ticks, 2]: (micro-batch, valid) of the tail stage 0 runs at each tick: the
        item whose last chunk's forward stage P-1 ran the tick before (turnaround 2 only)."""
        out = np.zeros((self.ticks, 2), np.int32)
        if self.turnaround == 2:
            c, last = self.columns, self.stages - 1
            ran = (c["f_valid"][:-1, last] == 1) & (c["f_chunk"][:-1, last] == self.virtual - 1)
            out[1:, 0] = np.where(ran, c["f_micro"][:-1, last], 0)
            out[1:, 1] = ran
        return out

    def in_flight(self) -> int:
        """Most items a stage holds between their forward and backward (after a tick's backward frees one)."""
        live = np.cumsum(self.columns["f_valid"], axis=0) - np.cumsum(self.columns["b_valid"], axis=0)
        return int(live.max())


def build_schedule(stages: int, virtual: int, micro: int, turnaround: int = 1) -> Schedule:
    """The tables for P=stages, V=virtual, M=micro and turnaround R (1, or 2 for a tail on
    stage 0); checks every dependency and the slot reuse."""
    if stages < 1 or virtual < 1 or micro < 1:
        raise ValueError(f"stages, virtual and micro must be >= 1, got {stages}, {virtual}, {micro}")
    if turnaround not in (1, 2) or (turnaround == 2 and stages < 2):
        raise ValueError(f"turnaround must be 1, or 2 with 2 stages or more; got {turnaround} with {stages}")
    P, V, M, R = stages, virtual, micro, turnaround
    forward_end = forward_tick(M - 1, V - 1, P - 1, P, V) + 1
    ticks = backward_tick(M - 1, 0, 0, P, V, R) + 1
    col = {name: np.zeros((ticks, P), np.int64) for name in TABLE_COLUMNS}
    for m in range(M):
        for v in range(V):
            for p in range(P):
                tf, tb = forward_tick(m, v, p, P, V), backward_tick(m, v, p, P, V, R)
                if col["f_valid"][tf, p] or col["b_valid"][tb, p]:
                    raise AssertionError(f"two items on stage {p} at one tick")
                col["f_micro"][tf, p], col["f_chunk"][tf, p], col["f_valid"][tf, p] = m, v, 1
                col["b_micro"][tb, p], col["b_chunk"][tb, p], col["b_valid"][tb, p] = m, v, 1
    _check_dependencies(P, V, M, R)
    # Slots per stage from a free list; the backward of a tick frees before its forward takes.
    slot_of: dict[tuple[int, int, int], int] = {}
    peak = 0
    for p in range(P):
        free: list[int] = []
        used = 0
        for t in range(ticks):
            if col["b_valid"][t, p]:
                slot = slot_of.pop((int(col["b_micro"][t, p]), int(col["b_chunk"][t, p]), p))
                col["b_slot"][t, p] = slot
                free.append(slot)
            if col["f_valid"][t, p]:
                if free:
                    slot = min(free)
                    free.remove(slot)
                else:
                    slot, used = used, used + 1
                slot_of[(int(col["f_micro"][t, p]), int(col["f_chunk"][t, p]), p)] = slot
                col["f_slot"][t, p] = slot
        peak = max(peak, used)
    if slot_of:
        raise AssertionError(f"items never consumed: {sorted(slot_of)[:4]}")
    # Idle forwards write (and idle backwards read) a scratch slot, so ring writes need no mask.
    col["f_slot"][col["f_valid"] == 0] = peak
    col["b_slot"][col["b_valid"] == 0] = peak
    return Schedule(P, V, M, min(P * V + R - 1, forward_end), forward_end, ticks, peak + 1, col, R)


def _check_dependencies(P: int, V: int, M: int, R: int) -> None:
    """Every input arrives exactly one tick before it is used, from the neighbour on the ring;
    with R = 2 the tail's tick (the one after the last chunk's forward) has both ring
    directions on stage 0 free: no forward of a chunk v > 0 and no backward of one there."""
    busy_wrap = set()
    for m in range(M):
        for v in range(1, V):
            busy_wrap.add(forward_tick(m, v, 0, P, V))
            busy_wrap.add(backward_tick(m, v, 0, P, V, R))
    for m in range(M):
        for v in range(V):
            for p in range(P):
                tf, tb = forward_tick(m, v, p, P, V), backward_tick(m, v, p, P, V, R)
                if R == 2 and p == P - 1 and v == V - 1 and tf + 1 in busy_wrap:
                    raise AssertionError(f"the tail of micro-batch {m} meets a wrap-around hop on stage 0")
                if p > 0 or v > 0:
                    prev = forward_tick(m, v, p - 1, P, V) if p > 0 else forward_tick(m, v - 1, P - 1, P, V)
                    if prev != tf - 1:
                        raise AssertionError(f"forward hop of micro-batch {m}, chunk {v}, stage {p}")
                if p < P - 1 or v < V - 1:
                    nxt = backward_tick(m, v, p + 1, P, V, R) if p < P - 1 else backward_tick(m, v + 1, 0, P, V, R)
                    if nxt != tb - 1:
                        raise AssertionError(f"backward hop of micro-batch {m}, chunk {v}, stage {p}")
                elif tb != tf + R:
                    raise AssertionError(f"loss turn-around of micro-batch {m}")


def describe(schedule: Schedule) -> str:
    """A text picture: one row per stage, F<m>.<v>/B<m>.<v> per tick ('.' where it idles)."""
    c = schedule.columns
    rows = []
    for p in range(schedule.stages):
        cells = []
        for t in range(schedule.ticks):
            f = f"F{c['f_micro'][t, p]}.{c['f_chunk'][t, p]}" if c["f_valid"][t, p] else "."
            b = f"B{c['b_micro'][t, p]}.{c['b_chunk'][t, p]}" if c["b_valid"][t, p] else "."
            cells.append(f"{f}/{b}")
        rows.append(f"stage {p}: " + " ".join(cells))
    return "\n".join(rows)


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """Where the model's layers sit among the V x P x S pipeline slots.

    `dense` leading dense layers and `layers` MoE layers, in model order, take the slots of a
    flat order with `pad_front` empty slots before the first and the rest after the last:

        slot(dense layer j) = pad_front + j,   slot(MoE layer l) = pad_front + dense + l,
        S = ceil((dense + layers + pad_front) / (V*P)),

    and the pipeline runs chunk c = v*P + p on stage p, holding slots c*S ... c*S + S-1 (v
    outermost). The model (and every checkpoint) keeps the scanned MoE stack as [L, ...] in
    model order: [L, ...] -> pad -> reshape [V, P, S, ...] is its whole re-layout and the way
    back reshape [V*P*S, ...] -> slice; a slot holding a dense layer or nothing holds zeros
    there. The dense layers' own parameters stay outside the stack (a dense SwiGLU instead
    of experts), and a stage running one reads them (maxmoe.model.stages). Front padding lands
    on stage 0's first chunk (which also runs the embedding and the pipeline's tail, MTP),
    back padding on the last chunk of stage P-1 (which also runs the head and the loss):
    skipped slots there balance those costs. Empty slots are exact no-ops.
    """

    layers: int
    stages: int
    virtual: int
    pad_front: int = 0
    dense: int = 0

    @property
    def per_chunk(self) -> int:
        return math.ceil((self.dense + self.layers + self.pad_front) / (self.stages * self.virtual))

    @property
    def slots(self) -> int:
        return self.stages * self.virtual * self.per_chunk

    @property
    def pad_back(self) -> int:
        return self.slots - self.dense - self.layers - self.pad_front

    def mask(self) -> np.ndarray:
        """bool [V, P, S]: True where a MoE layer sits."""
        return self.layer_at() >= 0

    def _at(self, start: int, count: int) -> np.ndarray:
        flat = np.full(self.slots, -1)
        flat[start : start + count] = np.arange(count)
        return flat.reshape(self.virtual, self.stages, self.per_chunk)

    def layer_at(self) -> np.ndarray:
        """int [V, P, S]: the MoE layer in each slot, -1 elsewhere."""
        return self._at(self.pad_front + self.dense, self.layers)

    def dense_at(self) -> np.ndarray:
        """int [V, P, S]: the dense layer in each slot, -1 elsewhere."""
        return self._at(self.pad_front, self.dense)

    def to_stages(self, a_L):
        """One [L, ...] array of the MoE stack (model order) -> [V, P, S, ...]; other slots zeros."""
        widths = [(self.pad_front + self.dense, self.pad_back)] + [(0, 0)] * (a_L.ndim - 1)
        return jnp.pad(a_L, widths).reshape(self.virtual, self.stages, self.per_chunk, *a_L.shape[1:])

    def to_model(self, a_VPS):
        """One [V, P, S, ...] array -> the MoE stack's [L, ...] in model order (other slots dropped)."""
        flat = a_VPS.reshape(self.slots, *a_VPS.shape[3:])
        start = self.pad_front + self.dense
        return flat[start : start + self.layers]

    def stage_shape(self, shape_L: tuple[int, ...]) -> tuple[int, ...]:
        """[L, ...] -> [V, P, S, ...]."""
        return (self.virtual, self.stages, self.per_chunk, *shape_L[1:])
