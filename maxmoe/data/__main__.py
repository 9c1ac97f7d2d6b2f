"""Make and inspect token folders for `data.source: shards`.

    python -m maxmoe.data prepare --input 'corpus/**/*.txt' --tokenizer byte --out data/corpus
    python -m maxmoe.data prepare --input 'docs/*.md' --tokenizer tok/tokenizer.json --out data/docs
    python -m maxmoe.data stats --path data/corpus     # or no --path: the built-in stdlib corpus

`prepare` reads every file matched by the --input globs (one document per file, sorted by
path), tokenises it (`byte`: byte b -> token b with EOS 257 and vocabulary 260; or a
Hugging Face tokenizer.json, which needs the `tokenizers` package), holds out whole
documents for eval (--eval-fraction) and writes `train.bin`, `eval.bin` and `meta.json`
(format in maxmoe.data.token_folder). Train with `data.source=shards data.path=OUT`.
"""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

import numpy as np

from maxmoe.cli import _Parser, main_guard
from maxmoe.config import UserError
from maxmoe.data import (
    BOS_ID,
    BYTE_VOCAB_SIZE,
    EOS_ID,
    PAD_ID,
    byte_tokens,
    read_meta,
    stdlib_corpus,
    write_token_folder,
)

# Names of end-of-document tokens in common tokenizers, tried in order when --eos-token is not given.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<｜end▁of▁sentence｜>", "[SEP]")


def _input_files(patterns: list[str]) -> list[str]:
    files: set[str] = set()
    for pattern in patterns:
        matched = [p for p in glob.glob(pattern, recursive=True) if Path(p).is_file()]
        if not matched:
            raise UserError(f"--input {pattern}: no files match")
        files.update(matched)
    return sorted(files)


def _tokenizer(spec: str, eos_token: str):
    """(encode(path) -> ids, vocab_size, eos_id, meta info) for `byte` or a tokenizer.json path."""
    if spec == "byte":
        if eos_token:
            raise UserError("--eos-token applies to a tokenizer.json; the byte tokenizer's EOS is 257")
        return (
            lambda path: byte_tokens(Path(path).read_bytes()),
            BYTE_VOCAB_SIZE,
            EOS_ID,
            {"tokenizer": "byte", "bos_id": BOS_ID, "pad_id": PAD_ID},
        )
    if not Path(spec).is_file():
        raise UserError(f"--tokenizer {spec}: expected 'byte' or the path of a tokenizer.json file")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError(f"--tokenizer {spec} needs the `tokenizers` package: pip install tokenizers") from None
    try:
        tokenizer = Tokenizer.from_file(spec)
    except Exception as e:  # the library raises plain Exception for malformed files
        raise UserError(f"--tokenizer {spec}: cannot load it ({str(e).splitlines()[0] if str(e) else e!r})") from None
    names = [eos_token] if eos_token else list(EOS_CANDIDATES)
    eos_id = next((i for i in map(tokenizer.token_to_id, names) if i is not None), None)
    if eos_id is None:
        wanted = f"has no token {eos_token!r}" if eos_token else f"has none of {', '.join(EOS_CANDIDATES)}"
        raise UserError(f"--tokenizer {spec} {wanted}; name its end-of-document token with --eos-token")

    def encode(path):
        text = Path(path).read_bytes().decode("utf-8", errors="replace")
        return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    return encode, tokenizer.get_vocab_size(with_added_tokens=True), eos_id, {"tokenizer": str(Path(spec).resolve())}


def prepare(args: argparse.Namespace) -> None:
    """Tokenise the input files into a token folder at args.out."""
    out = Path(args.out)
    if out.exists():
        raise UserError(f"--out {out} already exists; remove it or choose another folder")
    files = _input_files(args.input)
    encode, vocab_size, eos_id, info = _tokenizer(args.tokenizer, args.eos_token)
    meta = write_token_folder(
        out,
        files,
        encode,
        vocab_size=vocab_size,
        eos_id=eos_id,
        eval_fraction=args.eval_fraction,
        info={"source": f"{len(files)} files from {', '.join(args.input)}", **info},
    )
    _print_stats(out, meta)


def _print_stats(folder: Path, meta: dict) -> None:
    print(f"{folder}: {meta.get('source', '?')}")
    print(
        f"  tokenizer {meta.get('tokenizer', '?')}, vocab {meta['vocab_size']}, {meta['dtype']}, "
        f"EOS {meta.get('eos_id')}"
    )
    for split, entry in meta["splits"].items():
        print(f"  {split:5s} {entry.get('tokens', 0):>14,} tokens  {entry.get('documents', 0):>8,} documents")


@main_guard
def main(argv: list[str] | None = None) -> int:
    """`python -m maxmoe.data prepare|stats`; returns the exit status."""
    parser = _Parser(prog="python -m maxmoe.data", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", parser_class=_Parser)
    make = commands.add_parser("prepare", help="tokenise files into a token folder")
    make.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="GLOB",
        help="files to read, one document each ('**' recurses); repeat for more",
    )
    make.add_argument(
        "--tokenizer", default="byte", metavar="byte|PATH", help="'byte' (default) or a Hugging Face tokenizer.json"
    )
    make.add_argument("--out", required=True, metavar="DIR", help="the token folder to create")
    make.add_argument("--eval-fraction", type=float, default=0.05, help="documents held out for eval")
    make.add_argument("--eos-token", default="", help="end-of-document token of a tokenizer.json")
    show = commands.add_parser("stats", help="describe a token folder")
    show.add_argument("--path", default="", metavar="DIR", help="token folder; default: the stdlib corpus")
    show.add_argument("--cache-dir", default="", metavar="DIR", help="stdlib cache parent (data.cache_dir)")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error("expected a command: prepare or stats (see --help)")
    try:
        if args.command == "prepare":
            prepare(args)
        else:
            folder = Path(args.path) if args.path else stdlib_corpus(args.cache_dir, 0.05)
            _print_stats(folder, read_meta(folder))
    except OSError as e:
        raise UserError(f"{e.filename or ''}: {e.strerror or e}".lstrip(": ")) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
