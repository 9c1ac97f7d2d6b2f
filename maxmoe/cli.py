"""Shared command-line plumbing: `--config` files, `key=value` overrides, one-line errors."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable

from maxmoe.config import Config, UserError, load_config


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as `maxmoe: error: ...` and exit status 2."""

    def error(self, message):  # noqa: D102 - argparse hook
        raise UserError(message)


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser that takes repeated `--config FILE` and trailing `section.key=value` overrides."""
    parser = _Parser(prog=prog, description=description)
    parser.add_argument(
        "--config", action="append", default=[], metavar="FILE", help="YAML config; repeat to merge in order"
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="typed overrides applied after the files"
    )
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    """The validated Config named by parsed `--config` files and overrides."""
    return load_config(args.config, args.overrides)


def main_guard(fn: Callable[..., int | None]) -> Callable[..., int]:
    """Wrap an entry point: user errors become one line on stderr and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> int:
        try:
            return fn(*args, **kwargs) or 0
        except UserError as e:
            print(f"maxmoe: error: {e}", file=sys.stderr)
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
