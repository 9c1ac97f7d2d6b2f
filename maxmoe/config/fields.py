"""Declaring a config key (type, limits, one line of doc) and checking a value against it.

Every section's dataclass declares its keys with `field`; `coerce` is the one place a value
is checked and converted to its key's type, for YAML files, overrides and the Python API.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any

from maxmoe.config.errors import ConfigError


def field(default, *, choices=None, ge=None, gt=None, auto=False, doc=""):
    """A config field with its allowed values and one line of doc; mutable defaults are copied per instance.

    `auto=True` also allows the string "auto" (a value resolved later, e.g. from the data).
    """
    meta = {"choices": choices, "ge": ge, "gt": gt, "auto": auto, "doc": doc}
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


def coerce(key: str, value: Any, kind: type, meta: dict) -> Any:
    """Check one value against its declared type and limits; return it in that type."""
    if meta.get("auto") and value == "auto":
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected true or false")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r}: expected an integer{' or auto' if meta.get('auto') else ''}")
        if not -(2**63) <= value < 2**63:  # past int64 nothing downstream (numpy, jax, C) can hold it
            raise ConfigError(f"{key}={value}: out of range (a 64-bit integer)")
    elif kind is float:
        if isinstance(value, str):
            try:  # YAML 1.1 reads 1e-9 (no dot) as a string
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: expected a number")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{key}={value!r}: expected a finite number")
    elif kind is str:
        if value is None:
            value = ""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: expected a string")
    elif kind is list:
        if value is None:
            value = []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list like [a, b]")
        value = list(value)
    elif kind is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping like {{a: [b]}}")
    choices, ge, gt = meta.get("choices"), meta.get("ge"), meta.get("gt")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key}={value!r}: allowed values are {', '.join(map(str, choices))}")
    if ge is not None and value < ge:
        raise ConfigError(f"{key}={value!r}: must be >= {ge}")
    if gt is not None and value <= gt:
        raise ConfigError(f"{key}={value!r}: must be > {gt}")
    return value
