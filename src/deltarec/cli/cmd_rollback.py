"""``deltarec rollback``: restore serving to a promoted generation, and check it."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rich.console import Console

from deltarec.cli.common import (
    add_location_arguments,
    add_sample_argument,
    add_through_seq_argument,
    require_existing_store,
)

if TYPE_CHECKING:
    from deltarec.promote.rollback import RollbackResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``deltarec rollback``."""
    add_location_arguments(parser)
    parser.add_argument("--to-generation", required=True, type=int, metavar="G")
    add_through_seq_argument(
        parser, "restore to this dump of G (default: the dump G was last promoted at)"
    )
    add_sample_argument(
        parser, None, "the closing check reads N keys per table (default: every key)"
    )


def run(args: argparse.Namespace) -> int:
    """Roll back, then verify the store against the point.

    Prints the new generation, the keys republished, come back and removed, who served
    before and after, and the check. Exit 1 (with what differs) when the store does not equal
    the point afterwards.
    """
    from deltarec.promote.rollback import RollbackCheckError
    from deltarec.promote.run import rollback

    require_existing_store(args.store)
    console = Console(soft_wrap=True)  # one line per fact, whatever the terminal width
    try:
        result = rollback(
            args.artifacts, args.run, args.store, args.to_generation,
            through_seq=args.through_seq, sample=args.sample or None,
        )  # fmt: skip
    except RollbackCheckError as e:
        _print(console, e.result)
        raise
    _print(console, result)
    return 0


def _print(console: Console, result: RollbackResult) -> None:
    point = f"generation {result.to_generation} dump {result.through_seq}"
    if result.generation is None:
        console.print(f"nothing changed after {point}; serving pointer recorded", highlight=False)
    else:
        console.print(
            f"rolled run {result.run!r} back to {point} through new generation "
            f"{result.generation} (version {result.version}): "
            f"{sum(result.restored.values())} keys republished, "
            f"{sum(result.came_back.values())} of them came back, "
            f"{sum(result.removed.values())} removed",
            highlight=False,
        )
        for table in sorted(result.restored):
            console.print(
                f"  {table}: {result.restored[table]} republished, "
                f"{result.came_back.get(table, 0)} came back, {result.removed.get(table, 0)} "
                "removed",
                highlight=False,
            )
    for when, serving in (("before", result.serving_before), ("after", result.serving_after)):
        if serving is not None:
            console.print(f"serving {when}: {serving.describe()}", highlight=False)
    v = result.verification
    if v is not None:
        what = "every key" if v.mode == "all" else f"a sample of {v.sample} keys per table"
        verdict = "equal" if v.passed else f"DIFFERENT: {v.failure_summary()}"
        console.print(
            f"checked {v.checked} keys ({what}) against {point}: {verdict}", highlight=False
        )
