"""One writer per run: a renewable lease on a run in the artifact root (SPEC §5).

Layout::

    <root>/<run>/LEASE/epoch-<E:06d>.json

The lease is built on the two operations every fsspec filesystem and object store offers
safely: creating an object only if it does not exist (``O_EXCL`` locally, a ``PutObject`` with
``If-None-Match: *`` that the server enforces on S3-compatible stores, the same primitive that
allocates generations: :meth:`ArtifactRoot.create_exclusive`) and replacing a whole object.
Who holds the run never depends on what a store lists: a listing only proposes the next
epoch, whose exclusive create decides, and a holder learns it was superseded by reading
epoch ``E + 1`` directly. Each holder owns one **epoch** file, created exclusively; the
newest epoch is the holder of the run.

* **acquire**: read the newest epoch. If its holder is alive (renewed within its ``ttl_s``
  and not released), refuse with :class:`LeaseHeldError` naming host, pid and since when.
  Otherwise create epoch ``E + 1`` exclusively: of two trainers racing for an expired lease
  exactly one creates it, the other sees a live holder and refuses.
* **renew**: the holder rewrites its own epoch file (``renewed_at``) every ``ttl_s / 4``; it
  is the only writer of that file.
* **check** (the fence, before every commit and checkpoint): the holder's epoch must still be
  the newest and its last successful renewal younger than ``ttl_s``; else
  :class:`LeaseLostError` names the newer holder, and the caller stops without committing.
* **release**: a clean exit marks the epoch released, so the next trainer starts at once.

A holder on this machine whose process is gone (same host and pid namespace, pid dead or
reused) counts as expired at once, so a trainer restarted after a crash does not wait for
the TTL. A holder on another machine is judged by the clock: hosts' clocks must agree to well
within ``ttl_s``.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import socket
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from deltarec.artifacts.root import ArtifactRoot
from deltarec.errors import ArtifactError, BadInputError, DeltarecError
from deltarec.ids import validate_run

log = logging.getLogger(__name__)

LEASE_DIR = "LEASE"
DEFAULT_TTL_S = 60.0
_EPOCH_RE = re.compile(r"^epoch-(\d{6,})\.json$")


class LeaseHeldError(BadInputError):
    """Another live trainer holds the run's lease: this one refuses to start (exit code 2)."""

    @classmethod
    def of(cls, run: str, holder: LeaseRecord, now: float) -> LeaseHeldError:
        """The error naming ``holder`` (host, pid, since when, when it expires)."""
        return cls(
            f"run {run!r} is being trained by another trainer: {holder.describe(now)}. "
            f"Stop that trainer, or wait until its lease expires "
            f"({max(0.0, holder.expires_at - now):.0f} s from now unless it is renewed)"
        )


class LeaseLostError(DeltarecError):
    """A newer trainer owns the run (or the lease could not be renewed): stop, commit nothing."""


@dataclass(frozen=True)
class LeaseRecord:
    """One epoch file: who holds the run, since when, until when unless renewed.

    Attributes:
        run: the run.
        epoch: the lease epoch (ascending; the newest is the holder).
        host: the holder's host name.
        pid: the holder's process id.
        since: unix seconds the holder acquired the lease.
        renewed_at: unix seconds of the holder's last renewal.
        ttl_s: the lease expires this many seconds after ``renewed_at``.
        generation: the generation the holder writes (None until allocated).
        released: True after a clean exit.
        pid_ns: the holder's pid namespace (tells whether ``pid`` is comparable here).
        pid_start: the holder process's start time in clock ticks (tells pid reuse apart).
    """

    run: str
    epoch: int
    host: str
    pid: int
    since: float
    renewed_at: float
    ttl_s: float
    generation: int | None = None
    released: bool = False
    pid_ns: str = ""
    pid_start: str = ""

    @property
    def expires_at(self) -> float:
        """Unix seconds when the lease expires unless renewed."""
        return self.renewed_at + self.ttl_s

    def alive(self, now: float) -> bool:
        """True if the holder may still write: not released, not expired, process not gone."""
        if self.released or now >= self.expires_at:
            return False
        return not _process_gone(self)

    def describe(self, now: float) -> str:
        """``host H pid P since <UTC time>, generation G, renewed N s ago``."""
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since))
        gen = f", generation {self.generation}" if self.generation is not None else ""
        return (
            f"host {self.host} pid {self.pid} since {since}{gen}, lease epoch {self.epoch}, "
            f"renewed {max(0.0, now - self.renewed_at):.0f} s ago"
        )

    def to_json(self) -> dict[str, Any]:
        """The epoch file's JSON object."""
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str) -> LeaseRecord:
        """Parse an epoch file; raises :class:`ArtifactError` naming ``where``."""
        try:
            gen = obj.get("generation")
            return cls(
                run=str(obj["run"]),
                epoch=int(obj["epoch"]),
                host=str(obj["host"]),
                pid=int(obj["pid"]),
                since=float(obj["since"]),
                renewed_at=float(obj["renewed_at"]),
                ttl_s=float(obj["ttl_s"]),
                generation=None if gen is None else int(gen),
                released=bool(obj.get("released", False)),
                pid_ns=str(obj.get("pid_ns", "")),
                pid_start=str(obj.get("pid_start", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(where, f"not a lease record: {type(e).__name__}: {e}") from e


def lease_dir(root: ArtifactRoot, run: str) -> str:
    """``<root>/<run>/LEASE``."""
    return posixpath.join(root.run_dir(validate_run(run)), LEASE_DIR)


def epoch_file(root: ArtifactRoot, run: str, epoch: int) -> str:
    """``<root>/<run>/LEASE/epoch-<E:06d>.json``."""
    return posixpath.join(lease_dir(root, run), f"epoch-{epoch:06d}.json")


def epochs(root: ArtifactRoot, run: str) -> list[int]:
    """Every lease epoch of ``run``, ascending."""
    return root.numbered_entries(lease_dir(root, run), _EPOCH_RE)


def read_epoch(root: ArtifactRoot, run: str, epoch: int) -> LeaseRecord:
    """Read one epoch file (retrying briefly while a local exclusive create is being filled)."""
    path = epoch_file(root, run, epoch)
    for attempt in range(20):
        try:
            return LeaseRecord.from_json(root.read_json(path), root.url(path))
        except ArtifactError:
            if attempt == 19:
                raise
            time.sleep(0.05)
    raise AssertionError("unreachable")


def current_holder(root: ArtifactRoot, run: str) -> LeaseRecord | None:
    """The newest epoch's record, or None if the run was never leased."""
    found = epochs(root, run)
    return read_epoch(root, run, found[-1]) if found else None


def check_free(root: ArtifactRoot, run: str) -> None:
    """Raise :class:`LeaseHeldError` if a live trainer holds ``run`` (a read-only probe)."""
    holder = current_holder(root, run)
    now = time.time()
    if holder is not None and holder.alive(now):
        raise LeaseHeldError.of(run, holder, now)


class RunLease:
    """The lease this process holds on a run; see the module docstring.

    Use :meth:`acquire`, then :meth:`start_renewing`; call :meth:`check` before committing
    anything and :meth:`release` at a clean exit (:meth:`stop` otherwise).
    """

    def __init__(self, root: ArtifactRoot, record: LeaseRecord) -> None:
        self.root = root
        self.record = record
        self.path = epoch_file(root, record.run, record.epoch)
        self._last_ok = time.monotonic()
        self._lost: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, root: ArtifactRoot, run: str, ttl_s: float = DEFAULT_TTL_S) -> RunLease:
        """Take the run's lease, or raise :class:`LeaseHeldError` naming the live holder.

        Raises:
            LeaseHeldError: a live trainer holds the run.
            BadInputError: the artifact root cannot be written (names it).
        """
        if ttl_s <= 0:
            raise BadInputError(f"lease ttl_s must be positive, got {ttl_s}")
        while True:
            found = epochs(root, run)
            now = time.time()
            if found:
                holder = read_epoch(root, run, found[-1])
                if holder.alive(now):
                    raise LeaseHeldError.of(run, holder, now)
                log.info("lease of run %r expired or released: %s", run, holder.describe(now))
            epoch = (found[-1] if found else 0) + 1
            record = LeaseRecord(
                run=run,
                epoch=epoch,
                host=socket.gethostname(),
                pid=os.getpid(),
                since=now,
                renewed_at=now,
                ttl_s=float(ttl_s),
                pid_ns=_pid_ns(),
                pid_start=_pid_start(os.getpid()),
            )
            data = json.dumps(record.to_json(), indent=2).encode()
            try:
                created = root.create_exclusive(epoch_file(root, run, epoch), data)
            except OSError as e:
                raise BadInputError(
                    f"cannot write the lease of run {run!r} under {root.url(lease_dir(root, run))}"
                    f": {type(e).__name__}: {e}"
                ) from e
            if created:
                return cls(root, record)
            # another trainer created this epoch first: it is the holder now (next pass refuses)

    # ---- holder side ---------------------------------------------------------------------
    def set_generation(self, generation: int) -> None:
        """Record the generation this holder writes (rewrites the epoch file)."""
        self._write(replace(self.record, generation=generation, renewed_at=time.time()))

    def renew(self) -> None:
        """Extend the lease; marks it lost if a newer epoch exists (raises nothing)."""
        try:
            newer = self._newer()
            if newer is not None:
                self._lose(newer)
                return
            self._write(replace(self.record, renewed_at=time.time()))
        except Exception as e:  # a transient filesystem error: retried at the next renewal
            log.warning("renewing the lease of run %r failed: %s", self.record.run, e)

    def start_renewing(self, every_s: float | None = None) -> None:
        """Renew from a daemon thread every ``every_s`` (default ``ttl_s / 4``)."""
        interval = every_s if every_s is not None else max(0.05, self.record.ttl_s / 4)

        def loop() -> None:
            while not self._stop.wait(interval):
                self.renew()
                if self._lost is not None:
                    return

        self._thread = threading.Thread(target=loop, name="deltarec-lease", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """The fence: raise :class:`LeaseLostError` unless this holder still owns the run."""
        if self._lost is None:
            newer = self._newer()
            if newer is not None:
                self._lose(newer)
            elif time.monotonic() - self._last_ok > self.record.ttl_s:
                self._lost = (
                    f"the lease of run {self.record.run!r} (epoch {self.record.epoch}) was not "
                    f"renewed for {time.monotonic() - self._last_ok:.0f} s (ttl "
                    f"{self.record.ttl_s:.0f} s) and may be held by another trainer"
                )
        if self._lost is not None:
            raise LeaseLostError(self._lost)

    @property
    def lost(self) -> str | None:
        """Why the lease was lost, or None while it is held."""
        return self._lost

    def stop(self) -> None:
        """Stop renewing (the lease then expires after ``ttl_s``)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def release(self) -> None:
        """Stop renewing and mark the epoch released, unless a newer holder took over."""
        self.stop()
        if self._lost is not None:
            return
        try:
            if self._newer() is None:
                self._write(replace(self.record, released=True, renewed_at=time.time()))
        except Exception as e:
            log.warning("releasing the lease of run %r failed: %s", self.record.run, e)

    # ---- internals -----------------------------------------------------------------------
    def _newer(self) -> LeaseRecord | None:
        # Every acquire creates the epoch after the newest it sees, so a newer holder exists
        # exactly when epoch E + 1 does: one HEAD of that object, no listing (what a store
        # lists differs: emptied prefixes, directory objects, cached listings).
        run, nxt = self.record.run, self.record.epoch + 1
        path = epoch_file(self.root, run, nxt)
        self.root.fs.invalidate_cache(posixpath.dirname(path))
        if not self.root.fs.exists(path):
            return None
        found = [e for e in epochs(self.root, run) if e > nxt]
        return read_epoch(self.root, run, found[-1] if found else nxt)

    def _lose(self, newer: LeaseRecord) -> None:
        self._lost = (
            f"run {self.record.run!r} was taken over by a newer trainer "
            f"({newer.describe(time.time())}); this trainer (lease epoch {self.record.epoch}"
            + (
                f", generation {self.record.generation}"
                if self.record.generation is not None
                else ""
            )
            + ") stops without committing"
        )

    def _write(self, record: LeaseRecord) -> None:
        with self._lock:
            self.root.replace_bytes(self.path, json.dumps(record.to_json(), indent=2).encode())
            self.record = record
            self._last_ok = time.monotonic()


def _pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str]:
    """Fields 3.. of /proc/PID/stat (state first), or [] where there is none."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return []
    return stat[stat.rfind(")") + 2 :].split()


def _pid_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    fields = _stat_fields(pid)
    return fields[19] if len(fields) > 19 else ""


def _process_gone(record: LeaseRecord) -> bool:
    """True if the holder ran on this machine (host and pid namespace) and has exited."""
    if record.host != socket.gethostname() or not record.pid_ns or record.pid_ns != _pid_ns():
        return False
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # a process of another user: alive
    fields = _stat_fields(record.pid)
    if fields[:1] in (["Z"], ["X"]):  # exited, not reaped yet
        return True
    start = fields[19] if len(fields) > 19 else ""
    return bool(record.pid_start) and bool(start) and start != record.pid_start
