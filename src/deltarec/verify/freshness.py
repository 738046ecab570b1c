"""Freshness of the verified dumps: age, rows live per version, and publish lag.

The lag of a dump is the slowest rank's step-to-visible time (from the moment the dump was
taken; from its commit for dumps without ``taken_at``) from the store's registry
(:meth:`~deltarec.stores.Registry.freshness`).
"""

from __future__ import annotations

import time

from deltarec.artifacts.lineage import ExpectedState
from deltarec.artifacts.types import Manifest, parse_time
from deltarec.ids import make_version
from deltarec.stores.base import Registry
from deltarec.verify.types import DumpFreshness, VerifyResult


def dump_freshness(
    state: ExpectedState, result: VerifyResult, registry: Registry
) -> list[DumpFreshness]:
    """Freshness of every dump of the expected state (age, live rows, slowest lag)."""
    now = time.time()
    live: dict[int, int] = {}
    for t in result.tables.values():
        for v, n in t.live_by_version.items():
            live[v] = live.get(v, 0) + n
    lags = _publish_lags(registry, state.run, sorted({m.generation for m in state.manifests}))
    return [_one(m, now, live.get(m.version, 0), lags.get(m.version)) for m in state.manifests]


def _publish_lags(registry: Registry, run: str, generations: list[int]) -> dict[int, float]:
    """Version -> publish lag of the slowest rank, from the store's freshness records."""
    lags: dict[int, float] = {}
    for g in generations:
        for r in registry.freshness(run, g):
            v = make_version(int(r.generation), int(r.seq))
            lag = float(r.visible_at) - float(r.committed_at)
            lags[v] = max(lags.get(v, lag), lag)
    return lags


def _one(m: Manifest, now: float, live_rows: int, lag_s: float | None) -> DumpFreshness:
    try:
        age: float | None = max(0.0, now - parse_time(m.created_at))
    except ValueError:
        age = None
    return DumpFreshness(
        generation=m.generation,
        seq=m.seq,
        version=m.version,
        kind=m.kind.value,
        created_at=m.created_at,
        first_step=m.first_step,
        last_step=m.last_step,
        rows=sum(m.tables.values()),
        age_s=age,
        live_rows=live_rows,
        lag_s=lag_s,
    )


__all__ = ["dump_freshness"]
