"""Flags shared by the commands that read artifacts (and a store)."""

from __future__ import annotations

import argparse


def add_location_arguments(parser: argparse.ArgumentParser, *, store: bool = True) -> None:
    """Add ``--artifacts ROOT --run RUN`` and, with ``store``, ``--store URL`` (all required)."""
    parser.add_argument("--artifacts", required=True, metavar="ROOT", help="artifact root URI")
    parser.add_argument("--run", required=True, metavar="RUN", help="run name")
    if store:
        parser.add_argument("--store", required=True, metavar="URL", help="store URL")
