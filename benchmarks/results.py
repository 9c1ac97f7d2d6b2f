"""How a benchmark times and records itself: mean seconds per call, the command line that ran it,
and its rows as JSON rewritten after every measurement, so a run cut off by its time limit keeps
what it measured."""

import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path


def timed(fn, args, repeats):
    """Mean seconds per call of fn(*args) after one warm-up call."""
    import jax

    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def command_line() -> str:
    """This process's command, runnable as printed (PYTHONPATH included)."""
    words = [f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}", sys.executable, *sys.argv]
    return " ".join(shlex.quote(w) for w in words)


def rows_writer(path: str | None, **fields) -> Callable[[list], None]:
    """write(rows): `fields` and the rows so far into JSON file `path` (nothing without a path)."""

    def write(rows: list) -> None:
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps({**fields, "rows": rows}, indent=1))

    return write
