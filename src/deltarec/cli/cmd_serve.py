"""``deltarec serve``: a serving replica of a run's promoted point, over HTTP (docs/serving.md).

Holds the run's tables (rows as stored) and dense state in memory on ``--device``, at the
point the store's serving pointer names; follows the served generation's new dumps; swaps a
newer generation in when it is promoted and back when rolled back; records its position in
``--state-dir`` to resume after a restart. ``deltarec verify --store replica://HOST:PORT``
reads its rows back. Runs until interrupted (SIGINT, SIGTERM).

The HTTP API is served by uvicorn on ``--host`` (127.0.0.1 unless told: the chart passes
0.0.0.0 behind its NetworkPolicy) with the bounds of ``deltarec.serving.limits.ServeLimits``;
``--max-connections``, ``--max-inflight-mb`` and ``--request-timeout`` change the ones an
operator sizes. ``/v1/*`` requires the bearer token in ``DELTAREC_REPLICA_TOKEN`` (or the file
``DELTAREC_REPLICA_TOKEN_FILE`` names) when one is set; never on the command line.
"""

from __future__ import annotations

import argparse
import logging
import signal
from types import FrameType

from deltarec.cli.common import add_location_arguments, require_existing_store
from deltarec.errors import BadInputError
from deltarec.serving.limits import ServeLimits
from deltarec.stores import token_from_env

log = logging.getLogger("deltarec.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``deltarec serve``."""
    add_location_arguments(parser)
    parser.add_argument(
        "--device", default="cpu", metavar="DEV", help="where the tables live: cpu, cuda, cuda:N"
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1; 0.0.0.0 for every interface)",
    )
    parser.add_argument("--port", type=int, default=8470, help="HTTP port (default: 8470)")
    parser.add_argument(
        "--state-dir", metavar="DIR", help="record the position and rows here; resume from it"
    )
    parser.add_argument(
        "--poll-seconds",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds between looks at the serving pointer and the outbox (default: 2)",
    )
    parser.add_argument(
        "--checkpoint-seconds",
        type=float,
        default=60.0,
        metavar="S",
        help="the most seconds between two records of the state while following (default: 60)",
    )
    parser.add_argument(
        "--no-follow",
        action="store_true",
        help="serve exactly the promoted dump; do not apply newer dumps of its generation",
    )
    parser.add_argument(
        "--no-shadow",
        action="store_true",
        help="do not apply a newer generation beside the served one before it is promoted",
    )
    parser.add_argument(
        "--score",
        action="store_true",
        help="answer POST /v1/score: the example model's scores from the served point's dense "
        "and sparse state (train with --dense-every N; docs/serving.md)",
    )
    parser.add_argument(
        "--model-config",
        metavar="FILE",
        help="with --score: the model's configuration, as deltarec train --model-config",
    )
    defaults = ServeLimits()
    parser.add_argument(
        "--max-connections",
        type=int,
        default=defaults.max_connections,
        metavar="N",
        help="open connections; beyond them requests get 503 "
        f"(default: {defaults.max_connections})",
    )
    parser.add_argument(
        "--max-inflight-mb",
        type=int,
        default=defaults.max_inflight_bytes >> 20,
        metavar="MB",
        help="MiB all requests in flight hold together, bodies and answers "
        f"(default: {defaults.max_inflight_bytes >> 20})",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=defaults.request_timeout_s,
        metavar="S",
        help="seconds to receive a body, and to send an answer to a client "
        f"(default: {defaults.request_timeout_s:g})",
    )


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; exit 0."""
    from deltarec.artifacts.root import ArtifactRoot
    from deltarec.serving.follow import Follower, FollowOptions, StorePointer
    from deltarec.serving.http import ReplicaServer
    from deltarec.serving.replica import Replica

    if args.poll_seconds <= 0 or args.checkpoint_seconds <= 0:
        raise BadInputError("--poll-seconds and --checkpoint-seconds must be > 0")
    if not 0 <= args.port < 65536:
        raise BadInputError(f"--port {args.port} is not a port")
    limits = ServeLimits(
        max_connections=args.max_connections,
        max_inflight_bytes=args.max_inflight_mb << 20,
        request_timeout_s=args.request_timeout,
    )
    token = token_from_env()
    if args.model_config and not args.score:
        raise BadInputError("--model-config configures --score: give both")
    root = ArtifactRoot(args.artifacts)
    if not root.list_generations(args.run):  # else never ready, and nothing says why
        raise BadInputError(
            f"run {args.run!r} does not exist under {root.uri} (runs there: {root.list_runs()})"
        )
    replica = Replica(root, args.run, args.device)
    require_existing_store(args.store)
    scorer = None
    if args.score:
        from deltarec.serving.score import ExampleScorer, load_model_config

        scorer = ExampleScorer(replica, load_model_config(args.model_config))
    options = FollowOptions(
        follow=not args.no_follow,
        shadow=not args.no_shadow,
        poll_s=args.poll_seconds,
        state_dir=args.state_dir,
        checkpoint_every_s=args.checkpoint_seconds,
    )
    pointer = StorePointer(args.store, args.artifacts, args.run)
    follower = Follower(replica, pointer, options)
    follower.resume()
    server = ReplicaServer(follower, args.host, args.port, limits, token, scorer).start()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping", signum)
        follower.request_stop()

    previous = signal.signal(signal.SIGTERM, on_signal)
    log.info(
        "replica of run %r on %s serving at http://%s:%d, /v1 %s (verify with --store "
        "replica://%s:%d)",
        args.run,
        replica.device,
        args.host,
        server.port,
        "with a bearer token" if token else "open",
        args.host,
        server.port,
    )
    try:
        follower.loop()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        follower.stop()
        server.close()
        pointer.close()
    return 0
