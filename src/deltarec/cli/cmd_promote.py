"""``deltarec promote``: record a verified generation as serving's current one."""

from __future__ import annotations

import argparse

from rich.console import Console

from deltarec.cli.common import (
    add_generation_argument,
    add_location_arguments,
    add_through_seq_argument,
    require_existing_store,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``deltarec promote``."""
    add_location_arguments(parser)
    add_generation_argument(parser, required=True)
    add_through_seq_argument(parser, "promote through this dump (default: newest)")
    parser.add_argument(
        "--force",
        action="store_true",
        help="promote even without a passing verification record (the registry notes it)",
    )


def run(args: argparse.Namespace) -> int:
    """Promote; a generation without a passing verification is refused (exit 1)."""
    from deltarec.promote.run import promote_generation
    from deltarec.stores import redact_url

    require_existing_store(args.store)
    result = promote_generation(
        args.artifacts, args.run, args.store, args.generation,
        through_seq=args.through_seq, force=args.force,
    )  # fmt: skip
    where = redact_url(args.store)
    p = result.pointer
    merged = f", {result.merged_rows} staged rows merged" if result.merged_rows else ""
    Console().print(
        f"serving of run {p.run!r} in {where} is now generation {p.generation} through dump "
        f"{p.seq} ({p.note}{merged})",
        highlight=False,
    )
    return 0
