"""Named fault points for crash tests: hold a process at a chosen moment so a test can kill it.

Production code calls :func:`failpoint` at the moments a crash is most harmful (mid shard
write, between the shards and the manifest, mid publish, during a checkpoint). Unless
``DELTAREC_FAULT`` names that point it returns at once (one dictionary lookup). When it does,
the calling thread writes ``<DELTAREC_FAULT_DIR>/<point>.<pid>`` and then blocks forever, so
that the test sees the process held exactly there and kills the whole process tree (``kill
-9``) - the way a machine loss or an OOM kill strikes.

``DELTAREC_FAULT`` is ``POINT``, ``POINT@N`` (the N-th time this process reaches it, default
1) or ``POINT@N:R`` (only on rank R, from ``RANK``).

**Slow points** make a store slow instead of stopping it: ``DELTAREC_SLOW=POINT:MS`` makes
:func:`slowdown` of ``POINT`` return ``MS`` milliseconds per megabyte, which the code there spends
where a real slow store would (Redis: on the server, after each script of the write, inside
its ``MULTI``/``EXEC`` or pipeline, so every reader waits for it). The read-latency budget's
tests use it (:data:`SLOW_POINTS`).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

ENV = "DELTAREC_FAULT"
DIR_ENV = "DELTAREC_FAULT_DIR"
POINTS = ("shard.write", "commit.manifest", "publish.batch", "checkpoint.save")
"""The fault points, in the order a dump and its checkpoint reach them."""
COMPACT_POINTS = ("compact.part", "compact.partition", "compact.base_json")
"""Compaction's fault points: after a part's bytes are built, before a partition's record is
written (a fanned-out compaction), before BASE.json is written."""
GC_POINTS = ("gc.delete",)
"""Retention's fault point: a dump's MANIFEST.json (a base's BASE.json) deleted, its folder not
yet."""

SLOW_ENV = "DELTAREC_SLOW"
SLOW_POINTS = ("redis.exec",)
"""The slow points: ``redis.exec``, each write transaction of the Redis store (each unit of a
paced write: every script of it)."""

_lock = threading.Lock()
_hits: dict[str, int] = {}


def _parse(spec: str) -> tuple[str, int, int | None]:
    point, _, rest = spec.partition("@")
    nth, _, rank = rest.partition(":")
    return point, int(nth or 1), int(rank) if rank else None


def failpoint(point: str) -> None:
    """Hold the calling thread forever if ``DELTAREC_FAULT`` selects this hit of ``point``."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, nth, rank = _parse(spec)
    if name != point or (rank is not None and int(os.environ.get("RANK", "0")) != rank):
        return
    with _lock:
        _hits[point] = _hits.get(point, 0) + 1
        if _hits[point] != nth:
            return
    where = Path(os.environ.get(DIR_ENV, "."))
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{point}.{os.getpid()}").write_text(f"{time.time()}\n")
    while True:  # until the test kills this process tree
        time.sleep(3600)


def slowdown(point: str) -> float:
    """Seconds per megabyte that ``DELTAREC_SLOW`` adds at ``point`` (0.0 unless it names it).

    Raises:
        ValueError: ``DELTAREC_SLOW`` is not ``POINT:MS`` with MS a number >= 0.
    """
    spec = os.environ.get(SLOW_ENV)
    if not spec:
        return 0.0
    name, _, ms = spec.partition(":")
    if name != point:
        return 0.0
    try:
        value = float(ms)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{SLOW_ENV}={spec!r}: expected POINT:MS, MS a number >= 0")
    return value / 1000.0
