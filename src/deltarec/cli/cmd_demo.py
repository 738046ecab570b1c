"""``deltarec demo [--workdir DIR] [--steps N] [--store URL] [--engine kfp|airflow]`` (SPEC §9)."""

from __future__ import annotations

import argparse
import os

from deltarec.cli.common import add_engine_argument
from deltarec.errors import CheckFailedError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's flags."""
    from deltarec.demo import DEFAULT_STEPS, DEFAULT_WORKDIR

    parser.add_argument(
        "--workdir",
        default=DEFAULT_WORKDIR,
        metavar="DIR",
        help=f"artifacts, store, kfp outputs and log (default: ./{DEFAULT_WORKDIR}; an earlier "
        "demo's outputs there are replaced)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        metavar="N",
        help=f"training steps (default: {DEFAULT_STEPS})",
    )
    parser.add_argument(
        "--store", default=None, metavar="URL", help="store URL (default: sqlite in --workdir)"
    )
    add_engine_argument(
        parser, "kfp.local (default) or Airflow's dag.test() (needs deltarec[airflow])"
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo, print the summary and the report path; exit 1 if verify failed."""
    from rich.console import Console

    from deltarec.demo import log_tail, run_demo, summary_table
    from deltarec.orchestrate.types import StepFailedError

    console = Console()
    try:
        result = run_demo(args.workdir, args.steps, args.store, console, engine=args.engine)
    except StepFailedError:
        log_path = os.path.join(os.path.abspath(args.workdir), "pipeline.log")
        console.print(f"[red]the pipeline failed[/red]; the end of {log_path}:")
        console.print(log_tail(log_path), highlight=False, markup=False)
        raise
    console.print(summary_table(result))
    # soft_wrap: paths stay on one line, whole, for copy and paste
    console.print(f"HTML report: {result.report_path}", highlight=False, soft_wrap=True)
    console.print(f"full log:    {result.log_path}", highlight=False, soft_wrap=True)
    if result.verdict != "PASS":
        raise CheckFailedError(f"verify of generation {result.generation} failed")
    return 0
