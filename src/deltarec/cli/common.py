"""Flags and outputs shared by the commands."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

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


def nonnegative_int(text: str) -> int:
    """An argparse type: a whole number >= 0 (argparse names the flag in the error)."""
    return _int_at_least(text, 0)


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (argparse names the flag in the error)."""
    return _int_at_least(text, 1)


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text} must be >= {minimum}")
    return value


def require_existing_store(url: str) -> None:
    """Refuse a SQLite store URL whose file does not exist, before anything opens it.

    Commands that read a store (verify, promote, rollback, serve) must not create an empty
    database file at a mistyped path and then advise provisioning it.

    Raises:
        BadInputError: the URL names a SQLite file that does not exist.
    """
    from deltarec.stores.config import SqliteConfig, parse_store_url

    try:
        config = parse_store_url(url)
    except BadInputError:
        return  # said, with its reason, where the store is opened
    if not isinstance(config, SqliteConfig) or config.path == ":memory:":
        return
    if not os.path.exists(config.path):
        raise BadInputError(
            f"--store {url}: the SQLite file {config.path} does not exist "
            "(publish or provision creates it)"
        )


def require_resolvable_host(url: str | None) -> None:
    """Refuse a network store URL whose host name does not resolve, before any retry starts.

    A store that is down is retried up to the retry deadline (600 s by default); a host name
    that the resolver answers "not known" for stays unknown, so it fails at once. A resolver
    that cannot answer now (``EAI_AGAIN``) is left to the retries.

    Raises:
        BadInputError: the URL's host does not resolve (names it and the URL).
    """
    import socket

    from deltarec.stores import redact_url
    from deltarec.stores.config import parse_store_url

    if not url:
        return
    try:
        host = getattr(parse_store_url(url), "host", None)
    except BadInputError:
        return  # said, with its reason, where the store is opened
    if not host or host.startswith("/"):  # no host, or a PostgreSQL socket directory
        return
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as e:
        if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            raise BadInputError(
                f"--store {redact_url(url)}: host {host!r} does not resolve ({e.strerror})"
            ) from None


# Exceptions by which object-store clients say an endpoint cannot be reached (none of them an
# OSError): botocore's, aiohttp's (s3fs, gcsfs) and requests' (ossfs, adlfs).
_UNREACHABLE = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ClientConnectorError",
    "ServerTimeoutError",
    "ConnectionError",
    "ConnectTimeout",
}


def unreachable(error: BaseException, artifacts: str | None = None) -> str | None:
    """One line for an error that says a remote endpoint cannot be reached, else None.

    Walks the error's causes: a client library's connection error (``_UNREACHABLE``, or an
    ``OSError`` connection error) deep inside a file-system call becomes "cannot reach" with
    the artifact root and the library's own message, which names the endpoint.
    """
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ConnectionError | TimeoutError) or type(e).__name__ in _UNREACHABLE:
            where = f"the artifact root {artifacts}" if artifacts else "a remote endpoint"
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            return f"cannot reach {where}: {first}"
        e = e.__cause__ or e.__context__
    return None


SAMPLE_HELP = "0: every key, as --all"
"""What ``--sample 0`` means, the same in every command (``verify``, ``rollback``,
``pipeline verify-serving``) and in the pipeline's ``sample_size``."""


def add_sample_argument(parser: Any, default: int | None, help_text: str) -> None:
    """``--sample N``: keys per table a check reads; 0 reads every key; negative is refused."""
    parser.add_argument(
        "--sample",
        type=sample_size,
        default=default,
        metavar="N",
        help=f"{help_text}; {SAMPLE_HELP}",
    )


def sample_size(text: str) -> int:
    """An argparse type: keys per table, an integer >= 0 (0: every key)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of keys") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0 keys per table (0: every key)")
    return value
