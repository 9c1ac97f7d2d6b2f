"""Declaring a config key (type, limits, one line of doc) and checking a value against it.

Every section's dataclass declares its keys with `field`; `coerce` is the one place a value
is checked and converted to its key's type, for YAML files, overrides and the Python API.
`check_extent` bounds what one value may hold, and `shown` is how a value appears in a message.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import pwd
import reprlib
from typing import Any

from maxmoe.config.errors import ConfigError

MAX_VALUES = 100_000  # scalars and containers one value may expand to (YAML anchors multiply them)
MAX_DEPTH = 32  # levels of nesting one value may have


def field(default, *, choices=None, ge=None, gt=None, auto=False, path=False, doc=""):
    """A config field with its allowed values and one line of doc; mutable defaults are copied per instance.

    `auto=True` also allows the string "auto" (a value resolved later, e.g. from the data);
    `path=True` marks a file or folder (a mapping's keys, for a dict): a leading `~` is expanded.
    """
    meta = {"choices": choices, "ge": ge, "gt": gt, "auto": auto, "path": path, "doc": doc}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def type_name(kind: type, meta: dict) -> str:
    """How a key's values are written: its choices, or its type (with its limits)."""
    if meta.get("choices"):
        return "|".join(map(str, meta["choices"]))
    name = {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "mapping"}[kind]
    limits = [
        f">= {meta['ge']}" if meta.get("ge") is not None else "",
        f"> {meta['gt']}" if meta.get("gt") is not None else "",
    ]
    name += "".join(f" {limit}" for limit in limits if limit)
    return f"{name} or auto" if meta.get("auto") else name


def unknown(key: str, candidates: list[str]) -> ConfigError:
    """The error for a key that does not exist, naming the nearest one that does."""
    near = difflib.get_close_matches(key, candidates, n=1, cutoff=0.4)
    hint = f"; did you mean '{near[0]}'?" if near else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxtuple = 3, 8, 8, 8
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 80, 80, 60


def shown(value: Any) -> str:
    """A value as a message shows it: its repr, cut short (a huge or deep value stays one short line)."""
    try:
        return _SHORT.repr(value)
    except ValueError:  # an integer past Python's 4,300-digit limit for str()
        return f"an integer of about {int(value.bit_length() * math.log10(2)):,} digits"


def check_extent(key: str, value: Any) -> None:
    """ConfigError when `value` holds more than MAX_VALUES items or nests deeper than MAX_DEPTH.

    Walked without recursion and stopped at the limit, so a YAML alias bomb (a few lines that
    expand to billions of items) or a list that contains itself costs no more than the limit.
    """
    count, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise ConfigError(f"{key}: the value expands to more than {MAX_VALUES:,} values; no config key takes that")
        if depth > MAX_DEPTH:
            raise ConfigError(f"{key}: the value is nested more than {MAX_DEPTH} levels deep")
        if isinstance(item, dict):
            stack.extend((part, depth + 1) for pair in item.items() for part in pair)
        elif isinstance(item, (list, tuple)):
            stack.extend((part, depth + 1) for part in item)


def expand_home(key: str, path: str) -> str:
    """`path` with a leading `~` or `~user` replaced by that home folder; ConfigError when there is none.

    $HOME unset or empty is refused, not read as `/` (a run would write into the root folder).
    """
    if not path.startswith("~"):
        return path
    user, slash, rest = path[1:].partition("/")
    if not user:
        home = os.environ.get("HOME")
        if not home:
            state = "empty" if home == "" else "not set"
            raise ConfigError(f"{key}={path}: ~ stands for $HOME, and HOME is {state}; give the full path")
    else:
        try:
            home = pwd.getpwnam(user).pw_dir
        except KeyError:
            raise ConfigError(f"{key}={path}: there is no user {user!r} for ~{user} to name") from None
    return os.path.join(home, rest) if slash and rest else home


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python number it holds; a path as its text; anything else as it is."""
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == () and hasattr(value, "item"):
        return value.item()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def coerce(key: str, value: Any, kind: type, meta: dict) -> Any:
    """Check one value against its declared type and limits; return it in that type."""
    value = _plain(value)
    if meta.get("auto") and value == "auto":
        return value
    choices = meta.get("choices")
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={shown(value)}: expected true or false")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={shown(value)}: expected an integer{' or auto' if meta.get('auto') else ''}")
        if not -(2**63) <= value < 2**63:  # past int64 nothing downstream (numpy, jax, C) can hold it
            raise ConfigError(f"{key}={shown(value)}: out of range (a 64-bit integer)")
    elif kind is float:
        if isinstance(value, str):
            try:  # YAML reads some numbers (1e-9 without a dot, in YAML 1.1) as strings
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={shown(value)}: expected a number")
        try:
            value = float(value)
        except OverflowError:
            raise ConfigError(f"{key}={shown(value)}: out of range (a 64-bit float)") from None
        if not math.isfinite(value):
            raise ConfigError(f"{key}={value!r}: expected a finite number")
    elif kind is str:
        if value is None:
            value = ""
        if isinstance(value, bool) and choices and str(value).lower() in choices:
            value = str(value).lower()  # a choice that reads like a boolean (true/false) takes the boolean
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise ConfigError(f"{key}={shown(value)}: expected a string")
        if meta.get("path"):
            if "\0" in value:  # the OS cannot name such a file: refused now, not at the first write
                raise ConfigError(f"{key}={shown(value)}: a path cannot hold a NUL character")
            value = expand_home(key, value)
    elif kind is list:
        if value is None:
            value = []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={shown(value)}: expected a list like [a, b]")
        value = list(value)
    elif kind is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={shown(value)}: expected a mapping like {{a: [b]}}")
        if meta.get("path"):
            value = {expand_home(key, _plain(k)) if isinstance(_plain(k), str) else k: v for k, v in value.items()}
    ge, gt = meta.get("ge"), meta.get("gt")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key}={shown(value)}: allowed values are {', '.join(map(str, choices))}")
    if ge is not None and value < ge:
        raise ConfigError(f"{key}={shown(value)}: must be >= {ge}")
    if gt is not None and value <= gt:
        raise ConfigError(f"{key}={shown(value)}: must be > {gt}")
    return value
