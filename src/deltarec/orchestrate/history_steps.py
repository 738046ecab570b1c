"""The pipeline's steps of a run's history (SPEC §3a): compact after train, gc after promote.

Library functions the KFP components and the Airflow tasks call through
:mod:`deltarec.orchestrate.steps`; the CLI's ``deltarec compact`` and ``deltarec gc`` share the
same library (:mod:`deltarec.artifacts.compact`, :mod:`deltarec.artifacts.compact_parts`,
:mod:`deltarec.promote.retain`).

Compaction in the pipeline: :func:`compact_plan` decides from the artifacts alone (no parquet
read) whether the trained generation is compacted (``compact_min_dumps``) and how: in one task
(:func:`compact_apply`), or, when a table's estimated rows exceed ``compact_partition_rows``,
by a fan-out of :func:`compact_part` tasks (a table and key range each) that
:func:`compact_apply` then commits. Verify runs after it, so verify and promote read from the
new base. Retention (:func:`retain`) runs after promote with ``gc_mode`` and
``gc_keep_promotions``, keeping every checkpoint under ``checkpoint_dir`` restorable.
"""

from __future__ import annotations

import logging
import math
import shlex
from typing import Any

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.base import covered_seq, list_bases
from deltarec.artifacts.compact import PART_ROWS, compact
from deltarec.artifacts.compact_parts import (
    MAX_PARTITIONS,
    commit_base,
    compact_partition,
    estimate_rows,
    parse_key_range,
)
from deltarec.artifacts.history import RunHistory
from deltarec.orchestrate.params import PipelineParams
from deltarec.orchestrate.types import GenerationRecord
from deltarec.promote.retain import KEEP_PROMOTIONS, collect
from deltarec.publish.types import PublishMode

log = logging.getLogger(__name__)

SKIP, ONE_STEP, FAN_OUT = "skip", "one-step", "fan-out"
"""The decisions of :func:`compact_plan`."""


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


def compact_plan(params: PipelineParams, record: GenerationRecord) -> dict[str, Any]:
    """Whether and how the pipeline compacts the generation ``record`` names.

    Returns:
        ``{"decision", "reason", "generation", "through_seq", "items"}``: ``decision`` is
        ``skip``, ``one-step`` or ``fan-out``; ``items`` (fan-out only) are the partitions,
        ``{"generation", "through_seq", "tables", "key_range"}`` each: every large table cut
        into key ranges of about ``compact_partition_rows`` rows, the other tables together.
    """
    root = RunHistory(ArtifactRoot(params.artifact_root))
    run, g, s = params.run_name, record.generation, record.last_seq
    plan: dict[str, Any] = {"generation": g, "through_seq": s, "items": []}
    reason = _skip_reason(params, root, run, g, s)
    if reason:
        log.info("compaction of run %r generation %d skipped: %s", run, g, reason)
        return {**plan, "decision": SKIP, "reason": reason}
    est = estimate_rows(root, run, g, s)
    limit = params.compact_partition_rows
    large = {t: n for t, n in est.items() if limit and n > limit}
    if not large:
        return {**plan, "decision": ONE_STEP, "reason": "no table is large enough to fan out"}
    items = []
    for table, rows in sorted(large.items()):
        count = min(MAX_PARTITIONS, math.ceil(rows / limit))
        items += [_item(g, s, [table], i, count) for i in range(count)]
    small = sorted(t for t in est if t not in large)
    if small:
        items.append(_item(g, s, small, 0, 1))
    reason = ", ".join(f"{t} ~{n} rows" for t, n in sorted(large.items()))
    return {**plan, "decision": FAN_OUT, "reason": reason, "items": items}


def _skip_reason(params: PipelineParams, root: ArtifactRoot, run: str, g: int, s: int) -> str:
    if params.compact_min_dumps == 0:
        return "compaction is off (compact_min_dumps = 0)"
    if params.publish_mode is PublishMode.STAGED:
        return "staged mode compacts after promote (the gc step)"
    if (g, s) in list_bases(root, run):
        return f"the base of generation {g} through dump {s} is committed already"
    covered = covered_seq(root, run, g)
    after = sum(covered < seq <= s for seq in root.list_dumps(run, g))
    if after < params.compact_min_dumps:
        return f"{after} dumps after the newest base, fewer than compact_min_dumps = " + str(
            params.compact_min_dumps
        )
    return ""


def _item(g: int, s: int, tables: list[str], index: int, count: int) -> dict[str, Any]:
    return {"generation": g, "through_seq": s, "tables": tables, "key_range": f"{index}/{count}"}


def compact_part(params: PipelineParams, item: dict[str, Any]) -> dict[str, Any]:
    """Write one partition of the plan (``item``); BASE.json is written by :func:`compact_apply`.

    Returns:
        ``{"key_range", "tables": {table: "written" | "done before"}}``.
    """
    root = RunHistory(ArtifactRoot(params.artifact_root))
    done = compact_partition(
        root,
        params.run_name,
        int(item["generation"]),
        int(item["through_seq"]),
        tables=list(item["tables"]),
        key_range=parse_key_range(str(item["key_range"])),
    )
    return {"key_range": item["key_range"], "tables": done.tables}


def compact_apply(params: PipelineParams, plan: dict[str, Any]) -> dict[str, Any]:
    """Carry out ``plan``: nothing (skip), compact in this task (one-step), or commit (fan-out).

    A fan-out's commit refuses, naming what is missing, unless every partition is in place;
    the previous state stays valid and running the step again completes it.

    Returns:
        ``{"decision", "reason", "generation", "through_seq", "written", "rows", "parts"}``.
    """
    decision = str(plan.get("decision", SKIP))
    out = {k: plan.get(k) for k in ("decision", "reason", "generation", "through_seq")}
    if decision == SKIP:
        return {**out, "written": False, "rows": 0, "parts": 0}
    root = RunHistory(ArtifactRoot(params.artifact_root))
    g, s = int(plan["generation"]), int(plan["through_seq"])
    if decision == ONE_STEP:
        result = compact(root, params.run_name, g, s)
    else:
        result = commit_base(root, params.run_name, g, s)
    b = result.base
    rows, parts = sum(b.rows.values()), len(b.parts)
    log.info("base of run %r generation %d through dump %d: %d rows", params.run_name, g, s, rows)
    return {**out, "written": result.written, "rows": rows, "parts": parts}


def gc_run(
    params: PipelineParams, keep_promotions: int = KEEP_PROMOTIONS, dry_run: bool = False
) -> dict[str, Any]:
    """Delete the run's dumps and bases a base covers and nothing needs (the pipeline's store).

    With ``params.checkpoint_dir`` (the trainer's ``--workdir``), every complete checkpoint of
    the run found there stays restorable; a checkpoint directory that cannot be read fails the
    step before anything is deleted.

    Returns:
        ``{"deleted", "kept", "dry_run", "checkpoints": [[generation, step], ...],
        "paths": [{"path", "delete", "reason"}, ...]}``.

    Raises:
        CheckpointDirError: ``params.checkpoint_dir`` cannot be read (nothing deleted).
    """
    result = collect(
        params.artifact_root,
        params.run_name,
        [params.store_url],
        keep_promotions=keep_promotions,
        checkpoint_dirs=checkpoint_dirs(params),
        dry_run=dry_run,
    )
    return {
        "deleted": result.deleted,
        "kept": sum(not d.delete for d in result.decisions),
        "dry_run": dry_run,
        "checkpoints": [[g, s] for g, s in result.checkpoints],
        "paths": [
            {"path": d.path, "delete": d.delete, "reason": d.reason} for d in result.decisions
        ],
    }


def checkpoint_dirs(params: PipelineParams) -> list[str]:
    """Where the run's trainer writes checkpoints.

    ``checkpoint_dir``, and for the example trainer a ``--workdir`` given in
    ``train_extra_args`` too (an entry point's own arguments are its own: only
    ``checkpoint_dir`` names its checkpoints).
    """
    dirs = [params.checkpoint_dir] if params.checkpoint_dir else []
    if not params.entry_point:
        args = shlex.split(params.train_extra_args)
        for i, arg in enumerate(args):
            if arg == "--workdir" and i + 1 < len(args):
                dirs.append(args[i + 1])
            elif arg.startswith("--workdir="):
                dirs.append(arg.split("=", 1)[1])
    return list(dict.fromkeys(dirs))


def retain(params: PipelineParams) -> dict[str, Any]:
    """The pipeline's step after promote: retention as ``gc_mode`` and ``gc_keep_promotions`` say.

    In ``staged`` mode the compaction the plan left for after promote runs here first (in one
    task), when ``compact_min_dumps`` dumps follow the newest base.

    Returns:
        :func:`gc_run`'s result with ``"mode"`` and ``"compacted"`` (the base written here, or
        None); ``{"mode": "off"}`` when retention is off.
    """
    compacted = None
    if params.publish_mode is PublishMode.STAGED and params.compact_min_dumps:
        root = RunHistory(ArtifactRoot(params.artifact_root))
        g = root.latest_generation(params.run_name)
        seqs = root.list_dumps(params.run_name, g)
        if seqs and not _skip_reason(_direct(params), root, params.run_name, g, seqs[-1]):
            compacted = compact_apply(params, {"decision": ONE_STEP, "generation": g,
                                               "through_seq": seqs[-1]})  # fmt: skip
    if params.gc_mode == "off":
        return {"mode": "off", "compacted": compacted}
    out = gc_run(params, params.gc_keep_promotions, dry_run=params.gc_mode == "dry-run")
    return {**out, "mode": params.gc_mode, "compacted": compacted}


def _direct(params: PipelineParams) -> PipelineParams:
    return params.model_copy(update={"publish_mode": PublishMode.DIRECT})
