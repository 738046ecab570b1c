"""A driver's exceptions as the store contract's errors: one helper, each backend its rules.

Every backend's calls into its driver run inside :meth:`DriverErrors.map_errors`, which turns
an exception of the driver into :class:`~deltarec.errors.StoreUnavailableError` where a retry
can fix it (the publisher retries those) and :class:`~deltarec.errors.StoreError` otherwise;
the message names the place and the driver's exception (``<where>: <Type>: <text>``), and the
driver's exception is the cause. What is transient is the one thing each backend says itself::

    _ERRORS = DriverErrors(sqlite3.Error, lambda e: "locked" in str(e) or "busy" in str(e))

    with _ERRORS.map_errors(self.describe()):
        conn.execute(...)

Exceptions that are not the driver's (deltarec's own among them) pass through unchanged. A
backend may also say what to fix for a permanent error (``advice``: the FeatureStore SDK's
authentication and schema errors name the credentials and the view's fields).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from deltarec.errors import StoreError, StoreUnavailableError


@dataclass(frozen=True)
class DriverErrors:
    """How one driver's exceptions map onto the store contract's errors.

    Attributes:
        driver: the driver's exception class(es); only these are mapped.
        transient: whether an exception of the driver is one a retry can fix (a lost or
            refused connection, a timeout, a lock or serialization conflict).
        advice: what to fix, for an exception that is not transient ("" when nothing
            particular; appended to the message).
    """

    driver: type[BaseException] | tuple[type[BaseException], ...]
    transient: Callable[[BaseException], bool]
    advice: Callable[[BaseException], str] | None = None

    def store_error(self, where: str, e: BaseException) -> StoreError:
        """The store error for the driver's exception ``e`` raised while doing ``where``.

        Returns:
            :class:`StoreUnavailableError` if ``e`` is transient, else :class:`StoreError`;
            the caller raises it ``from e``.
        """
        text = f"{where}: {type(e).__name__}: {e}".strip()
        if self.transient(e):
            return StoreUnavailableError(text)
        hint = self.advice(e) if self.advice is not None else ""
        return StoreError(f"{text}: {hint}" if hint else text)

    @contextmanager
    def map_errors(self, where: str) -> Iterator[None]:
        """Raise the driver's exceptions in the block as :meth:`store_error` (``from`` them)."""
        try:
            yield
        except self.driver as e:
            raise self.store_error(where, e) from e
