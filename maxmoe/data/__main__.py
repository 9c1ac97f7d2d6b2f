"""Make and inspect token folders for `data.source: shards`.

    python -m maxmoe.data prepare --input 'corpus/**/*.txt' --tokenizer byte --out data/corpus
    python -m maxmoe.data prepare --input 'web/*.jsonl.gz' --input 'books/*.parquet' \
        --tokenizer tok/tokenizer.json --text-key text --workers 8 --out data/web
    python -m maxmoe.data stats data/corpus     # or no folder: the built-in stdlib corpus

`prepare` tokenises every file the --input globs match (.jsonl / .jsonl.gz: one document per
line; .parquet: one per row; any other file: one document) in --workers processes, holds out
--eval-fraction of the tokens as whole documents, and writes train.bin, eval.bin and meta.json;
the output does not depend on the number of workers. Train with `data.path=OUT`.
docs/ARCHITECTURE.md, "Data", has the details.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path

from maxmoe.cli import _Parser, check_new_folder, main_guard, path_argument
from maxmoe.config import UserError
from maxmoe.data import load_tokens, read_meta, stdlib_corpus
from maxmoe.data.prepare import prepare_folder
from maxmoe.data.text_cache import glob_files

MAX_WORKERS = max(256, 2 * (os.cpu_count() or 1))  # more processes than this only thrash


class Terminated(BaseException):
    """SIGTERM arrived; raised where the main process is, so unfinished output is removed on the way out."""


@contextlib.contextmanager
def _sigterm_raises():
    """Within: SIGTERM raises Terminated (the default action would kill the process mid-write)."""

    def handler(signum, frame):
        raise Terminated

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _input_files(patterns: list[str]) -> list[str]:
    files: set[str] = set()
    for pattern in patterns:
        matched = [pattern] if Path(pattern).is_file() else glob_files(pattern)  # a file's name may hold [ ]
        if not matched:
            if Path(pattern).is_dir():
                raise UserError(f"--input {pattern} is a folder; give a glob, e.g. '{pattern.rstrip('/')}/**/*.jsonl'")
            if Path(pattern).exists():
                raise UserError(f"--input {pattern}: not a regular file (a device, a pipe or a socket)")
            raise UserError(f"--input {pattern}: no files match")
        files.update(matched)
    return sorted(files)


def prepare(args: argparse.Namespace) -> None:
    """Tokenise the input files into a token folder at args.out."""
    out = Path(args.out)
    if args.workers < 1 or args.workers > MAX_WORKERS:
        raise UserError(f"--workers {args.workers}: expected a number of processes from 1 to {MAX_WORKERS}")
    if not 0 < args.eval_fraction < 1:  # also false for nan
        raise UserError(f"--eval-fraction {args.eval_fraction}: must be between 0 and 1 (exclusive)")
    files = _input_files(args.input)
    check_new_folder(out, empty_ok=False)
    meta = prepare_folder(
        out,
        files,
        tokenizer=args.tokenizer,
        eos_token=args.eos_token,
        workers=args.workers,
        eval_fraction=args.eval_fraction,
        text_key=args.text_key,
        source=f"{len(files)} files from {', '.join(args.input)}",
    )
    _print_stats(out, meta)


def _print_stats(folder: Path, meta: dict) -> None:
    print(f"{folder}: {meta.get('source', '?')}")
    print(
        f"  tokenizer {meta.get('tokenizer', '?')}, vocab {meta['vocab_size']}, {meta['dtype']}, "
        f"EOS {meta.get('eos_id')}"
    )
    cut = meta.get("cut_documents")  # the document cut between the splits, counted once: in train
    cut = cut if isinstance(cut, int) and cut > 0 else 0
    for split, entry in meta["splits"].items():
        documents = entry.get("documents", 0) - (cut if split == "eval" else 0)
        where = {"train": " (one cut: its tail is in eval)", "eval": " and the tail of the one cut"}
        note = where.get(split, "") if cut else ""
        print(f"  {split:5s} {entry.get('tokens', 0):>14,} tokens  {_documents(documents, 8)}{note}")
    if isinstance(meta.get("documents"), int):
        print(f"  {_documents(meta['documents'])} in all")


def _documents(count, width: int = 0) -> str:
    return f"{count:>{width},} document" + ("" if count == 1 else "s")


@main_guard
def main(argv: list[str] | None = None) -> int:
    """`python -m maxmoe.data prepare|stats`; returns the exit status."""
    parser = _Parser(prog="python -m maxmoe.data", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", parser_class=_Parser)
    make = commands.add_parser("prepare", help="tokenise files into a token folder")
    make.add_argument(
        "--input",
        action="append",
        type=path_argument,
        required=True,
        metavar="GLOB",
        help="files to read: .txt (or any) one document each, .jsonl[.gz] one per line, .parquet one per row "
        "('**' recurses); repeat for more",
    )
    make.add_argument(
        "--tokenizer", default="byte", metavar="byte|PATH", help="'byte' (default) or a Hugging Face tokenizer.json"
    )
    make.add_argument("--out", type=path_argument, required=True, metavar="DIR", help="the token folder to create")
    make.add_argument("--eval-fraction", type=float, default=0.05, help="share of the tokens held out for eval")
    make.add_argument("--text-key", default="text", help="the text field of .jsonl records and .parquet rows")
    make.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="tokenising processes (default: one per CPU); the output is the same for any number",
    )
    make.add_argument("--eos-token", default="", help="end-of-document token of a tokenizer.json")
    show = commands.add_parser("stats", help="describe a token folder")
    show.add_argument(
        "folder", nargs="?", type=path_argument, metavar="DIR", help="token folder; default: the stdlib corpus"
    )
    show.add_argument("--path", type=path_argument, metavar="DIR", help="the same as DIR")
    show.add_argument("--cache-dir", default="", metavar="DIR", help="stdlib cache parent (data.cache_dir)")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error("expected a command: prepare or stats (see --help)")
    try:
        with _sigterm_raises():
            if args.command == "prepare":
                prepare(args)
            else:
                if args.folder and args.path and args.folder != args.path:
                    raise UserError(f"stats: two folders given ({args.folder} and --path {args.path}); give one")
                named = args.folder or args.path
                folder = Path(named) if named else stdlib_corpus(args.cache_dir, 0.05)
                for split in ("train", "eval"):  # the checks training makes: a folder it refuses is refused here
                    load_tokens(folder, split)
                _print_stats(folder, read_meta(folder))
    except Terminated:
        print("maxmoe: stopped by SIGTERM; nothing was written", file=sys.stderr)
        return 128 + signal.SIGTERM
    except OSError as e:
        raise UserError(f"{_where(e, args)}{e.strerror or e}") from None
    return 0


def _where(error: OSError, args: argparse.Namespace) -> str:
    """'NAME: ' for an OSError's file; the token folder's scratch space beside --out is called --out."""
    name = str(error.filename or "")
    out = getattr(args, "out", None)
    if out and Path(name).name.startswith(f".{Path(out).name}.tmp-"):
        return f"--out {out}: "
    return f"{name}: " if name else ""


if __name__ == "__main__":
    sys.exit(main())
