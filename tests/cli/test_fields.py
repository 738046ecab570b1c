"""Flags derived from model fields: help from the docstring, type and default from the field."""

from __future__ import annotations

import argparse
from enum import Enum
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from deltarec.cli import build_parser
from deltarec.cli.cmd_train import _flags
from deltarec.cli.fields import FieldFlag, add_flags, field_docs, plain_text


class Colour(Enum):
    RED = "red"
    BLUE = "blue"


class Base(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)  # as every flag's model sets

    size: int | None = Field(default=None, ge=1)
    """Rows per batch; None: as many as fit."""


class Example(Base):
    name: str
    """The name (``[a-z]+``), see :func:`~deltarec.ids.validate_run`."""
    mode: Literal["fast", "safe"] = "safe"
    """How to go."""
    colour: Colour = Colour.BLUE
    """A colour; 100% optional."""
    verbose: bool = False
    """Say more."""
    fsync: bool = True
    """Sync files before renaming them."""
    undocumented: int = 3


def _parse(flags, argv):
    parser = argparse.ArgumentParser()
    add_flags(parser, flags)
    return parser, parser.parse_args(argv)


def test_field_docs_include_the_bases_fields_and_skip_the_undocumented():
    docs = field_docs(Example)
    assert docs["size"] == "Rows per batch; None: as many as fit."
    assert docs["mode"] == "How to go."
    assert "undocumented" not in docs


def test_plain_text_drops_roles_and_literals_and_escapes_percent():
    doc = "See :func:`~a.b.check` and :class:`a.B` for ``x``;\n  100% sure."
    assert plain_text(doc) == "See check and a.B for x; 100%% sure."


def test_flags_take_type_choices_default_and_requiredness_from_the_field():
    flags = (
        FieldFlag("--size", Example, "size", "N"),
        FieldFlag("--name", Example, "name"),
        FieldFlag("--mode", Example, "mode"),
        FieldFlag("--colour", Example, "colour"),
    )
    parser, args = _parse(flags, ["--name", "x", "--size", "4"])
    assert (args.size, args.name, args.mode, args.colour) == (4, "x", "safe", "blue")
    actions = {a.dest: a for a in parser._actions}
    assert actions["name"].required
    assert actions["mode"].choices == ["fast", "safe"]
    assert actions["colour"].choices == ["red", "blue"]
    assert actions["colour"].help == "A colour; 100%% optional. (default: blue)"
    assert "100% optional" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--name", "x", "--mode", "slow"])


def test_an_optional_flag_defaults_to_none_and_names_the_fields_default():
    flags = (FieldFlag("--name", Example, "name", optional=True),)
    flags += (FieldFlag("--mode", Example, "mode", optional=True),)
    parser, args = _parse(flags, [])
    assert (args.name, args.mode) == (None, None)
    assert not any(flag.given(args) for flag in flags)
    assert "How to go. (default: safe)" in " ".join(parser.format_help().split())


def test_switches_turn_a_field_on_or_off_by_their_name():
    on = FieldFlag("--verbose", Example, "verbose")
    off = FieldFlag("--no-fsync", Example, "fsync")
    _, args = _parse((on, off), [])
    assert (on.value(args), off.value(args), on.given(args), off.given(args)) == (
        False,
        True,
        False,
        False,
    )
    _, args = _parse((on, off), ["--verbose", "--no-fsync"])
    assert (on.value(args), off.value(args), on.given(args), off.given(args)) == (
        True,
        False,
        True,
        True,
    )


@pytest.mark.parametrize(
    ("flag", "problem"),
    [
        (FieldFlag("--undocumented", Example, "undocumented"), "has no docstring"),
        (FieldFlag("--fsync", Example, "fsync"), "does not say it turns fsync on or off"),
        (FieldFlag("--no-verbose", Example, "verbose"), "does not say it turns verbose on or off"),
    ],
)
def test_a_flag_without_docstring_or_with_a_misleading_switch_name_is_refused(flag, problem):
    with pytest.raises(RuntimeError, match=problem):
        _parse((flag,), [])


def _train_actions():
    parser = build_parser("train")
    sub = next(a for a in parser._actions if a.dest == "command")
    return {a.option_strings[-1]: a for a in sub.choices["train"]._actions if a.option_strings}


@pytest.mark.parametrize("flag", _flags(), ids=lambda f: f.flag)
def test_every_train_flag_but_nproc_is_documented_by_its_fields_docstring(flag):
    action = _train_actions()[flag.flag]
    assert plain_text(field_docs(flag.model)[flag.field]) in action.help
    if not flag.optional and not flag.is_switch and not flag.is_file:
        assert action.default == getattr(flag.info.default, "value", flag.info.default)


def test_every_pipeline_parameter_flag_is_documented_by_its_fields_docstring():
    from deltarec.orchestrate.params import PipelineParams

    parser = build_parser("pipeline")
    sub = next(a for a in parser._actions if a.dest == "command").choices["pipeline"]
    run = next(a for a in sub._actions if a.dest == "action").choices["run"]
    actions = {a.dest: a for a in run._actions}
    docs = field_docs(PipelineParams)
    for name in PipelineParams.names():
        assert plain_text(docs[name]) in actions[name].help, name
