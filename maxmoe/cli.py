"""Shared command-line plumbing: `--config` files, `key=value` overrides, `--print-config`, one-line errors.

`--help` lists every config key with its type, default and doc (from maxmoe.config's declarations).
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from maxmoe.config import Config, UserError, all_keys, describe_keys, load_config


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as `maxmoe: error: ...` and exit status 2."""

    def error(self, message):  # noqa: D102 - argparse hook
        raise UserError(message)


class _ConfigParser(_Parser):
    """Options and `section.key=value` overrides in any order (`... train.steps=5 --print-config`)."""

    def parse_args(self, args=None, namespace=None):  # noqa: D102 - argparse hook
        self._argv = list(sys.argv[1:] if args is None else args)
        return self.parse_intermixed_args(args, namespace)

    def error(self, message):  # noqa: D102 - argparse hook
        raise UserError(message + option_hint(getattr(self, "_argv", [])))


def option_hint(argv: list[str]) -> str:
    """For `--steps 50` (an option where config takes a key): '; ... train.steps=50'; else ''."""
    keys = all_keys()
    for index, word in enumerate(argv):
        name = word[2:].split("=", 1)[0].replace("-", "_")
        if not word.startswith("--") or not name:
            continue
        matches = [key for key in keys if key.split(".", 1)[1] == name]
        if len(matches) == 1:
            following = argv[index + 1] if index + 1 < len(argv) and "=" not in argv[index + 1] else "VALUE"
            value = word.split("=", 1)[1] if "=" in word else following
            return f"; config keys are set as section.key=value: {matches[0]}={value}"
    return ""


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser that takes repeated `--config FILE` and trailing `section.key=value` overrides."""
    parser = _ConfigParser(
        prog=prog,
        description=description,
        epilog="config keys (set in a --config file or as section.key=value):\n\n" + describe_keys(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", action="append", default=[], metavar="FILE", help="YAML config; repeat to merge in order"
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="typed overrides applied after the files"
    )
    return parser


def config_from_args(args: argparse.Namespace, resolve: Callable[[Config], Config] | None = None) -> Config:
    """The validated Config named by parsed `--config` files and overrides, passed through `resolve`
    (the entry points give maxmoe.data.resolve_vocab_size: model.vocab_size=auto from the data).

    With `--print-config`, prints it (resolved) as YAML and exits with status 0.
    """
    config = load_config(args.config, args.overrides)
    if resolve is not None:
        config = resolve(config)
    if getattr(args, "print_config", False):
        print(config.to_yaml(), end="")
        sys.exit(0)
    return config


def path_argument(text: str) -> str:
    """An argparse `type` for a file or folder: an empty string (which a Path reads as the current
    folder) is refused as `argument --x: an empty path`."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; name a file or folder")
    return text


def check_new_folder(out: Path, flag: str = "--out", *, empty_ok: bool = True) -> None:
    """UserError unless `out` is new (or, with `empty_ok`, an empty folder) and a folder can be made there.

    Checked before any work, so a file on the way or a folder that cannot be written (/proc,
    a read-only mount) is one line naming the option, not an error from deep inside the writer.
    """
    if out.is_symlink() and not out.exists():
        raise UserError(f"{flag} {out} is a dangling symbolic link; choose a new folder")
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {out} is a file; choose a new folder")
    if out.exists() and not empty_ok:
        raise UserError(f"{flag} {out} already exists; remove it or choose another folder")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"output {out} exists and is not empty; choose a new folder")
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UserError(f"{flag} {out}: {parent} is a file, not a folder")
    if out.exists():
        return
    try:  # where the first missing folder goes; nothing is left behind
        tempfile.TemporaryDirectory(dir=parent or Path.cwd(), prefix=f".{out.name}.probe-").cleanup()
    except OSError as e:
        raise UserError(f"{flag} {out}: cannot create a folder in {parent} ({e.strerror or e})") from None


def check_output_file(path: Path, flag: str) -> None:
    """UserError unless a file can be written at `path` (its folders are made on the way): checked
    before the work whose result it holds, not after."""
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder; name a file")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UserError(f"{flag} {path}: {parent} is a file, not a folder")
    try:
        tempfile.TemporaryDirectory(dir=parent or Path.cwd(), prefix=f".{path.name}.probe-").cleanup()
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write in {parent} ({e.strerror or e})") from None


def backend_failure(error: BaseException) -> str | None:
    """The one line for jax failing to start a backend (JAX_PLATFORMS naming one this machine
    lacks: jax raises a RuntimeError, or for cuda without its plugin an AssertionError), else None."""
    if not isinstance(error, (RuntimeError, AssertionError)) or "jax" not in sys.modules:
        return None
    import jax  # imported already: the error came from it

    try:  # asked again: a backend that cannot start fails again, any other error was something else
        jax.devices()
        return None
    except (RuntimeError, AssertionError) as again:
        error = again if str(again).strip() else error
    platforms = os.environ.get("JAX_PLATFORMS", "")
    named = f"JAX_PLATFORMS={platforms}" if platforms else "its default backend"
    detail = str(error).strip().splitlines()[0][:200] if str(error).strip() else "no such backend here"
    return (
        f"jax cannot start {named} on this machine ({detail}); unset JAX_PLATFORMS to use the devices "
        f"this machine has, or install jax for that platform (e.g. pip install 'jax[cuda12]')"
    )


_FLAG = re.compile(r"--[A-Za-z_][A-Za-z0-9_]*(=.*)?", re.DOTALL)


def check_xla_flags_environment() -> None:
    """UserError when $XLA_FLAGS holds a word that is not a flag (`--name` or `--name=value`):
    XLA would abort the process with its usage text when the backend starts."""
    text = os.environ.get("XLA_FLAGS", "")
    try:
        words = shlex.split(text)
    except ValueError:
        raise UserError(f"XLA_FLAGS={text[:80]!r}: a quote is not closed; fix or unset XLA_FLAGS") from None
    bad = next((word for word in words if not _FLAG.fullmatch(word)), None)
    if bad is not None:
        raise UserError(
            f"XLA_FLAGS: {bad[:80]!r} is not an XLA flag (expected --xla_name=value); fix or unset XLA_FLAGS"
        )


def main_guard(fn: Callable[..., int | None]) -> Callable[..., int]:
    """Wrap an entry point: user errors (and a backend jax cannot start) become one line on stderr
    and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> int:
        try:
            check_xla_flags_environment()
            return fn(*args, **kwargs) or 0
        except UserError as e:
            print(f"maxmoe: error: {e}", file=sys.stderr)
            return 2
        except (RuntimeError, AssertionError) as e:
            line = backend_failure(e)
            if line is None:
                raise
            print(f"maxmoe: error: {line}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("maxmoe: interrupted", file=sys.stderr)
            return 130

    return wrapper


def exit_with(code: int) -> None:
    """Exit a command-line process; after a user error (2), without interpreter shutdown.

    Background I/O threads (orbax, tensorstore) that were reading a bad checkpoint would
    otherwise print tracebacks while the interpreter shuts down, after the one-line error.
    The entry point has finished its own writes by then (train closes its checkpointer).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 2:
        os._exit(code)
    sys.exit(code)
