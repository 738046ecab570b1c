"""``deltarec compact``: fold a generation's lineage through a dump into a base (SPEC §3a).

Readers then start from the base and read only the dumps after it; retention (``deltarec gc``)
may delete the dumps it covers. Safe to run beside a training job and to run again after a
crash: BASE.json is written last. ``--busy-share S`` paces it (:mod:`deltarec.artifacts.pacing`):
it sleeps between chunks of its work so that it works at most ``S`` of its time, which spreads
its memory traffic on a host it shares with training (docs/history.md); the base is the same.

Fanned out (SPEC §3a: a base is partitionable by table and key range): ``--key-range I/N``
(and/or ``--tables``) writes one partition of the base of ``--through-seq`` and no BASE.json;
``--commit`` then writes BASE.json once every table's parts are in place, and refuses naming
what is missing otherwise.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from deltarec.cli.common import (
    add_generation_argument,
    add_location_arguments,
    add_through_seq_argument,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``deltarec compact``."""
    add_location_arguments(parser, store=False)
    add_generation_argument(parser, "the generation folded (default: the newest)")
    add_through_seq_argument(parser, "the newest dump folded (default: the newest committed)")
    parser.add_argument(
        "--part-rows", type=int, default=None, metavar="N", help="the most rows of one part"
    )
    parser.add_argument(
        "--tables",
        default=None,
        metavar="T1,T2",
        help="write a partition of these tables only (comma separated; needs --through-seq)",
    )
    parser.add_argument(
        "--key-range",
        default=None,
        metavar="I/N",
        help="write the I-th of N key ranges of each table, not BASE.json (needs --through-seq)",
    )
    parser.add_argument(
        "--commit",
        action="store_true",
        help="write BASE.json of the partitions written (needs --through-seq)",
    )
    parser.add_argument(
        "--busy-share",
        type=float,
        default=1.0,
        metavar="S",
        help="work at most this share of the time, sleeping between chunks of work "
        "(0 < S <= 1; default 1: no pauses); the base written is the same",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (for machines)")


def run(args: argparse.Namespace) -> int:
    """Write the base (or find it committed) and print what it holds."""
    from deltarec.artifacts import ArtifactRoot, pacing
    from deltarec.artifacts.compact import PART_ROWS, compact
    from deltarec.artifacts.history import RunHistory

    pacing.check_busy_share(args.busy_share, "--busy-share")
    root = RunHistory(ArtifactRoot(args.artifacts))
    partitioned = args.tables is not None or args.key_range is not None
    with pacing.paced(args.busy_share) as pacer:
        if partitioned or args.commit:
            return _partitioned(root, args, part_rows=args.part_rows or PART_ROWS)
        result = compact(
            root,
            args.run,
            args.generation,
            args.through_seq,
            part_rows=args.part_rows or PART_ROWS,
        )
    return _report(root, args, result, pacer.report() if args.busy_share < 1 else None)


def _report(
    root: Any, args: argparse.Namespace, result: Any, paced: dict[str, Any] | None = None
) -> int:
    import sys

    b = result.base
    out = {
        "base": root.url(root.base_dir(b.run, b.generation, b.through_seq)),
        "generation": b.generation,
        "through_seq": b.through_seq,
        "written": result.written,
        "built_from": None
        if b.base is None
        else {"generation": b.base[0], "through_seq": b.base[1]},
        "dumps_read": result.dumps_read,
        "rows": b.rows,
        "parts": len(b.parts),
    }
    if paced is not None:  # --busy-share: what the pacing did
        out["pacing"] = paced
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        what = "wrote" if result.written else "already committed:"
        print(
            f"{what} base of run {b.run!r} generation {b.generation} through dump "
            f"{b.through_seq}: {sum(b.rows.values())} rows in {len(b.parts)} parts "
            f"({result.dumps_read} dumps read after "
            f"{'no base' if b.base is None else f'base {b.base[0]}-{b.base[1]}'})",
            file=sys.stderr,
        )
    return 0


def _partitioned(root: Any, args: argparse.Namespace, part_rows: int) -> int:
    """``--key-range`` / ``--tables``: write one partition; ``--commit``: commit the base."""
    import sys

    from deltarec.artifacts.compact_parts import commit_base, compact_partition, parse_key_range
    from deltarec.errors import BadInputError

    what = "--commit" if args.commit else "--key-range/--tables"
    if args.through_seq is None:
        raise BadInputError(f"{what} needs --through-seq: every partition folds the same dump")
    if args.commit and (args.tables is not None or args.key_range is not None):
        raise BadInputError("--commit takes no --tables or --key-range: it commits them all")
    generation = (
        args.generation if args.generation is not None else root.latest_generation(args.run)
    )
    if args.commit:
        return _report(
            root,
            args,
            commit_base(root, args.run, generation, args.through_seq, part_rows=part_rows),
        )
    tables = None if args.tables is None else [t for t in args.tables.split(",") if t]
    key_range = parse_key_range(args.key_range or "0/1")
    done = compact_partition(
        root, args.run, generation, args.through_seq,
        tables=tables, key_range=key_range, part_rows=part_rows,
    )  # fmt: skip
    out = {
        "generation": done.generation,
        "through_seq": done.through_seq,
        "key_range": f"{key_range[0]}/{key_range[1]}",
        "tables": done.tables,
        "committed_before": done.committed,
    }
    if args.json:
        print(json.dumps(out, indent=2))
    elif done.committed:
        print(f"base {generation}-{args.through_seq} is committed already", file=sys.stderr)
    else:
        for table, how in done.tables.items():
            print(f"{how}: {table} key range {out['key_range']}", file=sys.stderr)
    return 0
