"""What runs where and when in the pipeline: the circular 1F1B tick tables and the layer slots.

P stages (the `pipeline` mesh axis), V chunks per stage (`mesh.pipeline_virtual`), M
micro-batches (`train.grad_accum`). Chunk c = v*P + p lives on stage p (circular
placement), so a micro-batch visits stages 0, 1, ..., P-1, 0, 1, ... and every hop goes
to the next stage on a ring. The forward of micro-batch m, chunk v on stage p runs at tick

    t_F(m, v, p) = (m // P) * P*V + v*P + (m % P) + p

and its backward at

    t_B(m, v, p) = P*V + (m // P) * P*V + (V-1-v) * P + (m % P) + (P-1-p).

Every input was produced by its neighbour exactly one tick before (forward: stage p-1, or
stage P-1 for the previous chunk; backward: stage p+1, or stage 0 of the next chunk; the
last chunk's backward starts the tick after its forward, whose loss gives the cotangent),
so one collective permute per direction per tick carries the activations and no receive
buffers are needed. A stage does at most one forward and one backward per tick.

Three phases: warm-up ticks [0, P*V) forward only, steady ticks [P*V, T_F) one forward and
one backward, cool-down ticks [T_F, T) backward only. A step costs T_F x (f + b) for a
chunk's forward f and backward b, against M*V x (f + b) without stages; with M a multiple
of P, T_F = M*V + P - 1, so

    bubble = (P - 1) / (M*V + P - 1).

Between an item's forward and its backward a stage keeps the item's residuals in a ring of
slots, allocated statically (a tick's backward frees its slot before the tick's forward
takes one): K = min(P*V + P - 1, M*V) slots, bounded by the stages, not by M.

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


def backward_tick(m: int, v: int, p: int, stages: int, virtual: int) -> int:
    """Tick of the backward of micro-batch m, chunk v, on stage p."""
    group = (m // stages) * stages * virtual
    return stages * virtual + group + (virtual - 1 - v) * stages + (m % stages) + stages - 1 - p


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

    @property
    def bubble(self) -> float:
        """Idle fraction of a stage's forward + backward time, every chunk costing the same."""
        return 1.0 - self.micro * self.virtual / self.forward_end

    def tables(self) -> np.ndarray:
        """int32 [ticks, P, 8]: the columns stacked (what the executor indexes per tick and stage)."""
        return np.stack([self.columns[name] for name in TABLE_COLUMNS], axis=-1).astype(np.int32)

    def in_flight(self) -> int:
        """Most items a stage holds between their forward and backward (after a tick's backward frees one)."""
        live = np.cumsum(self.columns["f_valid"], axis=0) - np.cumsum(self.columns["b_valid"], axis=0)
        return int(live.max())


def build_schedule(stages: int, virtual: int, micro: int) -> Schedule:
    """The tables for P=stages, V=virtual, M=micro; checks every dependency and the slot reuse."""
    if stages < 1 or virtual < 1 or micro < 1:
        raise ValueError(f"stages, virtual and micro must be >= 1, got {stages}, {virtual}, {micro}")
    P, V, M = stages, virtual, micro
    forward_end = forward_tick(M - 1, V - 1, P - 1, P, V) + 1
    ticks = backward_tick(M - 1, 0, 0, P, V) + 1
    col = {name: np.zeros((ticks, P), np.int64) for name in TABLE_COLUMNS}
    for m in range(M):
        for v in range(V):
            for p in range(P):
                tf, tb = forward_tick(m, v, p, P, V), backward_tick(m, v, p, P, V)
                if col["f_valid"][tf, p] or col["b_valid"][tb, p]:
                    raise AssertionError(f"two items on stage {p} at one tick")
                col["f_micro"][tf, p], col["f_chunk"][tf, p], col["f_valid"][tf, p] = m, v, 1
                col["b_micro"][tb, p], col["b_chunk"][tb, p], col["b_valid"][tb, p] = m, v, 1
    _check_dependencies(P, V, M)
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
    return Schedule(P, V, M, P * V, forward_end, ticks, peak + 1, col)


def _check_dependencies(P: int, V: int, M: int) -> None:
    """Every input arrives exactly one tick before it is used, from the neighbour on the ring."""
    for m in range(M):
        for v in range(V):
            for p in range(P):
                tf, tb = forward_tick(m, v, p, P, V), backward_tick(m, v, p, P, V)
                if p > 0 or v > 0:
                    prev = forward_tick(m, v, p - 1, P, V) if p > 0 else forward_tick(m, v - 1, P - 1, P, V)
                    if prev != tf - 1:
                        raise AssertionError(f"forward hop of micro-batch {m}, chunk {v}, stage {p}")
                if p < P - 1 or v < V - 1:
                    nxt = backward_tick(m, v, p + 1, P, V) if p < P - 1 else backward_tick(m, v + 1, 0, P, V)
                    if nxt != tb - 1:
                        raise AssertionError(f"backward hop of micro-batch {m}, chunk {v}, stage {p}")
                elif tb != tf + 1:
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
    """Where each of `layers` stacked model layers sits among the V x P x S pipeline slots.

    The model (and every checkpoint) keeps a scanned stack as [L, ...] in model order. The
    pipeline runs chunk c = v*P + p on stage p, holding slots c*S ... c*S + S-1 of a flat
    slot order that is the model order with `pad_front` empty slots before layer 0 and the
    rest after layer L-1:

        slot(l) = pad_front + l,   S = ceil((L + pad_front) / (V*P)),

    so [L, ...] -> pad -> reshape [V, P, S, ...] is the whole re-layout (v outermost), and
    the way back is reshape [V*P*S, ...] -> slice. Front padding lands on stage 0's first
    chunk (which also runs the embedding and dense layers), back padding on the last chunk
    of stage P-1 (which also runs the head, the loss and MTP): skipped slots there balance
    those costs. Empty slots are exact no-ops with zero parameters and zero gradients.
    """

    layers: int
    stages: int
    virtual: int
    pad_front: int = 0

    @property
    def per_chunk(self) -> int:
        return math.ceil((self.layers + self.pad_front) / (self.stages * self.virtual))

    @property
    def slots(self) -> int:
        return self.stages * self.virtual * self.per_chunk

    @property
    def pad_back(self) -> int:
        return self.slots - self.layers - self.pad_front

    def mask(self) -> np.ndarray:
        """bool [V, P, S]: True where a model layer sits."""
        return self.layer_at() >= 0

    def layer_at(self) -> np.ndarray:
        """int [V, P, S]: the model layer in each slot, -1 for padding."""
        flat = np.full(self.slots, -1)
        flat[self.pad_front : self.pad_front + self.layers] = np.arange(self.layers)
        return flat.reshape(self.virtual, self.stages, self.per_chunk)

    def to_stages(self, a_L):
        """One [L, ...] array (model order) -> [V, P, S, ...]; padding slots are zeros."""
        widths = [(self.pad_front, self.pad_back)] + [(0, 0)] * (a_L.ndim - 1)
        return jnp.pad(a_L, widths).reshape(self.virtual, self.stages, self.per_chunk, *a_L.shape[1:])

    def to_model(self, a_VPS):
        """One [V, P, S, ...] array -> [L, ...] in model order (padding dropped)."""
        flat = a_VPS.reshape(self.slots, *a_VPS.shape[3:])
        return flat[self.pad_front : self.pad_front + self.layers]

    def stage_shape(self, shape_L: tuple[int, ...]) -> tuple[int, ...]:
        """[L, ...] -> [V, P, S, ...]."""
        return (self.virtual, self.stages, self.per_chunk, *shape_L[1:])
