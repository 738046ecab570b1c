"""Rank 0's claim on a run at start: the run's lease, the clean-up, a new generation.

Only the run's one writer may clean up incomplete dumps and allocate a generation, so the
lease comes first (docs/reliability.md). The outcome is what rank 0 broadcasts to the other
ranks (:meth:`~deltarec.dump.dumper.Dumper.start`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deltarec.artifacts.lease import LeaseHeldError, RunLease
from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.types import GenerationInfo, Parent, TableSpec
from deltarec.dump.config import DumperConfig

log = logging.getLogger("deltarec.dump.dumper")  # the dumper's messages, under its name


@dataclass(frozen=True)
class GenerationClaim:
    """What rank 0 claims: a generation of ``config.run`` with ``tables`` under ``root``.

    Attributes:
        root: the artifact root.
        config: the dumper's config (run, lease TTL).
        world_size: the ranks writing the generation.
        tables: the tables the ranks agreed on.
        parent: the checkpoint the generation restores from, if any.
        on_generation: called once the generation is allocated (a failure fails the claim).
    """

    root: ArtifactRoot
    config: DumperConfig
    world_size: int
    tables: dict[str, TableSpec]
    parent: Parent | None
    on_generation: Callable[[GenerationInfo], None] | None

    def run(self, keep: Callable[[RunLease | None], None]) -> tuple[str, Any]:
        """Take the lease, clean up, allocate; never raises.

        ``keep`` is handed the lease as soon as it is held (so a caller that fails later still
        releases it) and None when it is released here, after a failure.

        Returns:
            ``("ok", GENERATION.json's object)``, ``("held", why)`` when another writer holds
            the run, or ``("error", what failed)``.
        """
        lease: RunLease | None = None
        outcome: tuple[str, Any]
        try:
            lease = RunLease.acquire(self.root, self.config.run, self.config.lease_ttl_s)
            keep(lease)
            removed = self.root.clean_incomplete(self.config.run)
            if removed:
                log.info("removed %d incomplete dump directories: %s", len(removed), removed)
            info = GenerationInfo(
                run=self.config.run,
                generation=1,
                world_size=self.world_size,
                tables=self.tables,
                parent=self.parent,
            )
            claimed = self.root.allocate_generation(info)
            lease.set_generation(claimed.generation)
            lease.start_renewing()
            if self.on_generation is not None:
                self.on_generation(claimed)
            outcome = ("ok", claimed.to_json())
        except LeaseHeldError as e:
            outcome = ("held", str(e))
        except Exception as e:
            outcome = ("error", f"{type(e).__name__}: {e}")
        if outcome[0] != "ok" and lease is not None:
            lease.release()
            keep(None)
        return outcome


__all__ = ["GenerationClaim"]
