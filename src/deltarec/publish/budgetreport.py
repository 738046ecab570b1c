"""What a read budget did over a publish, and where the trainer's publishers leave it.

:class:`BudgetReport` is ``deltarec publish --json``'s ``budget``; the trainer's background
publisher leaves each rank's beside the generation (:func:`record_report`), where verify's
KFP metrics add them up (:func:`held_back_s`). The policy and the throttle that fill it in
are :mod:`deltarec.publish.budget`.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass

from deltarec.artifacts import ArtifactRoot


@dataclass
class BudgetReport:
    """What the budget did over a publish (``deltarec publish --json``'s ``budget``).

    ``probe_*``: every probe read; ``noise_p99_ms``: those made while nothing was written;
    ``target_p99_ms``: what the writes were held to at the end (module doc, 2);
    ``writing_s``: the transactions' own time (from the store's apply to the commit), over
    ``transactions``: with ``held_back_s``, where a throttled publish's time went;
    ``server_s``: of ``writing_s``, the server's own time in the writes where the store tells
    it (Redis: its units' ``EXEC``/``EVALSHA`` microseconds, ``INFO commandstats``): the rest is
    the publisher's encoding, the round trips and the waits between;
    ``futile_judgements``: judgements over the target where no pause could have diluted the
    writes' slow reads to a p99 (a blocking store's,
    :meth:`~deltarec.publish.budget.ReadBudget._diluting_duty`).
    """

    read_p99_ms: float
    held_back_s: float = 0.0
    writing_s: float = 0.0
    transactions: int = 0
    server_s: float | None = None
    probes: int = 0
    probe_p50_ms: float | None = None
    probe_p99_ms: float | None = None
    probe_max_ms: float | None = None
    noise_p99_ms: float | None = None
    target_p99_ms: float | None = None
    smallest_batch_bytes: int = 0
    last_batch_bytes: int = 0
    smallest_unit_rows: int | None = None
    last_unit_rows: int | None = None
    futile_judgements: int = 0

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict."""
        return dict(self.__dict__)


def report_path(root: ArtifactRoot, run: str, generation: int, rank: int) -> str:
    """Where a rank's background publisher leaves its budget's report: ``gen-<G>/budget/``."""
    return posixpath.join(root.gen_dir(run, generation), "budget", f"rank-{rank}.json")


def record_report(
    root: ArtifactRoot, run: str, generation: int, rank: int, report: BudgetReport
) -> None:
    """Leave ``report`` beside ``generation`` for rank ``rank`` (replacing an earlier one)."""
    path = report_path(root, run, generation, rank)
    root.write_bytes_atomic(path, json.dumps(report.to_json(), indent=1).encode())


def held_back_s(root: ArtifactRoot, run: str, generation: int) -> float | None:
    """Seconds the ranks' publishers of ``generation`` held back in all; None: no budget ran."""
    folder = posixpath.dirname(report_path(root, run, generation, 0))
    if not root.exists(folder):
        return None
    names = [n for n in root.fs.ls(folder, detail=False) if str(n).endswith(".json")]
    return sum(float(root.read_json(str(n))["held_back_s"]) for n in names)
