"""Reading a listed file only where it lies: a regular file inside its directory.

A manifest names its shards by relative path; :meth:`ArtifactRoot.open_listed
<deltarec.artifacts.root.ArtifactRoot.open_listed>` opens one only if the path stays inside its
dump directory (:func:`confined_relpath`) and, on a local disk, the file opened is a regular
file whose resolved path lies under the resolved directory (:func:`local_regular`): a link or a
FIFO planted in the artifacts is never read.
"""

from __future__ import annotations

import contextlib
import functools
import os
import stat
from collections.abc import Iterator

from deltarec.errors import ArtifactError


def confined_relpath(relpath: str) -> bool:
    """Whether ``relpath`` is a plain relative path that stays inside its directory."""
    parts = relpath.split("/")
    return (
        bool(relpath)
        and not relpath.startswith("/")
        and "\\" not in relpath
        and all(p not in {"", ".", ".."} for p in parts)
    )


@functools.lru_cache(maxsize=1024)
def _real_dir(directory: str) -> str:
    """``directory`` resolved, with a trailing separator: what an opened file must lie under.

    Cached: a dump of hundreds of ranks lists thousands of shards in one directory, and
    resolving it walks every component (an ``lstat`` each). The check stays on the opened file:
    a directory swapped for a link after it was resolved leaves its files' real paths outside
    the cached one, so they are refused, as they would be if it were resolved again.
    """
    return os.path.realpath(directory).rstrip(os.sep) + os.sep


@contextlib.contextmanager
def local_regular(directory: str, relpath: str, where: str) -> Iterator[str]:
    """Open a local file for reading only if it is a regular file inside ``directory``.

    Yields a path that names the opened file itself (``/proc/self/fd/N`` on Linux), so that a
    reader that opens by path (Arrow's native reader) opens exactly the checked file: a link
    swapped in after the check is never followed. The final component is opened without
    following links and without blocking (a FIFO cannot hang the reader), then checked to be a
    regular file whose resolved path lies under the resolved ``directory``.
    """
    path = os.path.join(directory, relpath)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: the file is a symbolic link
        problem = f"not a regular file inside its directory ({e.strerror})"
        raise ArtifactError(where, problem) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ArtifactError(where, "not a regular file; only regular files are read")
        proc = f"/proc/self/fd/{fd}"
        if os.path.exists(proc):
            real = os.readlink(proc)
            inside = _real_dir(directory)
            if not real.startswith(inside):
                raise ArtifactError(where, "resolves outside its directory; it is not read")
            yield proc
        else:  # no /proc: the path was checked, opened without following its last link
            yield path
    finally:
        os.close(fd)


__all__ = ["confined_relpath", "local_regular"]
