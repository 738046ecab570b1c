"""The ``deltarec`` command line (SPEC §7a).

Each command lives in its own module ``deltarec.cli.cmd_<name>`` which defines
``add_arguments(parser)`` and ``run(args) -> int``; its one-line help is in :data:`COMMANDS`.
Modules are imported only when their command runs, so ``deltarec verify`` never imports torch.
Every command's flags are frozen by tests/cli/test_cli_surface.py.

Exit codes: 0 success, 1 a check failed (or the command failed), 2 bad usage or bad input.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from deltarec.credentials import redact_text
from deltarec.environ import one_blas_thread
from deltarec.errors import BadInputError, CheckFailedError, DeltarecError

COMMANDS: dict[str, str] = {
    "demo": "run the whole pipeline locally on the example model (SQLite, 2 CPU ranks)",
    "train": "train the example model with delta dumps (under torchrun for several ranks)",
    "provision": "create the store views for the tables of a generation",
    "publish": "publish the committed dumps of a generation that the store does not hold yet",
    "verify": "read rows back from the store and compare them with the artifacts",
    "promote": "record a verified generation as serving's current one",
    "rollback": "restore serving to a promoted generation",
    "inspect": "list generations, dumps, tables, rows and bytes under an artifact root",
    "compact": "fold a generation's dumps into a base that readers start from",
    "gc": "delete the dumps and bases of a run that a newer base covers and nothing needs",
    "serve": "serve a run's promoted tables and dense state from memory (a replica, HTTP)",
    "pipeline": "compile, submit or locally run the pipeline on Kubeflow or Airflow",
}
"""Command name -> one-line help. The module is ``deltarec.cli.cmd_<name>``."""

TRAINING = frozenset({"demo", "train", "pipeline"})
"""Commands that run a model (torch and the user's code); every other one does no linear
algebra in numpy and keeps its OpenBLAS to one thread (:mod:`deltarec.environ`)."""

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _command_module(name: str):  # type: ignore[no-untyped-def]
    return importlib.import_module(f"deltarec.cli.cmd_{name}")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors never echo a credential.

    ``unrecognized arguments: postgresql://u:PW@...`` prints ``u:***@``.
    """

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {redact_text(message)}\n")


class RedactingFormatter(logging.Formatter):
    """A log formatter that masks the credentials of every URL in a record.

    Applies to the message and its traceback, whichever library logged it.
    """

    def format(self, record: logging.LogRecord) -> str:
        """The record formatted as usual, then passed through ``redact_text``."""
        return redact_text(super().format(record))


def configure_logging(verbose: bool) -> None:
    """INFO logging through :class:`RedactingFormatter`.

    ``verbose`` raises deltarec's own loggers to DEBUG, no other: a library's DEBUG lines
    carry request headers and tokens (botocore logs ``x-amz-security-token``).
    """
    handler = logging.StreamHandler()
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    for chatty in ("botocore", "aiobotocore"):  # "Found credentials in ..." on every start
        logging.getLogger(chatty).setLevel(logging.WARNING)
    if verbose:
        logging.getLogger("deltarec").setLevel(logging.DEBUG)


def _redacting_excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """Print an uncaught exception's traceback with every URL's credentials masked."""
    text = "".join(traceback.format_exception(kind, value, tb))
    sys.stderr.write(redact_text(text))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; the sub-parser of ``command`` gets its full arguments."""
    parser = _Parser(
        prog="deltarec",
        description="Publish the embedding rows a torchrec job changes to an online store "
        "while it trains, and prove that serving holds what the model holds.",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="debug logging (deltarec's own loggers)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            _command_module(name).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``deltarec`` console script."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    if command not in COMMANDS:
        command = None
    if command not in TRAINING:
        one_blas_thread()  # before any command module imports numpy
    parser = build_parser(command)
    args = parser.parse_args(args_list)
    configure_logging(args.verbose)
    sys.excepthook = _redacting_excepthook  # a crash's traceback may quote a URL too
    try:
        return int(_command_module(args.command).run(args) or 0)
    except BadInputError as e:
        print(f"deltarec {args.command}: error: {redact_text(str(e))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except CheckFailedError as e:
        print(f"deltarec {args.command}: check failed: {redact_text(str(e))}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    except DeltarecError as e:
        print(f"deltarec {args.command}: failed: {redact_text(str(e))}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # an object store's endpoint that cannot be reached: one line
        from deltarec.cli.common import unreachable

        reason = unreachable(e, getattr(args, "artifacts", None))
        if reason is None:
            raise
        print(f"deltarec {args.command}: failed: {redact_text(reason)}", file=sys.stderr)
        return EXIT_CHECK_FAILED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
