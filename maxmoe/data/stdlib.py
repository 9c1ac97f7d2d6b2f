"""The built-in corpus: the running Python's standard library as byte tokens, cached once."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

from maxmoe.config import UserError
from maxmoe.data.byte_tokenizer import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID, byte_tokens
from maxmoe.data.token_folder import EVAL_SPLIT_RULE, FORMAT_VERSION, check_eval_fraction, write_token_folder

# Folders under the stdlib root that are not part of the standard library proper (site-packages)
# or are test suites: large, repetitive, and full of deliberately broken code.
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


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
    eval_fraction, format version and eval split rule, so a different Python or split gets
    its own folder.
    """
    root, names = stdlib_files()
    if not names:
        raise UserError(f"empty corpus: no *.py files under the stdlib path {root}")
    check_eval_fraction(eval_fraction)
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, EVAL_SPLIT_RULE, eval_fraction, str(root)]).encode())
    for name in names:
        key.update(f"{name}\0{(root / name).stat().st_size}\n".encode())
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    base = Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "maxmoe"
    folder = base / f"stdlib-{version}-{key.hexdigest()[:12]}"
    if (folder / "meta.json").is_file():
        return folder
    try:
        write_token_folder(
            folder,
            ((name, byte_tokens((root / name).read_bytes())) for name in names),
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
    except OSError as e:
        where = f"data.cache_dir={cache_dir}" if cache_dir else f"the token cache {base} (data.cache_dir)"
        detail = f"{e.filename}: {e.strerror}" if e.filename else (e.strerror or type(e).__name__)
        raise UserError(f"{where}: cannot build the stdlib token cache ({detail})") from None
    return folder
