"""Token batches for training and evaluation: synthetic, the built-in stdlib corpus, token shards.

    make_dataset(config, split="train", process_index=p, process_count=P) -> BatchIterator

yields numpy int32 arrays [train.batch_size / P, train.seq_len + 1] (inputs are row[:-1],
targets row[1:]). Every batch is a pure function of (train.seed, step, global row): process
p gets rows [p * b, (p + 1) * b) of the global batch, so the data a run sees does not depend
on the mesh shape or the process count, and each process reads only its own rows.

Sources (`data.source`):
- synthetic: uniform random tokens in [0, model.vocab_size), for benchmarks.
- stdlib: the running Python's standard library, byte-level (see `stdlib_files`), cached
  once under data.cache_dir (default ~/.cache/maxmoe) as a token folder.
- shards: a token folder made by `python -m maxmoe.data prepare` (data.path).

A token folder holds `meta.json` and one flat little-endian token file per split
(`train.bin`, `eval.bin`; uint16 when every id fits, else uint32). Documents are split into
train and eval whole, each followed by EOS. Training samples are windows of seq_len + 1
tokens starting at multiples of seq_len, visited in a seeded permutation that is redrawn
every epoch (grain's `MapDataset.shuffle`); eval uses the first train.eval_batches global
batches of a fixed permutation, the same for every run and every seed.

Byte-level vocabulary: byte b -> token b; 256 BOS, 257 EOS, 258 PAD, 259 reserved.
grain is imported only inside the functions that build pipelines.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import sys
import sysconfig
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from maxmoe.config import Config, UserError

BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
BYTE_VOCAB_SIZE = 260
FORMAT = "maxmoe-tokens"
FORMAT_VERSION = 1
# Folders under the stdlib root that are not part of the standard library proper (site-packages)
# or are test suites: large, repetitive, and full of deliberately broken code.
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
_EVAL_STREAM = 1  # key that separates eval randomness from train randomness


# --------------------------------------------------------------------------- token folders


def byte_tokens(data: bytes) -> np.ndarray:
    """Byte-level tokens: byte b -> token b."""
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


def decode_bytes(tokens: Iterable[int]) -> bytes:
    """Bytes of byte-level tokens; special tokens (>= 256) are dropped."""
    array = np.asarray(tokens)
    return array[array < 256].astype(np.uint8).tobytes()


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id below vocab_size."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def eval_documents(names: list[str], eval_fraction: float) -> set[str]:
    """Which documents are held out: a fixed fraction chosen by a hash of each name.

    Hashing names (not positions) keeps a document on the same side of the split when
    other documents are added or removed.
    """
    if not 0 < eval_fraction < 1:
        raise UserError(f"data.eval_fraction={eval_fraction}: must be between 0 and 1 (exclusive)")
    if len(names) < 2:
        return set()
    count = min(len(names) - 1, max(1, round(len(names) * eval_fraction)))
    by_hash = sorted(names, key=lambda n: hashlib.sha256(n.encode()).hexdigest())
    return set(by_hash[:count])


def write_token_folder(
    out_dir: str | Path,
    names: list[str],
    encode: Callable[[str], np.ndarray],
    *,
    vocab_size: int,
    eos_id: int,
    eval_fraction: float,
    info: dict | None = None,
) -> dict:
    """Tokenise documents `names` with `encode` into a token folder at `out_dir`, atomically.

    Documents go whole to train or eval (`eval_documents`), each followed by `eos_id`; with a
    single document its last eval_fraction of tokens is held out instead. The folder is built
    beside `out_dir` and renamed into place, so readers never see a half-written folder; if
    another process got there first, its folder is kept. Returns the meta dict.
    """
    out_dir = Path(out_dir)
    names = sorted(names)
    held_out = eval_documents(names, eval_fraction)
    dtype = token_dtype(vocab_size)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    work.mkdir()
    try:
        counts = {"train": [0, 0], "eval": [0, 0]}  # tokens, documents
        eos = np.array([eos_id], dtype=dtype)
        with open(work / "train.bin", "wb") as train_file, open(work / "eval.bin", "wb") as eval_file:
            files = {"train": train_file, "eval": eval_file}
            for name in names:
                tokens = np.asarray(encode(name))
                if tokens.size == 0:
                    continue
                if tokens.min() < 0 or tokens.max() >= vocab_size:
                    raise UserError(f"{name}: token id {int(tokens.max())} is outside the vocabulary of {vocab_size}")
                tokens = tokens.astype(dtype)
                if len(names) == 1:
                    cut = len(tokens) - max(1, round(len(tokens) * eval_fraction))
                    parts = {"train": tokens[:cut], "eval": tokens[cut:]}
                else:
                    parts = {"eval" if name in held_out else "train": tokens}
                for split, part in parts.items():
                    files[split].write(np.concatenate([part, eos]).astype(dtype.newbyteorder("<")).tobytes())
                    counts[split][0] += len(part) + 1
                    counts[split][1] += 1
        if counts["train"][0] == 0:
            raise UserError(f"empty corpus: the {len(names)} input documents hold no tokens")
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            **(info or {}),
            "vocab_size": int(vocab_size),
            "dtype": dtype.name,
            "eos_id": int(eos_id),
            "token_count": counts["train"][0] + counts["eval"][0],
            "eval_fraction": eval_fraction,
            "splits": {
                split: {"file": f"{split}.bin", "tokens": tokens, "documents": docs}
                for split, (tokens, docs) in counts.items()
            },
        }
        (work / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        try:
            os.rename(work, out_dir)
        except OSError:
            if not (out_dir / "meta.json").is_file():
                raise
            return read_meta(out_dir)  # another process finished the same folder first
        return meta
    finally:
        shutil.rmtree(work, ignore_errors=True)


def read_meta(folder: str | Path) -> dict:
    """The checked meta.json of a token folder; any problem is one UserError line."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"data folder not found: {folder}")
    path = folder / "meta.json"
    if not path.is_file():
        raise UserError(f"{path} not found: not a token folder made by `python -m maxmoe.data prepare`")
    try:
        meta = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{path}: not valid JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UserError(f'{path}: not a maxmoe token folder (expected "format": "{FORMAT}")')
    if meta.get("version") != FORMAT_VERSION:
        raise UserError(f"{path}: format version {meta.get('version')!r}, this maxmoe reads {FORMAT_VERSION}")
    if meta.get("dtype") not in ("uint16", "uint32"):
        raise UserError(f"{path}: dtype {meta.get('dtype')!r}, expected uint16 or uint32")
    vocab = meta.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0 or np.dtype(meta["dtype"]) != token_dtype(vocab):
        raise UserError(f"{path}: vocab_size {vocab!r} does not fit dtype {meta['dtype']}")
    splits = meta.get("splits")
    if not isinstance(splits, dict) or any(not isinstance(splits.get(s), dict) for s in ("train", "eval")):
        raise UserError(f"{path}: missing the train and eval splits")
    return meta


def load_tokens(folder: str | Path, split: str) -> tuple[np.ndarray, dict]:
    """The tokens of one split of a token folder (memory-mapped) and its meta."""
    meta = read_meta(folder)
    entry = meta["splits"][split]
    path = Path(folder) / str(entry.get("file", ""))
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    count = entry.get("tokens")
    if not path.is_file():
        raise UserError(f"{path} not found (listed in {Path(folder) / 'meta.json'})")
    if not isinstance(count, int) or path.stat().st_size != count * dtype.itemsize:
        raise UserError(f"{path}: {path.stat().st_size} bytes, meta.json promises {count!r} {meta['dtype']} tokens")
    if count == 0:
        return np.zeros(0, dtype), meta
    return np.memmap(path, dtype=dtype, mode="r"), meta


# --------------------------------------------------------------------------- the stdlib corpus


def stdlib_files() -> tuple[Path, list[str]]:
    """The stdlib root and its *.py files as sorted relative paths.

    Everything under sysconfig's stdlib path except site-packages and test suites
    (`STDLIB_SKIP_DIRS`): on CPython 3.11 about 1,900 files and 14 MB.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP_DIRS]
        rel = Path(dirpath).relative_to(root)
        names += [(rel / f).as_posix() for f in filenames if f.endswith(".py")]
    return root, sorted(names)


def stdlib_corpus(cache_dir: str, eval_fraction: float) -> Path:
    """The token folder of the stdlib corpus, built on first use.

    Its name carries the Python version and a hash of the file list, file sizes,
    eval_fraction and format version, so a different Python or split gets its own folder.
    """
    root, names = stdlib_files()
    if not names:
        raise UserError(f"empty corpus: no *.py files under the stdlib path {root}")
    eval_documents(names, eval_fraction)  # checks eval_fraction before any work
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, eval_fraction, str(root)]).encode())
    for name in names:
        key.update(f"{name}\0{(root / name).stat().st_size}\n".encode())
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    base = Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "maxmoe"
    folder = base / f"stdlib-{version}-{key.hexdigest()[:12]}"
    if not (folder / "meta.json").is_file():
        write_token_folder(
            folder,
            names,
            lambda name: byte_tokens((root / name).read_bytes()),
            vocab_size=BYTE_VOCAB_SIZE,
            eos_id=EOS_ID,
            eval_fraction=eval_fraction,
            info={
                "source": f"python {sys.version.split()[0]} stdlib at {root}",
                "tokenizer": "byte",
                "bos_id": BOS_ID,
                "pad_id": PAD_ID,
            },
        )
    return folder


# --------------------------------------------------------------------------- batches


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
