"""The per-rank background publisher the dumper feeds during training (direct mode).

``submit`` hands over a committed dump's rows for this rank and returns at once unless the
queue already holds ``max_queue_bytes`` of rows (backpressure instead of growing memory); a
daemon thread writes them to the store with :class:`~deltarec.publish.DumpPublisher`. A
failure on the thread is re-raised on the training thread by the next ``submit``, ``check`` or
``close``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.shards import ShardRows
from deltarec.artifacts.types import Manifest
from deltarec.errors import DeltarecError, StoreError
from deltarec.publish.budget import Throttle, check_budget, throttled
from deltarec.publish.budgetreport import BudgetReport, record_report
from deltarec.publish.metrics import PublishMetrics
from deltarec.publish.publisher import DumpPublisher, PartResult
from deltarec.publish.retry import RetryPolicy
from deltarec.publish.types import PublishMode
from deltarec.stores.backends import open_store
from deltarec.stores.base import Store

log = logging.getLogger(__name__)

DEFAULT_QUEUE_BYTES = 512 << 20


@dataclass
class _Item:
    manifest: Manifest | None  # None: wait for the manifest of (generation, seq) on disk
    rows: Mapping[str, ShardRows] | None
    nbytes: int
    generation: int = 0
    seq: int = 0
    wait_s: float = 0.0


_STOP = _Item(None, None, 0)


class BackgroundPublisher:
    """Publish this rank's part of each committed dump on a background thread.

    Args:
        store_url: the store URL (opened on the background thread, with retries).
        artifacts: the artifact root URI (rows not in memory are read from it).
        run: the run name.
        rank: this process's rank; only rank ``rank``'s shards are published.
        world_size: the number of ranks.
        mode: ``direct`` (live views) or ``staged`` (the generation's staging views).
        max_queue_bytes: bytes of rows allowed to wait; ``submit`` blocks beyond that.
        batch_bytes: target bytes per store transaction (default: by store kind, see
            :func:`~deltarec.publish.publisher.default_batch_bytes`).
        retry: the retry policy for transient store errors.
        metrics: Prometheus metrics (default: a private registry).
        metrics_port: serve the metrics over HTTP on this port (None: do not serve).
        read_p99_ms: a read-latency budget (:mod:`deltarec.publish.budget`); None: none.
        yield_cpu: under the budget, the publisher's own thread (and the threads it starts)
            runs at the lowest CPU priority (:mod:`deltarec.publish.yieldcpu`); never the
            caller's (the training thread). Off by default here: on a training host whose
            cores are all busy a starved publisher's queue fills, and a full queue holds the
            dump worker's commits and, through the host budget, the training thread.
    """

    def __init__(
        self,
        store_url: str,
        artifacts: str,
        run: str,
        rank: int,
        world_size: int,
        mode: PublishMode | str = PublishMode.DIRECT,
        *,
        max_queue_bytes: int = DEFAULT_QUEUE_BYTES,
        batch_bytes: int | None = None,
        retry: RetryPolicy | None = None,
        metrics: PublishMetrics | None = None,
        metrics_port: int | None = None,
        read_p99_ms: float | None = None,
        yield_cpu: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.store_url = store_url
        self.root = ArtifactRoot(artifacts)
        self.run = run
        self.rank = rank
        self.world_size = world_size
        self.mode = PublishMode.parse(mode)
        self.max_queue_bytes = max_queue_bytes
        self.batch_bytes = batch_bytes
        self.retry = retry or RetryPolicy()
        self.read_p99_ms = check_budget(read_p99_ms)
        self.yield_cpu = yield_cpu
        self.throttle: Throttle | None = None
        """The read budget's throttle, once the publisher runs (None without a budget)."""
        self.metrics = metrics or PublishMetrics()
        if metrics_port is not None:
            self.metrics.serve(metrics_port)
        self.results: list[PartResult] = []
        self.blocked_submits = 0
        """Submits that waited for room in the queue (backpressure on the training thread)."""
        self.manifest_polls = 0
        """Looks for a manifest another rank had not committed yet (``submit_when_committed``)."""
        self._queue: queue.Queue[_Item] = queue.Queue()
        self._queued = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self._store: Store | None = None
        self._thread = threading.Thread(
            target=self._work, name=f"deltarec-publisher-rank{rank}", daemon=True
        )
        self._thread.start()

    # ---- training thread -----------------------------------------------------------------
    def submit(self, manifest: Manifest, rows: Mapping[str, ShardRows] | None) -> None:
        """Queue this rank's rows of a COMMITTED dump (None or missing tables: artifacts).

        Blocks only while the queue holds ``max_queue_bytes`` (one oversized dump is admitted
        when the queue is empty). Raises the background failure, if any.
        """
        nbytes = sum(int(r.embedding.nbytes + r.keys.nbytes) for r in (rows or {}).values())
        self._enqueue(_Item(manifest, rows, nbytes))

    def submit_when_committed(
        self,
        generation: int,
        seq: int,
        rows: Mapping[str, ShardRows] | None,
        timeout_s: float = 3600.0,
    ) -> None:
        """Queue rows of a dump whose manifest another rank commits; the thread polls for it.

        Raises (on a later call) :class:`StoreError` if the manifest does not appear in
        ``timeout_s``.
        """
        nbytes = sum(int(r.embedding.nbytes + r.keys.nbytes) for r in (rows or {}).values())
        self._enqueue(_Item(None, rows, nbytes, generation, seq, timeout_s))

    def _enqueue(self, item: _Item) -> None:
        self.check()
        if self._closed:
            raise StoreError("the background publisher is closed")
        with self._cond:
            waited = False
            while (
                self._queued > 0
                and self._queued + item.nbytes > self.max_queue_bytes
                and self._error is None
            ):
                if not waited:
                    waited = True
                    self.blocked_submits += 1
                self._cond.wait(0.5)
            self._queued += item.nbytes
            self.metrics.queued_bytes.set(self._queued)
        self.check()
        self._queue.put(item)

    def check(self) -> None:
        """Re-raise a failure of the background thread (once per failure, then again)."""
        if self._error is not None:
            if isinstance(self._error, DeltarecError):
                raise self._error
            raise StoreError(f"background publisher failed: {self._error!r}") from self._error

    def close(self, timeout: float | None = None) -> None:
        """Publish everything queued, then stop the thread and close the store.

        Raises:
            StoreError: the queue did not drain within ``timeout`` seconds.
            DeltarecError: the background failure, if any.
        """
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise StoreError(
                f"background publisher of rank {self.rank} did not drain in {timeout}s "
                f"({self._queue.qsize()} dumps still queued)"
            )
        self.check()

    # ---- background thread ---------------------------------------------------------------
    def _open(self) -> DumpPublisher:
        if self._store is None:
            self._store = self.retry.call(
                lambda: open_store(self.store_url, self.root.uri, run=self.run),
                f"open store for rank {self.rank}",
            )
        publisher = DumpPublisher(
            self._store,
            self.root,
            self.run,
            self.mode,
            self.batch_bytes,
            self.retry,
            self.metrics,
        )
        self.throttle = throttled(publisher, self.read_p99_ms, self.yield_cpu)  # on this thread
        return publisher

    def _work(self) -> None:
        publisher: DumpPublisher | None = None
        try:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    return
                if self._error is None:
                    try:
                        publisher = publisher or self._open()
                        manifest = item.manifest or self._wait_manifest(item)
                        self.results.append(publisher.publish_dump(manifest, self.rank, item.rows))
                    except BaseException as e:  # re-raised on the training thread
                        log.error("rank %d: publishing failed: %s", self.rank, e)
                        self._error = e
                with self._cond:
                    self._queued -= item.nbytes
                    self.metrics.queued_bytes.set(self._queued)
                    self._cond.notify_all()
        finally:
            if self.throttle is not None:
                self._record_budget(self.throttle.close())
            if self._store is not None:
                self._store.close()

    def _record_budget(self, report: BudgetReport) -> None:
        """Leave the budget's report beside the last generation published (verify's metrics)."""
        if self.results:
            try:
                record_report(self.root, self.run, self.results[-1].generation, self.rank, report)
            except OSError as e:  # a report is not worth failing the run for
                log.warning("rank %d: the read budget's report was not written: %s", self.rank, e)

    def _wait_manifest(self, item: _Item) -> Manifest:
        path = self.root.manifest_file(self.run, item.generation, item.seq)
        deadline = time.monotonic() + item.wait_s
        delay = 0.05
        while not self.root.exists(path):
            if time.monotonic() > deadline:
                raise StoreError(
                    f"rank {self.rank}: manifest of generation {item.generation} dump "
                    f"{item.seq} not committed within {item.wait_s}s ({self.root.url(path)})"
                )
            self.manifest_polls += 1
            time.sleep(delay)
            delay = min(1.0, delay * 2)
        return self.root.read_manifest(self.run, item.generation, item.seq)
