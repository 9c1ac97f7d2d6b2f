"""How maxmoe reads YAML: what the text says, not what YAML 1.1 guesses it means.

- Numbers are YAML 1.2's: `010` is ten (not octal 8), `1:20` is text (not 80); hex and octal
  need 0x and 0o. A decimal integer past Python's 4,300-digit limit is out of range, one line.
- A key of a text-typed config key keeps the text as written (`dir: 010` is "010").
- A key given twice in one mapping is refused (YAML keeps the last one silently).
- Errors are one ConfigError line naming where (file and line, or the override's key).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import yaml

from maxmoe.config.errors import ConfigError

INT, FLOAT, STR, NULL = (f"tag:yaml.org,2002:{name}" for name in ("int", "float", "str", "null"))
MERGE = "tag:yaml.org,2002:merge"
MAX_DIGITS = 4300  # Python's limit for int(text) in base 10


class _Refused(yaml.YAMLError):
    """A document that parses but that maxmoe will not read (a duplicate key, an enormous integer)."""

    def __init__(self, message: str, mark: Any):
        super().__init__(message)
        self.message, self.problem_mark = message, mark


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's integers and floats."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (INT, FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    INT, re.compile(r"^(?:[-+]?[0-9][0-9_]*|0x[0-9a-fA-F_]+|0o[0-7_]+)$"), list("-+0123456789")
)
_Loader.add_implicit_resolver(
    FLOAT,
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9][0-9_]*\.[0-9_]*|[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+)"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text.lstrip("+"))
    if digits.startswith(("0x", "0o")):
        return sign * int(digits[2:], 16 if digits[1] == "x" else 8)
    if len(digits) > MAX_DIGITS:
        raise _Refused(f"an integer of {len(digits):,} digits is out of range (a 64-bit integer)", node.start_mark)
    return sign * int(digits)


_Loader.add_constructor(INT, _construct_int)


def _check_keys(root: yaml.Node, text_key: Callable[[str, str], bool]) -> None:
    """Refuse a key given twice in any mapping; give the plain scalars of text keys the str tag.

    Walked without recursion and each node once (anchors share nodes), so neither a deep nor
    an aliased document costs more than its text.
    """
    seen, stack = set(), [(root, ())]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, path) for item in node.value)
        if not isinstance(node, yaml.MappingNode):
            continue
        names = set()
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == MERGE:
                stack.append((value, path))
                continue
            name = (*path, key.value)
            if key.value in names:
                what = f"section {key.value}" if not path else ".".join(name)
                raise _Refused(f"{what} is given twice", key.start_mark)
            names.add(key.value)
            plain = isinstance(value, yaml.ScalarNode) and value.style is None
            if len(name) == 2 and plain and value.tag not in (STR, NULL) and text_key(*name):
                value.tag = STR  # the text as written: `dir: 010` stays "010"
            stack.append((value, name if len(name) < 2 else (".".join(name),)))


def read_yaml(text: str, where: str, text_key: Callable[[str, str], bool] = lambda section, name: False) -> Any:
    """The document in `text` (None when empty); ConfigError naming `where` when it cannot be read.

    `text_key(section, name)` says which keys of `section: {name: value}` mappings are text.
    """
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_keys(node, text_key)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        at = f" (line {line + 1})" if line is not None else ""
        problem = e.message if isinstance(e, _Refused) else "not valid YAML"
        raise ConfigError(f"{where}{at}: {problem}") from None
    except RecursionError:  # the composer and constructor recurse once per level of nesting
        raise ConfigError(f"{where}: not valid YAML (nested too deeply to read)") from None
    finally:
        loader.dispose()


def read_value(text: str, key: str) -> Any:
    """An override's value as YAML (`[1, 2]`, `0.5`, `true`); text YAML cannot read stays text."""
    if not text.strip():
        return ""
    try:
        return read_yaml(text, key)
    except ConfigError as e:
        if str(e).endswith(": not valid YAML"):
            return text  # `[1` is the text "[1", which the key's type check then refuses
        raise ConfigError(f"{key}={text[:60]}{'...' if len(text) > 60 else ''}: {str(e).split(': ', 1)[1]}") from None
