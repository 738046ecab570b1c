"""``deltarec provision``: create the store views of a generation's tables (SPEC §7a).

Reads the tables from GENERATION.json (default: the newest generation), creates one view per
table and the registry, and registers the generation. Idempotent; a view that exists with
another dim or dtype is an error naming both (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from deltarec.cli.common import (
    add_generation_argument,
    add_json_result_argument,
    add_location_arguments,
    write_output,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``provision`` flags."""
    add_location_arguments(parser)
    add_generation_argument(
        parser, "generation whose GENERATION.json lists the tables (default: the newest)"
    )
    parser.add_argument(
        "--staged",
        action="store_true",
        help="also create the generation's staging views (publish mode 'staged')",
    )
    add_json_result_argument(parser)


def provision(
    artifacts: str, run: str, store_url: str, generation: int | None = None, staged: bool = False
) -> dict[str, Any]:
    """Provision the views of ``generation``'s tables; returns a JSON-ready description."""
    from deltarec.stores.provision import provision_generation

    result, tables = provision_generation(artifacts, run, store_url, generation, staged)
    return {
        "run": run,
        "generation": result.generation,
        "store": result.store,
        "views": {
            t: {
                "view": result.views[t],
                "dim": tables[t].dim,
                "dtype": tables[t].dtype.value,
                "staging_view": result.staging_views.get(t),
            }
            for t in sorted(result.views)
        },
    }


def run(args: argparse.Namespace) -> int:
    """Provision and report."""
    result = provision(args.artifacts, args.run, args.store, args.generation, args.staged)
    if args.json is not None:
        write_output(args.json, json.dumps(result, indent=2) + "\n")
    if args.json != "-":
        for table, v in result["views"].items():
            print(f"{table} -> {v['view']} (dim={v['dim']} dtype={v['dtype']})", file=sys.stderr)
        print(
            f"provisioned {len(result['views'])} views of run {args.run!r} generation "
            f"{result['generation']} in {result['store']}",
            file=sys.stderr,
        )
    return 0
