"""Flags and outputs shared by the commands."""

from __future__ import annotations

import argparse
import sys

from deltarec.errors import BadInputError


def add_location_arguments(parser: argparse.ArgumentParser, *, store: bool = True) -> None:
    """Add ``--artifacts ROOT --run RUN`` and, with ``store``, ``--store URL`` (all required)."""
    parser.add_argument("--artifacts", required=True, metavar="ROOT", help="artifact root URI")
    parser.add_argument("--run", required=True, metavar="RUN", help="run name")
    if store:
        parser.add_argument("--store", required=True, metavar="URL", help="store URL")


def add_generation_argument(
    parser: argparse.ArgumentParser, help_text: str | None = None, *, required: bool = False
) -> None:
    """Add ``--generation G``: the generation the command works on."""
    parser.add_argument("--generation", type=int, required=required, metavar="G", help=help_text)


def add_through_seq_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    """Add ``--through-seq S``: the last dump of the generation that counts."""
    parser.add_argument("--through-seq", type=int, metavar="S", help=help_text)


def add_engine_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    """Add ``--engine kfp|airflow`` (default ``kfp``): what runs the pipeline."""
    from deltarec.demo import ENGINES

    parser.add_argument("--engine", choices=ENGINES, default="kfp", help=help_text)


def add_json_result_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--json [PATH]``: the command's result as JSON to PATH, or to stdout when bare."""
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="write the result as JSON to PATH (or stdout without PATH)",
    )


def write_output(path: str, text: str) -> None:
    """Write ``text`` to ``path`` (a local path or fsspec URI), or to stdout for ``-``.

    Raises:
        BadInputError: ``path`` cannot be written (names it and why).
    """
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    import fsspec

    try:
        with fsspec.open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except (OSError, ValueError) as e:
        raise BadInputError(f"cannot write {path}: {e}") from e


def seconds(text: str) -> float:
    """An argparse type: a duration in seconds, finite and >= 0 (argparse names the flag)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a duration >= 0 seconds")
    return value
