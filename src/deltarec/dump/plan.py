"""What a dumper's configuration and table sources make of its memory, encoders and tables.

:func:`plan_dump` is the plan :class:`~deltarec.dump.dumper.Dumper` is built around: its host
budget, whether a child process encodes the shards, the pinned ring's slot size and how the
budget is shared out (:func:`~deltarec.dump.budget.plan_host_budget`). At start the ranks
agree on the tables (:func:`agreed_table_specs`) and on whether a snapshot fits
(:func:`snapshot_fits`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from deltarec.artifacts.types import TableSpec
from deltarec.dump.budget import HostBudgetPlan, plan_host_budget
from deltarec.dump.config import DumperConfig, check_row_encoding
from deltarec.dump.encode import encode_scratch_bytes
from deltarec.dump.exchange import Exchange
from deltarec.errors import ConfigError
from deltarec.tracking.pinned import pinned_slot_bytes
from deltarec.tracking.types import TableSource

log = logging.getLogger("deltarec.dump.dumper")  # the dumper's messages, under its name


def uses_encoder_process(config: DumperConfig) -> bool:
    """Whether chunks are encoded in a child process (``DumperConfig.encoder``).

    ``auto``: where CUDA is available. On a few CPU cores shared by the training ranks (the
    CPU path) the child's copies into the ring cost more than the GIL it frees.
    """
    if config.encoder == "auto":
        return torch.cuda.is_available()
    return config.encoder == "process"


def ring_slot_bytes(chunk_rows: int, sources: Sequence[TableSource], shared: bool) -> int:
    """A pinned ring slot: one chunk of the widest table (4-byte values), keys and ops.

    0 (no ring) without CUDA, unless the ring is ``shared`` with an encoder process.
    """
    if not sources or not (shared or torch.cuda.is_available()):
        return 0
    return pinned_slot_bytes(chunk_rows, max(s.spec.dim for s in sources))


@dataclass(frozen=True)
class DumpPlan:
    """A dumper's memory and encoding plan.

    Attributes:
        host_budget: bytes of host memory the dump path may hold (``host_budget_bytes()``).
        encoder_process: whether a child process encodes and writes the shards.
        slot_bytes: one pinned ring slot (0: no ring).
        host: how ``host_budget`` is shared out.
    """

    host_budget: int
    encoder_process: bool
    slot_bytes: int
    host: HostBudgetPlan


def plan_dump(config: DumperConfig, sources: Sequence[TableSource], keep_rows: bool) -> DumpPlan:
    """The plan for ``sources`` under ``config``; ``keep_rows``: rows are handed to a publisher."""
    budget = config.host_budget_bytes()
    widest = max(  # the most scratch one chunk's encoding takes, over the tables
        (
            encode_scratch_bytes(config.dtype_of(s.table_id), s.spec.dim, config.chunk_rows)
            for s in sources
        ),
        default=0,
    )
    process = uses_encoder_process(config)
    slot = ring_slot_bytes(config.chunk_rows, sources, process)
    host = plan_host_budget(budget, config.encode_threads(), widest, keep_rows, slot)
    return DumpPlan(budget, process, slot, host)


def snapshot_fits(
    config: DumperConfig,
    sources: Sequence[TableSource],
    exchange: Exchange,
    host_budget: int,
    generation: int,
) -> bool:
    """Collective: whether every rank's rows fit ``snapshot_max_bytes`` (logs if not)."""
    limit = config.snapshot_max_bytes
    if limit is None:
        limit = host_budget
    # a rank's share of every table's rows (4-byte values)
    share = sum(s.spec.num_embeddings * s.spec.dim * 4 for s in sources)
    share //= exchange.world_size
    fits = limit == 0 or share <= limit
    if all(exchange.all_gather(fits, what="the snapshot's size check")):
        return True
    log.warning(
        "no snapshot (dump 0) for generation %s: a rank's share of the tables' rows is "
        "%.1f GiB, over snapshot_max_bytes %.1f GiB (default: the host budget) on this or "
        "another rank, and writing them would stall the training thread until they are "
        "written; serving gets the rows the deltas touch. Raise snapshot_max_bytes (0: no "
        "limit) to write it anyway.",
        generation,
        share / 2**30,
        limit / 2**30,
    )
    return False


def agreed_table_specs(
    config: DumperConfig, sources: Sequence[TableSource], exchange: Exchange
) -> dict[str, TableSpec]:
    """Collective: the tables' specs in the configured dtypes, the same on every rank.

    Raises:
        ConfigError: ranks discovered different tables, ``table_dtypes`` names an unknown
            table, or a table's row cannot be encoded in its dtype.
    """
    tables = {s.table_id: replace(s.spec, dtype=config.dtype_of(s.table_id)) for s in sources}
    everyone = exchange.all_gather(sorted(tables))
    if any(names != everyone[0] for names in everyone):
        raise ConfigError(
            "ranks discovered different tables: "
            + "; ".join(f"rank {r}: {names}" for r, names in enumerate(everyone))
        )
    unknown = sorted(set(config.table_dtypes) - set(tables))
    if unknown:
        raise ConfigError(f"table_dtypes names unknown tables {unknown}; tables: {sorted(tables)}")
    for table, spec in tables.items():
        check_row_encoding(table, spec.dim, spec.dtype)
    return tables


__all__ = [
    "DumpPlan",
    "agreed_table_specs",
    "plan_dump",
    "ring_slot_bytes",
    "snapshot_fits",
    "uses_encoder_process",
]
