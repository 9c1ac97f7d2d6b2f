"""Reading an XLA:GPU optimized program (`compiled.as_text()` of maxmoe.analysis.gpu_compile): kernels, async schedule.

  kernel_calls(hlo)       {kernel: times written}: custom-call targets and XLA's Triton fusions by kind
  async_collectives(hlo)  one row per async collective: kind, computation, runs per step and
                          `kernels_between`, the work scheduled between its start and its done
                          (what can run under the transfer; none, or a synchronous one: exposed)
  schedule_summary(rows)  per kind: async pairs, how many have work inside, runs per step
A scheduled module prints its schedule in order, so the text alone is read. What counts as an
async pair and as work: docs/PERFORMANCE.md, "Reading an XLA:GPU program: kernels and schedule".
"""

from __future__ import annotations

import re
from collections import Counter

from maxmoe.analysis.hlo import KINDS, computation_runs

_INSTRUCTION_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][a-z0-9\-]*)\((.*)$")
_CUSTOM_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_FUSION_KIND_RE = re.compile(r'"fusion_backend_config":\{"kind":"([^"]+)"')
_CALLS_RE = re.compile(r"\bcalls=%?([\w.\-]+)")
# Instructions that launch nothing: values already there, views, tuples, and the async edges.
FREE = frozenset(
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "after-all",
        "add-dependency",
        "opt-barrier",
        "partition-id",
        "replica-id",
        "domain",
    }
)


def kernel_calls(hlo_text: str) -> dict[str, int]:
    """{kernel name: times written} of an XLA:GPU program: custom-call targets and the kinds of its
    custom fusions (XLA's Triton GEMMs and fusions, collective fusions), most written first."""
    counts = Counter(_CUSTOM_TARGET_RE.findall(hlo_text)) + Counter(_FUSION_KIND_RE.findall(hlo_text))
    return dict(counts.most_common())


def _instructions(lines: list[str]) -> list[tuple[str, str, str]]:
    """(name, opcode, the rest of the line after the opcode's parenthesis) per instruction."""
    out = []
    for line in lines:
        m = _INSTRUCTION_RE.match(line)
        if m:
            out.append((m.group(1), m.group(2), m.group(3)))
    return out


def _collective_inside(comps: dict[str, list[str]], name: str, depth: int = 0) -> str | None:
    """The collective kind a computation (or one it calls) holds, if any."""
    if name not in comps or depth > 8:
        return None
    for _, opcode, rest in _instructions(comps[name]):
        base = opcode.removesuffix("-start")
        if base in KINDS:
            return base
        called = _CALLS_RE.search(rest)
        if called:
            inner = _collective_inside(comps, called.group(1), depth + 1)
            if inner:
                return inner
    return None


def async_collectives(hlo_text: str) -> list[dict]:
    """One row per asynchronous collective of a scheduled XLA:GPU program (see the module docstring).

    Row keys: name (of the start), kind, computation, runs (per step), in_loop (its computation
    runs more than once per step), kernels_between.
    """
    comps, runs = computation_runs(hlo_text)
    rows = []
    for computation, lines in comps.items():
        open_starts: dict[str, tuple[str, int]] = {}
        kernels = 0  # launching instructions seen so far in this computation
        for name, opcode, rest in _instructions(lines):
            if opcode.endswith("-start"):
                base = opcode.removesuffix("-start")
                if base in KINDS:
                    open_starts[name] = (base, kernels)
                elif base in ("fusion", "async"):
                    called = _CALLS_RE.search(rest)
                    kind = _collective_inside(comps, called.group(1)) if called else None
                    if kind:
                        open_starts[name] = (kind, kernels)
            elif opcode.endswith("-done"):
                operand = re.match(r"\s*%?([\w.\-]+)", rest)
                started = open_starts.pop(operand.group(1), None) if operand else None
                if started:
                    kind, before = started
                    rows.append(
                        {
                            "name": operand.group(1),
                            "kind": kind,
                            "computation": computation,
                            "runs": int(runs.get(computation, 1.0)),
                            "in_loop": runs.get(computation, 1.0) > 1,
                            "kernels_between": kernels - before,
                        }
                    )
            elif opcode not in FREE:
                kernels += 1
    return rows


def schedule_summary(rows: list[dict]) -> dict[str, dict[str, int]]:
    """{kind: {"async": pairs written, "with_compute": of which with work scheduled inside,
    "runs": their runs per step, "runs_with_compute": ...}} of `async_collectives` rows."""
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        entry = out.setdefault(r["kind"], {"async": 0, "with_compute": 0, "runs": 0, "runs_with_compute": 0})
        entry["async"] += 1
        entry["runs"] += r["runs"]
        if r["kernels_between"]:
            entry["with_compute"] += 1
            entry["runs_with_compute"] += r["runs"]
    return out
