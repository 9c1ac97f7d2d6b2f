"""Token folders: the on-disk format every token source is read from.

A token folder holds `meta.json` and one flat little-endian token file per split
(`train.bin`, `eval.bin`; uint16 when every id fits, else uint32). Documents are split into
train and eval whole, each followed by EOS.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from maxmoe.config import UserError

FORMAT = "maxmoe-tokens"
FORMAT_VERSION = 1


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
