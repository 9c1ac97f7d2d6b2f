"""Batches for training and evaluation: one process's rows of each global batch, resumable.

Training samples are windows of seq_len + 1 tokens starting at multiples of seq_len, visited
in a seeded permutation that is redrawn every epoch (grain's `MapDataset.shuffle`); eval
uses the first train.eval_batches global batches of a fixed permutation, the same for every
run and every seed. grain is imported only inside the functions that build pipelines.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from maxmoe.config import Config, UserError
from maxmoe.data.byte_tokenizer import BYTE_VOCAB_SIZE
from maxmoe.data.stdlib import stdlib_corpus
from maxmoe.data.token_folder import load_tokens, read_meta

_EVAL_STREAM = 1  # key that separates eval randomness from train randomness


def data_folder(config: Config) -> Path:
    """The token folder a config reads (stdlib: built now if not cached)."""
    if config.data.source == "stdlib":
        return stdlib_corpus(config.data.cache_dir, config.data.eval_fraction)
    if config.data.source == "shards":
        return Path(config.data.path).expanduser()
    raise UserError(f"data.source={config.data.source} has no token folder")


def vocab_size_of(config: Config) -> int:
    """The vocabulary size the data needs; model.vocab_size must be at least this."""
    if config.data.source == "synthetic":
        return config.model.vocab_size
    if config.data.source == "stdlib":
        return BYTE_VOCAB_SIZE
    return read_meta(data_folder(config))["vocab_size"]


def _stream_seed(seed: int, stream: int) -> int:
    """A well-mixed 32-bit seed for one random stream (grain reseeds epochs with seed + epoch)."""
    return int(np.random.SeedSequence([seed, stream]).generate_state(1)[0])


class BatchIterator:
    """Batches of one process's rows; `get_state`/`set_state` resume exactly.

    Attributes: split, local_batch_size, seq_len, num_batches (None: endless train stream),
    description (one line for logs).
    """

    def __init__(
        self, dataset, *, split: str, local_batch_size: int, seq_len: int, num_batches: int | None, description: str
    ):
        self._dataset = dataset  # grain MapDataset of local batches; random access by step
        self.split, self.local_batch_size, self.seq_len = split, local_batch_size, seq_len
        self.num_batches, self.description = num_batches, description
        self._step = 0
        self._iterator = None

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> np.ndarray:
        if self.num_batches is not None and self._step >= self.num_batches:
            raise StopIteration
        if self._iterator is None:
            import grain

            # Threads read a few batches ahead; a small buffer bounds host memory.
            options = grain.ReadOptions(num_threads=4, prefetch_buffer_size=8)
            self._iterator = iter(self._dataset[self._step :].to_iter_dataset(options))
        batch = next(self._iterator)
        self._step += 1
        return batch

    def get_state(self) -> dict:
        """JSON-serialisable position: the number of batches already returned."""
        return {"split": self.split, "step": self._step}

    def set_state(self, state: dict) -> None:
        """Continue from a `get_state` result (also valid with a different process count)."""
        step = state.get("step") if isinstance(state, dict) else None
        if not isinstance(step, int) or step < 0 or state.get("split", self.split) != self.split:
            raise UserError(f"data iterator state {state!r}: expected {{'split': '{self.split}', 'step': N >= 0}}")
        self._step, self._iterator = step, None


def make_dataset(
    config: Config, *, split: str = "train", process_index: int = 0, process_count: int = 1
) -> BatchIterator:
    """The batch iterator of one process for `split` ('train': endless; 'eval': train.eval_batches)."""
    import grain

    t = config.train
    if split not in ("train", "eval"):
        raise UserError(f"split={split!r}: expected 'train' or 'eval'")
    if not 0 <= process_index < process_count:
        raise UserError(f"process_index={process_index} is outside 0..{process_count - 1}")
    if t.batch_size % process_count:
        raise UserError(f"train.batch_size={t.batch_size} is not divisible by the {process_count} processes")
    local = t.batch_size // process_count
    window = t.seq_len + 1
    seed = 0 if split == "eval" else t.seed  # eval batches are the same whatever the seed
    stream = _EVAL_STREAM if split == "eval" else 0

    if config.data.source == "synthetic":
        vocab = config.model.vocab_size
        samples = grain.MapDataset.range(2**62)
        draw_key = _stream_seed(seed, stream)

        def rows(sample_ids):
            return np.stack(
                [
                    np.random.default_rng([draw_key, int(i)]).integers(0, vocab, window, dtype=np.int32)
                    for i in sample_ids
                ]
            )

        description = f"synthetic tokens in [0, {vocab})"
    else:
        folder = data_folder(config)
        tokens, meta = load_tokens(folder, split)
        if config.model.vocab_size < meta["vocab_size"]:
            raise UserError(
                f"model.vocab_size={config.model.vocab_size} is smaller than the data's vocabulary "
                f"of {meta['vocab_size']} ({folder})"
            )
        if len(tokens) < window:
            raise UserError(
                f"train.seq_len={t.seq_len}: windows of {window} tokens do not fit the {len(tokens)} "
                f"{split} tokens of {folder}"
            )
        num_windows = (len(tokens) - 1) // t.seq_len
        samples = grain.MapDataset.range(num_windows).shuffle(seed=_stream_seed(seed, stream)).repeat()

        def rows(window_ids):
            batch = np.empty((len(window_ids), window), np.int32)
            for row, start in enumerate(np.asarray(window_ids) * t.seq_len):
                batch[row] = tokens[start : start + window]  # slice copies beat a fancy-index gather 3x
            return batch

        description = (
            f"{config.data.source} {split}: {len(tokens):,} tokens, {num_windows:,} windows of {window} ({folder})"
        )
    num_batches = t.eval_batches if split == "eval" else None
    if num_batches is not None:
        samples = samples[: num_batches * t.batch_size]
    # Global sample s * batch + r is row r of step s: batching by the local size and taking every
    # process_count-th batch gives this process its contiguous rows without touching the others.
    local_batches = samples.batch(local)[process_index::process_count].map(rows)
    return BatchIterator(
        local_batches,
        split=split,
        local_batch_size=local,
        seq_len=t.seq_len,
        num_batches=num_batches,
        description=description,
    )
