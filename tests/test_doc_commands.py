"""Every `python -m maxmoe...` command in README.md and docs/ parses as written.

Each command is given to its entry point's own argument parser, stopped right after parsing
(nothing runs), and its `--config` files and `section.key=value` overrides are loaded and
validated as `maxmoe.config.load_config` does for a run. A doc that names an option, a key or
a value the code no longer has fails here.

Commands are taken from fenced code blocks (with `\\` continuations) and inline code spans that
pass options or overrides; a bare mention such as `python -m maxmoe.train` is prose. Words in
capitals that the docs use as placeholders (RECIPE, OUT.json, ...) stand for the example values
below, and `[...]` marks an optional part, left out.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from maxmoe import cli
from maxmoe.config import load_config

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND = re.compile(r"python -m (maxmoe(?:\.\w+)?)\b(.*)")
PLACEHOLDERS = {
    "RECIPE": "blockwise",
    "P": "full",
    "S": "0",
    "A": "2",
    "4A": "8",
    "N": "8",
    "C": "configs/tiny.yaml",
    "NAME": "gb300",
    "KIND": "NVIDIA H200",
    "OUT.json": "runs/sweep/out.json",
    "OUT": "runs/out",
    "PATH": "runs/out",
}


def _joined_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) with backslash continuations joined, inside fenced blocks only."""
    out, fenced, pending, start = [], False, "", 0
    for number, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    return out


def _commands_in(path: Path) -> list[tuple[str, str]]:
    """(where, command text after `python -m`) for every command in a Markdown file."""
    text = path.read_text()
    found = []
    for number, line in _joined_lines(text):
        match = COMMAND.search(line)
        if match and not line.lstrip().startswith("#") and "`" not in line and re.search(r"--|=", match.group(2)):
            found.append((f"{path.name}:{number}", match.group(1) + match.group(2)))
    for number, line in enumerate(text.split("\n"), 1):
        for span in re.findall(r"`([^`]+)`", line):
            match = COMMAND.search(span)
            if match and re.search(r"--|=", match.group(2)):
                found.append((f"{path.name}:{number}", match.group(1) + match.group(2)))
    return found


def _argv(rest: str) -> list[str]:
    words, optional = [], False
    for word in shlex.split(rest.split(" # ")[0]):
        optional = optional or word.startswith("[")
        if not optional:
            words.append(_example(word))
        optional = optional and not word.endswith("]")
    return words


def _example(word: str) -> str:
    """A placeholder word, or the value of `key=PLACEHOLDER`, replaced by its example."""
    key, eq, value = word.rpartition("=")
    return f"{key}={PLACEHOLDERS.get(value, value)}" if eq else PLACEHOLDERS.get(word, word)


ALL = [(where, command) for path in DOCS for where, command in _commands_in(path)]


def test_the_docs_have_commands():
    """The extraction finds the README's main commands (a broken extraction must not pass vacuously)."""
    texts = [command for _, command in ALL]
    assert "maxmoe.train --config configs/tiny.yaml" in [t.strip() for t in texts]
    assert any(t.startswith("maxmoe.sweep ") and "--dry-run" in t for t in texts)
    assert len(ALL) >= 30


def test_the_readme_runs_the_clone_s_virtual_environment():
    """Every README command runs `.venv/bin/python` (the set-up's environment), never a bare `python`
    that may be another interpreter without maxmoe."""
    text = (REPO / "README.md").read_text()
    lines = [(n, line) for n, line in _joined_lines(text)]
    lines += [(n, span) for n, line in enumerate(text.split("\n"), 1) for span in re.findall(r"`([^`]+)`", line)]
    bare = []
    for number, line in lines:
        for match in COMMAND.finditer(line):
            if re.search(r"--|=", match.group(2)) and not line[: match.start()].endswith(".venv/bin/"):
                bare.append(f"README.md:{number}: {line.strip()}")
    assert not bare, "\n".join(bare)
    assert sum(".venv/bin/python -m maxmoe" in line for _, line in lines) >= 20  # the check saw the commands


class _Parsed(BaseException):
    """Raised by the patched parser with what it parsed: the entry point stops there."""

    def __init__(self, namespace):
        super().__init__()
        self.namespace = namespace


def _stop_after_parsing(monkeypatch):
    def wrap(original):
        def parse(self, args=None, namespace=None):
            raise _Parsed(original(self, args, namespace))

        return parse

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", wrap(argparse.ArgumentParser.parse_args))
    monkeypatch.setattr(cli._ConfigParser, "parse_args", wrap(cli._ConfigParser.parse_args))


def _entry_point(module: str):
    imported = importlib.import_module(module)
    if not hasattr(imported, "main"):
        imported = importlib.import_module(module + ".__main__")
    return imported.main


@pytest.mark.parametrize(("where", "command"), ALL, ids=[w for w, _ in ALL])
def test_doc_command_parses(where, command, monkeypatch, capsys):
    """The entry point's parser accepts the command and its configs and overrides load."""
    monkeypatch.chdir(REPO)
    module, _, rest = command.partition(" ")
    argv = _argv(rest)
    main = _entry_point(module)
    _stop_after_parsing(monkeypatch)
    try:
        status = main(argv)
    except _Parsed as parsed:
        namespace = parsed.namespace
    except SystemExit as done:  # --help
        assert done.code == 0, f"{where}: {command}\n{capsys.readouterr().err}"
        return
    else:
        pytest.fail(f"{where}: `{command}` did not parse (status {status}): {capsys.readouterr().err.strip()}")
    files = getattr(namespace, "config", None)
    overrides = getattr(namespace, "overrides", None)
    if files is None and overrides is None:
        return
    missing = [f for f in files or [] if not (REPO / f).is_file()]
    if missing:
        # A config an earlier command writes (convert's ckpt/.../config.yaml): overrides checked on defaults.
        assert all("ckpt/" in f or f.startswith("runs/") for f in missing), f"{where}: no such config {missing}"
        files = []
    load_config(files, overrides or [])
