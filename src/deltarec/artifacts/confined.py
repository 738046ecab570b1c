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
from collections.abc import Callable, Iterator

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
def local_regular(directory: str, relpath: str, where: Callable[[], str]) -> Iterator[str]:
    """Open a local file for reading only if it is a regular file inside ``directory``.

    Yields a path that names the opened file itself (``/proc/self/fd/N`` on Linux), so that a
    reader that opens by path (Arrow's native reader) opens exactly the checked file: a link
    swapped in after the check is never followed. The final component is opened without
    following links and without blocking (a FIFO cannot hang the reader), then checked to be a
    regular file whose resolved path lies under the resolved ``directory``. ``where``: the
    file's URL for an error (built only then).
    """
    path = os.path.join(directory, relpath)
    fd, _ = _open_regular(path, where)
    try:
        proc = _inside(fd, directory, where)
        yield path if proc is None else proc
    finally:
        os.close(fd)


def read_regular(directory: str, relpath: str, limit: int, where: Callable[[], str]) -> bytes:
    """At most ``limit`` bytes of a local regular file inside ``directory``.

    The checks of :func:`local_regular`, on the one descriptor the bytes are then read from: a
    small shard read whole costs one open (thousands of them a dump of hundreds of ranks).

    Raises:
        ArtifactError: a link, a FIFO or another non-regular file, or a file resolving outside
            ``directory``.
        FileNotFoundError: the file does not exist.
    """
    fd, size = _open_regular(os.path.join(directory, relpath), where)
    try:
        _inside(fd, directory, where)
        # At most the size the open file has: no read to find its end (a larger file gives
        # ``limit`` bytes; one that grows meanwhile is read as it was when opened).
        chunks, left = [], min(size, limit)
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _open_regular(path: str, where: Callable[[], str]) -> tuple[int, int]:
    """``(descriptor, size)`` of ``path``, a regular file, opened without following a link.

    Opened without blocking (a FIFO); anything but a regular file is closed and refused.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: the file is a symbolic link
        problem = f"not a regular file inside its directory ({e.strerror})"
        raise ArtifactError(where(), problem) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError(where(), "not a regular file; only regular files are read")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _inside(fd: int, directory: str, where: Callable[[], str]) -> str | None:
    """``/proc/self/fd/N`` naming ``fd`` if the opened file lies under ``directory`` resolved.

    None where there is no ``/proc`` (the path was checked and opened without following its
    last link).

    Raises:
        ArtifactError: the opened file resolves outside ``directory``.
    """
    proc = f"/proc/self/fd/{fd}"
    try:
        real = os.readlink(proc)
    except FileNotFoundError:
        return None
    if not real.startswith(_real_dir(directory)):
        raise ArtifactError(where(), "resolves outside its directory; it is not read")
    return proc


__all__ = ["confined_relpath", "local_regular", "read_regular"]
