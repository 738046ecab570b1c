"""``deltarec inspect``: generations, dumps, tables, rows, bytes and step ranges of a run.

Reads only GENERATION.json, MANIFEST.json and BASE.json files (never a shard), so it is cheap
on any fsspec root. Incomplete dumps (no manifest) are listed as such.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from deltarec.cli.common import add_generation_argument, add_location_arguments
from deltarec.errors import BadInputError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``deltarec inspect`` (SPEC §7a)."""
    add_location_arguments(parser, store=False)
    add_generation_argument(parser, "only this generation")
    parser.add_argument("--json", action="store_true", help="print JSON (for machines)")


def describe(root: Any, run: str, generation: int | None = None) -> dict[str, Any]:
    """The run's generations and dumps as a JSON-able dict (what ``--json`` prints).

    Raises:
        BadInputError: if the run has no generation, or not the one asked for.
    """
    gens = root.list_generations(run)
    if not gens:
        raise BadInputError(f"run {run!r} has no generation under {root.uri}")
    if generation is not None:
        if generation not in gens:
            raise BadInputError(
                f"run {run!r} has no generation {generation} under {root.uri} (has {gens})"
            )
        gens = [generation]
    return {
        "run": run,
        "root": root.uri,
        "bases": _bases(root, run),
        "generations": [_generation(root, run, g) for g in gens],
    }


def _bases(root: Any, run: str) -> list[dict[str, Any]]:
    """The committed bases (SPEC §3a): what each folds and how many rows it holds."""
    from deltarec.artifacts.base import list_bases, read_base

    out = []
    for g, s in list_bases(root, run):
        b = read_base(root, run, g, s)
        out.append(
            {
                "generation": g,
                "through_seq": s,
                "lineage": [e.to_json() for e in b.lineage],
                "built_from": None if b.base is None else list(b.base),
                "rows": sum(b.rows.values()),
                "bytes": sum(p.bytes for p in b.parts),
                "parts": len(b.parts),
                "created_at": b.created_at,
            }
        )
    return out


def _generation(root: Any, run: str, g: int) -> dict[str, Any]:
    info = root.read_generation(run, g)
    dumps = []
    for seq in root.list_dumps(run, g):
        m = root.read_manifest(run, g, seq)
        tables = {
            t: {"rows": rows, "bytes": sum(s.bytes for s in m.shards_of(t))}
            for t, rows in m.tables.items()
        }
        dumps.append(
            {
                "seq": seq,
                "version": m.version,
                "kind": m.kind.value,
                "first_step": m.first_step,
                "last_step": m.last_step,
                "created_at": m.created_at,
                "rows": sum(m.tables.values()),
                "bytes": sum(s.bytes for s in m.shards),
                "shards": len(m.shards),
                "tables": tables,
            }
        )
    parent = None
    if info.parent is not None:
        parent = {
            "generation": info.parent.generation,
            "checkpoint_step": info.parent.checkpoint_step,
        }
    steps = [d["first_step"] for d in dumps] + [d["last_step"] for d in dumps]
    return {
        "generation": g,
        "created_at": info.created_at,
        "parent": parent,
        "world_size": info.world_size,
        "tables": {t: s.to_json() for t, s in info.tables.items()},
        "dumps": dumps,
        "incomplete_dumps": root.list_incomplete_dumps(run, g),
        "rows": sum(d["rows"] for d in dumps),
        "bytes": sum(d["bytes"] for d in dumps),
        "steps": [min(steps), max(steps)] if steps else None,
    }


def _print(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Column, Table

    from deltarec.verify.report import fits

    console = Console()
    console.print(f"run [bold]{report['run']}[/bold] under {report['root']}")
    for b in report.get("bases", []):
        console.print(
            f"base of generation {b['generation']} through dump {b['through_seq']}: "
            f"{b['rows']:,} rows in {b['parts']} parts, {b['bytes']:,} bytes",
            soft_wrap=True,
        )
    for g in report["generations"]:
        parent = g["parent"]
        origin = (
            f"restored from generation {parent['generation']} step {parent['checkpoint_step']}"
            if parent
            else "fresh start"
        )
        steps = f"steps {g['steps'][0]}-{g['steps'][1]}" if g["steps"] else "no dumps"
        console.print(
            f"\n[bold]generation {g['generation']}[/bold] ({origin}; {g['world_size']} ranks; "
            f"{len(g['tables'])} tables; {len(g['dumps'])} dumps; {g['rows']:,} rows; "
            f"{g['bytes']:,} bytes; {steps})",
            soft_wrap=True,
        )
        # a table name and a time are read whole (copied into other commands): never folded
        # nor cut; a console too narrow for the table gets one line per dump and table
        t = Table("seq", "kind", "steps", Column("table", no_wrap=True), "rows", "bytes",
                  Column("created", no_wrap=True))  # fmt: skip
        lines = []
        for d in g["dumps"]:
            t.add_row(
                str(d["seq"]),
                d["kind"],
                f"{d['first_step']}-{d['last_step']}",
                "[bold]all tables[/bold]",
                f"{d['rows']:,}",
                f"{d['bytes']:,}",
                d["created_at"][:19],
            )
            lines.append(
                f"dump {d['seq']} {d['kind']} steps {d['first_step']}-{d['last_step']}: "
                f"{d['rows']:,} rows, {d['bytes']:,} bytes, created {d['created_at'][:19]}"
            )
            for name, tab in d["tables"].items():
                if tab["rows"]:
                    t.add_row("", "", "", name, f"{tab['rows']:,}", f"{tab['bytes']:,}", "")
                    lines.append(f"  {name}: {tab['rows']:,} rows, {tab['bytes']:,} bytes")
        if fits(console, t):
            console.print(t)
        else:
            for line in lines:
                console.print(line, soft_wrap=True, highlight=False)
        if g["incomplete_dumps"]:
            left = g["incomplete_dumps"]
            console.print(f"incomplete dumps (no manifest; cleaned at the next start): {left}")


def run(args: argparse.Namespace) -> int:
    """Print the description of the run (table, or JSON with ``--json``)."""
    from deltarec.artifacts import ArtifactRoot
    from deltarec.artifacts.history import RunHistory

    report = describe(RunHistory(ArtifactRoot(args.artifacts)), args.run, args.generation)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0
