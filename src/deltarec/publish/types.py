"""The vocabulary of publishing, named once.

Exports:
    PublishMode: where a generation's rows go (SPEC §6).
    check_publish_mode: the mode for a store, refused once where it is chosen.
    PartResult: what publishing one rank's part of one dump did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from deltarec.errors import ConfigError
from deltarec.stores.config import redact_url


class PublishMode(str, Enum):
    """Where a generation's rows are published (SPEC §6).

    A ``str`` enum: ``PublishMode.STAGED == "staged"``, and configs, command lines and
    Prometheus labels carry the value.

    Attributes:
        DIRECT: into the live view, for freshness.
        STAGED: into a per-generation staging view, made live by promote.
    """

    DIRECT = "direct"
    STAGED = "staged"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def names(cls) -> list[str]:
        """The modes as written on command lines and in configs."""
        return [m.value for m in cls]

    @classmethod
    def parse(cls, value: PublishMode | str, where: str = "publish mode") -> PublishMode:
        """The mode ``value`` names.

        Args:
            value: a mode or its name.
            where: what the value was given as, for the error (``publish_mode``,
                ``DELTAREC_PUBLISH_MODE``...).

        Raises:
            ConfigError: naming ``where`` and the modes, when ``value`` is none of them.
        """
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(
                f"{where} {value!r}: expected one of {', '.join(cls.names())}"
            ) from None


def check_publish_mode(store_url: str | None, mode: PublishMode | str) -> PublishMode:
    """The mode ``mode`` names, refused for a store that has no staging views when staged.

    Called where the mode is chosen (pipeline parameters, ``deltarec train``), so the refusal
    comes once, before anything starts.

    Raises:
        ConfigError: ``mode`` is no mode, or it is staged and ``store_url`` is a
            ``featurestore://`` URL (PAI FeatureStore has no staging views).
    """
    parsed = PublishMode.parse(mode)
    if parsed is PublishMode.STAGED and (store_url or "").strip().lower().startswith(
        "featurestore:"
    ):
        raise ConfigError(
            "publish mode 'staged' needs staging views, which PAI FeatureStore does not have "
            f"({redact_url(store_url or '')}): publish with mode 'direct' (verify still checks "
            "every row in the view before promote)"
        )
    return parsed


@dataclass
class PartResult:
    """What publishing one rank's part of one dump did."""

    generation: int
    seq: int
    rank: int
    rows: int = 0  # rows written now
    bytes: int = 0  # encoded row bytes written now
    skipped_rows: int = 0  # rows already in the store per the progress marks
    tables: list[str] = field(default_factory=list)
    seconds: float = 0.0
    lag_s: float | None = None  # commit -> visible (direct mode)
    freshness_s: float | None = None  # dump taken (training step) -> visible (direct mode)

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict."""
        return dict(self.__dict__)
