"""Documents of input files, by file type: plain text, JSON lines (optionally gzipped), Parquet.

    for name, text in read_documents("corpus/part-0.jsonl.gz", text_key="text"): ...

- `.jsonl`, `.jsonl.gz`: one document per line, the string under `text_key`;
- `.parquet`: one document per row, the string column `text_key` (needs pyarrow, imported
  only here: `pip install 'maxmoe[data]'`);
- anything else: the whole file is one document, read as bytes.

Names are `path` for whole files and `path:N` (line or row N, from 1) for records; they
decide which documents are held out for eval. Null texts are empty documents (skipped
later). Malformed records, and JSON lines that are not UTF-8, are one-line UserErrors naming
the file and line.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

from maxmoe.config import UserError

FORMATS = {".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".parquet": "parquet"}  # suffix -> format; others: text


def document_format(path: str) -> str:
    """'jsonl', 'parquet' or 'text' (one document per file), from the file name."""
    name = Path(path).name.lower()
    return next((kind for suffix, kind in FORMATS.items() if name.endswith(suffix)), "text")


def read_documents(path: str, text_key: str = "text") -> Iterator[tuple[str, str | bytes]]:
    """(name, text) of every document in `path`, in file order."""
    kind = document_format(path)
    if kind == "text":
        yield path, Path(path).read_bytes()
    elif kind == "jsonl":
        yield from _jsonl_documents(path, text_key)
    else:
        yield from _parquet_documents(path, text_key)


def _text_of(value, where: str, text_key: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise UserError(f"{where}: {text_key!r} holds a {type(value).__name__}, expected a string")
    return value


def _jsonl_documents(path: str, text_key: str) -> Iterator[tuple[str, str]]:
    """Records of a JSON-lines file: UTF-8 text (a byte order mark at the start is skipped); a
    line that is not UTF-8 is refused, never read with replacement characters."""
    opener = gzip.open if path.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as lines:
            for number, raw in enumerate(lines, start=1):
                where = f"{path}:{number}"
                try:
                    line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    raise UserError(f"{where}: not UTF-8 text (byte {e.start + 1} of the line)") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    raise UserError(f"{where}: not a valid JSON line") from None
                except RecursionError:  # the decoder recurses once per level of nesting
                    raise UserError(f"{where}: JSON nested too deeply to read") from None
                if not isinstance(record, dict) or text_key not in record:
                    keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                    raise UserError(
                        f"{where}: no key {text_key!r} (found: {keys}); name the text field with --text-key"
                    )
                yield where, _text_of(record[text_key], where, text_key)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise UserError(f"{path}: not a readable gzip file ({e})") from None


def _parquet_documents(path: str, text_key: str) -> Iterator[tuple[str, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path}: reading .parquet needs pyarrow: pip install 'maxmoe[data]'") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid for files that are not Parquet
        raise UserError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    columns = table.schema_arrow.names
    if text_key not in columns:
        raise UserError(f"{path}: no column {text_key!r} (found: {', '.join(columns)}); name it with --text-key")
    row = 0
    batches = table.iter_batches(batch_size=1024, columns=[text_key])
    while True:
        try:
            batch = next(batches, None)
        except Exception as e:  # pyarrow's own error types for a damaged row group or page
            raise UserError(f"{path}: unreadable after row {row} ({str(e).splitlines()[0][:200]})") from None
        if batch is None:
            return
        for value in batch.column(0).to_pylist():
            row += 1
            where = f"{path}:{row}"
            yield where, _text_of(value, where, text_key)
