"""``deltarec verify``: read rows back from the store and compare them with the artifacts."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn

from deltarec.cli.common import add_location_arguments, write_output
from deltarec.errors import BadInputError, CheckFailedError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``deltarec verify`` (SPEC §7a, plus optional extras)."""
    add_location_arguments(parser)
    parser.add_argument("--generation", type=int, metavar="G", help="default: the newest")
    parser.add_argument(
        "--through-seq", type=int, metavar="S", help="last dump to include (default: the newest)"
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--sample",
        type=int,
        metavar="N",
        default=10_000,
        help="keys sampled per table (default: 10000)",
    )
    which.add_argument(
        "--all",
        action="store_true",
        help="check every expected key and scan the store for keys the lineage never wrote",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--json", metavar="PATH", help="write the JSON result ('-' = stdout)")
    parser.add_argument("--report", metavar="PATH", help="write a self-contained HTML report")
    parser.add_argument("--metrics", metavar="PATH", help="write KFP metrics as a JSON object")
    parser.add_argument(
        "--batch-size", type=int, default=8192, metavar="N", help="keys per store read"
    )
    parser.add_argument(
        "--max-mismatches", type=int, default=20, metavar="N", help="worst keys kept per table"
    )
    parser.add_argument(
        "--no-record",
        action="store_true",
        help="do not leave a verification record in the artifact root (promote needs one)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the verification; exit 0 if it passed, raise CheckFailedError (exit 1) if not."""
    from deltarec.verify import dumps_json, kfp_metrics, print_summary, render_html
    from deltarec.verify.run import run_verification

    if args.sample is not None and args.sample < 0:
        raise BadInputError(f"--sample must be >= 0, got {args.sample}")
    to_stdout = args.json == "-"
    console = Console(stderr=to_stdout)
    with _progress(console) as progress:
        tasks: dict[str, TaskID] = {}

        def on_progress(table: str, done: int, total: int) -> None:
            if table not in tasks:
                tasks[table] = progress.add_task(table, total=total)
            progress.update(tasks[table], completed=done)

        result = run_verification(
            args.artifacts,
            args.run,
            args.store,
            generation=args.generation,
            through_seq=args.through_seq,
            sample=None if args.all else args.sample,
            seed=args.seed,
            batch_size=args.batch_size,
            max_mismatches=args.max_mismatches,
            record=not args.no_record,
            progress=on_progress,
        )
    print_summary(result, console)
    if args.json:
        write_output(args.json, dumps_json(result) + "\n")
    if args.metrics:
        write_output(args.metrics, json.dumps(kfp_metrics(result), indent=2) + "\n")
    if args.report:
        write_output(args.report, render_html(result))
        console.print(f"report: {args.report}")
    if not result.passed:
        raise CheckFailedError(result.failure_summary())
    return 0


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
