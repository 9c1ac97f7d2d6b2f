"""Measured kernel rates: one YAML file, `rates:` and `steps:` lists of flat entries (maxmoe/kernels/rates.yaml).

A rate names where and what ran: device_kind (jax's, "NVIDIA H200"), system (the planner's
name, h200), class (KERNEL_CLASSES), backend (the kernel: xla, mosaic_gpu, triton, chunked,
cudnn, tokamax, ragged_dot, scaled_matmul), precision (bf16 or a model.fp8 recipe), pass (fwd
or fwd+bwd), shape (a label) with dims (the sizes the benchmark names); what it reached: tflops
(the useful FLOPs the benchmark counts per second), peak_fraction (over the datasheet peak of the
precision it ran at); and how: date, commit, command. A step names device_kind, system, config,
overrides, kernels, tokens_per_s, tflops_per_device, mfu, date, commit, command: a whole training
step measured, which predictions are checked against. One rate per (system, class, backend,
precision, pass, shape). `load_rates(path)` reads and checks a file; a bad one is a UserError
of one line naming the file and the entry.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import yaml

from maxmoe.config import UserError
from maxmoe.config.errors import read_named_file

DEFAULT_RATES = Path(__file__).with_name("rates.yaml")
KERNEL_CLASSES = ("dense_gemm", "grouped_gemm", "attention_core")
PRECISIONS = ("bf16", "tensorwise", "mxfp8", "blockwise")
PASSES = ("fwd", "fwd+bwd")
_TEXT = ("device_kind", "system", "date", "commit", "command")


@dataclasses.dataclass(frozen=True)
class Rate:
    """One kernel measured on one device."""

    device_kind: str
    system: str
    kernel_class: str
    backend: str
    precision: str
    pass_: str
    shape: str
    dims: tuple  # ((name, size), ...)
    tflops: float
    peak_fraction: float
    date: str
    commit: str
    command: str

    @property
    def where(self) -> str:
        """'NVIDIA H200, 2026-12-04, f240f24': the measurement's device, date and commit."""
        return f"{self.device_kind}, {self.date}, {self.commit}"


@dataclasses.dataclass(frozen=True)
class Step:
    """One training step measured on one device."""

    device_kind: str
    system: str
    config: str
    overrides: tuple[str, ...]
    kernels: str
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    date: str
    commit: str
    command: str


@dataclasses.dataclass(frozen=True)
class RateTable:
    """A rates file, read: its path, rates and steps."""

    path: str
    rates: tuple[Rate, ...]
    steps: tuple[Step, ...] = ()

    def find(self, **match) -> tuple[Rate, ...]:
        """The rates whose fields equal `match` (e.g. system="h200", kernel_class="grouped_gemm")."""
        return tuple(r for r in self.rates if all(getattr(r, k) == v for k, v in match.items()))


def _fail(path, where: str, what: str):
    raise UserError(f"rates file {path}: {where}: {what}")


def _text(path, where, entry, key) -> str:
    value = entry.get(key)
    if value is None or isinstance(value, (dict, list, bool)) or str(value).strip() == "":
        _fail(path, where, f"'{key}' is missing or not text")
    return str(value)


def _number(path, where, entry, key, upper=math.inf) -> float:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= upper:
        _fail(path, where, f"'{key}' {value!r}: expected a number in (0, {upper:g}]")
    return float(value)


def _choice(path, where, entry, key, allowed) -> str:
    value = entry.get(key)
    if value not in allowed:
        _fail(path, where, f"'{key}' {value!r}: expected one of {', '.join(allowed)}")
    return value


def _rate(path, where: str, entry: dict) -> Rate:
    dims = entry.get("dims", {})
    if not isinstance(dims, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in dims.values()):
        _fail(path, where, f"'dims' {dims!r}: expected a mapping of sizes")
    return Rate(
        **{k: _text(path, where, entry, k) for k in _TEXT},
        kernel_class=_choice(path, where, entry, "class", KERNEL_CLASSES),
        backend=_text(path, where, entry, "backend"),
        precision=_choice(path, where, entry, "precision", PRECISIONS),
        pass_=_choice(path, where, entry, "pass", PASSES),
        shape=_text(path, where, entry, "shape"),
        dims=tuple(sorted((str(k), v) for k, v in dims.items())),
        tflops=_number(path, where, entry, "tflops"),
        peak_fraction=_number(path, where, entry, "peak_fraction", 1.0),
    )


def _step(path, where: str, entry: dict) -> Step:
    overrides = entry.get("overrides", [])
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        _fail(path, where, f"'overrides' {overrides!r}: expected a list of key=value texts")
    return Step(
        **{k: _text(path, where, entry, k) for k in _TEXT},
        config=_text(path, where, entry, "config"),
        overrides=tuple(overrides),
        kernels=_text(path, where, entry, "kernels"),
        tokens_per_s=_number(path, where, entry, "tokens_per_s"),
        tflops_per_device=_number(path, where, entry, "tflops_per_device"),
        mfu=_number(path, where, entry, "mfu", 1.0),
    )


def _entries(path, doc: dict, key: str) -> list:
    entries = doc.get(key, [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        _fail(path, key, "expected a list of mappings")
    return entries


@functools.cache
def load_rates(path: str | Path = DEFAULT_RATES) -> RateTable:
    """The rates file at `path`, checked (the module docstring's format); UserError if it is not one."""
    text = read_named_file(path, "rates file")
    try:
        doc = yaml.safe_load(text.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError):
        raise UserError(f"rates file {path}: not valid YAML") from None
    if not isinstance(doc, dict) or not set(doc) <= {"rates", "steps"} or "rates" not in doc:
        raise UserError(f"rates file {path}: expected a mapping with a 'rates' list (and optionally 'steps')")
    rates = tuple(_rate(path, f"rates[{i}]", e) for i, e in enumerate(_entries(path, doc, "rates")))
    seen = {}
    for i, r in enumerate(rates):
        key = (r.system, r.kernel_class, r.backend, r.precision, r.pass_, r.shape)
        if key in seen:
            _fail(path, f"rates[{i}]", f"the same kernel and shape as rates[{seen[key]}] ({', '.join(key)})")
        seen[key] = i
    steps = tuple(_step(path, f"steps[{i}]", e) for i, e in enumerate(_entries(path, doc, "steps")))
    return RateTable(str(path), rates, steps)
