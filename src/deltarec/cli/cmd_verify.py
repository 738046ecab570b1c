"""``deltarec verify``: read rows back from the store and compare them with the artifacts."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn

from deltarec.cli.common import (
    add_generation_argument,
    add_location_arguments,
    add_sample_argument,
    add_through_seq_argument,
    nonnegative_int,
    positive_int,
    require_existing_store,
    write_output,
)
from deltarec.errors import ArtifactError, BadInputError, CheckFailedError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``deltarec verify`` (SPEC §7a, plus optional extras)."""
    add_location_arguments(parser)
    add_generation_argument(parser, "default: the newest")
    add_through_seq_argument(parser, "last dump to include (default: the newest)")
    which = parser.add_mutually_exclusive_group()
    add_sample_argument(
        which,
        10_000,
        "keys sampled per table (default: 10000), and each table's key count compared",
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
        "--batch-size", type=positive_int, default=8192, metavar="N", help="keys per store read"
    )
    parser.add_argument(
        "--max-mismatches",
        type=nonnegative_int,
        default=20,
        metavar="N",
        help="worst keys kept per table",
    )
    parser.add_argument(
        "--no-record",
        action="store_true",
        help="do not leave a verification record in the artifact root (promote needs one)",
    )
    fan = parser.add_mutually_exclusive_group()
    fan.add_argument(
        "--partition",
        metavar="I/N",
        help="check only partition I of N (a key range of every table; no record is left): "
        "run 0/N .. N-1/N anywhere, each with --json, then --combine their documents",
    )
    fan.add_argument(
        "--combine",
        nargs="+",
        metavar="JSON",
        help="combine the --json documents of partitions 0/N .. N-1/N into one result and "
        "leave its record (the gate)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the verification; exit 0 if it passed, raise CheckFailedError (exit 1) if not."""
    from deltarec.artifacts import ArtifactRoot
    from deltarec.verify import kfp_metrics, print_summary, render_html
    from deltarec.verify.run import keep_record

    if not args.combine:
        require_existing_store(args.store)
    to_stdout = args.json == "-"
    console = Console(stderr=to_stdout)
    result = _combined(args) if args.combine else _verified(args, console)
    print_summary(result, console)
    # The result is printed first and each output written on its own, so that one output
    # that cannot be written (a read-only root) loses none of the others.
    unwritten = []
    outputs = [
        (args.json, lambda: _json_doc(result, bool(args.partition))),
        (args.metrics, lambda: json.dumps(kfp_metrics(result), indent=2) + "\n"),
        (args.report, lambda: render_html(result)),
    ]
    for path, text in outputs:
        if path:
            try:
                write_output(path, text())
            except BadInputError as e:
                unwritten.append(str(e))
    if args.report and not any(args.report in u for u in unwritten):
        console.print(f"report: {args.report}")
    if not (args.no_record or args.partition):
        try:
            keep_record(ArtifactRoot(args.artifacts), result)
        except ArtifactError as e:
            unwritten.append(f"{e} (promote needs this record)")
    if unwritten:
        verdict = "PASSED" if result.passed else "FAILED"
        raise BadInputError(f"verdict {verdict}, but not written: " + "; ".join(unwritten))
    if not result.passed:
        raise CheckFailedError(result.failure_summary())
    return 0


def _json_doc(result: Any, partition: bool) -> str:
    from deltarec.verify import dumps_json
    from deltarec.verify.partition import partition_json

    doc = partition_json(result) if partition else json.loads(dumps_json(result))
    return json.dumps(doc, indent=2, allow_nan=False) + "\n"


def _combined(args: argparse.Namespace) -> Any:
    """The gate: the partitions' documents combined (and recorded unless --no-record)."""
    from deltarec.verify.fanout import combine_partitions
    from deltarec.verify.partition import result_from_json

    docs = []
    for path in args.combine:
        try:
            with open(path, encoding="utf-8") as f:
                docs.append(result_from_json(json.load(f)))
        except (OSError, json.JSONDecodeError) as e:
            raise BadInputError(f"--combine {path}: {e}") from e
    for r in docs:
        if (r.run, r.generation) != (docs[0].run, docs[0].generation) or r.run != args.run:
            raise BadInputError(
                f"--combine: {r.run!r} generation {r.generation} is not a partition of run "
                f"{args.run!r}"
            )
    return combine_partitions(
        args.artifacts, docs, max_mismatches=args.max_mismatches, record=False
    )


def _verified(args: argparse.Namespace, console: Console) -> Any:
    from deltarec.verify.fanout import verify_partition
    from deltarec.verify.partition import Partition
    from deltarec.verify.run import run_verification

    with _progress(console) as progress:
        tasks: dict[str, TaskID] = {}

        def on_progress(table: str, done: int, total: int) -> None:
            if table not in tasks:
                tasks[table] = progress.add_task(table, total=total)
            progress.update(tasks[table], completed=done)

        common = dict(
            generation=args.generation,
            through_seq=args.through_seq,
            sample=None if args.all or not args.sample else args.sample,
            seed=args.seed,
            batch_size=args.batch_size,
            max_mismatches=args.max_mismatches,
            progress=on_progress,
        )
        if args.partition:
            part = Partition.parse(args.partition)
            return verify_partition(args.artifacts, args.run, args.store, part, **common)
        return run_verification(args.artifacts, args.run, args.store, record=False, **common)


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
