"""Mixtures of token folders: which folder each global sample comes from, in exact proportions.

    sources, indices = mixture_sources(sample_ids, weights)

Sample i of the global stream (step s, row r: i = s x train.batch_size + r) is assigned to
one folder by a stateless rule, so any step can be read without replaying the ones before
(resume, other process counts). The rule splits the stream in a chain: folder 0 takes
samples by a Bresenham line of slope p0 = w0 / (w0 + w1 + ...), so the first n samples hold
exactly round(n p0) of folder 0 (halves rounded down); the samples it leaves are split the
same way between folder 1 and the rest, and so on. Any window of consecutive samples holds
each folder's share to within a sample or two, and a window that starts at a sample where
every share is a whole number (sample 0, for one) and whose length gives whole shares holds
them exactly: with weights 3:1 every batch of 8 rows has 6 and 2. A sample's index
within its folder counts the samples that folder received before it, so each folder is read
as its own seeded, epoch-reshuffled stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _taken_before(index: np.ndarray, fraction: float) -> np.ndarray:
    """How many of the samples 0 .. index-1 a Bresenham line of slope `fraction` takes."""
    return np.floor(index * fraction + 0.5).astype(np.int64)


def mixture_sources(sample_ids: np.ndarray, weights: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """(folder, index within that folder's stream) of each global sample id; weights > 0."""
    ids = np.asarray(sample_ids, dtype=np.int64)
    total = [float(sum(weights[s:])) for s in range(len(weights))]
    source = np.full(ids.shape, len(weights) - 1, dtype=np.int64)
    index = ids.copy()  # position within the part of the stream not yet assigned
    open_ = np.ones(ids.shape, dtype=bool)
    for s in range(len(weights) - 1):
        fraction = weights[s] / total[s]
        before = _taken_before(index, fraction)
        take = open_ & (_taken_before(index + 1, fraction) > before)
        source[take] = s
        index = np.where(open_, np.where(take, before, index - before), index)
        open_ &= ~take
    return source, index
