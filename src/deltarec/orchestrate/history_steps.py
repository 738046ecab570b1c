"""The pipeline's steps of a run's history (SPEC §3a): compact, then gc.

Library functions the KFP components (``components/compact``, ``components/gc``) call through
:mod:`deltarec.orchestrate.steps`; the CLI's ``deltarec compact`` and ``deltarec gc`` do the
same. Neither is wired into the default pipeline: a team adds them after promote, or runs them
on a schedule (the chart's gc CronJob).
"""

from __future__ import annotations

from typing import Any

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.compact import PART_ROWS, compact
from deltarec.artifacts.history import RunHistory
from deltarec.orchestrate.params import PipelineParams
from deltarec.promote.retain import KEEP_PROMOTIONS, collect


def compact_run(
    params: PipelineParams, generation: int | None = None, part_rows: int = PART_ROWS
) -> dict[str, Any]:
    """Compact the run's ``generation`` (default: the newest) through its newest dump.

    Returns:
        ``{"generation", "through_seq", "written", "dumps_read", "rows", "parts"}``.
    """
    root = RunHistory(ArtifactRoot(params.artifact_root))
    result = compact(root, params.run_name, generation, part_rows=part_rows)
    b = result.base
    return {
        "generation": b.generation,
        "through_seq": b.through_seq,
        "written": result.written,
        "dumps_read": result.dumps_read,
        "rows": sum(b.rows.values()),
        "parts": len(b.parts),
    }


def gc_run(
    params: PipelineParams, keep_promotions: int = KEEP_PROMOTIONS, dry_run: bool = False
) -> dict[str, Any]:
    """Delete the run's dumps and bases a base covers and nothing needs (the pipeline's store).

    Returns:
        ``{"deleted", "kept", "dry_run", "paths": [{"path", "delete", "reason"}, ...]}``.
    """
    result = collect(
        params.artifact_root,
        params.run_name,
        [params.store_url],
        keep_promotions=keep_promotions,
        dry_run=dry_run,
    )
    return {
        "deleted": result.deleted,
        "kept": sum(not d.delete for d in result.decisions),
        "dry_run": dry_run,
        "paths": [
            {"path": d.path, "delete": d.delete, "reason": d.reason} for d in result.decisions
        ],
    }
