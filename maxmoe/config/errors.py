"""The errors a user's input raises, and reading a file the user named."""

from __future__ import annotations

from pathlib import Path


class UserError(Exception):
    """An error caused by the user's input; reported as one line, exit status 2."""


class ConfigError(UserError):
    """A bad configuration key or value."""


def read_named_file(path: str | Path, what: str, *, missing: str = "", error: type[UserError] = UserError) -> bytes:
    """The bytes of a file the user named, else one `error` line saying why not: a folder, not a
    regular file (a device, a FIFO), missing (`missing` says what that suggests), unreadable."""
    if not str(path).strip():  # Path("") is the current folder
        raise error(f"{what} {str(path)!r}: an empty path; name a file")
    p = Path(path)
    if p.is_dir():
        raise error(f"{what} {path} is a folder; name a file")
    if p.exists() and not p.is_file():
        raise error(f"{what} {path} is not a regular file")
    if not p.is_file():
        raise error(f"{what} {path} not found{missing}")
    try:
        return p.read_bytes()
    except OSError as e:
        raise error(f"{what} {path}: cannot read it ({e.strerror or type(e).__name__})") from None
