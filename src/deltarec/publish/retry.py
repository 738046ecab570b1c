"""Retries with exponential backoff and jitter, for transient store errors only.

Only :class:`~deltarec.errors.StoreUnavailableError` (connection refused or reset, timeouts, a
locked database) is retried. Everything else, in particular
:class:`~deltarec.errors.InvalidRowError`, fails at once: retrying a NaN never helps.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from deltarec.errors import ConfigError, StoreUnavailableError

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how often to retry a store that cannot be reached.

    Attempt ``i`` (from 0) waits ``min(max_s, initial_s * multiplier**i)`` scaled by a random
    factor in ``[1 - jitter, 1]``, so ranks that lost the store together do not come back in
    lockstep. After ``deadline_s`` seconds of failures the last error is raised.
    """

    initial_s: float = 0.1
    max_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.5
    deadline_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("initial_s", "max_s", "deadline_s"):
            value = getattr(self, name)
            if not value >= 0:  # also refuses NaN
                raise ConfigError(f"retry {name} must be >= 0 seconds, got {value}")
        if not self.multiplier >= 1:
            raise ConfigError(f"retry multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter <= 1:
            raise ConfigError(f"retry jitter must be within [0, 1], got {self.jitter}")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait before retry number ``attempt`` (0-based)."""
        base = min(self.max_s, self.initial_s * self.multiplier**attempt)
        return base * (1.0 - self.jitter * (rng or random).random())

    def call(
        self,
        fn: Callable[[], T],
        what: str,
        on_retry: Callable[[StoreUnavailableError, float], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> T:
        """Run ``fn`` until it succeeds, retrying :class:`StoreUnavailableError` only.

        Args:
            fn: the operation (must be safe to repeat: every store write is).
            what: what is being done, for log messages.
            on_retry: called with the error and the wait before each retry (metrics).
            sleep: the sleep function (tests pass a fake).

        Raises:
            StoreUnavailableError: still unreachable after ``deadline_s`` (names ``what``).
        """
        start = time.monotonic()
        attempt = 0
        while True:
            try:
                return fn()
            except StoreUnavailableError as e:
                wait = self.delay(attempt)
                elapsed = time.monotonic() - start
                if elapsed + wait > self.deadline_s:
                    raise StoreUnavailableError(
                        f"{what}: store still unavailable after {elapsed:.1f}s "
                        f"and {attempt + 1} attempts: {e}"
                    ) from e
                log.warning("%s: %s; retrying in %.2fs", what, e, wait)
                if on_retry is not None:
                    on_retry(e, wait)
                sleep(wait)
                attempt += 1
