"""The artifact root: paths, atomic writes and listing on any fsspec URI (SPEC §3).

Layout::

    <root>/<run>/gen-<G:06d>/GENERATION.json
    <root>/<run>/gen-<G:06d>/dump-<S:06d>/<table>/rank-<R:05d>.parquet
    <root>/<run>/gen-<G:06d>/dump-<S:06d>/MANIFEST.json        # written last

Every file is written under a temporary name and renamed into place (on local disks after an
fsync). A dump directory without MANIFEST.json is incomplete: readers ignore it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import posixpath
import re
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from deltarec.artifacts.base import BASE_FILE, BASE_RE, base_name, covered_seq, seq_ranges
from deltarec.artifacts.confined import confined_relpath, local_regular, read_regular
from deltarec.artifacts.types import GenerationInfo, Manifest, shard_relpath
from deltarec.errors import ArtifactError, BadInputError, MissingDumpError
from deltarec.ids import validate_run

GENERATION_FILE = "GENERATION.json"
MANIFEST_FILE = "MANIFEST.json"
_GEN_RE = re.compile(r"^gen-(\d{6,})$")
_DUMP_RE = re.compile(r"^dump-(\d{6,})$")
TMP_MARK = ".tmp-"

if TYPE_CHECKING:
    import fsspec


def gen_name(generation: int) -> str:
    """``gen-<G:06d>``."""
    return f"gen-{generation:06d}"


def dump_name(seq: int) -> str:
    """``dump-<S:06d>``."""
    return f"dump-{seq:06d}"


class ArtifactRoot:
    """An artifact root on a filesystem that fsspec understands.

    Args:
        uri: a local path or an fsspec URI (``file://``; ``s3://`` and ``oss://`` with their
            extras; docs/artifact-roots.md says what is tested).
        storage_options: passed to fsspec (credentials come from the environment by default).
    """

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None) -> None:
        if not uri:
            raise BadInputError("artifact root is empty")
        self.uri = uri
        self._storage_options = storage_options or {}
        self._fs: fsspec.AbstractFileSystem | None = None
        local = None if self._storage_options else _plain_local_path(uri)
        if local is None:
            self._fs, path = _url_to_fs(uri, self._storage_options)
            self.is_local = _is_local_fs(self._fs)
        else:
            path, self.is_local = local, True
        self.path: str = path.rstrip("/") or "/"

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The root's fsspec filesystem.

        A root given as a plain local path builds it on first use only: the local reads and
        listings below go to the OS directly, and fsspec's import (asyncio among it) costs
        about 60 ms of a ``deltarec publish`` or ``verify`` that never needs it.
        """
        if self._fs is None:
            self._fs = _url_to_fs(self.uri, self._storage_options)[0]
        return self._fs

    def __repr__(self) -> str:
        return f"ArtifactRoot({self.uri!r})"

    # ---- paths ---------------------------------------------------------------------------
    def run_dir(self, run: str) -> str:
        """``<root>/<run>``."""
        return posixpath.join(self.path, validate_run(run))

    def gen_dir(self, run: str, generation: int) -> str:
        """``<root>/<run>/gen-<G>``."""
        return posixpath.join(self.run_dir(run), gen_name(generation))

    def dump_dir(self, run: str, generation: int, seq: int) -> str:
        """``<root>/<run>/gen-<G>/dump-<S>``."""
        return posixpath.join(self.gen_dir(run, generation), dump_name(seq))

    def shard_path(self, run: str, generation: int, seq: int, table: str, rank: int) -> str:
        """The full path of one shard."""
        return posixpath.join(self.dump_dir(run, generation, seq), shard_relpath(table, rank))

    def url(self, path: str) -> str:
        """A path on this filesystem as a URI (for messages and artifact metadata)."""
        if self._fs is None:  # a plain local path, as fsspec's local filesystem names it
            return f"file://{_posix_abspath(path)}"
        return self.fs.unstrip_protocol(path)

    # ---- low-level I/O -------------------------------------------------------------------
    def open(self, path: str, mode: str = "rb") -> BinaryIO:
        """Open a file of the root in a binary ``mode``, locally without fsspec."""
        f = open(path, mode) if self.is_local else self.fs.open(path, mode)  # noqa: SIM115
        return cast(BinaryIO, f)

    @contextlib.contextmanager
    def open_listed(self, directory: str, relpath: str) -> Iterator[str | BinaryIO]:
        """Open a file that an artifact lists (a shard, a base part, dense state) for reading.

        The artifact root is a trust boundary (SPEC §3): whoever wrote a manifest may not make
        a reader open anything but a regular file inside the listing's own directory. Locally
        the yielded value is a path naming the opened file (for Arrow's native reader; open it
        inside the ``with``), on an object store an open binary file.

        Raises:
            ArtifactError: ``relpath`` is absolute, has ``..``, ``.`` or empty parts, or names
                something that is not a regular file inside ``directory``.
            FileNotFoundError: the file does not exist.
        """
        where = functools.partial(self._listed_url, directory, relpath)  # built on error only
        if not confined_relpath(relpath):
            raise ArtifactError(where(), f"listed path {relpath!r} leaves its directory; refused")
        if self.is_local:
            with local_regular(directory, relpath, where) as path:
                yield path
            return
        path = posixpath.join(directory, relpath)
        info = self.fs.info(path)
        if info.get("type") != "file":
            raise ArtifactError(where(), "not a regular file; only regular files are read")
        with self.fs.open(path, "rb") as f:
            yield cast(BinaryIO, f)

    def read_listed(self, directory: str, relpath: str, limit: int) -> bytes:
        """At most ``limit`` bytes of a file an artifact lists, under :meth:`open_listed`'s checks.

        Locally one open: the checks and the read on one descriptor (a dump of hundreds of
        ranks has thousands of small shards, each read whole).

        Raises:
            ArtifactError: as :meth:`open_listed`.
            FileNotFoundError: the file does not exist.
        """
        if not (self.is_local and confined_relpath(relpath)):
            with self.open_listed(directory, relpath) as f:
                assert not isinstance(f, str)
                return f.read(limit)
        return read_regular(
            directory, relpath, limit, functools.partial(self._listed_url, directory, relpath)
        )

    def _listed_url(self, directory: str, relpath: str) -> str:
        return self.url(posixpath.join(directory, relpath))

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists, locally without fsspec."""
        if self.is_local:
            return os.path.exists(path)
        return bool(self.fs.exists(path))

    def makedirs(self, path: str) -> None:
        """Create a directory (no-op on object stores)."""
        if self.is_local:
            os.makedirs(path, exist_ok=True)
        else:
            self.fs.makedirs(path, exist_ok=True)

    def tmp_path(self, final: str) -> str:
        """A unique temporary sibling of ``final`` (ignored by readers)."""
        head, tail = posixpath.split(final)
        return posixpath.join(head, f"{TMP_MARK}{tail}.{uuid.uuid4().hex[:12]}")

    def publish_file(self, tmp: str, final: str) -> None:
        """Rename a fully written temporary file into place (atomic on local disks)."""
        if self.is_local:
            os.replace(tmp, final)
            _fsync_dir(posixpath.dirname(final))
        else:
            self.fs.mv(tmp, final)

    def write_bytes_atomic(self, final: str, data: bytes) -> None:
        """Write ``data`` to ``final`` via a durable temporary file and a rename."""
        self.makedirs(posixpath.dirname(final))
        tmp = self.tmp_path(final)
        if self.is_local:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
        self.publish_file(tmp, final)

    def replace_bytes(self, path: str, data: bytes) -> None:
        """Replace the whole object at ``path`` (one PUT on object stores; a rename locally).

        Readers see the old content or the new one, never a mix.
        """
        if self.is_local:
            self.write_bytes_atomic(path, data)
        else:
            self.fs.pipe_file(path, data)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` only if it does not exist. Returns False if it already existed.

        Locally ``O_EXCL``; on an object store a conditional write the server enforces
        (S3 ``PutObject`` with ``If-None-Match: *``, which AWS S3, SeaweedFS and MinIO honour;
        on ``oss://`` through ossfs, OSS's ``x-oss-forbid-overwrite``), never a listing or an
        existence check followed by a write: of two writers racing for one path exactly one
        gets True.
        """
        self.makedirs(posixpath.dirname(path))
        if self.is_local:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(posixpath.dirname(path))
            return True
        try:
            if _protocols(self.fs) & {"oss"}:  # ossfs: OSS's own header, refused with 409
                self.fs.pipe_file(path, data, headers={"x-oss-forbid-overwrite": "true"})
            else:  # PutObject with If-None-Match: * (s3fs, and fsspec's "create" mode)
                self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        except OSError as e:
            if _precondition_failed(e):  # the server refused: the object exists
                return False
            raise
        except (ValueError, NotImplementedError, TypeError) as e:
            raise BadInputError(
                f"{self.url(path)}: the filesystem cannot create files exclusively ({e}); "
                "generations and leases could not be allocated safely"
            ) from e
        return True

    def read_json(self, path: str) -> dict[str, Any]:
        """Read and parse a JSON file; raises :class:`ArtifactError` naming the file."""
        try:
            with self.open(path) as f:
                obj = json.loads(f.read())
        except FileNotFoundError:
            raise ArtifactError(self.url(path), "not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ArtifactError(self.url(path), f"not valid JSON: {e}") from e
        if not isinstance(obj, dict):
            raise ArtifactError(self.url(path), "expected a JSON object")
        return obj

    def numbered_entries(self, path: str, pattern: re.Pattern[str]) -> list[int]:
        """The numbers (``pattern``'s first group) of the entries of ``path`` it matches.

        Ascending, without repeats; ``[]`` if the folder does not exist. On object stores the
        listing is asked for again, never served from fsspec's cache.
        """
        try:
            names = self._names(path)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            m = pattern.match(name)
            if m:
                found.append(int(m.group(1)))
        return sorted(set(found))

    def _names(self, path: str) -> list[str]:
        """The names of the entries of folder ``path``; raises FileNotFoundError if none."""
        if self.is_local:
            try:
                return os.listdir(path)
            except NotADirectoryError:
                raise FileNotFoundError(path) from None
        # Object-store listings are cached (s3fs): ask again (a fence must not read a cached one).
        self.fs.invalidate_cache(path)
        entries = self.fs.ls(path, detail=False)
        return [posixpath.basename(str(e).rstrip("/")) for e in entries]

    def _holds_objects(self, path: str) -> bool:
        """Whether any file lies under ``path``.

        Object stores differ in what they list once a folder is emptied: AWS S3 and moto drop
        the prefix, SeaweedFS (and stores with directory objects, OSS among them) keep listing
        it. A directory counts by the files it holds, never by being listed.
        """
        if self.is_local:
            return any(files for _, _, files in os.walk(path))
        inside = path.rstrip("/") + "/"
        try:
            found = self.fs.find(path, withdirs=False, detail=True)
        except FileNotFoundError:
            return False
        # SeaweedFS reports an emptied folder as an entry named like the folder itself, and a
        # directory object ("dump-000001/") is no file either: only entries below it count.
        return any(
            str(name).startswith(inside)
            and not str(name).endswith("/")
            and (info or {}).get("type", "file") == "file"
            for name, info in found.items()
        )

    # ---- generations ---------------------------------------------------------------------
    def list_runs(self) -> list[str]:
        """Every run under the root that has at least one generation."""
        try:
            runs = self._names(self.path)
        except FileNotFoundError:
            return []
        return sorted(r for r in runs if self.list_generations(r))

    def list_generations(self, run: str) -> list[int]:
        """Generations of ``run`` whose GENERATION.json exists, ascending."""
        gens = self.numbered_entries(self.run_dir(run), _GEN_RE)
        return [g for g in gens if self.exists(self.generation_file(run, g))]

    def generation_file(self, run: str, generation: int) -> str:
        """Path of GENERATION.json."""
        return posixpath.join(self.gen_dir(run, generation), GENERATION_FILE)

    def read_generation(self, run: str, generation: int) -> GenerationInfo:
        """Parse GENERATION.json of one generation."""
        path = self.generation_file(run, generation)
        info = GenerationInfo.from_json(self.read_json(path), self.url(path))
        if info.run != run or info.generation != generation:
            raise ArtifactError(
                self.url(path), f"describes run {info.run!r} generation {info.generation}"
            )
        return info

    def newest_generation_number(self, run: str) -> int:
        """The highest ``gen-<G>`` directory of ``run`` (0 if none): one listing, no reads."""
        gens = self.numbered_entries(self.run_dir(run), _GEN_RE)
        return gens[-1] if gens else 0

    def latest_generation(self, run: str) -> int:
        """The newest generation of ``run``; raises :class:`BadInputError` if there is none."""
        gens = self.list_generations(run)
        if not gens:
            raise BadInputError(f"run {run!r} has no generation under {self.uri}")
        return gens[-1]

    def allocate_generation(self, info: GenerationInfo) -> GenerationInfo:
        """Atomically claim the next free generation number for ``info.run``.

        ``info.generation`` is a lower bound; the returned info carries the number claimed.
        Two callers can never claim the same number: GENERATION.json is created exclusively.
        """
        from dataclasses import replace

        existing = self.numbered_entries(self.run_dir(info.run), _GEN_RE)
        candidate = max([info.generation - 1, *existing]) + 1
        while True:
            claimed = replace(info, generation=candidate)
            data = json.dumps(claimed.to_json(), indent=2, sort_keys=False).encode()
            if self.create_exclusive(self.generation_file(info.run, candidate), data):
                return claimed
            candidate += 1

    def lineage(self, run: str, generation: int) -> list[GenerationInfo]:
        """The generation and its ancestors (via ``parent``), oldest first."""
        chain: list[GenerationInfo] = []
        seen: set[int] = set()
        current: int | None = generation
        while current is not None:
            if current in seen:
                raise ArtifactError(self.url(self.gen_dir(run, current)), "parent cycle")
            seen.add(current)
            info = self.read_generation(run, current)
            chain.append(info)
            current = info.parent.generation if info.parent else None
        return chain[::-1]

    # ---- dumps ---------------------------------------------------------------------------
    def manifest_file(self, run: str, generation: int, seq: int) -> str:
        """Path of MANIFEST.json."""
        return posixpath.join(self.dump_dir(run, generation, seq), MANIFEST_FILE)

    def committed_seqs(self, run: str, generation: int) -> list[int]:
        """Committed dumps (with a manifest) of a generation, ascending, holes not checked.

        For retention and cleanup only; every reader uses :meth:`list_dumps`.
        """
        seqs = self.numbered_entries(self.gen_dir(run, generation), _DUMP_RE)
        return [s for s in seqs if self.exists(self.manifest_file(run, generation, s))]

    def list_dumps(self, run: str, generation: int) -> list[int]:
        """Committed dumps of a generation, ascending by seq, the chain checked (SPEC §3a).

        The seqs after the newest committed base that covers the generation (from 0 or 1
        where none does: the snapshot is optional) must be consecutive up to the newest
        committed dump; a dump below a covering base may be gone (retention removed it).

        Raises:
            MissingDumpError: a seq is missing, naming the run, generation and seq.
        """
        seqs = self.committed_seqs(run, generation)
        if not seqs or (seqs[0] <= 1 and seqs[-1] - seqs[0] + 1 == len(seqs)):
            return seqs  # no hole: no base needs reading
        covered = covered_seq(self, run, generation)
        start = covered + 1 if covered >= 0 else min(seqs[0], 1)
        have = set(seqs)
        for seq in range(start, seqs[-1] + 1):
            if seq not in have:
                detail = (
                    f"committed after base through dump {covered}: "
                    if covered >= 0
                    else "no base covers it; committed: "
                )
                raise MissingDumpError(
                    self.url(self.gen_dir(run, generation)),
                    run,
                    generation,
                    seq,
                    detail + seq_ranges([s for s in seqs if s >= start]),
                )
        return seqs

    def list_incomplete_dumps(self, run: str, generation: int) -> list[int]:
        """Dump directories that hold files but no manifest (an emptied folder is none)."""
        seqs = self.numbered_entries(self.gen_dir(run, generation), _DUMP_RE)
        return [
            s
            for s in seqs
            if not self.exists(self.manifest_file(run, generation, s))
            and self._holds_objects(self.dump_dir(run, generation, s))
        ]

    def read_manifest(self, run: str, generation: int, seq: int) -> Manifest:
        """Parse MANIFEST.json of one dump."""
        path = self.manifest_file(run, generation, seq)
        m = Manifest.from_json(self.read_json(path), self.url(path))
        if (m.run, m.generation, m.seq) != (run, generation, seq):
            raise ArtifactError(
                self.url(path), f"describes run {m.run!r} generation {m.generation} seq {m.seq}"
            )
        return m

    def commit_manifest(self, manifest: Manifest) -> str:
        """Write MANIFEST.json last, atomically; returns its path."""
        path = self.manifest_file(manifest.run, manifest.generation, manifest.seq)
        self.write_bytes_atomic(path, json.dumps(manifest.to_json(), indent=2).encode())
        return path

    # ---- bases ---------------------------------------------------------------------------
    def base_dir(self, run: str, generation: int, through_seq: int) -> str:
        """``<root>/<run>/base-<G>-<S>``."""
        return posixpath.join(self.run_dir(run), base_name(generation, through_seq))

    def base_file(self, run: str, generation: int, through_seq: int) -> str:
        """Path of BASE.json."""
        return posixpath.join(self.base_dir(run, generation, through_seq), BASE_FILE)

    def base_dirs(self, run: str) -> list[tuple[int, int]]:
        """Every ``base-<G>-<S>`` directory of ``run`` (committed or not), ascending."""
        try:
            names = self._names(self.run_dir(run))
        except FileNotFoundError:
            return []
        found = {(int(m.group(1)), int(m.group(2))) for m in map(BASE_RE.match, names) if m}
        return sorted(found)

    def clean_incomplete(self, run: str) -> list[str]:
        """Remove dump directories without a manifest and stray temporary files of ``run``.

        Called at the start of a new generation, when no writer of an earlier one is alive.
        Returns the removed paths.
        """
        removed: list[str] = []
        for g in self.numbered_entries(self.run_dir(run), _GEN_RE):
            for s in self.list_incomplete_dumps(run, g):
                d = self.dump_dir(run, g, s)
                self.fs.rm(d, recursive=True)
                removed.append(d)
        return removed


def _plain_local_path(uri: str) -> str | None:
    """The absolute path ``uri`` names if it is a plain local path (no protocol), else None."""
    if "://" in uri or "::" in uri:
        return None
    return _posix_abspath(uri)


def _posix_abspath(path: str) -> str:
    """``path`` made absolute the way fsspec's local filesystem does (``make_path_posix``)."""
    if path.startswith("/"):
        return path
    if path.startswith("~"):
        return os.path.expanduser(path)
    if path.startswith("./"):
        path = path[2:]
    elif path == ".":
        path = ""
    return f"{os.getcwd()}/{path}"


def _url_to_fs(uri: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    """The fsspec filesystem and path for ``uri``; raises :class:`BadInputError` if it has none."""
    import fsspec  # heavy (asyncio, compression codecs): only where a root needs it

    try:
        fs, path = fsspec.core.url_to_fs(uri, **storage_options)
    except (ValueError, ImportError) as e:
        raise BadInputError(f"artifact root {uri!r}: {e}") from e
    return fs, str(path)


def _is_local_fs(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def _protocols(fs: Any) -> set[str]:
    protocol = getattr(fs, "protocol", ())
    return {protocol} if isinstance(protocol, str) else set(protocol)


def _precondition_failed(e: BaseException) -> bool:
    """Whether an object store refused a conditional write because the object exists.

    s3fs turns S3's 412 into ``FileExistsError`` only when the answer names the
    ``If-None-Match`` condition (AWS); SeaweedFS and others answer a bare 412, which s3fs
    makes an ``OSError``. OSS answers ``x-oss-forbid-overwrite`` with 409 FileAlreadyExists.
    """
    seen: BaseException | None = e
    while seen is not None:
        if getattr(seen, "code", None) == "FileAlreadyExists":  # oss2's error
            return True
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if error.get("Code") in ("PreconditionFailed", "412") or status == 412:
                return True
        seen = seen.__cause__ or seen.__context__
    text = str(e).lower()
    return "pre-condition" in text or "precondition" in text


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
