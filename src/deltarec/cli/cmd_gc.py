"""``deltarec gc``: delete the dumps and bases of a run that a newer base covers and nothing needs.

SPEC §3a. What still needs them is read from the stores (``--store``, repeatable): their kept
promotions (rollback targets) and their progress marks; the trainer's checkpoints are found
under ``--checkpoints-from WORKDIR`` (every complete one of the run stays restorable; a folder
that cannot be read makes gc delete nothing) or named with ``--checkpoint G:STEP``.
``--dry-run`` lists every path with what would happen and why.
"""

from __future__ import annotations

import argparse
import json
import sys

from deltarec.cli.common import add_location_arguments
from deltarec.errors import BadInputError

KEEP_PROMOTIONS = 3
"""Rollback targets kept unless told (``deltarec.promote.retain.KEEP_PROMOTIONS``)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``deltarec gc``."""
    add_location_arguments(parser, store=False)
    parser.add_argument(
        "--store",
        action="append",
        required=True,
        metavar="URL",
        help="a store the run publishes to (repeatable): its promotions and progress count",
    )
    parser.add_argument(
        "--keep-promotions",
        type=int,
        default=KEEP_PROMOTIONS,
        metavar="N",
        help=f"rollback targets kept: the newest N promotions (default {KEEP_PROMOTIONS})",
    )
    parser.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        metavar="G:STEP",
        help="a checkpoint a restore may come back to (repeatable)",
    )
    parser.add_argument(
        "--checkpoints-from",
        action="append",
        default=[],
        metavar="WORKDIR",
        help="a trainer's --workdir (repeatable): every complete checkpoint of the run found "
        "there stays restorable; unreadable: gc deletes nothing",
    )
    parser.add_argument("--dry-run", action="store_true", help="list, delete nothing")
    parser.add_argument("--json", action="store_true", help="print JSON (for machines)")


def _checkpoints(values: list[str]) -> list[tuple[int, int]]:
    out = []
    for v in values:
        g, _, step = v.partition(":")
        try:
            out.append((int(g), int(step)))
        except ValueError:
            raise BadInputError(f"--checkpoint {v!r}: expected G:STEP, e.g. 3:1200") from None
    return out


def run(args: argparse.Namespace) -> int:
    """Plan (and unless ``--dry-run``, apply) the run's retention; print every decision."""
    from deltarec.promote.retain import collect

    result = collect(
        args.artifacts,
        args.run,
        args.store,
        keep_promotions=args.keep_promotions,
        checkpoints=_checkpoints(args.checkpoint),
        checkpoint_dirs=args.checkpoints_from,
        dry_run=args.dry_run,
    )
    kept = [{"generation": g, "step": s} for g, s in result.checkpoints]
    decisions, deleted = result.decisions, result.deleted
    if args.json:
        rows = [
            {"path": d.path, "kind": d.kind, "delete": d.delete, "reason": d.reason}
            for d in decisions
        ]
        out = {"dry_run": args.dry_run, "deleted": deleted, "checkpoints": kept, "paths": rows}
        print(json.dumps(out, indent=2))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    if result.checkpoints:
        named = ", ".join(f"{g}:{s}" for g, s in result.checkpoints)
        print(f"checkpoints kept restorable (generation:step): {named}", file=sys.stderr)
    for d in decisions:
        print(f"{verb if d.delete else 'keep':>12}  {d.path}  ({d.reason})")
    gone = sum(d.delete for d in decisions)
    print(f"{verb} {gone} of {len(decisions)} dumps and bases of run {args.run!r}", file=sys.stderr)
    return 0
