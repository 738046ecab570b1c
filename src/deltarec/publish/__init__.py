"""Publishing committed dumps to an online store (SPEC §6).

Exports:
    BackgroundPublisher: per rank, on a background thread, fed by the dumper (training).
    DumpPublisher: publish one rank's part of a dump, or every pending dump of a generation
        (``deltarec publish``); resumes from progress marks.
    PartResult: what one part's publication did.
    RetryPolicy: exponential backoff with jitter for transient store errors.
    PublishMetrics: Prometheus metrics (rows, bytes, retries, lag).
    finish_snapshot: the snapshot-completion rule (all ranks in -> sweep and record).
    PublishMode: ``direct`` or ``staged`` (SPEC §6).
    check_publish_mode: the mode for a store URL, refused once where it is chosen.
"""

from deltarec.publish.background import BackgroundPublisher
from deltarec.publish.metrics import PublishMetrics
from deltarec.publish.publisher import DumpPublisher, PartResult
from deltarec.publish.retry import RetryPolicy
from deltarec.publish.snapshot import finish_snapshot
from deltarec.publish.types import PublishMode, check_publish_mode

__all__ = [
    "BackgroundPublisher",
    "DumpPublisher",
    "PartResult",
    "PublishMetrics",
    "PublishMode",
    "RetryPolicy",
    "check_publish_mode",
    "finish_snapshot",
]
