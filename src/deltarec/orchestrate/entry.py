"""Run a training entry point ``package.module:function`` as a program (each torchrun rank).

``python -m deltarec.orchestrate.entry package.module:function [--] ARG...`` imports the
module, sets ``sys.argv`` to ``[package.module, ARG...]`` and calls ``function()`` with no
arguments; the settings come from the ``DELTAREC_*`` environment (docs/api.md). The process
exits with the function's return value when it is an int, else 0; an exception fails it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from deltarec.errors import BadInputError


def load_entry_point(spec: str) -> Callable[[], Any]:
    """The function ``spec`` (``package.module:function``) names.

    Raises:
        BadInputError: the module cannot be imported or has no such callable (names both).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise BadInputError(f"entry point {spec!r} is not package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise BadInputError(
                f"entry point {spec!r}: module {module_name!r} is not importable here ({e})"
            ) from e
        raise
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise BadInputError(f"entry point {spec!r}: {module_name} has no callable {attr!r}")
    return fn  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the entry point named by ``argv[0]`` with the rest as its ``sys.argv[1:]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        raise SystemExit("usage: python -m deltarec.orchestrate.entry package.module:function ...")
    spec, rest = args[0], args[1:]
    if rest and rest[0] == "--":
        rest = rest[1:]
    from deltarec.train.launch import exit_with_parent, under_torchrun

    if under_torchrun():
        exit_with_parent()  # a rank ends with its launcher, however the launcher dies
    fn = load_entry_point(spec)
    sys.argv = [spec.partition(":")[0], *rest]
    result = fn()
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
