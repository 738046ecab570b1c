"""Changes to this process's environment that undo themselves."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["environ_set"]


@contextlib.contextmanager
def environ_set(name: str, value: str) -> Iterator[None]:
    """Set the environment variable ``name`` to ``value`` while inside.

    On the way out the variable gets back the value it had, or is removed again if it was
    unset, so the processes started after the block see what they would have seen before.
    """
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
