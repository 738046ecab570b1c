"""Command-line flags derived from the fields of pydantic models: one definition per flag.

A :class:`FieldFlag` names a flag, the model field it sets and, optionally, a metavar. The
flag's type, choices, default and whether it is required come from the field
(:func:`argument_options`); its help is the field's docstring (:func:`field_docs`), with the
reStructuredText roles and literals written as plain text (:func:`plain_text`). A ``bool``
field is a switch: ``--X`` turns on a field that is off by default, ``--no-X`` turns off one
that is on.
"""

from __future__ import annotations

import argparse
import inspect
import re
import types
from enum import Enum
from typing import Any, Literal, NamedTuple, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo


def field_docs(model: type[BaseModel]) -> dict[str, str]:
    """The docstring of each field of ``model`` (the string literal after its annotation).

    Pydantic reads them into each field's ``description`` (``use_attribute_docstrings``, set
    on every model whose fields are flags); a field without one is left out.
    """
    return {
        name: inspect.cleandoc(info.description)
        for name, info in model.model_fields.items()
        if info.description
    }


_ROLE = re.compile(r":[a-z]+:`(~?)([^`]*)`")


def _role_text(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return target.rsplit(".", 1)[-1] if tilde else target


def plain_text(doc: str) -> str:
    """A docstring as one line of ``--help`` text.

    ``:func:`~a.b.c``` becomes ``c`` (``a.b.c`` without the tilde), a ````literal```` its text,
    newlines spaces, and ``%`` is escaped for argparse.
    """
    text = _ROLE.sub(_role_text, doc)
    return " ".join(text.replace("``", "").split()).replace("%", "%%")


def value_type(annotation: Any) -> Any:
    """The annotation without ``None`` (``int | None`` -> ``int``)."""
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def argument_options(info: FieldInfo) -> dict[str, Any]:
    """The ``add_argument`` options a field gives: type, choices, and default or required.

    ``int`` and ``float`` fields convert their value; ``Literal`` and ``Enum`` fields take
    their values as choices (an Enum default as its value); other values stay strings.
    """
    annotation = value_type(info.annotation)
    options: dict[str, Any] = {}
    if annotation in (int, float):
        options["type"] = annotation
    if get_origin(annotation) is Literal:
        options["choices"] = list(get_args(annotation))
    elif isinstance(annotation, type) and issubclass(annotation, Enum):
        options["choices"] = [member.value for member in annotation]
    if info.is_required():
        options["required"] = True
    else:
        options["default"] = getattr(info.default, "value", info.default)
    return options


class FieldFlag(NamedTuple):
    """One flag that sets one field of a pydantic model.

    With ``optional`` the flag's default is None (off for a switch) whatever the field's, and
    a required field's flag is not required: the flag counts as given only when set, and the
    field's own default (named in the help) applies otherwise.
    """

    flag: str
    model: type[BaseModel]
    field: str
    metavar: str | None = None
    optional: bool = False
    name: str | None = None
    """The attribute of the parsed namespace; None: the flag's name, as argparse derives it."""

    @property
    def dest(self) -> str:
        """The attribute of the parsed namespace."""
        return self.name or self.flag.removeprefix("--").replace("-", "_")

    @property
    def info(self) -> FieldInfo:
        """The model field."""
        return self.model.model_fields[self.field]

    @property
    def is_switch(self) -> bool:
        """Whether the flag takes no value (a ``bool`` field)."""
        return value_type(self.info.annotation) is bool

    @property
    def is_file(self) -> bool:
        """Whether the field is a model of its own, given as the path of a JSON file."""
        annotation = value_type(self.info.annotation)
        return isinstance(annotation, type) and issubclass(annotation, BaseModel)

    @property
    def turns_off(self) -> bool:
        """Whether the switch turns off a field that is on by default (``--no-X``)."""
        return self.is_switch and self.info.default is True

    def add_to(self, group: argparse._ActionsContainer, docs: dict[str, str]) -> None:
        """Add the flag to ``group``; ``docs`` are the model's :func:`field_docs`.

        Raises:
            RuntimeError: the field has no docstring, or a switch's name does not say which
                way it turns the field (a programming error, raised when the parser is built).
        """
        if self.field not in docs:
            raise RuntimeError(f"{self.model.__name__}.{self.field} ({self.flag}) has no docstring")
        help_text = plain_text(docs[self.field])
        if self.is_switch:
            if self.turns_off != self.flag.startswith("--no-"):
                raise RuntimeError(f"{self.flag} does not say it turns {self.field} on or off")
            if self.turns_off:
                help_text += f" On by default; {self.flag} turns it off."
            group.add_argument(self.flag, action="store_true", dest=self.dest, help=help_text)
            return
        if self.is_file:
            group.add_argument(
                self.flag, dest=self.dest, metavar=self.metavar, help=f"JSON file: {help_text}"
            )
            return
        options = argument_options(self.info)
        field_default = options.pop("default", None)
        if field_default not in (None, ""):
            help_text += f" (default: {plain_text(str(field_default))})"
        if self.optional:
            options.pop("required", None)
        elif not options.get("required"):
            options["default"] = field_default
        group.add_argument(
            self.flag, dest=self.dest, metavar=self.metavar, help=help_text, **options
        )

    def given(self, args: argparse.Namespace) -> bool:
        """Whether the flag was set on the command line (for an ``optional`` flag)."""
        value = getattr(args, self.dest)
        return value is not None and value is not False

    def value(self, args: argparse.Namespace) -> Any:
        """The field's value the parsed flag gives (a ``--no-X`` switch inverted)."""
        value = getattr(args, self.dest)
        return not value if self.turns_off else value


def add_flags(group: argparse._ActionsContainer, flags: tuple[FieldFlag, ...]) -> None:
    """Add ``flags`` to ``group``, in order, each with its field's docstring as help."""
    docs: dict[type[BaseModel], dict[str, str]] = {}
    for flag in flags:
        if flag.model not in docs:
            docs[flag.model] = field_docs(flag.model)
        flag.add_to(group, docs[flag.model])
