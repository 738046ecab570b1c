"""Every ``deltarec`` command in README.md and docs/ names a real subcommand and real flags.

The commands are taken from the fenced shell code blocks (``text`` blocks are left out): a
line whose first word (after ``$ ``, ``VAR=value`` assignments, ``.venv/bin/`` or a
``torchrun ...`` prefix) is ``deltarec``, joined with its continuation lines. A synopsis's
``[--flag VALUE]`` counts as written without the brackets and ``a|b`` as ``a``. A command
without placeholders (``...``, ``ROOT``, ``URL``, ``<x>``) is parsed by the CLI's own argparse
parser (nothing runs); one with placeholders has its subcommand and every flag checked.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from deltarec.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PLACEHOLDER = re.compile(r"^(\.\.\.|[A-Z][A-Z_/]*|<[^>]*>)$")  # ..., ROOT, URL, I/N, <name>
FENCE = re.compile(r"^\s*```(\w*)")
SHELL = {"", "bash", "sh", "shell", "console"}  # a ```text block (a diagram) is not run


@dataclass(frozen=True)
class DocCommand:
    where: str
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: deltarec {' '.join(self.words)}"


def _deltarec_words(line: str) -> list[str] | None:
    """The words after ``deltarec`` if the line runs deltarec, else None."""
    try:
        words = shlex.split(line.split(" #")[0].strip().removeprefix("$ "))
    except ValueError:
        return None
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # VAR=value
        words = words[1:]
    if words[:1] == ["torchrun"]:  # torchrun [its flags] deltarec ...
        words = words[next((i for i, w in enumerate(words) if w.endswith("deltarec")), 0) :]
    if not words or words[0] not in ("deltarec", ".venv/bin/deltarec"):
        return None
    rest = words[1:]
    if not rest or rest[0].endswith(":"):  # an error message quoted in the docs
        return None
    return rest


def _commands(path: Path) -> list[DocCommand]:
    found, fenced, shell, current, start = [], False, False, None, 0
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, raw in enumerate(lines, 1):
        fence = FENCE.match(raw)
        if fence:
            fenced = not fenced
            shell = fenced and fence.group(1) in SHELL
            continue
        if not shell:
            continue
        line = raw.split(" #")[0].rstrip()
        if current is not None and (current.endswith("\\") or re.match(r"^\s+[\[-]", line)):
            current = current.removesuffix("\\") + " " + line.strip()
            continue
        if current is not None:
            words = _deltarec_words(current)
            if words:
                found.append(DocCommand(f"{path.relative_to(ROOT)}:{start}", tuple(words)))
        current, start = line, n
    if current is not None and (words := _deltarec_words(current)):
        found.append(DocCommand(f"{path.relative_to(ROOT)}:{start}", tuple(words)))
    return found


def _unbracketed(words: tuple[str, ...]) -> list[str]:
    """``[--flag X]`` without brackets, ``a|b`` as ``a``."""
    out = []
    for w in words:
        w = w.strip("[]")
        if w and "|" in w and not w.startswith(("{", "'")):
            w = w.split("|")[0]
        if w:
            out.append(w)
    return out


COMMANDS_IN_DOCS = [c for doc in DOCS for c in _commands(doc)]


def test_the_docs_show_deltarec_commands():
    assert len(COMMANDS_IN_DOCS) >= 40, [str(c) for c in COMMANDS_IN_DOCS]
    assert {c.words[0] for c in COMMANDS_IN_DOCS} >= {"train", "verify", "publish", "pipeline"}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _parser_of(words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The innermost parser the words name, and the words it takes."""
    command = words[0]
    parser = _subparsers(build_parser(command))[command]
    rest = words[1:]
    actions = _subparsers(parser)
    if actions and rest and rest[0] in actions:
        parser, rest = actions[rest[0]], rest[1:]
    return parser, rest


@pytest.mark.parametrize("doc", COMMANDS_IN_DOCS, ids=str)
def test_every_command_in_the_docs_names_a_real_subcommand_and_real_flags(doc):
    words = _unbracketed(doc.words)
    assert words[0] in COMMANDS, f"{doc}: no command {words[0]!r}"
    parser, rest = _parser_of(words)
    flags = {o for a in parser._actions for o in a.option_strings}
    unknown = [w.split("=")[0] for w in rest if w.startswith("--") and w.split("=")[0] not in flags]
    assert not unknown, f"{doc}: no flag {unknown} (flags: {sorted(flags)})"
    if any(PLACEHOLDER.match(w) for w in rest):
        return  # a synopsis: its flags exist; its values are placeholders
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            build_parser(words[0]).parse_args(words)
        except SystemExit as e:
            pytest.fail(f"{doc}: refused by the CLI (exit {e.code}): {err.getvalue().strip()}")
