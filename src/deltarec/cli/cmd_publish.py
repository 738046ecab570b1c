"""``deltarec publish``: publish every committed dump the store does not hold yet (SPEC §7a).

For one generation (default: the newest) it publishes, in dump order and for every rank (or
``--ranks``), each part whose progress marks in the store are not complete, from the
artifacts; a part cut short by a crash resumes after its last mark. Run it again after an
outage: it only writes what is missing. Progress goes to stderr; ``--json`` is for machines.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from deltarec.cli.common import (
    add_generation_argument,
    add_json_result_argument,
    add_location_arguments,
    require_resolvable_host,
    seconds,
    write_output,
)
from deltarec.publish.types import PublishMode


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``publish`` flags."""
    add_location_arguments(parser)
    add_generation_argument(parser, "generation to publish (default: the newest)")
    parser.add_argument(
        "--mode",
        choices=PublishMode.names(),
        default=PublishMode.DIRECT.value,
        help="direct: into the live views; staged: into the generation's staging views, made "
        "live by promote (default: direct)",
    )
    parser.add_argument(
        "--ranks",
        default=None,
        metavar="R,R",
        help="publish only these ranks' shards (default: every rank)",
    )
    parser.add_argument(
        "--batch-mb",
        type=float,
        default=None,
        metavar="MB",
        help="encoded megabytes per store transaction and progress mark (default: by store "
        "kind, 512 for SQLite and PostgreSQL, 8 otherwise); rows are read in 8 MB chunks "
        "whatever this is",
    )
    parser.add_argument(
        "--retry-deadline",
        type=seconds,
        default=600.0,
        metavar="S",
        help="give up after the store has been unreachable this long (default: 600)",
    )
    parser.add_argument(
        "--read-p99-ms",
        type=float,
        default=None,
        metavar="MS",
        help="a read-latency budget: probe reads of serving keys while publishing and slow the "
        "writes down (smaller transactions, pauses) so that their p99 stays within MS "
        "milliseconds (default: no budget, write as fast as the store takes it)",
    )
    parser.add_argument(
        "--no-yield-cpu",
        dest="yield_cpu",
        action="store_false",
        help="under --read-p99-ms, keep the publisher's threads at their CPU priority (default: "
        "they run at the lowest, so that serving's threads on the same machine take a core "
        "first)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on this port while publishing",
    )
    add_json_result_argument(parser)


def _ranks(text: str | None) -> list[int] | None:
    from deltarec.errors import BadInputError

    if text is None:
        return None
    try:
        ranks = sorted({int(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise BadInputError(f"--ranks {text!r}: expected comma-separated integers") from None
    if not ranks or ranks[0] < 0:
        raise BadInputError(f"--ranks {text!r}: expected ranks >= 0")
    return ranks


def run(args: argparse.Namespace) -> int:
    """Publish the pending dumps and report."""
    from deltarec.artifacts import ArtifactRoot
    from deltarec.artifacts.history import RunHistory
    from deltarec.errors import BadInputError
    from deltarec.publish import DumpPublisher, PublishMetrics, RetryPolicy
    from deltarec.publish.budget import check_budget, throttled
    from deltarec.stores import open_store, redact_url

    if args.batch_mb is not None and args.batch_mb <= 0:
        raise BadInputError(f"--batch-mb must be positive, got {args.batch_mb}")
    check_budget(args.read_p99_ms, "--read-p99-ms")
    ranks = _ranks(args.ranks)
    root = RunHistory(ArtifactRoot(args.artifacts))  # the run's records read once
    generation = (
        args.generation if args.generation is not None else root.latest_generation(args.run)
    )
    if ranks is not None:
        world = root.read_generation(args.run, generation).world_size
        beyond = [r for r in ranks if r >= world]
        if beyond:  # refused before the store is opened: no progress mark for a rank not there
            raise BadInputError(
                f"--ranks {args.ranks}: run {args.run!r} generation {generation} has ranks "
                f"0..{world - 1}, not {beyond}"
            )
    require_resolvable_host(args.store)
    metrics = PublishMetrics()
    if args.metrics_port is not None:
        metrics.serve(args.metrics_port)
    quiet = args.json == "-"
    progress = _Progress(quiet)
    retry = RetryPolicy(deadline_s=args.retry_deadline)
    start = time.monotonic()
    with retry.call(
        lambda: open_store(args.store, args.artifacts, run=args.run), "open store"
    ) as store:
        publisher = DumpPublisher(
            store,
            root,
            args.run,
            mode=args.mode,
            batch_bytes=None if args.batch_mb is None else int(args.batch_mb * (1 << 20)),
            retry=retry,
            metrics=metrics,
            after_batch=progress.batch,
        )
        throttle = throttled(publisher, args.read_p99_ms, args.yield_cpu)
        try:
            parts = publisher.publish_generation(generation, ranks, on_part=progress.part)
        finally:
            progress.finish()
            budget = None if throttle is None else throttle.close()
    result: dict[str, Any] = {
        "run": args.run,
        "generation": generation,
        "store": redact_url(args.store),
        "mode": args.mode,
        "parts": [p.to_json() for p in parts],
        "rows": sum(p.rows for p in parts),
        "bytes": sum(p.bytes for p in parts),
        "retries": metrics.value("deltarec_publish_retries_total"),
        "seconds": round(time.monotonic() - start, 3),
    }
    if budget is not None:
        result["budget"] = budget.to_json()
    if args.json is not None:
        write_output(args.json, json.dumps(result, indent=2) + "\n")
    if not quiet:
        what = f"{len(parts)} dump parts" if parts else "nothing pending"
        print(
            f"published {what}: {result['rows']:,} rows, {result['bytes'] / 1e6:.1f} MB in "
            f"{result['seconds']:.1f}s (run {args.run!r} generation {generation})",
            file=sys.stderr,
        )
        if budget is not None:
            print(
                f"read budget {budget.read_p99_ms} ms: held back {budget.held_back_s:.1f}s, "
                f"probe p99 {budget.probe_p99_ms} ms over {budget.probes} reads",
                file=sys.stderr,
            )
    return 0


class _Progress:
    """Progress lines on stderr: one per dump, and every few seconds within a part.

    A dump's parts (one per rank) are summed into one line, printed when the next dump's first
    part comes or at :meth:`finish`: a 256-rank job publishes 256 parts a dump.
    """

    def __init__(self, quiet: bool, every_s: float = 2.0) -> None:
        self.quiet = quiet
        self.every_s = every_s
        self.last = time.monotonic()
        self.rows = 0
        self._parts: list[Any] = []  # the parts of the dump being published

    def batch(self, mark: Any, n: int) -> None:
        self.rows += n
        now = time.monotonic()
        if not self.quiet and now - self.last >= self.every_s:
            self.last = now
            print(
                f"  dump {mark.seq} rank {mark.rank} {mark.table}: {mark.rows:,} rows "
                f"({self.rows:,} in total)",
                file=sys.stderr,
            )

    def part(self, part: Any) -> None:
        if self._parts and self._parts[0].seq != part.seq:
            self.finish()
        self._parts.append(part)

    def finish(self) -> None:
        """Print the dump whose parts came last (published so far)."""
        parts, self._parts = self._parts, []
        if self.quiet or not parts:
            return
        ranks = sorted({p.rank for p in parts})
        if len(ranks) == 1:
            who = f"rank {ranks[0]}"
        elif ranks == list(range(ranks[0], ranks[-1] + 1)):
            who = f"ranks {ranks[0]}-{ranks[-1]}"
        else:
            who = f"{len(ranks)} ranks"
        lags = [p.lag_s for p in parts if p.lag_s is not None]
        lag = f", lag {max(lags):.1f}s" if lags else ""
        print(
            f"dump {parts[0].seq} {who}: {sum(p.rows for p in parts):,} rows "
            f"({sum(p.bytes for p in parts) / 1e6:.1f} MB) in "
            f"{sum(p.seconds for p in parts):.2f}s{lag}",
            file=sys.stderr,
        )
