"""``deltarec rollback``: restore serving to a promoted generation."""

from __future__ import annotations

import argparse

from rich.console import Console

from deltarec.cli.common import add_location_arguments, add_through_seq_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``deltarec rollback``."""
    add_location_arguments(parser)
    parser.add_argument("--to-generation", required=True, type=int, metavar="G")
    add_through_seq_argument(
        parser, "restore to this dump of G (default: the dump G was last promoted at)"
    )


def run(args: argparse.Namespace) -> int:
    """Roll back; prints the new generation and the keys restored and removed."""
    from deltarec.promote.run import rollback

    result = rollback(
        args.artifacts, args.run, args.store, args.to_generation, through_seq=args.through_seq
    )
    console = Console()
    if result.generation is None:
        console.print(
            f"nothing changed after generation {result.to_generation} dump "
            f"{result.through_seq}; serving pointer recorded",
            highlight=False,
        )
        return 0
    console.print(
        f"rolled run {result.run!r} back to generation {result.to_generation} dump "
        f"{result.through_seq} through new generation {result.generation} (version "
        f"{result.version}): {sum(result.restored.values())} keys restored, "
        f"{sum(result.removed.values())} removed",
        highlight=False,
    )
    for table in sorted(result.restored):
        console.print(
            f"  {table}: {result.restored[table]} restored, {result.removed[table]} removed",
            highlight=False,
        )
    return 0
