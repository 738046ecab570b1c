"""Lazy package exports: a name is imported from its module on first use, not with the package.

The packages whose modules import torch or torchrec (``deltarec.dump``, ``deltarec.model``,
``deltarec.train``) export their API through :func:`lazy_exports`, so importing the package
(or the torch-free modules beside it: configurations, errors, the table list) stays cheap and
the store side, ``deltarec verify`` and a ``deltarec train`` that only starts torchrun never
import torch::

    from deltarec._lazy import lazy_exports

    __getattr__ = lazy_exports(__name__, {"Dumper": "deltarec.dump.dumper"})

Each package still imports the names under ``TYPE_CHECKING`` so type checkers see them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports each of ``exports`` on first use.

    Args:
        package: the package's ``__name__``.
        exports: exported name -> the module that defines it (under the same name).

    Returns:
        The function to bind as the package's ``__getattr__`` (PEP 562). Each access reads
        the name from its module (imported once, by Python's module cache), so a name patched
        in its module is seen through the package too; any other name raises
        ``AttributeError`` as a plain module would.
    """
    table = dict(exports)

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
