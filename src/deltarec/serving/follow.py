"""Keeping a replica on the promoted point of its run: the serving pointer, the outbox, restarts.

One :meth:`Follower.poll` round:

1. Read the serving pointer (:class:`PointerSource`: the store's registry,
   ``Registry.get_serving(run)``). A new pointer moves the replica to exactly that point: by
   swapping in the shadow of that generation (promote), swapping back to the previous line
   (rollback), applying the dumps up to it, or loading it from the artifacts' expected state.
   Generations switch only here, so a generation that was never promoted (a failed verify)
   is never served.
2. Follow (``follow``): while the served generation is the run's newest, apply its newly
   committed dumps in order, each atomically.
3. Shadow: when a newer training generation exists, keep it applied beside the served one,
   ready for its promote (rollback generations are not shadowed: their rows are an older
   point, which the pointer names).

A dump that does not come next (a gap, a duplicate, an older one) stops the line where it is:
:attr:`Follower.blocked` names it and the replica keeps serving its last good point. With a
``state_dir`` the served line is recorded (:mod:`deltarec.serving.state`) after every move and
at most every ``checkpoint_every_s`` while following, so a restart resumes from there.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from deltarec.artifacts.types import ROLLBACK_FIELD, Manifest
from deltarec.errors import ArtifactError, DeltarecError, MissingDumpError, StoreError
from deltarec.serving.replica import Line, Replica, manifest_digest, taken_at
from deltarec.serving.state import load_line, read_state, save_state
from deltarec.serving.types import DuplicateDumpError, Position, SequenceError
from deltarec.stores import ReplicaStatus, Serving, who_serves
from deltarec.stores.types import ServingPointer

log = logging.getLogger(__name__)


class PointerSource(Protocol):
    """Where the serving pointer of the run is read.

    A source may also tell who serves the store (``serving() -> Serving | None``, as
    :class:`StorePointer` does); the follower then reports it and is not ready while its run
    does not serve.
    """

    def current(self) -> ServingPointer | None:
        """The current pointer, or None if the run was never promoted."""


class StorePointer:
    """The serving pointer in a store's registry (reopened after the store was unreachable).

    Args:
        url: the store URL.
        artifacts: the artifact root (a FeatureStore store keeps its registry under it).
        run: the run.
    """

    def __init__(self, url: str, artifacts: str, run: str) -> None:
        self.url, self.artifacts, self.run = url, artifacts, run
        self._store: Any = None

    def current(self) -> ServingPointer | None:
        """``Registry.get_serving(run)``."""
        from deltarec.stores import open_store

        if self._store is None:
            self._store = open_store(self.url, self.artifacts, run=self.run)
        try:
            return self._store.registry.get_serving(self.run)  # type: ignore[no-any-return]
        except StoreError:
            self.close()
            raise

    def serving(self) -> Serving | None:
        """Who serves the store (read with the pointer, in the same round)."""
        if self._store is None:
            return None
        try:
            return who_serves(self._store)
        except StoreError:
            self.close()
            raise

    def close(self) -> None:
        """Close the store handle (idempotent)."""
        store, self._store = self._store, None
        if store is not None:
            store.close()


class FixedPointer:
    """A pointer that never moves: serve one point (tests, benchmarks, a pinned replica)."""

    def __init__(self, pointer: ServingPointer | None) -> None:
        self.pointer = pointer

    def current(self) -> ServingPointer | None:
        """The fixed pointer."""
        return self.pointer


@dataclass(frozen=True)
class FollowOptions:
    """How a follower keeps its replica up to date.

    Attributes:
        follow: apply the served generation's new dumps as they are committed (while it is the
            run's newest generation); False serves exactly the promoted point.
        shadow: keep a newer generation applied beside the served one, for an instant promote.
        poll_s: seconds between rounds of :meth:`Follower.loop`.
        state_dir: where the replica records its position and rows (None: nowhere).
        checkpoint_every_s: the most seconds between two records while following.
        round_deadline_s: the most seconds one round spends applying dumps. A round past it
            stops before its next dump, says so in :attr:`Follower.blocked` and goes on from
            there in the next round; a round still inside one dump past it is reported
            ``blocked`` by :meth:`Follower.status` while it runs.
    """

    follow: bool = True
    shadow: bool = True
    poll_s: float = 2.0
    state_dir: str | None = None
    checkpoint_every_s: float = 60.0
    round_deadline_s: float = 300.0


def _pointer_json(p: ServingPointer) -> dict[str, Any]:
    return {"generation": p.generation, "seq": p.seq, "promoted_at": p.promoted_at}


class Follower:
    """Drives a :class:`Replica` from the serving pointer and the outbox (one thread).

    Args:
        replica: the replica to keep.
        pointer: where the serving pointer is read.
        options: how (see :class:`FollowOptions`).
    """

    def __init__(
        self, replica: Replica, pointer: PointerSource, options: FollowOptions | None = None
    ) -> None:
        self.replica = replica
        self.pointer_source = pointer
        self.options = options or FollowOptions()
        self.pointer: ServingPointer | None = None
        self.serving: Serving | None = None
        """Who serves the store, as last read (None: the pointer source does not say)."""
        self.blocked: str | None = None
        """Why the replica does not advance (a gap, a duplicate, a corrupted dump), or None."""
        self.error: str | None = None
        """The last round's failure that was not about a dump (the store unreachable)."""
        self.newest_seq: int | None = None
        self.lag_dumps = 0
        self.lag_s = 0.0
        self._refused = False  # the recorded dump is not the outbox's: never advance
        self._moved: tuple[int, int, float] | None = None
        self._saved_version = 0
        self._saved_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._round_started: float | None = None  # monotonic start of the round in flight

    @property
    def root(self) -> Any:
        """The replica's artifact root."""
        return self.replica.root

    @property
    def run(self) -> str:
        """The run served."""
        return self.replica.run

    # ---- restart ---------------------------------------------------------------------------
    def resume(self) -> bool:
        """Serve the line recorded in ``state_dir``, if any; returns whether one was.

        The outbox's manifest of the recorded dump must be the one applied then; if it is not
        (the dump was rewritten, or the state is of an earlier run's outbox), the replica
        serves the recorded point but refuses to advance (:attr:`blocked`).
        """
        state_dir = self.options.state_dir
        if state_dir is None:
            return False
        saved = read_state(state_dir, self.run)
        if saved is None:
            return False
        line = load_line(state_dir, saved, self.root, self.replica.device)
        self.replica.install(line)
        if saved.pointer is not None:
            ptr = saved.pointer
            self._moved = (int(ptr["generation"]), int(ptr["seq"]), float(ptr["promoted_at"]))
        self._saved_version, self._saved_at = saved.position.version, time.monotonic()
        self._check_recorded(line)
        log.info("replica resumed at %s from %s", saved.position.describe(), state_dir)
        return True

    def _check_recorded(self, line: Line) -> None:
        p = line.position
        if not line.digest:
            return
        try:
            m = self.root.read_manifest(p.run, p.generation, p.seq)
        except ArtifactError as e:
            self.blocked = f"the dump this replica applied last is gone from the outbox: {e}"
            self._refused = True
            return
        if manifest_digest(m) != line.digest:
            err = DuplicateDumpError(
                p.run,
                p.generation,
                p.seq,
                p.seq,
                "the outbox holds another dump under the seq this replica applied last "
                "(rewritten, or an earlier outbox)",
            )
            self.blocked = str(err)
            self._refused = True

    # ---- one round -------------------------------------------------------------------------
    def poll(self) -> None:
        """One round: move to a new pointer, follow, keep the shadow, record the state.

        The round applies dumps until :attr:`FollowOptions.round_deadline_s` has passed or a
        stop is requested, then returns; the next round goes on from where it stopped.
        """
        self._round_started = time.monotonic()
        try:
            self._poll()
        finally:
            self._round_started = None

    def _out_of_time(self, line: Line) -> bool:
        """True (and :attr:`blocked` says why) once the round must not start another dump."""
        if self._stop.is_set():
            return True
        started = self._round_started
        deadline = self.options.round_deadline_s
        if started is None or time.monotonic() - started <= deadline:
            return False
        self.blocked = (
            f"run {line.position.run!r}: a round applying dumps passed its {deadline:g} s "
            f"deadline at {line.position.describe()}; the next round goes on from there"
        )
        return True

    def _poll(self) -> None:
        pointer = self.pointer_source.current()
        self.pointer = pointer
        serving = getattr(self.pointer_source, "serving", None)
        was = self.serving
        self.serving = serving() if callable(serving) else None
        if self.serving is not None and self.serving != was:
            if self.serving.serves(self.run):
                log.info("replica of run %r: serving is %s", self.run, self.serving.describe())
            else:
                log.warning("replica of run %r: %s", self.run, self.serving.not_serving(self.run))
        if pointer is None:
            return
        key = (pointer.generation, pointer.seq, pointer.promoted_at)
        if key != self._moved and self._move_to(pointer):
            self._moved = key
            self._save(force=True)
        line = self.replica.line
        if line is None:
            return
        newest = self._newest_training_generation()
        if self.options.follow and line.position.generation == newest and not self._refused:
            self._advance(line, None)
        if self.options.shadow and newest is not None and newest > line.position.generation:
            self._keep_shadow(newest)
        self._measure_lag(line)
        self._save(force=False)

    def _newest_training_generation(self) -> int | None:
        """The run's newest generation unless it is a rollback's (those are not followed)."""
        gens = self.root.list_generations(self.run)
        if not gens:
            return None
        info = self.root.read_generation(self.run, gens[-1])
        return None if ROLLBACK_FIELD in info.extra else gens[-1]

    def _move_to(self, pointer: ServingPointer) -> bool:
        """Serve exactly the pointer's point; True once there (False: blocked on the way)."""
        r = self.replica
        target = Position(self.run, pointer.generation, pointer.seq)
        line = r.line
        newest = self._newest_training_generation()
        following = self.options.follow and pointer.generation == newest
        if line is not None and line.position.generation == target.generation:
            if line.position.seq == target.seq or (following and line.position.seq > target.seq):
                return True
            if line.position.seq < target.seq:
                return self._advance(line, target.seq)
        shadow = r.shadow
        if shadow is not None and shadow.position.generation == target.generation:
            if shadow.position.seq <= target.seq:
                if not self._advance(shadow, target.seq):
                    return False  # blocked on the way: keep serving the last good point
                r.install(shadow)
                log.info("promoted: %s swapped in from the shadow", shadow.position.describe())
                return True
            if following and shadow.position.seq > target.seq:
                r.install(shadow)
                return True
        previous = r.previous
        if previous is not None and previous.position == target:
            r.swap_back()
            log.info("rolled back: %s swapped back in", target.describe())
            return True
        try:
            fresh = r.load(target.generation, target.seq)
        except (SequenceError, MissingDumpError) as e:
            self.blocked = str(e)
            return False
        r.install(fresh)
        log.info("serving %s (loaded from the artifacts)", target.describe())
        self.blocked, self._refused = None, False
        return True

    def _advance(self, line: Line, through: int | None) -> bool:
        """Apply ``line``'s committed dumps after its position (up to ``through``) in order.

        Returns True if ``through`` (or the newest dump) was reached; on a dump that does not
        come next, or that cannot be read, sets :attr:`blocked` and returns False.
        """
        p = line.position
        try:
            seqs = [s for s in self.root.list_dumps(p.run, p.generation) if s > p.seq]
        except MissingDumpError as e:  # a hole in the outbox: keep serving the last good point
            if self.blocked != str(e):
                log.error("replica of run %r stops at %s: %s", p.run, line.position, e)
            self.blocked = str(e)
            return False
        if through is not None:
            seqs = [s for s in seqs if s <= through]
        for s in seqs:
            if self._out_of_time(line):
                return False
            try:
                manifest = self.root.read_manifest(p.run, p.generation, s)
                self.replica.apply(manifest, line)
            except (SequenceError, ArtifactError) as e:
                if self.blocked != str(e):
                    log.error("replica of run %r stops at %s: %s", p.run, line.position, e)
                self.blocked = str(e)
                return False
        reached = through is None or line.position.seq == through
        if reached and line is self.replica.line:
            self.blocked = None
        if through is not None and not reached and self.blocked is None:
            self.blocked = (
                f"run {p.run!r} generation {p.generation}: dump {line.position.seq + 1} is "
                f"missing on the way to the promoted dump {through}"
            )
        return reached

    def _keep_shadow(self, generation: int) -> None:
        r = self.replica
        if r.shadow is None or r.shadow.position.generation != generation:
            try:
                dumps = self.root.list_dumps(self.run, generation)
                if not dumps:
                    return
                r.shadow = r.load(generation, dumps[-1])
            except MissingDumpError as e:  # the served point stays; the shadow waits
                log.error("no shadow of generation %d: %s", generation, e)
                return
            log.info("shadow: %s applied beside the served point", r.shadow.position.describe())
            return
        self._advance(r.shadow, None)

    def _measure_lag(self, line: Line) -> None:
        p = line.position
        dumps = self.root.committed_seqs(p.run, p.generation)  # a lag, holes or not
        self.newest_seq = dumps[-1] if dumps else None
        behind = [s for s in dumps if s > p.seq]
        self.lag_dumps = len(behind)
        self.lag_s = 0.0
        if behind:
            m: Manifest = self.root.read_manifest(p.run, p.generation, behind[0])
            taken = taken_at(m)
            self.lag_s = max(0.0, time.time() - taken) if taken is not None else 0.0

    def _save(self, force: bool) -> None:
        line, state_dir = self.replica.line, self.options.state_dir
        if line is None or state_dir is None or line.position.version == self._saved_version:
            return
        if not force and time.monotonic() - self._saved_at < self.options.checkpoint_every_s:
            return
        pointer = _pointer_json(self.pointer) if self.pointer is not None else None
        save_state(state_dir, line, pointer)
        self._saved_version, self._saved_at = line.position.version, time.monotonic()

    # ---- background ------------------------------------------------------------------------
    def start(self) -> None:
        """Run :meth:`loop` on a background thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self.loop, name="deltarec-replica", daemon=True)
        self._thread.start()

    def loop(self) -> None:
        """Poll until stopped; a failed round is logged and retried at the next one."""
        while not self._stop.is_set():
            try:
                self.poll()
                self.error = None
            except DeltarecError as e:
                self.error = str(e)
                log.warning("replica round failed (retried in %.1f s): %s", self.options.poll_s, e)
            except Exception as e:  # a round must never end the loop; the status shows it
                self.error = f"{type(e).__name__}: {e}"
                log.exception("replica round failed")
            self._stop.wait(self.options.poll_s)

    def request_stop(self) -> None:
        """Make :meth:`loop` return after its current round (safe from a signal handler)."""
        self._stop.set()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the background thread and record the served point (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._save(force=True)

    # ---- status ----------------------------------------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        """``(ready, why)``: what ``GET /readyz`` answers.

        Ready once a generation is served and while the replica's run serves the store (as far
        as the pointer source says); a replica of a run that no longer serves is not ready and
        names the run that does.
        """
        if self.replica.current is None:
            return False, "not ready: no generation served yet"
        if self.serving is not None and not self.serving.serves(self.run):
            return False, f"not ready: {self.serving.not_serving(self.run)}"
        return True, "ready"

    def status(self) -> ReplicaStatus:
        """What the replica serves now and how far behind it is."""
        r = self.replica
        st = ReplicaStatus(run=self.run, device=str(r.device), applied_dumps=r.applied_dumps)
        snap = r.current
        if self.pointer is not None:
            st.pointer = _pointer_json(self.pointer)
        st.blocked, st.error = self.blocked, self.error
        started = self._round_started
        overrun = None if started is None else time.monotonic() - started
        if overrun is not None and overrun > self.options.round_deadline_s and not st.blocked:
            st.blocked = (
                f"a round has been applying one dump for {overrun:.0f} s, past its "
                f"{self.options.round_deadline_s:g} s deadline"
            )
        if self.serving is not None:
            st.serves = self.serving.serves(self.run)
            st.serving = {"describe": self.serving.describe(), **self.serving.to_json()}
        if snap is not None:
            p = snap.position
            st.ready = self.readiness()[0]
            st.generation, st.seq, st.version = p.generation, p.seq, p.version
            st.dense_step = snap.dense.info.step if snap.dense is not None else None
            st.tables = {
                t: {
                    "rows": len(s),
                    "dim": s.spec.dim,
                    "dtype": s.spec.dtype.value,
                    "kind": s.spec.kind.value,
                }
                for t, s in snap.tables.items()
            }
        if r.shadow is not None:
            sp = r.shadow.position
            st.shadow = {"generation": sp.generation, "seq": sp.seq}
        st.newest_seq, st.lag_dumps, st.lag_s = self.newest_seq, self.lag_dumps, self.lag_s
        st.following = self.options.follow
        return st


__all__ = ["FixedPointer", "FollowOptions", "Follower", "PointerSource", "StorePointer"]
