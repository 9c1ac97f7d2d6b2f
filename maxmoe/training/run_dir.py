"""run.dir before anything compiles: created, checked writable, and locked for one job at a time.

    lock = claim_run_dir(config.run.dir, process_index, process_count)   # UserError if it cannot be had
    ...                                                                   # the run
    lock.release()                                                        # (also on process exit)

The lock is `flock` on `run.dir/maxmoe.lock`, held by process 0 for the whole run; the file
records the holder's pid, host and start time, so a second job on the same run.dir stops at
once with one line naming them, before it reads a checkpoint or writes a byte. The kernel drops
an flock when its holder dies (even by SIGKILL), so a stale file never blocks a restart. Other
processes of a multi-process job do not lock (on a shared file system they would block their
own process 0); they learn from process 0 whether it got the lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import socket
import sys
import time
from pathlib import Path

import numpy as np
import yaml
from jax.experimental import multihost_utils

from maxmoe.config import ConfigError, UserError
from maxmoe.config.fields import check_extent
from maxmoe.config.yaml_reader import read_yaml

LOCK_NAME = "maxmoe.lock"
# What a run writes in run.dir: each must be a regular file (or folder) if it is there at all.
RUN_FILES = ("metrics.jsonl", "config.yaml", "xla_flags.txt", "allocator.env", LOCK_NAME)
RUN_FOLDERS = ("checkpoints", "tensorboard", "profile")


def check_layout(run_dir: Path) -> None:
    """A UserError naming the first entry of run.dir that is not of the kind the run writes there.

    Found at the first save, a regular file named `checkpoints` would cost the training done
    so far; a symbolic link named like the lock file would be truncated through.
    """
    lock = run_dir / LOCK_NAME
    if lock.is_symlink():
        raise UserError(f"{lock} is a symbolic link; the lock file must be a regular file (remove the link)")
    for name in RUN_FILES:
        path = run_dir / name
        if path.exists() and not path.is_file():
            raise UserError(f"run.dir {run_dir}: {path} is not a regular file; move it away or choose another run.dir")
    for name in RUN_FOLDERS:
        path = run_dir / name
        if path.exists() and not path.is_dir():
            raise UserError(f"run.dir {run_dir}: {path} is not a folder; move it away or choose another run.dir")


def prepare_run_dir(path: str | Path) -> Path:
    """Create run.dir (and its parents) and check that a file can be written in it.

    A regular file on the way, or a folder this process cannot write, is a UserError naming it.
    """
    run_dir = Path(path)  # `~` was expanded in the config: every user of run.dir names the same folder
    for folder in (run_dir, *run_dir.parents):
        if folder.exists() and not folder.is_dir():
            raise UserError(f"run.dir={path}: {folder} is a file, not a folder")
    probe = run_dir / f".write-test-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        where = f" ({e.filename})" if e.filename and Path(e.filename) != probe else ""
        raise UserError(f"run.dir={path}: cannot write there{where}: {e.strerror or type(e).__name__}") from None
    check_layout(run_dir)
    return run_dir


def describe_holder(lock_file: Path) -> str:
    """'process 1234 on host-a (since 2025-01-01 12:00:00)' from a lock file, or what is known."""
    try:
        holder = json.loads(lock_file.read_text())
        text = f"process {int(holder['pid'])} on {holder['host']}"
        if holder.get("started"):
            text += f" (since {holder['started']})"
        return text
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (its lock file names none yet)"


class RunDirLock:
    """An exclusive flock on run.dir/maxmoe.lock; `acquire` raises a UserError naming the holder."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._file = None

    def acquire(self) -> None:
        """Take the lock without waiting, and write this process's pid, host and start time into the file.

        A holder that was refused removes the file it made (`remove_file`); a lock taken on a file
        removed meanwhile is let go and the lock taken again on the file now at the path.
        """
        for _ in range(3):
            handle, locked = self._lock_file()
            if not locked or self._still_at_path(handle):
                break
            handle.close()  # locked a file its holder had just removed: lock the one at the path now
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "argv": sys.argv,
        }
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps(holder) + "\n")
            handle.flush()
        except OSError as e:  # a full disk: the run would fail at its first write anyway
            with contextlib.suppress(OSError):  # closing flushes the write that failed, and fails again
                handle.close()
            raise UserError(f"cannot write {self.path}: {e.strerror or type(e).__name__}") from None
        self._file = handle

    def _still_at_path(self, handle) -> bool:
        try:
            return os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            return False

    def _lock_file(self):
        """(the lock file, open, whether it is flock-ed: not where the file system has no flock)."""
        # O_NOFOLLOW: a link named like the lock file must not lead the truncation below to another file.
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UserError(f"{self.path} is a symbolic link; the lock file must be a regular file") from None
            raise UserError(f"cannot open {self.path}: {e.strerror or type(e).__name__}") from None
        handle = os.fdopen(fd, "r+")  # held open for the whole run
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise UserError(
                f"run.dir {self.path.parent} is in use by {describe_holder(self.path)}; "
                f"wait for that job to end, stop it, or choose another run.dir"
            ) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                handle.close()
                raise UserError(f"cannot lock {self.path}: {e.strerror or type(e).__name__}") from None
            # A file system without locks: run unguarded rather than not at all.
            print(f"maxmoe: warning: {self.path}: the file system has no flock; run.dir is not locked", file=sys.stderr)
            return handle, False
        return handle, True

    def remove_file(self) -> None:
        """Delete the lock file while still holding it (a refused run leaves run.dir as it found it)."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def release(self) -> None:
        """Drop the lock (the file stays: deleting it could let two jobs lock two different files)."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _agree(ok: bool, process_count: int) -> bool:
    """Whether process 0's `ok` is true, on every process (a broadcast when there are several)."""
    if process_count == 1:
        return ok
    return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


def claim_run_dir(path: str | Path, process_index: int = 0, process_count: int = 1) -> RunDirLock:
    """Prepare run.dir and lock it for this job (process 0 holds the lock); UserError if it cannot.

    Every process checks that it can write there (each writes its own checkpoint shards).
    """
    run_dir = prepare_run_dir(path)
    lock = RunDirLock(run_dir)
    error = None
    if process_index == 0:
        try:
            lock.acquire()
        except UserError as e:
            error = e
    if not _agree(error is None, process_count):
        raise error or UserError(f"run.dir {run_dir}: process 0 could not lock it (see its error)")
    return lock


# The first line of the config.yaml a run writes: a run.dir's config.yaml without it is not
# rewritten (unless an earlier maxmoe wrote it, see `_written_by_a_run`).
CONFIG_HEADER = "# maxmoe: the resolved config of the run in this folder (written again when it resumes)\n"


def _written_by_a_run(path: Path) -> bool:
    """Whether run.dir/config.yaml is one a run wrote: it starts with CONFIG_HEADER, or (written
    before the header) it is exactly a YAML dump of a config, in a folder that holds a run."""
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    if text.startswith(CONFIG_HEADER):
        return True
    if not ((path.parent / "checkpoints").is_dir() or (path.parent / "metrics.jsonl").is_file()):
        return False
    try:
        loaded = read_yaml(text, str(path))
        check_extent(str(path), loaded)
    except ConfigError:
        return False
    return isinstance(loaded, dict) and yaml.safe_dump(loaded, sort_keys=False) == text


def check_run_config(run_dir: str | Path) -> None:
    """UserError when run.dir holds a config.yaml that no run wrote (a --config file, say): a run
    writes its resolved config there, and must never overwrite a file it did not write."""
    path = Path(run_dir) / "config.yaml"
    if path.is_file() and not _written_by_a_run(path):
        raise UserError(
            f"run.dir {run_dir} holds config.yaml, not written by maxmoe (your --config file?); a run writes its "
            f"resolved config there: choose another run.dir, or move the file away (nothing was changed)"
        )


def write_run_config(run_dir: str | Path, text: str) -> None:
    """Write run.dir/config.yaml (CONFIG_HEADER, then `text`) whole or not at all: a full disk
    leaves the one that was there, and is one UserError line."""
    path = Path(run_dir) / "config.yaml"
    tmp = path.with_name(f".config.yaml.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.write_text(CONFIG_HEADER + text)
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"cannot write {path} ({e.strerror or type(e).__name__}); nothing was changed") from None
    finally:
        tmp.unlink(missing_ok=True)
