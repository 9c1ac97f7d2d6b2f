"""Batches for training and evaluation: one process's rows of each global batch, resumable.

Training samples are windows of seq_len + 1 tokens starting at multiples of seq_len, visited
in a seeded permutation that is redrawn every epoch (grain's `MapDataset.shuffle`); eval
uses the first train.eval_batches global batches of a fixed permutation, the same for every
run and every seed. With a mixture (`data.mixture`), each global sample is drawn from one
folder in exact proportions (maxmoe.data.mixture) and each folder keeps its own permutation.

grain reads token folders; it is imported where those pipelines are built, because
synthetic data (benchmarks, bare GPU images) runs without it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from pathlib import Path

import numpy as np

from maxmoe.config import Config, ConfigError, UserError, validate
from maxmoe.data.byte_tokenizer import BYTE_VOCAB_SIZE
from maxmoe.data.mixture import mixture_sources
from maxmoe.data.stdlib import stdlib_corpus
from maxmoe.data.text_cache import token_folder_for
from maxmoe.data.token_folder import load_tokens, read_meta

_EVAL_STREAM = 1  # key that separates eval randomness from train randomness


def data_folders(config: Config) -> list[tuple[Path, float]]:
    """The token folders a config reads and their weights (stdlib: built now if not cached).

    `data.path` is one folder (weight 1); `data.mixture` maps folders to weights.
    """
    d = config.data
    if d.kind == "stdlib":
        return [(stdlib_corpus(d.cache_dir, d.eval_fraction), 1.0)]
    if d.kind == "shards":
        # Text rather than a token folder is tokenised once into the cache (maxmoe.data.text_cache).
        folder = functools.partial(
            token_folder_for,
            tokenizer=d.tokenizer,
            text_key=d.text_key,
            eval_fraction=d.eval_fraction,
            cache_dir=d.cache_dir,
        )
        if d.mixture:
            return [(folder(str(path)), float(weight)) for path, weight in d.mixture.items()]
        return [(folder(d.path), 1.0)]
    raise UserError(f"data.source={d.source} has no token folder")


def vocab_size_of(config: Config) -> int:
    """The vocabulary size the data needs; model.vocab_size must be at least this."""
    if config.data.kind == "synthetic":
        return config.model.vocab_size
    if config.data.kind == "stdlib":
        return BYTE_VOCAB_SIZE
    metas = {str(folder): read_meta(folder) for folder, _ in data_folders(config)}
    check_one_tokenizer(metas)
    return next(iter(metas.values()))["vocab_size"]


def _tokenizer_of(meta: dict) -> tuple:
    """What must agree between the folders of one mixture: vocabulary size, EOS id, byte or not."""
    return meta["vocab_size"], meta.get("eos_id"), meta.get("tokenizer") == "byte"


def check_one_tokenizer(metas: dict[str, dict]) -> None:
    """A UserError unless every folder's meta.json ({folder: meta}) says the same tokenizer.

    Token ids of two tokenizers mean different things; mixed, they train on noise however
    model.vocab_size is set.
    """
    if len({_tokenizer_of(meta) for meta in metas.values()}) <= 1:
        return
    listed = ", ".join(
        f"{folder}: {meta.get('tokenizer', 'tokenizer unknown')}, vocabulary {meta['vocab_size']}, "
        f"EOS {meta.get('eos_id')}"
        for folder, meta in metas.items()
    )
    raise UserError(f"data.mixture: the folders were made with different tokenizers ({listed}); use one tokenizer")


def _grain():
    """The grain module, or one line saying it is missing (a core dependency; bare GPU images lack it)."""
    try:
        import grain
    except ImportError:
        raise UserError(
            "token folders (data.source=stdlib or shards) are read with grain, which is not installed: "
            "pip install grain (or data.source=synthetic)"
        ) from None
    return grain


def _stream_seed(seed: int, stream: int, folder: int = 0) -> int:
    """A well-mixed 32-bit seed for one random stream (grain reseeds epochs with seed + epoch)."""
    entropy = [seed, stream] if folder == 0 else [seed, stream, folder]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


class BatchIterator:
    """Batches of one process's rows; `get_state`/`set_state` resume exactly.

    `batches` is a grain MapDataset of local batches (random access by step, read ahead by
    threads) or a plain function of the step (synthetic data, which needs no grain).
    Attributes: split, local_batch_size, seq_len, num_batches (None: endless train stream),
    description (one line for logs).
    """

    def __init__(
        self,
        batches,
        *,
        split: str,
        local_batch_size: int,
        seq_len: int,
        num_batches: int | None,
        description: str,
        fingerprint: str | None = None,
        source: str = "",
    ):
        self._batches = batches
        self.split, self.local_batch_size, self.seq_len = split, local_batch_size, seq_len
        self.num_batches, self.description = num_batches, description
        self.fingerprint, self.source = fingerprint, source  # the data read (data_fingerprint) and its key
        self._step = 0
        self._iterator = None

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> np.ndarray:
        if self.num_batches is not None and self._step >= self.num_batches:
            raise StopIteration
        if callable(self._batches):
            batch = self._batches(self._step)
        else:
            if self._iterator is None:
                grain = _grain()
                # Threads read a few batches ahead; a small buffer bounds host memory.
                options = grain.ReadOptions(num_threads=4, prefetch_buffer_size=8)
                self._iterator = iter(self._batches[self._step :].to_iter_dataset(options))
            batch = next(self._iterator)
        self._step += 1
        return batch

    def get_state(self) -> dict:
        """JSON-serialisable position: the number of batches already returned (and which data, when known)."""
        state = {"split": self.split, "step": self._step}
        return state if self.fingerprint is None else {**state, "data": self.fingerprint}

    def set_state(self, state: dict) -> None:
        """Continue from a `get_state` result (also valid with a different process count)."""
        step = state.get("step") if isinstance(state, dict) else None
        if not isinstance(step, int) or step < 0 or state.get("split", self.split) != self.split:
            raise UserError(f"data iterator state {state!r}: expected {{'split': '{self.split}', 'step': N >= 0}}")
        self._step, self._iterator = step, None


def _synthetic_batches(config: Config, *, seed: int, stream: int, local: int, process_index: int, process_count: int):
    """step -> this process's rows of uniform random tokens; each row a pure function of its global index."""
    vocab, window, draw_key = config.model.vocab_size, config.train.seq_len + 1, _stream_seed(seed, stream)

    def batch_at(step: int) -> np.ndarray:
        # Global sample s * batch + r is row r of step s; this process holds a contiguous block of rows.
        first = (step * process_count + process_index) * local
        return np.stack(
            [
                np.random.default_rng([draw_key, i]).integers(0, vocab, window, dtype=np.int32)
                for i in range(first, first + local)
            ]
        )

    return batch_at


def make_dataset(
    config: Config, *, split: str = "train", process_index: int = 0, process_count: int = 1
) -> BatchIterator:
    """The batch iterator of one process for `split` ('train': endless; 'eval': train.eval_batches)."""
    t = config.train
    if split not in ("train", "eval"):
        raise UserError(f"split={split!r}: expected 'train' or 'eval'")
    if not 0 <= process_index < process_count:
        raise UserError(f"process_index={process_index} is outside 0..{process_count - 1}")
    if t.batch_size % process_count:
        raise UserError(f"train.batch_size={t.batch_size} is not divisible by the {process_count} processes")
    local = t.batch_size // process_count
    seed = 0 if split == "eval" else t.seed  # eval batches are the same whatever the seed
    stream = _EVAL_STREAM if split == "eval" else 0
    num_batches = t.eval_batches if split == "eval" else None
    common = dict(split=split, local_batch_size=local, seq_len=t.seq_len, num_batches=num_batches)

    if config.data.kind == "synthetic":
        batches = _synthetic_batches(
            config, seed=seed, stream=stream, local=local, process_index=process_index, process_count=process_count
        )
        return BatchIterator(batches, description=f"synthetic tokens in [0, {config.model.vocab_size})", **common)

    grain = _grain()
    window = t.seq_len + 1
    folders = data_folders(config)
    weights = [weight for _, weight in folders]
    streams, token_arrays, described = [], [], []
    if len(folders) > 1:
        check_one_tokenizer({str(folder): read_meta(folder) for folder, _ in folders})
    for number, (folder, weight) in enumerate(folders):
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
        # Windows of this folder in a seeded order, reshuffled every epoch; indexable without end.
        streams.append(grain.MapDataset.range(num_windows).shuffle(seed=_stream_seed(seed, stream, number)).repeat())
        token_arrays.append(tokens)
        share = f"{100 * weight / sum(weights):.3g}%: " if len(folders) > 1 else ""
        described.append(f"{share}{len(tokens):,} tokens, {num_windows:,} windows of {window} ({folder})")

    def rows(sample_ids):
        sample_ids = np.asarray(sample_ids)
        if len(folders) == 1:
            sources, indices = np.zeros_like(sample_ids), sample_ids
        else:
            sources, indices = mixture_sources(sample_ids, weights)
        batch = np.empty((len(sample_ids), window), np.int32)
        for row, (source, index) in enumerate(zip(sources, indices)):
            start = streams[source][int(index)] * t.seq_len
            batch[row] = token_arrays[source][start : start + window]  # one positioned read per row
        return batch

    # Global sample s * batch + r is row r of step s: batching by the local size and taking every
    # process_count-th batch gives this process its contiguous rows without touching the others.
    count = num_batches * t.batch_size if num_batches is not None else 2**62
    local_batches = grain.MapDataset.range(count).batch(local)[process_index::process_count].map(rows)
    name = "mixture of " + "; ".join(described) if len(folders) > 1 else described[0]
    fingerprint = data_fingerprint([folder for folder, _ in folders]) if config.data.kind == "shards" else None
    source = f"data.path={config.data.path}" if config.data.path else "data.mixture"
    return BatchIterator(
        local_batches,
        description=f"{config.data.kind} {split}: {name}",
        fingerprint=fingerprint,
        source=source,
        **common,
    )


def data_fingerprint(folders: list[Path]) -> str:
    """16 hex digits naming the token folders' contents: each folder's name (a text cache's names
    hash the files it was made from) and its meta.json (which counts the tokens and, in folders
    made now, holds each split's SHA-256)."""
    digest = hashlib.sha256()
    for folder in folders:
        digest.update(f"{Path(folder).name}\0".encode() + (Path(folder) / "meta.json").read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def check_same_data(saved: dict, batches: BatchIterator, step: int, allow_change: bool) -> str | None:
    """Whether `batches` read the data that checkpoint `step` (its data position `saved`) was read
    from: None when it is (or either side does not say); when it changed, a UserError, or with
    `allow_change` (checkpoint.allow_config_change) the change as words."""
    there = saved.get("data") if isinstance(saved, dict) else None
    if there is None or batches.fingerprint is None or there == batches.fingerprint:
        return None
    change = f"{batches.source}: the data changed since step {step} was saved (an edited or replaced file)"
    if allow_change:
        return change
    raise UserError(
        f"{change}; resuming would continue the run on other data: put the data back, use a new run.dir, "
        f"or set checkpoint.allow_config_change=true"
    )


def vocab_size_note(config: Config, resolved: Config) -> str | None:
    """The console line saying what model.vocab_size=auto took (None when `config` named a number)."""
    if config.model.vocab_size != "auto":
        return None
    data = config.data
    where = f"data.path={data.path}" if data.path else "data.mixture" if data.mixture else "the built-in byte corpus"
    return f"maxmoe: model.vocab_size=auto: {resolved.model.vocab_size:,}, the vocabulary of {where}"


def resolve_vocab_size(config: Config) -> Config:
    """`config` with model.vocab_size=auto replaced by the data's vocabulary size (other values kept).

    The synthetic source has no vocabulary of its own, so it needs a number.
    """
    if config.model.vocab_size != "auto":
        return config
    if config.data.kind == "synthetic":
        raise ConfigError(
            "model.vocab_size=auto takes the vocabulary from the data; data.source=synthetic needs a number"
        )
    model = dataclasses.replace(config.model, vocab_size=vocab_size_of(config))
    resolved = config.replace(model=model)
    validate(resolved)
    return resolved
