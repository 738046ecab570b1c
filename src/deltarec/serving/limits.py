"""What one request to a replica may ask for (no torch here).

The replica's HTTP API (:mod:`deltarec.serving.api`) checks every bound here *before* it
reads a body or does the work: a request over a bound is answered with a 4xx naming the bound,
never by a dropped connection, and the memory all requests in flight hold together stays
under :attr:`ServeLimits.max_inflight_bytes` (docs/serving.md, "Bounds").

The bearer token is read from the environment by :func:`deltarec.stores.token_from_env`, which
the ``replica://`` store client shares.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from deltarec.errors import ConfigError

JSON_ID_BYTES = 22
"""The most bytes one id takes in a ``/v1/lookup`` body: 20 digits and sign, a comma."""
JSON_VALUE_BYTES = 26
"""The most bytes one decoded float takes in a ``/v1/lookup`` answer (``-1.2345678901234567e-05,``
and a space)."""


@dataclass(frozen=True)
class ServeLimits:
    """Bounds of the replica's HTTP API; every one is checked before the work it bounds.

    Attributes:
        max_keys: keys in one ``POST /v1/rows`` body, and keys one ``GET /v1/keys`` answers
            (a larger ``limit`` is capped).
        max_ids: ids in one ``POST /v1/lookup``.
        max_answer_bytes: bytes of one answer: keys x (9 + encoded row bytes) for
            ``/v1/rows``, ids x dim x :data:`JSON_VALUE_BYTES` for ``/v1/lookup``, keys x 8
            for ``/v1/keys``. Over it: 413 with ``X-Deltarec-Max-Keys``, the most keys of
            that table one request may name.
        max_inflight_bytes: bytes all requests in flight hold together (bodies read,
            answers built and their working copies, counted before the work: twice the body
            and answer of a readback); a request that does not fit waits up to
            ``queue_timeout_s``, then gets 503 with ``Retry-After``. It must hold one largest
            request.
        max_connections: open connections; a request on any connection beyond it gets 503.
        max_workers: threads doing lookups and encoding answers (the rest wait).
        max_head_bytes: bytes of a request line and headers (over it: 431).
        header_timeout_s: seconds to receive a request's line and headers (then 408).
        request_timeout_s: seconds to receive a body, and seconds to send an answer to a
            client that does not read it (then the connection is closed).
        queue_timeout_s: seconds a request waits for room in ``max_inflight_bytes``.
        keepalive_s: seconds an idle keep-alive connection stays open.
    """

    max_keys: int = 1 << 20
    max_ids: int = 1 << 16
    max_answer_bytes: int = 64 << 20
    max_inflight_bytes: int = 256 << 20
    max_connections: int = 1024
    max_workers: int = 4
    max_head_bytes: int = 16 << 10
    header_timeout_s: float = 10.0
    request_timeout_s: float = 30.0
    queue_timeout_s: float = 10.0
    keepalive_s: float = 5.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ConfigError(f"replica limit {f.name}={getattr(self, f.name)} must be > 0")
        if 2 * (self.max_answer_bytes + self.max_body_bytes(rows=True)) > self.max_inflight_bytes:
            raise ConfigError(
                f"replica limits: max_inflight_bytes={self.max_inflight_bytes} must hold one "
                f"largest request: twice max_answer_bytes={self.max_answer_bytes} and a body of "
                f"max_keys={self.max_keys} keys (its answer and body, and their working copies)"
            )

    def max_body_bytes(self, rows: bool) -> int:
        """The largest body: ``/v1/rows`` (``rows``: 8 bytes a key) or ``/v1/lookup`` (JSON)."""
        return self.max_keys * 8 if rows else self.max_ids * JSON_ID_BYTES + 1024


__all__ = [
    "JSON_ID_BYTES",
    "JSON_VALUE_BYTES",
    "ServeLimits",
]
