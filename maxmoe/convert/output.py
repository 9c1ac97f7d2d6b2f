"""The output folder of a conversion: checked before any work, removed again if writing fails.

    maxmoe.cli.check_new_folder(out)   new or empty, and creatable where it is named (first)
    with removed_on_failure(out): ...  whatever was written is removed on an error or a signal
    storage_error(e)                   "No space left on device" etc. for an error while writing

A conversion that fails half-way leaves nothing behind, so the same command can simply be
run again (after freeing space, say) instead of being refused for a non-empty folder.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

# What a failed write says, whether Python (OSError) or tensorstore (ValueError, message) reports it.
_STORAGE_PROBLEMS = re.compile(
    r"No space left on device|Disk quota exceeded|Read-only file system|Permission denied|"
    r"Operation not permitted|File too large|Input/output error"
)


@contextlib.contextmanager
def removed_on_failure(out: Path) -> Iterator[None]:
    """Run the body; if it raises (an error, Ctrl-C), remove what it wrote under `out`.

    `out` must be new or empty on entry (`check_new_folder`): a folder it creates goes
    entirely, an empty folder that was there is emptied again.
    """
    created = not out.exists()
    try:
        yield
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        elif out.is_dir():
            for path in out.iterdir():
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        raise


def storage_error(error: BaseException) -> str | None:
    """The storage problem an error reports ('No space left on device', ...), or None if it is not one."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    found = _STORAGE_PROBLEMS.search(str(error))
    return found.group(0) if found else None


@contextlib.contextmanager
def quiet_save() -> Iterator[None]:
    """Hold back what a failed orbax save prints besides its exception, which the caller reports
    in one line: absl log records with each background thread's traceback, and tensorstore's
    callbacks that find the save's event loop already closed (unraisable RuntimeErrors)."""
    logger = logging.getLogger("absl")
    level, hook = logger.level, sys.unraisablehook

    def unraisable(report):
        if not (isinstance(report.exc_value, RuntimeError) and "Event loop is closed" in str(report.exc_value)):
            hook(report)

    logger.setLevel(logging.CRITICAL)
    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        logger.setLevel(level)
        sys.unraisablehook = hook
