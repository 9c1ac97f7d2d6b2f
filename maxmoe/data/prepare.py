"""Tokenise documents into a token folder, in parallel worker processes.

    prepare_folder(out, files, tokenizer="byte", workers=8, eval_fraction=0.05, text_key="text")

Documents are read in the main process (sorted files, then file order), sent in chunks to
`workers` processes that tokenise them, and written back in the order they were read, so
the folder is the same byte for byte whatever the number of workers. Tokenizers: `byte`
(byte b -> token b, EOS 257, vocabulary 260) or a Hugging Face tokenizer.json (needs the
`tokenizers` package), whose full vocabulary size (added tokens included) goes into
meta.json for training to check or take (`model.vocab_size=auto`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import multiprocessing
import os
import signal
from collections.abc import Iterable, Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from maxmoe.config import UserError
from maxmoe.data.byte_tokenizer import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID, byte_tokens
from maxmoe.data.documents import read_documents
from maxmoe.data.token_folder import write_token_folder

# Names of end-of-document tokens in common tokenizers, tried in order when --eos-token is not given.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<｜end▁of▁sentence｜>", "[SEP]")
CHUNK_CHARS = 1 << 20  # about 1 MB of text per task: large enough to amortise the transfer


class Encoder:
    """Tokenises lists of texts with `byte` or a tokenizer.json; knows the vocabulary and EOS id."""

    def __init__(self, spec: str, eos_token: str = ""):
        self.spec, self.eos_token = spec, eos_token
        if spec == "byte":
            if eos_token:
                raise UserError("--eos-token applies to a tokenizer.json; the byte tokenizer's EOS is 257")
            self.tokenizer, self.vocab_size, self.eos_id = None, BYTE_VOCAB_SIZE, EOS_ID
            self.info = {"tokenizer": "byte", "bos_id": BOS_ID, "pad_id": PAD_ID}
            return
        if not Path(spec).is_file():
            raise UserError(f"--tokenizer {spec}: expected 'byte' or the path of a tokenizer.json file")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError(f"--tokenizer {spec} needs the `tokenizers` package: pip install tokenizers") from None
        try:
            self.tokenizer = Tokenizer.from_file(spec)
        except Exception as e:  # the library raises plain Exception for malformed files
            first = str(e).splitlines()[0] if str(e) else repr(e)
            raise UserError(f"--tokenizer {spec}: cannot load it ({first})") from None
        names = [eos_token] if eos_token else list(EOS_CANDIDATES)
        eos_id = next((i for i in map(self.tokenizer.token_to_id, names) if i is not None), None)
        if eos_id is None:
            wanted = f"has no token {eos_token!r}" if eos_token else f"has none of {', '.join(EOS_CANDIDATES)}"
            raise UserError(f"--tokenizer {spec} {wanted}; name its end-of-document token with --eos-token")
        self.vocab_size, self.eos_id = self.tokenizer.get_vocab_size(with_added_tokens=True), eos_id
        self.info = {"tokenizer": str(Path(spec).resolve())}

    def encode(self, texts: list[str | bytes]) -> list[np.ndarray]:
        """Token ids of each text (bytes are UTF-8; invalid sequences become U+FFFD for a tokenizer.json)."""
        if self.tokenizer is None:
            return [byte_tokens(t if isinstance(t, bytes) else t.encode("utf-8")) for t in texts]
        strings = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
        return [np.asarray(e.ids, np.int64) for e in self.tokenizer.encode_batch(strings, add_special_tokens=False)]


_worker_encoder: Encoder | None = None


def _start_worker(spec: str, eos_token: str) -> None:
    global _worker_encoder
    # Ctrl-C reaches the whole process group; the main process stops the work and cleans up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _worker_encoder = Encoder(spec, eos_token)


def _encode_in_worker(texts: list[str | bytes]) -> list[np.ndarray]:
    return _worker_encoder.encode(texts)


def _chunks(
    documents: Iterable[tuple[str, str | bytes]], chunk_chars: int
) -> Iterator[tuple[list[str], list[str | bytes]]]:
    names, texts, size = [], [], 0
    for name, text in documents:
        names.append(name)
        texts.append(text)
        size += len(text)
        if size >= chunk_chars:
            yield names, texts
            names, texts, size = [], [], 0
    if names:
        yield names, texts


def tokenized_documents(
    files: list[str], encoder: Encoder, *, workers: int = 1, text_key: str = "text", chunk_chars: int = CHUNK_CHARS
) -> Iterator[tuple[str, np.ndarray]]:
    """(name, token ids) of every document of `files`, in reading order, tokenised by `workers` processes.

    Input that fits in one chunk (`chunk_chars` characters) is tokenised here: starting
    processes would cost more than it saves.
    """
    chunks = _chunks((doc for path in files for doc in read_documents(path, text_key)), chunk_chars)
    first = next(chunks, None)
    second = next(chunks, None)
    chunks = itertools.chain([c for c in (first, second) if c is not None], chunks)
    if workers <= 1 or second is None:
        for names, texts in chunks:
            yield from zip(names, encoder.encode(texts))
        return
    try:
        yield from _tokenized_in_workers(chunks, encoder, workers)
    except BrokenProcessPool:
        raise UserError(
            f"a tokenising worker process died (killed, or out of memory); try fewer --workers than {workers}"
        ) from None


def _tokenized_in_workers(chunks, encoder: Encoder, workers: int) -> Iterator[tuple[str, np.ndarray]]:
    context = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    with concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(encoder.spec, encoder.eos_token)
    ) as pool:
        pending = collections.deque()
        for names, texts in chunks:
            pending.append((names, pool.submit(_encode_in_worker, texts)))
            if len(pending) >= 2 * workers:  # bounded read-ahead: memory stays a few chunks per worker
                names_done, future = pending.popleft()
                yield from zip(names_done, future.result())
        while pending:
            names_done, future = pending.popleft()
            yield from zip(names_done, future.result())


def prepare_folder(
    out: str | Path,
    files: list[str],
    *,
    tokenizer: str = "byte",
    eos_token: str = "",
    workers: int = 1,
    eval_fraction: float = 0.05,
    text_key: str = "text",
    source: str = "",
    chunk_chars: int = CHUNK_CHARS,
) -> dict:
    """Tokenise `files` into a token folder at `out`; returns its meta."""
    encoder = Encoder(tokenizer, eos_token)
    if eos_token:
        encoder.info["eos_token"] = eos_token
    return write_token_folder(
        out,
        tokenized_documents(files, encoder, workers=workers, text_key=text_key, chunk_chars=chunk_chars),
        vocab_size=encoder.vocab_size,
        eos_id=encoder.eos_id,
        eval_fraction=eval_fraction,
        info={"source": source or f"{len(files)} files", **encoder.info},
    )
