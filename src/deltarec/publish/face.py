"""The publisher's face: what the other ways to publish use of it.

``together.py``, ``ahead.py``, ``backlog.py``, ``frombase.py`` and ``heldparts.py`` publish
through a :class:`~deltarec.publish.publisher.DumpPublisher` and use only its public attributes
and methods, stated here by :class:`PublisherFace`. They name this Protocol instead of the
class, so they stay below ``publisher.py``, which imports them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Protocol

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.shards import ShardRows
from deltarec.artifacts.types import GenerationInfo, Manifest, TableSpec
from deltarec.publish.metrics import PublishMetrics
from deltarec.publish.rows import TablePart
from deltarec.publish.types import PartResult, PublishMode
from deltarec.stores.base import Registry, Store
from deltarec.stores.types import ProgressMark

BatchHook = Callable[[ProgressMark, int], None]
"""Called after each committed transaction with its mark and its row count."""


class PublisherFace(Protocol):
    """What a collaborator of the publisher uses of it (``DumpPublisher`` is one).

    Attributes:
        store: the open store written to.
        registry: the store's registry (progress marks, generations, freshness).
        root: the artifact root read from.
        run: the run published.
        mode: direct or staged.
        metrics: the publish metrics.
        after_batch: called after each committed transaction, if set.
    """

    store: Store
    registry: Registry
    root: ArtifactRoot
    run: str
    mode: PublishMode
    metrics: PublishMetrics
    after_batch: BatchHook | None

    def generation_info(self, generation: int) -> GenerationInfo:
        """GENERATION.json of ``generation`` (cached)."""
        ...

    def prepare(self, generation: int) -> None:
        """Provision the generation's views (and staging views) and register it; idempotent."""
        ...

    def call(self, fn: Callable[[], object], what: str) -> object:
        """``fn()`` under the retry policy (transient store errors retried, each counted)."""
        ...

    def fence(self, generation: int) -> None:
        """Refuse unless ``generation`` is the run's newest (one writer per run, SPEC §5)."""
        ...

    def marks(self, generation: int, seq: int, rank: int) -> dict[str, ProgressMark]:
        """Table id -> the store's progress mark of dump ``seq``'s part of rank ``rank``."""
        ...

    def transaction_rows(self, spec: TableSpec) -> int:
        """Rows of ``spec`` per store transaction now."""
        ...

    def check_part(self, part: TablePart, where: str) -> None:
        """Check every row of ``part`` (shard checksums first), as a write would; keep none."""
        ...

    def publish_dump(
        self,
        manifest: Manifest,
        rank: int,
        rows: Mapping[str, ShardRows] | None = None,
        checked: Future[frozenset[str]] | None = None,
    ) -> PartResult:
        """Publish rank ``rank``'s part of a committed dump."""
        ...

    def complete_snapshot(self, manifest: Manifest) -> None:
        """Complete a snapshot dump's tables whose parts are all in."""
        ...

    def record_freshness(self, manifest: Manifest, rank: int, result: PartResult) -> None:
        """Record when the part became readable."""
        ...
