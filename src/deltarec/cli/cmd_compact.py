"""``deltarec compact``: fold a generation's lineage through a dump into a base (SPEC §3a).

Readers then start from the base and read only the dumps after it; retention (``deltarec gc``)
may delete the dumps it covers. Safe to run beside a training job and to run again after a
crash: BASE.json is written last.
"""

from __future__ import annotations

import argparse
import json

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
    parser.add_argument("--json", action="store_true", help="print JSON (for machines)")


def run(args: argparse.Namespace) -> int:
    """Write the base (or find it committed) and print what it holds."""
    import sys

    from deltarec.artifacts import ArtifactRoot
    from deltarec.artifacts.compact import PART_ROWS, compact
    from deltarec.artifacts.history import RunHistory

    root = RunHistory(ArtifactRoot(args.artifacts))
    result = compact(
        root,
        args.run,
        args.generation,
        args.through_seq,
        part_rows=args.part_rows or PART_ROWS,
    )
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
