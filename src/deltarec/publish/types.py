"""The vocabulary of publishing, named once.

Exports:
    PublishMode: where a generation's rows go (SPEC §6).
"""

from __future__ import annotations

from enum import Enum


class PublishMode(str, Enum):
    """Where a generation's rows are published (SPEC §6).

    Attributes:
        DIRECT: into the live view, for freshness.
        STAGED: into a per-generation staging view, made live by promote.
    """

    DIRECT = "direct"
    STAGED = "staged"

    @classmethod
    def names(cls) -> list[str]:
        """The modes as written on command lines and in configs."""
        return [m.value for m in cls]
