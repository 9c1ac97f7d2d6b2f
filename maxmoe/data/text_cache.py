"""`data.path` to text: a file, a glob or a folder of documents, tokenised once into a cached token folder.

    token_folder_for("corpus/notes.txt", tokenizer="byte", text_key="text", eval_fraction=0.05, cache_dir="")

A path that is a token folder (it holds `meta.json`) is used as it is. Anything else names
input documents: one file (`.jsonl[.gz]` one document per line, `.parquet` one per row,
any other file one document), a glob (`'corpus/**/*.jsonl.gz'`), or a folder, whose
`.txt`, `.md`, `.jsonl`, `.jsonl.gz` and `.parquet` files are read (recursively). They are
tokenised into `data.cache_dir/text-<key>` (default ~/.cache/maxmoe), where the key hashes
the files' names and contents, the tokenizer (a tokenizer.json by its content), the text
key, the eval share and the folder format: the same inputs reuse the folder (a resumed run,
a second run), an edited file gets a new one. File contents are hashed once per (path,
size, modification time) and the hash remembered in the cache, so a large corpus is not
read again at every start.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import os
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from maxmoe.config import UserError
from maxmoe.data.prepare import Encoder, tokenized_documents
from maxmoe.data.token_folder import EVAL_SPLIT_RULE, FORMAT_VERSION, check_eval_fraction, write_token_folder

TEXT_SUFFIXES = (".txt", ".md", ".jsonl", ".jsonl.gz", ".parquet")  # what a folder of documents contributes
_HASH_BLOCK = 1 << 22
_PROGRESS_EVERY_S = 2.0
_HASHES_SEEN: dict[tuple, str] = {}  # (path, size, mtime_ns) -> sha256 of the content, this process


def cache_base(cache_dir: str) -> Path:
    """data.cache_dir, or ~/.cache/maxmoe when it is empty."""
    return Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "maxmoe"


def is_token_folder(path: str | Path) -> bool:
    """Whether `path` is a folder with a meta.json (a token folder, checked when it is read)."""
    return (Path(path).expanduser() / "meta.json").is_file()


def input_files(spec: str, label: str = "data.path") -> list[str]:
    """The document files `spec` names (a file, a folder of TEXT_SUFFIXES files, or a glob), sorted.

    A path that exists is that file or folder, even when its name holds glob characters
    (`book[1].txt`); only a path that does not exist is read as a glob.
    """
    path = Path(spec).expanduser()
    if path.is_file():
        files = [str(path)]
    elif path.is_dir():
        files = [
            name
            for name in glob_files(str(path / "**" / "*"))
            if not Path(name).name.startswith(".") and name.lower().endswith(TEXT_SUFFIXES)
        ]
        if not files:
            raise UserError(
                f"{label}={spec}: a folder with no meta.json (not a token folder) and no "
                f"{', '.join(TEXT_SUFFIXES)} files to read"
            )
    elif path.exists():
        raise UserError(f"{label}={spec}: not a regular file or folder (a device, a pipe or a socket)")
    elif glob.has_magic(spec):
        files = glob_files(str(path))
        if not files:
            raise UserError(f"{label}={spec}: no files match")
    else:
        raise UserError(f"{label}={spec}: no such file or folder")
    return sorted(files)


def glob_files(pattern: str) -> list[str]:
    """The regular files matching a glob (`**`: any number of folders), each real folder entered
    once under `**`: a symbolic link back up the tree, or a second link to a folder already read,
    adds nothing (Python's glob follows a loop until the path is too long, reading it again each
    time). Names starting with '.' match only a pattern part that starts with '.', as in glob."""
    parts = Path(pattern).parts
    parts = (*parts, "*") if parts and parts[-1] == "**" else parts  # `a/**`: the files at any depth
    fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    found, entered = [], set()

    def children(folder: Path, part: str) -> list[Path]:
        try:
            names = sorted(os.listdir(folder))
        except OSError:  # unreadable or not a folder: nothing matches under it, as in glob
            return []
        hidden_ok = part.startswith(".")
        return [folder / n for n in names if fnmatch.fnmatchcase(n, part) and (hidden_ok or not n.startswith("."))]

    def walk(path: Path, rest: tuple[str, ...]) -> None:
        if not rest:
            if path.is_file():
                found.append(str(path))
        elif rest[0] == "**":
            real = os.path.realpath(path)
            if real in entered or not path.is_dir():
                return
            entered.add(real)
            walk(path, rest[1:])
            for child in children(path, "*"):
                if child.is_dir():
                    walk(child, rest)
        elif glob.has_magic(rest[0]):
            for child in children(path, rest[0]):
                walk(child, rest[1:])
        else:
            walk(path / rest[0], rest[1:])

    walk(Path(*parts[:fixed]) if fixed else Path(), parts[fixed:])
    return found


def _content_hash(path: str, remembered: dict[str, str]) -> str:
    stat = os.stat(path)
    key = f"{Path(path).resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    if key in remembered:
        return remembered[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    remembered[key] = digest.hexdigest()
    return remembered[key]


def _load_remembered(base: Path) -> dict[str, str]:
    try:
        return {**json.loads((base / "file-hashes.json").read_text()), **_HASHES_SEEN}
    except (OSError, ValueError):
        return dict(_HASHES_SEEN)


def _store_remembered(base: Path, remembered: dict[str, str]) -> None:
    _HASHES_SEEN.update(remembered)
    tmp = base / f".file-hashes.json.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        base.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(remembered))
        os.replace(tmp, base / "file-hashes.json")
    except OSError:
        pass  # only a shortcut: the hashes are recomputed next time
    finally:
        tmp.unlink(missing_ok=True)


def cache_key(files: list[str], tokenizer: str, text_key: str, eval_fraction: float, base: Path) -> str:
    """Hex key of what the token folder depends on: files (names, contents), tokenizer, text key, split, format."""
    remembered = _load_remembered(base)
    before = len(remembered)
    tokenizer_id = tokenizer if tokenizer == "byte" else f"json:{_content_hash(tokenizer, remembered)}"
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, EVAL_SPLIT_RULE, eval_fraction, text_key, tokenizer_id]).encode())
    for name in files:  # names decide the eval split (maxmoe.data.token_folder.eval_split)
        key.update(f"{name}\0{_content_hash(name, remembered)}\n".encode())
    if len(remembered) != before:
        _store_remembered(base, remembered)
    return key.hexdigest()[:16]


def _with_progress(
    documents: Iterator[tuple[str, np.ndarray]], files: list[str], out=None
) -> Iterator[tuple[str, np.ndarray]]:
    """Pass documents through, printing files done and tokens so far every few seconds."""
    out = out or sys.stdout
    order = {name: i for i, name in enumerate(files)}
    tokens = documents_seen = 0
    start = last = time.perf_counter()
    for name, ids in documents:
        tokens += len(ids)
        documents_seen += 1
        now = time.perf_counter()
        if now - last >= _PROGRESS_EVERY_S:
            last = now
            file = name if name in order else name.rsplit(":", 1)[0]  # records are named path:N
            done = order.get(file, 0)
            print(
                f"maxmoe:   {tokens:,} tokens, {documents_seen:,} document{'s' if documents_seen != 1 else ''}, "
                f"file {done + 1} of {len(files)} "
                f"({now - start:.0f}s)",
                file=out,
                flush=True,
            )
        yield name, ids


def token_folder_for(
    spec: str, *, tokenizer: str = "byte", text_key: str = "text", eval_fraction: float = 0.05, cache_dir: str = ""
) -> Path:
    """The token folder that `data.path=spec` trains on: `spec` itself when it is one, else its cached tokens."""
    path = Path(spec).expanduser()
    if is_token_folder(path):
        return path
    files = input_files(spec)
    check_eval_fraction(eval_fraction)
    base = cache_base(cache_dir)
    if tokenizer != "byte" and not Path(tokenizer).expanduser().is_file():
        raise UserError(f"data.tokenizer={tokenizer}: expected 'byte' or the path of a tokenizer.json file")
    tokenizer = tokenizer if tokenizer == "byte" else str(Path(tokenizer).expanduser())
    folder = base / f"text-{cache_key(files, tokenizer, text_key, eval_fraction, base)}"
    if is_token_folder(folder):
        return folder
    size = sum(os.path.getsize(f) for f in files)
    print(
        f"maxmoe: data.path={spec}: tokenising {len(files)} file(s), {size / 1e6:,.1f} MB, with tokenizer "
        f"{tokenizer} into {folder} (once: later runs on the same files reuse it)",
        flush=True,
    )
    start = time.perf_counter()
    try:
        encoder = Encoder(tokenizer)
    except UserError as e:  # its messages name the prepare command's option
        raise UserError(str(e).replace("--tokenizer ", "data.tokenizer=", 1)) from None
    try:
        meta = write_token_folder(
            folder,
            _with_progress(tokenized_documents(files, encoder, workers=os.cpu_count() or 1, text_key=text_key), files),
            vocab_size=encoder.vocab_size,
            eos_id=encoder.eos_id,
            eval_fraction=eval_fraction,
            info={"source": f"{len(files)} file(s) from data.path={spec}", "inputs": files, **encoder.info},
        )
    except OSError as e:
        detail = f"{e.filename}: {e.strerror}" if e.filename else (e.strerror or type(e).__name__)
        raise UserError(f"data.path={spec}: cannot write its token folder under {base} ({detail})") from None
    splits = meta["splits"]
    print(
        f"maxmoe: data.path={spec}: {splits['train']['tokens']:,} train and {splits['eval']['tokens']:,} eval tokens "
        f"in {time.perf_counter() - start:.1f}s",
        flush=True,
    )
    return folder
