"""Retention with what the stores say (SPEC §3a): the facts ``deltarec gc`` keeps for.

:func:`deltarec.artifacts.retention.plan` decides from the artifacts and a :class:`Needs`;
this module reads the needs from the stores a run publishes to: their kept promotions (the
newest distinct points of the serving history, rollback targets) and their progress marks,
and from the trainer's checkpoint directories (:func:`checkpoints_from`): every complete
checkpoint of the run stays restorable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from deltarec.artifacts.retention import Decision, Needs, apply, plan
from deltarec.artifacts.root import ArtifactRoot
from deltarec.errors import BadInputError

KEEP_PROMOTIONS = 3
"""Rollback targets kept unless told: the newest promotions of the run, distinct points."""


class CheckpointDirError(BadInputError):
    """A trainer's checkpoint directory cannot be read: retention deletes nothing."""


@dataclass(frozen=True)
class GcResult:
    """What a retention run decided (every path, with its reason) and deleted."""

    decisions: list[Decision]
    deleted: int
    dry_run: bool
    checkpoints: list[tuple[int, int]] = field(default_factory=list)
    """The ``(generation, step)`` of the checkpoints kept restorable (named and found)."""


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


def checkpoints_from(workdirs: Sequence[str], run: str) -> list[tuple[int, int]]:
    """``(generation, step)`` of every complete checkpoint of ``run`` under the ``workdirs``.

    Each is a trainer's ``--workdir`` (``<workdir>/checkpoints/step-N``); a checkpoint of
    another run, or saved before the run's dumper started, needs nothing of ``run``.

    Raises:
        CheckpointDirError: a directory or a checkpoint in it cannot be read; retention then
            deletes nothing (a checkpoint it could not see might need what it would delete).
    """
    from deltarec.train.checkpoint_info import read_checkpoints
    from deltarec.train.errors import CheckpointError

    out: list[tuple[int, int]] = []
    for workdir in workdirs:
        try:
            found = read_checkpoints(workdir)
        except CheckpointError as e:
            raise CheckpointDirError(
                f"gc deletes nothing: the checkpoints under {workdir} cannot be read "
                f"({e.path}: {e.problem})"
            ) from e
        for c in found:
            out += [(g, c.step) for r, g in c.lineage if r == run and (g, c.step) not in out]
    return sorted(out)


def collect(
    artifacts: str,
    run: str,
    store_urls: Sequence[str],
    *,
    keep_promotions: int = KEEP_PROMOTIONS,
    checkpoints: Sequence[tuple[int, int]] = (),
    checkpoint_dirs: Sequence[str] = (),
    dry_run: bool = False,
) -> GcResult:
    """Plan ``run``'s retention against the stores and, unless ``dry_run``, apply it.

    Args:
        artifacts: the artifact root.
        run: the run whose dumps and bases are decided.
        store_urls: the stores the run publishes to (their promotions and marks count).
        keep_promotions: rollback targets kept, the newest distinct points of each store.
        checkpoints: ``(generation, step)`` of checkpoints named by hand.
        checkpoint_dirs: trainers' ``--workdir`` folders: every complete checkpoint of ``run``
            found there is kept restorable (:func:`checkpoints_from`), read before any deletion.
        dry_run: decide and report only; delete nothing.

    Raises:
        BadInputError: no such run, no store, or a bad ``keep_promotions``.
        CheckpointDirError: a checkpoint directory cannot be read (nothing is deleted).
    """
    root = ArtifactRoot(artifacts)
    gens = root.list_generations(run)
    if not gens:
        raise BadInputError(f"run {run!r} has no generation under {root.uri}")
    found = checkpoints_from(checkpoint_dirs, run)
    checkpoints = sorted(set(checkpoints) | set(found))
    needs = store_needs(artifacts, run, store_urls, gens, keep_promotions, checkpoints)
    decisions = plan(root, run, needs)
    deleted = 0 if dry_run else apply(root, run, decisions)
    return GcResult(decisions, deleted, dry_run, list(checkpoints))
