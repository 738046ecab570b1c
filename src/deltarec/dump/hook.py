"""The dumper as a training hook (``deltarec.train.hooks.TrainHook``), and its factory.

``deltarec train --artifacts ROOT --run NAME ...`` builds the hook with::

    from deltarec.dump import make_train_hook
    hook = make_train_hook(artifacts=root, run=name, every_steps=50, every_minutes=None,
                           snapshot=True, store=None, publish_mode="direct")

The training loop then calls ``load_state_dict`` (when resuming), ``on_start``, ``after_step``
every step, ``before_eval``/``after_eval`` around evaluation, ``on_end`` (the final dump) and
``close`` on every exit path. With a ``store``, each committed dump's rows of this rank are
handed to a :class:`deltarec.publish.BackgroundPublisher` from memory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from deltarec.artifacts.shards import ShardRows
from deltarec.artifacts.types import GenerationInfo, Manifest
from deltarec.dump.config import DumperConfig
from deltarec.dump.dense import DenseDumps, DenseStateFn
from deltarec.dump.dumper import Dumper
from deltarec.errors import ConfigError, validation_problems
from deltarec.publish.types import PublishMode
from deltarec.tracking.types import TableSource

if TYPE_CHECKING:
    from deltarec.publish.background import BackgroundPublisher

log = logging.getLogger(__name__)

SourceFactory = Callable[[torch.nn.Module], Sequence[TableSource]]


def _default_sources(model: torch.nn.Module) -> Sequence[TableSource]:
    from deltarec.tracking.discovery import discover_sources

    return discover_sources(model)


class DumpHook:
    """Drives a :class:`Dumper` from the training loop (implements ``TrainHook``).

    Args:
        config: the dumper's configuration.
        store: a store URL to publish committed dumps to (None: artifacts only).
        publish_mode: ``direct`` or ``staged`` (see SPEC §6).
        sources: builds the table sources from the model (default: DMP discovery).
        metrics_port: serve Prometheus metrics on this port plus the process's
            ``LOCAL_RANK`` (None: not served): the dump path's (:mod:`deltarec.dump.metrics`)
            and, with a store, the background publisher's (the same as ``deltarec publish
            --metrics-port``).
        dense_every: commit the model's dense (non-embedding) state with every N-th dump
            (:mod:`deltarec.dump.dense`; None: no dense state).
        dense_state: reads the dense state (default: :func:`deltarec.dump.dense.dense_state`).
    """

    def __init__(
        self,
        config: DumperConfig,
        store: str | None = None,
        publish_mode: PublishMode | str = PublishMode.DIRECT,
        sources: SourceFactory = _default_sources,
        metrics_port: int | None = None,
        dense_every: int | None = None,
        dense_state: DenseStateFn | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.publish_mode = PublishMode.parse(publish_mode, "publish_mode")
        self._sources = sources
        self.metrics_port = metrics_port
        self.dumper: Dumper | None = None
        self.publisher: BackgroundPublisher | None = None
        self.registry: Any = None  # prometheus_client.CollectorRegistry when served
        self._state: dict[str, Any] | None = None
        self.dense = None if dense_every is None else DenseDumps(dense_every, dense_state)

    def on_start(self, model: torch.nn.Module, step: int, restored_from: int | None) -> None:
        """Discover the tables, open the generation (snapshot or republish).

        With a store, rank 0 first publishes what earlier generations committed but did not
        publish (a trainer killed between a commit and its publish), once it holds the run's
        lease and while the store still accepts them: once this generation registers, the
        store refuses older ones.
        """
        sources = self._sources(model)
        if self.metrics_port is not None:
            from prometheus_client import CollectorRegistry

            self.registry = CollectorRegistry()
        publishing = self.store is not None
        self.dumper = Dumper(
            self.config,
            sources,
            on_commit=self._submit if publishing else None,
            keep_rows=publishing,
            on_generation=self._publish_earlier_generations if publishing else None,
        )
        if self.dense is not None:  # its commits carry the dense state of their step
            self.dumper.root = self.dense.root(self.config.artifacts, self.config.storage_options)
        if publishing:  # before start: the first commits hand their rows to it
            self.publisher = self._make_publisher(self.dumper.plan.publish_queue_bytes)
        if self.registry is not None:
            from prometheus_client import start_http_server

            from deltarec.dump.metrics import DumpCollector
            from deltarec.publish.metrics import metrics_host

            self.registry.register(DumpCollector(self.dumper))
            if self.publisher is None:  # no store: the dump path's metrics alone
                start_http_server(self._rank_port(), addr=metrics_host(), registry=self.registry)
        if self._state is not None:
            self.dumper.load_state_dict(self._state)
        self.dumper.start(step, restored_from)
        if self.dense is not None:
            self.dense.started(model, step)

    def _publish_earlier_generations(self, new: GenerationInfo) -> None:
        """Publish earlier generations' committed dumps that the store does not hold yet.

        Runs on rank 0 with the run's lease held and ``new`` allocated but not yet registered
        with the store: only the generations the store may still take (its newest one and
        any newer), in order.
        """
        from deltarec.artifacts.root import ArtifactRoot
        from deltarec.errors import StaleGenerationError
        from deltarec.publish import DumpPublisher
        from deltarec.publish.retry import RetryPolicy
        from deltarec.stores import open_store

        assert self.store is not None
        root = ArtifactRoot(self.config.artifacts, self.config.storage_options)
        run = self.config.run
        generations = [g for g in root.list_generations(run) if g < new.generation]
        if not generations:
            return
        retry = RetryPolicy()
        store = retry.call(
            lambda: open_store(self.store, root.uri, run=run), f"open the store of run {run!r}"
        )
        try:
            publisher = DumpPublisher(store, root, run, mode=self.publish_mode, retry=retry)
            seen = publisher.retry.call(
                lambda: store.registry.generations(run), f"read the generations of run {run!r}"
            )
            for g in [g for g in generations if not seen or g >= seen[-1]]:
                try:
                    parts = publisher.publish_generation(g)
                except StaleGenerationError as e:
                    log.warning("not publishing generation %d any more: %s", g, e)
                    continue
                if parts:
                    log.info(
                        "published %d dump parts that generation %d had committed but not "
                        "published",
                        len(parts),
                        g,
                    )
        finally:
            store.close()

    def _make_publisher(self, max_queue_bytes: int) -> BackgroundPublisher:
        import torch.distributed as dist

        from deltarec.publish import BackgroundPublisher, PublishMetrics

        distributed = dist.is_available() and dist.is_initialized()
        assert self.store is not None
        return BackgroundPublisher(
            self.store,
            self.config.artifacts,
            self.config.run,
            rank=dist.get_rank() if distributed else 0,
            world_size=dist.get_world_size() if distributed else 1,
            mode=self.publish_mode,
            max_queue_bytes=max(1, max_queue_bytes),
            metrics=None if self.registry is None else PublishMetrics(self.registry),
            metrics_port=None if self.registry is None else self._rank_port(),
            read_p99_ms=self.config.read_p99_ms,
        )

    def _rank_port(self) -> int:
        """The metrics port of this process: ``metrics_port`` plus its ``LOCAL_RANK``."""
        assert self.metrics_port is not None
        return self.metrics_port + int(os.environ.get("LOCAL_RANK", "0") or 0)

    def _submit(self, manifest: Manifest, rows: dict[str, ShardRows] | None) -> None:
        assert self.publisher is not None  # the dumper's on_commit only with a publisher
        self.publisher.submit(manifest, rows)

    def after_step(self, step: int) -> None:
        """Dump if due; re-raise an earlier dump's or publish's failure."""
        assert self.dumper is not None, "on_start was not called"
        if self.publisher is not None:
            self.publisher.check()
        seq = None
        try:
            seq = self.dumper.maybe_dump(step)
        finally:
            if self.dense is not None:
                self.dense.stepped(step, seq is not None)

    def before_eval(self) -> None:
        """Pause tracking: evaluation lookups are not training updates."""
        if self.dumper is not None:
            self.dumper.before_eval()

    def after_eval(self) -> None:
        """Resume tracking; ids recorded during evaluation are dropped."""
        if self.dumper is not None:
            self.dumper.after_eval()

    def before_checkpoint(self) -> None:
        """Wait until every dump so far is committed; stop if a newer trainer owns the run.

        A checkpoint records the dumper's position: were a queued dump still uncommitted, a
        crash after the checkpoint would lose its rows for good (the restored tracker no longer
        knows them). Collective: every rank waits for its worker, then rank 0 checks the lease.

        Raises:
            DumpError: a dump failed.
            LeaseLostError: the run's lease was taken over; no checkpoint may be written.
        """
        if self.dumper is not None:
            self.dumper.wait_idle()
            self.dumper.check_owner()

    def on_end(self, step: int) -> None:
        """The final dump (every rank's last step must agree); waits until committed."""
        assert self.dumper is not None, "on_start was not called"
        if self.dense is not None:
            self.dense.ending(step)
        self.dumper.final_dump(step)
        if self.publisher is not None:
            self.publisher.close(None)
            self.publisher.check()
            self.publisher = None

    def close(self) -> None:
        """Stop the worker and the publisher (also after a failure; never masks it)."""
        if self.dense is not None:
            self.dense.close()
        try:
            if self.dumper is not None:
                self.dumper.close()
        finally:
            if self.publisher is not None:
                publisher, self.publisher = self.publisher, None
                try:
                    publisher.close(timeout=60.0)
                except Exception:
                    log.exception("closing the background publisher failed")

    def state_dict(self) -> dict[str, Any]:
        """The dumper's state for the training checkpoint."""
        if self.dumper is None:
            return dict(self._state or {})
        return self.dumper.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep the checkpoint's dumper state; applied in :meth:`on_start`."""
        self._state = dict(state)


def make_train_hook(
    *,
    artifacts: str,
    run: str,
    every_steps: int | None = None,
    every_minutes: float | None = None,
    snapshot: bool = True,
    store: str | None = None,
    publish_mode: PublishMode | str = PublishMode.DIRECT,
    metrics_port: int | None = None,
    dense_every: int | None = None,
    **options: Any,
) -> DumpHook:
    """Build the dump hook for ``deltarec train`` (keyword arguments only).

    Args:
        artifacts: artifact root (local path or fsspec URI).
        run: run name.
        every_steps: dump every N steps (None: no step cadence).
        every_minutes: dump every M minutes (None: no time cadence).
        snapshot: write a snapshot (dump 0) when a generation starts without a parent.
        store: store URL to publish to while training (None: artifacts only).
        publish_mode: ``direct`` or ``staged``.
        metrics_port: serve Prometheus metrics on this port plus ``LOCAL_RANK``: the dump
            path's and, with a store, the background publisher's (as ``deltarec publish
            --metrics-port``).
        dense_every: commit the model's dense state with every N-th dump (default: the
            ``DELTAREC_DENSE_EVERY`` variable if set, else none); see docs/serving.md.
        **options: further :class:`DumperConfig` fields (``table_dtypes``, ``queue_bytes``...).
            ``zch_misses`` defaults to on when ``store`` asks for it (PAI FeatureStore with
            ``contract=tzrec``).

    Raises:
        ConfigError: for invalid or unknown options.
    """
    from pydantic import ValidationError

    if store is not None and "zch_misses" not in options:
        from deltarec.stores import wants_zch_misses

        if wants_zch_misses(store):
            options["zch_misses"] = True
    try:
        config = DumperConfig(
            artifacts=artifacts,
            run=run,
            every_steps=every_steps,
            every_minutes=every_minutes,
            snapshot=snapshot,
            **options,
        )
    except ValidationError as e:
        raise ConfigError(f"dumper configuration: {validation_problems(e)}") from e
    if dense_every is None and os.environ.get("DELTAREC_DENSE_EVERY"):
        text = os.environ["DELTAREC_DENSE_EVERY"]
        if not text.isdigit() or int(text) < 1:
            raise ConfigError(f"DELTAREC_DENSE_EVERY={text!r}: expected a whole number >= 1")
        dense_every = int(text)
    if dense_every is not None and dense_every < 1:
        raise ConfigError(f"dense_every must be >= 1 (dumps per dense state), got {dense_every}")
    return DumpHook(
        config,
        store=store,
        publish_mode=publish_mode,
        metrics_port=metrics_port,
        dense_every=dense_every,
    )


def hook_from_env(
    *,
    sources: SourceFactory | None = None,
    environ: Mapping[str, str] | None = None,
    **options: Any,
) -> DumpHook:
    """Build the dump hook from the ``DELTAREC_*`` environment (the pipeline's train step).

    The one way a team's training program receives the pipeline's dump, publish and store
    settings: see :class:`deltarec.dump.env.TrainSettings` for the variables.

    Args:
        sources: builds the table sources from the model (default: discovery of the
            ``DistributedModelParallel`` model's tables); pass one for tables outside DMP.
        environ: the variables (default: ``os.environ``).
        **options: further :class:`DumperConfig` fields (``table_dtypes``, ``queue_bytes``...).

    Raises:
        ConfigError: a variable is missing or invalid, or an option is (names it).
    """
    from deltarec.dump.env import TrainSettings

    settings = TrainSettings.from_env(environ)
    hook = make_train_hook(**settings.hook_arguments(), **options)
    if sources is not None:
        hook._sources = sources
    return hook
