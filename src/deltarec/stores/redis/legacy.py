"""Redis stores written before rows were kept per run: moved over, or refused.

Until rows were kept per run (docs/runs.md), a view was registered as ``<table>|<stage>`` and its
hash held whatever run wrote it. Opening such a store moves it to the per-run layout when one
run (or none) wrote it: the live hash keeps its name, which is the serving name of the run that
owns it from then on. Otherwise every row operation is refused with
:func:`~deltarec.stores.runviews.runless_problem`'s message (the SQL stores move the same way:
:mod:`deltarec.stores.sql.legacy`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deltarec.stores.runviews import runless_problem


@dataclass(frozen=True)
class RunlessKeys:
    """The key names of the store being opened, as its own naming gives them.

    Attributes:
        prefix: the store's key prefix.
        reg: a registry key (``<prefix>~<name>[:<part>...]``).
        serving: a table's serving hash.
        parked: a run's parked hash of a table (also its floor's field).
        stage_hash: a run's staging hash of a table.
    """

    prefix: str
    reg: Callable[..., str]
    serving: Callable[[str], str]
    parked: Callable[[str, str], str]
    stage_hash: Callable[[str, int, str], str]


def migrate_runless(
    client: Any, keys: RunlessKeys, where: str, watch_error: type[Exception]
) -> str | None:
    """Move a Redis store of the runless layout to per-run views; None, or why it is refused.

    A runless view is registered as ``<table>|<stage>``. With one run known, the live hash stays
    where it is, as the serving name of the run that now owns it (so serving reads the same
    hash); its tombstones, floor and staging hashes are renamed to that run's names. One
    ``MULTI``/``EXEC``, watched against a concurrent opener doing the same.

    Args:
        client: the store's Redis client.
        keys: the store's key names.
        where: the store, for messages (its ``describe()``).
        watch_error: what the client raises when a watched key changed.
    """
    reg = keys.reg
    for _ in range(20):
        with client.pipeline(transaction=True) as pipe:
            pipe.watch(reg("views"))
            fields = [_text(f) for f in pipe.hkeys(reg("views"))]
            runless = [f for f in fields if f.count("|") == 1]
            if not runless:
                return None
            runs = sorted(
                _text(k)[len(reg("gens")) + 1 :] for k in pipe.scan_iter(f"{reg('gens')}:*")
            )
            tables = [f.split("|") for f in runless]
            if len(runs) > 1 or (not runs and any(pipe.exists(keys.serving(t)) for t, _ in tables)):
                return runless_problem(where, runs)
            records = {f: pipe.hget(reg("views"), f) for f in runless}
            floors = {t: pipe.hget(reg("floors"), keys.serving(t)) for t, _ in tables}
            renames = []
            owner = runs[0] if runs else None
            for table, stage in tables:
                if owner is None:
                    continue
                if int(stage):
                    old = f"{keys.prefix}~stage:{stage}:{table}"
                    new = keys.stage_hash(owner, int(stage), table)
                else:
                    old, new = reg("tomb", table), reg("tomb", owner, table)
                if pipe.exists(old):
                    renames.append((old, new))
            pipe.multi()
            for field in runless:
                pipe.hdel(reg("views"), field)
                if owner is not None:
                    pipe.hset(reg("views"), f"{owner}|{field}", records[field])
            for table, stage in tables:
                if owner is not None and not int(stage):
                    pipe.hsetnx(reg("serves"), table, owner)
                    if floors[table] is not None:
                        pipe.hset(reg("floors"), keys.parked(owner, table), floors[table])
                        pipe.hdel(reg("floors"), keys.serving(table))
            for old, new in renames:
                pipe.rename(old, new)
            try:
                pipe.execute()
                return None
            except watch_error:
                continue
    return f"{where}: moving the runless layout kept racing with another opener"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
