"""Data dependences between collectives and GEMMs, from lowered StableHLO.

`marker_dependencies` interprets the text from @main and tells, for every "marker" op (by
default each ragged all-to-all and each ragged dot), which markers its operands depend on.
Calls and shard_map bodies (sdy.manual_computation) are followed precisely: arguments map
to parameters by position, results to what the callee or body returns. Every other op with
regions (while, sort, scatter, reduce, case, ...) is over-approximated: its results, and
its regions' block arguments, depend on all its operands and on everything computed
inside (loop bodies run twice, so what one iteration computes reaches the next). A "no
dependence" answer is therefore sound.
"""

from __future__ import annotations

import dataclasses
import re

DEPENDENCY_MARKERS = {"ragged_all_to_all": r"@ragged_all_to_all\b", "ragged_dot": r"\bchlo\.ragged_dot\b"}
_FUNC_RE = re.compile(r"^\s*func\.func\s+(?:public\s+|private\s+)?@([\w.$-]+)\((.*)$")
_DEF_RE = re.compile(r"^\s*(%[\w.$-]+)(?::\d+)?\s*=\s*(.*)$")
_USE_RE = re.compile(r"%[\w.$-]+(?:#\d+)?")
_CALLEE_RE = re.compile(r"\bcall @([\w.$-]+)\(([^)]*)\)")
_DECLARED_RE = re.compile(r"(%[\w.$-]+)(?::\s| = )")  # "(%arg3: tensor<..>" and "(%iterArg = %x"
_RETURN_RE = re.compile(r"^\s*(?:func\.return|return|sdy\.return|stablehlo\.return)\b")


@dataclasses.dataclass(frozen=True)
class Marker:
    """One marker op: its kind, its line in the text (1-based), the markers it depends on."""

    kind: str
    line: int
    deps: frozenset


_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')


def _brace_net(line: str) -> int:
    """Opened minus closed braces of a line, those inside string literals not counted (a kernel's
    serialised module in a custom call's backend_config holds any bytes)."""
    code = _STRING_RE.sub('""', line)
    return code.count("{") - code.count("}")


def _split_functions(lines: list[str]) -> dict[str, tuple[list[str], int, int]]:
    """name -> (parameter names, first body line index, end index) of every func.func."""
    functions = {}
    i = 0
    while i < len(lines):
        match = _FUNC_RE.match(lines[i])
        if not match:
            i += 1
            continue
        params = re.findall(r"(%arg\d+)\s*:", match.group(2))
        depth, start = _brace_net(lines[i]), i + 1
        i += 1
        while i < len(lines) and depth + _brace_net(lines[i]) > 0:
            depth += _brace_net(lines[i])
            i += 1
        functions[match.group(1)] = (params, start, i)
        i += 1
    return functions


class _Interpreter:
    """Propagates sets of marker ids through the module (see the section comment above)."""

    def __init__(self, text: str, markers: dict[str, str]):
        self.lines = text.splitlines()
        self.functions = _split_functions(self.lines)
        self.patterns = {kind: re.compile(pattern) for kind, pattern in markers.items()}
        self.found: dict[str, Marker] = {}

    @staticmethod
    def lookup(env: dict, token: str) -> frozenset:
        name, _, index = token.partition("#")
        value = env.get(name, frozenset())
        if isinstance(value, list):
            return value[int(index)] if index else frozenset().union(*value)
        return value

    def uses(self, env: dict, text: str, skip=()) -> frozenset:
        out = set()
        for token in _USE_RE.findall(text):
            if token not in skip:
                out |= self.lookup(env, token)
        return frozenset(out)

    def call(self, name: str, arg_deps: list[frozenset], path: str) -> list[frozenset]:
        params, start, end = self.functions[name]
        returned, _ = self.block(start, end, dict(zip(params, arg_deps)), path)
        return returned

    def op_end(self, index: int, end: int) -> int:
        """One past the last line of the op starting at `index` (its regions included)."""
        depth, stop = _brace_net(self.lines[index]), index + 1
        if depth == 0 and stop < end and self.lines[stop].lstrip().startswith("cond {"):
            depth, stop = _brace_net(self.lines[stop]), stop + 1  # a while: regions on the next lines
        while stop < end and depth > 0:
            depth += _brace_net(self.lines[stop])
            stop += 1
        return stop

    def block(self, start: int, end: int, env: dict, path: str) -> tuple[list[frozenset], frozenset]:
        """Run lines [start, end); returns (what a return line returns, union of all deps seen).

        Lines that define nothing and return nothing are region structure ("cond {",
        "} do {", "^bb0(...):", "})") and are skipped.
        """
        returned: list[frozenset] = []
        produced: set = set()
        i = start
        while i < end:
            line = self.lines[i]
            match = _DEF_RE.match(line)
            if not match:
                if _RETURN_RE.match(line):
                    returned = [self.lookup(env, token) for token in _USE_RE.findall(line.split(" : ", 1)[0])]
                i += 1
                continue
            result, rhs = match.group(1), match.group(2)
            stop = self.op_end(i, end)
            callee = _CALLEE_RE.search(rhs)
            if stop > i + 1:
                value = self.region_op(i, stop, env, path)
            elif callee and callee.group(1) in self.functions:
                args = [self.lookup(env, token) for token in _USE_RE.findall(callee.group(2))]
                results = self.call(callee.group(1), args, f"{path}/{i + 1}")
                value = results if len(results) > 1 else (results[0] if results else frozenset())
            else:
                value = self.mark(rhs, self.uses(env, rhs, skip=(result,)), i, path)
            env[result] = value
            produced |= value if isinstance(value, frozenset) else frozenset().union(*value)
            i = stop
        return returned, frozenset(produced)

    def mark(self, code: str, deps: frozenset, index: int, path: str) -> frozenset:
        """deps, plus this op's own id if it is a marker (recorded with what it depends on)."""
        for kind, pattern in self.patterns.items():
            if pattern.search(code):
                marker = f"{path}:{index + 1}"
                previous = self.found.get(marker)
                self.found[marker] = Marker(kind, index + 1, deps | (previous.deps if previous else frozenset()))
                return deps | {marker}
        return deps

    def region_op(self, start: int, stop: int, env: dict, path: str):
        """An op spanning lines [start, stop): a shard_map body precisely, anything else over-approximated."""
        rhs = _DEF_RE.match(self.lines[start]).group(2)
        declared = set(_DECLARED_RE.findall(rhs))
        if "sdy.manual_computation(" in rhs:
            operands = _USE_RE.findall(rhs.split("sdy.manual_computation(", 1)[1].split(")", 1)[0])
            params = re.findall(r"(%[\w.$-]+):\s", rhs.rsplit("(", 1)[-1])
            inner = dict(env)
            inner.update({p: self.lookup(env, o) for p, o in zip(params, operands)})
            returned, _ = self.block(start + 1, stop - 1, inner, path)
            return returned
        operands = self.uses(env, rhs, skip=declared)
        args = operands
        for _ in range(2):  # the second pass feeds what the regions compute back into their arguments
            inner = dict(env)
            inner.update({name: args for name in declared})
            for index in range(start + 1, stop - 1):
                if self.lines[index].lstrip().startswith("^"):  # a block header declares arguments
                    inner.update({name: args for name in _DECLARED_RE.findall(self.lines[index])})
            _, produced = self.block(start + 1, stop - 1, inner, path)
            args = operands | produced
        return self.mark(rhs, args, start, path)


def marker_dependencies(stablehlo_text: str, markers: dict[str, str] | None = None) -> dict[str, Marker]:
    """Every marker op of a lowered module, keyed by call path and line, with the markers it depends on.

    `markers` maps a kind to a regular expression for its op (default DEPENDENCY_MARKERS:
    ragged all-to-alls and ragged dots). Interpretation starts at @main.
    """
    interpreter = _Interpreter(stablehlo_text, markers or DEPENDENCY_MARKERS)
    if "main" not in interpreter.functions:
        raise ValueError("no func.func @main in the program text")
    params, _, _ = interpreter.functions["main"]
    interpreter.call("main", [frozenset()] * len(params), "main")
    return interpreter.found


def independent_chains(
    markers: dict[str, Marker], exchange: str = "ragged_all_to_all", compute: str = "ragged_dot"
) -> tuple[list[set], list[str]]:
    """(chains of `compute` markers, `exchange` markers that depend on compute of two chains).

    Two compute markers are in one chain when one depends on the other, directly or through
    an exchange, or both depend on a common exchange. A batch-split MoE layer lowered with
    its backward pass has two chains and no exchange coupling them; a plain one has one.
    """
    parent = {m: m for m in markers}

    def find(m):
        while parent[m] != m:
            parent[m] = parent[parent[m]]
            m = parent[m]
        return m

    computes = [m for m, v in markers.items() if v.kind == compute]
    for m in computes:
        for dep in markers[m].deps:
            if dep in parent:
                parent[find(dep)] = find(m)
    chains: dict[str, set] = {}
    for m in computes:
        chains.setdefault(find(m), set()).add(m)
    chain_of = {m: root for root, members in chains.items() for m in members}
    coupled = [
        m for m, v in markers.items() if v.kind == exchange and len({chain_of[d] for d in v.deps if d in chain_of}) > 1
    ]
    return list(chains.values()), coupled
