"""Retention with what the stores say (SPEC §3a): the facts ``deltarec gc`` keeps for.

:func:`deltarec.artifacts.retention.plan` decides from the artifacts and a :class:`Needs`;
this module reads the needs from the stores a run publishes to: their kept promotions (the
newest distinct points of the serving history, rollback targets) and their progress marks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deltarec.artifacts.retention import Decision, Needs, apply, plan
from deltarec.artifacts.root import ArtifactRoot
from deltarec.errors import BadInputError

KEEP_PROMOTIONS = 3
"""Rollback targets kept unless told: the newest promotions of the run, distinct points."""


@dataclass(frozen=True)
class GcResult:
    """What a retention run decided (every path, with its reason) and deleted."""

    decisions: list[Decision]
    deleted: int
    dry_run: bool


def store_needs(
    artifacts: str,
    run: str,
    store_urls: Sequence[str],
    generations: Sequence[int],
    keep_promotions: int = KEEP_PROMOTIONS,
    checkpoints: Sequence[tuple[int, int]] = (),
) -> Needs:
    """What the stores (and the named checkpoints) still need of ``run``'s artifacts."""
    from deltarec.stores import open_store

    if keep_promotions < 0:
        raise BadInputError(f"keep_promotions must be >= 0, got {keep_promotions}")
    if not store_urls:
        raise BadInputError("retention needs at least one store: its promotions and marks count")
    needs = Needs(checkpoints=list(checkpoints))
    for url in store_urls:
        with open_store(url, artifacts) as store:
            points: list[tuple[int, int]] = []
            for p in reversed(store.registry.serving_history(run)):
                if (p.generation, p.seq) not in points:
                    points.append((p.generation, p.seq))
            needs.promotions.extend(points[:keep_promotions])
            held = {}
            for g in generations:
                marks = store.registry.progress(run, g)
                held[g] = max((m.seq for m in marks if m.complete), default=-1)
            needs.stores[store.describe()] = held
    return needs


def collect(
    artifacts: str,
    run: str,
    store_urls: Sequence[str],
    *,
    keep_promotions: int = KEEP_PROMOTIONS,
    checkpoints: Sequence[tuple[int, int]] = (),
    dry_run: bool = False,
) -> GcResult:
    """Plan ``run``'s retention against the stores and, unless ``dry_run``, apply it.

    Raises:
        BadInputError: no such run, no store, or a bad ``keep_promotions``.
    """
    root = ArtifactRoot(artifacts)
    gens = root.list_generations(run)
    if not gens:
        raise BadInputError(f"run {run!r} has no generation under {root.uri}")
    needs = store_needs(artifacts, run, store_urls, gens, keep_promotions, checkpoints)
    decisions = plan(root, run, needs)
    deleted = 0 if dry_run else apply(root, run, decisions)
    return GcResult(decisions, deleted, dry_run)
