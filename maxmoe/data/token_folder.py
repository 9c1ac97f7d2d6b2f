"""Token folders: the on-disk format every token source is read from.

A token folder holds `meta.json` and one flat little-endian token file per split
(`train.bin`, `eval.bin`; uint16 when every id fits, else uint32). Documents go to train or
eval whole (one may be cut, see `eval_split`), each part followed by EOS.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from maxmoe.config import UserError

FORMAT = "maxmoe-tokens"
FORMAT_VERSION = 1
EVAL_SPLIT_RULE = "tokens"  # eval_split holds out a share of tokens (earlier folders: a share of documents)


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id below vocab_size."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def check_eval_fraction(eval_fraction: float) -> None:
    """A UserError unless 0 < eval_fraction < 1."""
    if not 0 < eval_fraction < 1:
        raise UserError(f"data.eval_fraction={eval_fraction}: must be between 0 and 1 (exclusive)")


def eval_split(names: list[str], lengths: list[int], eval_fraction: float) -> dict[int, int]:
    """Which tokens are held out for eval: {document index: tokens at its end that go to eval}.

    Documents are taken whole, in the order of a hash of their names, until eval holds
    round(eval_fraction x all tokens); the document that crosses that line is cut and only
    its tail held out, so the eval share is met to the token however large the documents
    are (with one document, its last eval_fraction). Each split gets at least one token.
    """
    check_eval_fraction(eval_fraction)
    total = sum(lengths)
    if total < 2:
        return {}
    needed = min(total - 1, max(1, round(total * eval_fraction)))
    held = {}
    for index in sorted(range(len(names)), key=lambda i: hashlib.sha256(names[i].encode()).hexdigest()):
        if needed == 0:
            break
        take = min(lengths[index], needed)
        if take:
            held[index] = take
            needed -= take
    return held


def write_token_folder(
    out_dir: str | Path,
    documents: Iterable[tuple[str, np.ndarray]],
    *,
    vocab_size: int,
    eos_id: int,
    eval_fraction: float,
    info: dict | None = None,
) -> dict:
    """Write (name, token ids) documents into a token folder at `out_dir`, atomically.

    Documents keep their order; each goes to train or eval whole, except the one that
    `eval_split` cuts, and each part is followed by `eos_id`. The tokens are first written
    to a scratch file (the split needs every document's length), then to `train.bin` and
    `eval.bin`. The folder is built beside `out_dir` and renamed into place, so readers never
    see a half-written folder; if another process got there first, its folder is kept.
    Returns the meta dict.
    """
    check_eval_fraction(eval_fraction)
    out_dir = Path(out_dir)
    dtype = token_dtype(vocab_size)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    work.mkdir()
    try:
        names, lengths = [], []
        with open(work / "all.tmp", "wb") as scratch:
            for name, tokens in documents:
                tokens = np.asarray(tokens)
                if tokens.size == 0:
                    continue
                if tokens.min() < 0 or tokens.max() >= vocab_size:
                    bad = int(tokens.max() if tokens.max() >= vocab_size else tokens.min())
                    raise UserError(f"{name}: token id {bad} is outside the vocabulary of {vocab_size}")
                scratch.write(tokens.astype(dtype.newbyteorder("<")).tobytes())
                names.append(name)
                lengths.append(int(tokens.size))
        if not names:
            raise UserError("empty corpus: the input documents hold no tokens")
        held = eval_split(names, lengths, eval_fraction)
        counts = {"train": [0, 0], "eval": [0, 0]}  # tokens, documents
        eos = np.array([eos_id], dtype=dtype.newbyteorder("<"))
        stream = np.memmap(work / "all.tmp", dtype=dtype.newbyteorder("<"), mode="r")
        hashes = {"train": hashlib.sha256(), "eval": hashlib.sha256()}  # what a resume checks it reads
        with open(work / "train.bin", "wb") as train_file, open(work / "eval.bin", "wb") as eval_file:
            files = {"train": train_file, "eval": eval_file}
            start = 0
            for index, length in enumerate(lengths):
                cut = length - held.get(index, 0)
                for split, part in (
                    ("train", stream[start : start + cut]),
                    ("eval", stream[start + cut : start + length]),
                ):
                    if part.size:
                        data = np.concatenate([part, eos]).tobytes()
                        files[split].write(data)
                        hashes[split].update(data)
                        counts[split][0] += part.size + 1
                        counts[split][1] += 1
                start += length
        del stream
        os.remove(work / "all.tmp")
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            **(info or {}),
            "vocab_size": int(vocab_size),
            "dtype": dtype.name,
            "eos_id": int(eos_id),
            "token_count": counts["train"][0] + counts["eval"][0],
            # Each split's `documents` counts the parts its file holds (each followed by EOS); the
            # document cut between the splits is a part of both and one of `documents`.
            "documents": len(names),
            "cut_documents": sum(0 < held.get(index, 0) < length for index, length in enumerate(lengths)),
            "eval_fraction": eval_fraction,
            "eval_split": EVAL_SPLIT_RULE,
            "splits": {
                split: {
                    "file": f"{split}.bin",
                    "tokens": tokens,
                    "documents": docs,
                    "sha256": hashes[split].hexdigest(),
                }
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


class TokenFile:
    """One split's tokens, read from the file on demand (positioned reads, never a memory map).

    A memory-mapped file that shrinks under a reader kills the process with SIGBUS; a read
    here that comes back short is a UserError naming the file instead. Slices with step 1
    read just their range; `np.asarray(tokens)` reads the whole file.
    """

    def __init__(self, path: Path, dtype: np.dtype, count: int):
        self.path, self.dtype, self.size = Path(path), np.dtype(dtype), count
        self.shape, self.ndim = (count,), 1
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)

    def __len__(self) -> int:
        return self.size

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as an array (clipped to the file's promised length, as slices are)."""
        start, stop = max(0, min(start, self.size)), max(0, min(stop, self.size))
        want = max(0, stop - start) * self.dtype.itemsize
        data = os.pread(self._fd, want, start * self.dtype.itemsize) if want else b""
        if len(data) != want:
            now = os.fstat(self._fd).st_size
            raise UserError(
                f"{self.path} changed while it was being read: {now} bytes now, meta.json promises "
                f"{self.size} tokens ({self.size * self.dtype.itemsize} bytes); a token folder must not "
                f"change while a run reads it (checkpoints already written stand)"
            )
        return np.frombuffer(data, self.dtype)

    def __getitem__(self, key):
        if isinstance(key, slice) and key.step in (None, 1):
            start, stop, _ = key.indices(self.size)
            return self.read(start, stop)
        if isinstance(key, (int, np.integer)):
            index = int(key) + (self.size if key < 0 else 0)
            if not 0 <= index < self.size:
                raise IndexError(f"token {key} is outside the {self.size} tokens of {self.path}")
            return self.read(index, index + 1)[0]
        return np.asarray(self)[key]

    def __array__(self, dtype=None, copy=None):  # noqa: ARG002 - numpy's protocol; always a new array
        tokens = self.read(0, self.size)
        return tokens if dtype is None else tokens.astype(dtype)

    def max(self) -> int:
        """The largest token id, read in blocks (bounded memory whatever the file size); -1 when empty."""
        return max((int(self.read(i, i + _SCAN_BLOCK).max()) for i in range(0, self.size, _SCAN_BLOCK)), default=-1)

    def __del__(self):
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)


# Largest token id of each token file already read: (path, size, mtime) -> id. Evaluation reopens
# the eval split every time; the scan runs once per file and process.
_MAX_ID_SEEN: dict[tuple, int] = {}
_SCAN_BLOCK = 1 << 24  # tokens per block of the scan: bounded memory whatever the file size


def _largest_id(path: Path, tokens: TokenFile) -> int:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key not in _MAX_ID_SEEN:
        _MAX_ID_SEEN[key] = tokens.max()
    return _MAX_ID_SEEN[key]


def load_tokens(folder: str | Path, split: str) -> tuple[TokenFile | np.ndarray, dict]:
    """The tokens of one split of a token folder (a TokenFile, read on demand) and its meta.

    The split's file must be a plain name inside the folder, hold exactly the promised number
    of tokens, and every id must be below the folder's vocab_size (checked once per file).
    """
    meta = read_meta(folder)
    entry = meta["splits"][split]
    name = entry.get("file")
    meta_path = Path(folder) / "meta.json"
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise UserError(f"{meta_path}: the {split} split names {name!r}; expected a file name inside the folder")
    path = Path(folder) / name
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    count = entry.get("tokens")
    if not path.is_file():
        raise UserError(f"{path} not found (listed in {meta_path})")
    if not isinstance(count, int) or path.stat().st_size != count * dtype.itemsize:
        raise UserError(f"{path}: {path.stat().st_size} bytes, meta.json promises {count!r} {meta['dtype']} tokens")
    if count == 0:
        return np.zeros(0, dtype), meta
    tokens = TokenFile(path, dtype, count)
    largest = _largest_id(path, tokens)
    if largest >= meta["vocab_size"]:
        raise UserError(
            f"{path}: token id {largest} is outside the vocabulary of {meta['vocab_size']} (meta.json vocab_size); "
            f"the folder was written with another tokenizer or is damaged"
        )
    return tokens, meta
