"""Where a benchmark ran: the first line each of them prints, and the commit its JSON keeps."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess


def commit() -> str:
    """The checkout's short commit ('' outside a git checkout)."""
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()


def header(name: str, rev: str) -> str:
    """``# <name> <date> UTC, <machine> (<cores> cores), commit <rev>``."""
    now = datetime.datetime.now(datetime.UTC)
    machine = f"{platform.node()} ({os.cpu_count()} cores)"
    return f"# {name} {now:%Y-%m-%d %H:%M} UTC, {machine}, commit {rev}"
