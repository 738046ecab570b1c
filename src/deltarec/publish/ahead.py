"""The next part's rows checked on a thread while this part is written (stores that are not SQL).

:meth:`~deltarec.publish.publisher.DumpPublisher.publish_dump` checks every row of a part
before it writes any of it. A SQL store checks the first table's rows while writing them (a bad
row aborts the one transaction); any other store needs a pass over the part's rows first, and
that pass leaves the store idle: the shards of a 250k-row part of dim 64 take about 0.1 s to
hash and decode. So when ``deltarec publish`` writes several ranks' parts of a dump one after
the other into such a store (Redis, FeatureStore), :func:`parts_checked_ahead` checks the next
part on a thread (:func:`check_part`) while this one is checked and written: the first two
checks run side by side, and the store is never left waiting for a check but the first.

A check's error (a bad row, a shard that does not match its sha256) is raised when that part's
turn comes, before anything of it is written, as its own check would raise it; the parts
before it are published as they were. Memory: the checking reader's read chunks (8 MB, two
read ahead) beside the writing one's.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from deltarec.artifacts.types import Manifest
from deltarec.publish.rows import TablePart

if TYPE_CHECKING:
    from deltarec.publish.face import PublisherFace
    from deltarec.publish.types import PartResult


def check_part(
    pub: PublisherFace, manifest: Manifest, rank: int, tables: list[str]
) -> frozenset[str]:
    """Check every row of ``tables`` of rank ``rank``'s part of ``manifest`` in the artifacts.

    Each shard's sha256 first, then every row, as ``publish_dump`` checks them before writing.

    Returns:
        ``tables``.

    Raises:
        InvalidRowError: a row cannot be published.
        ChecksumError: a shard does not match its manifest entry.
    """
    info = pub.generation_info(manifest.generation)
    where = f"run {pub.run!r} generation {manifest.generation} dump {manifest.seq} rank {rank}"
    for table in tables:
        pub.check_part(TablePart(pub.root, manifest, rank, table, info.tables[table]), where)
    return frozenset(tables)


def _pending_tables(pub: PublisherFace, manifest: Manifest, rank: int) -> list[str]:
    """The tables of the part that ``publish_dump`` would check: declared and not complete."""
    info = pub.generation_info(manifest.generation)
    done = pub.marks(manifest.generation, manifest.seq, rank)
    return [
        t
        for t in sorted(manifest.tables)
        if t in info.tables and not (t in done and done[t].complete)
    ]


def parts_checked_ahead(
    pub: PublisherFace, manifest: Manifest, ranks: list[int]
) -> Iterator[PartResult]:
    """``publish_dump`` of each of ``ranks``' parts from the artifacts, each as it is done.

    The next part is checked on a thread meanwhile (see the module docstring).
    """
    with ThreadPoolExecutor(1, thread_name_prefix="publish-check") as pool:
        following: Future[frozenset[str]] | None = None
        for i, rank in enumerate(ranks):
            mine = following
            following = None
            if i + 1 < len(ranks):
                tables = _pending_tables(pub, manifest, ranks[i + 1])  # the store, from here
                following = pool.submit(check_part, pub, manifest, ranks[i + 1], tables)
            yield pub.publish_dump(manifest, rank, checked=mine)
