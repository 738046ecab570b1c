"""The trainer compacts its outbox in the background (SPEC §3a): every N committed dumps.

Rank 0 of a trainer with :attr:`~deltarec.dump.config.DumperConfig.compact_every_dumps` runs
``deltarec compact`` of its generation through the dump just committed, in a child process
(never on the training thread, nor holding its GIL), one at a time: a compaction fallen
behind is never doubled; the triggers that come while it runs are folded into one, through
the newest dump they name, run as soon as it ends (:attr:`BackgroundCompactor.skipped` counts
those folded away). The child runs under ``SCHED_IDLE`` with its disk I/O in the idle class
(:mod:`deltarec.publish.yieldcpu`): it takes a core only when no thread of normal priority
wants one, and the disk when no other request waits. It still shares the host's memory
bandwidth and caches, so it also paces itself (:mod:`deltarec.artifacts.pacing`): between
bounded chunks of its work it sleeps, working at most ``busy_share`` of its wall time
(:attr:`~deltarec.dump.config.DumperConfig.compact_busy_share`; docs/history.md, "The trainer
compacts in the background"). A compaction that fails is logged and never fails training;
one still running at :meth:`BackgroundCompactor.close` is stopped (asleep or not), which
leaves the previous state valid (a base without BASE.json is ignored) and the next run
completes it.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from typing import Any

from deltarec.artifacts.pacing import check_busy_share
from deltarec.artifacts.types import Manifest
from deltarec.dump.config import DumperConfig

log = logging.getLogger(__name__)

_PROGRAM = """
import json, sys
from deltarec.publish import yieldcpu
yieldcpu.lower("the background compaction")  # before any thread starts: they inherit it
yieldcpu.lower_io()
from deltarec.artifacts import ArtifactRoot, pacing
from deltarec.artifacts.compact import compact
a = json.loads(sys.stdin.read())
with pacing.paced(a["busy_share"]) as pacer:
    r = compact(ArtifactRoot(a["root"], a["options"]), a["run"], a["generation"], a["seq"])
p = yieldcpu.thread_priority()
print(json.dumps({"written": r.written, "dumps_read": r.dumps_read,
                  "policy": p.policy if p else None, "io_class": yieldcpu.io_priority_class(),
                  **pacer.report()}))
"""


class BackgroundCompactor:
    """Compacts ``run``'s generation every ``every`` committed dumps, in a child process.

    Args:
        root: the artifact root's URI.
        storage_options: its fsspec options (handed to the child on its stdin, never argv).
        run: the run.
        generation: the generation this trainer writes.
        every: compact after every ``every``-th committed dump.
        busy_share: the most of its wall time the child spends working, in ``(0, 1]``
            (:class:`~deltarec.artifacts.pacing.Pacer`); 1: never pauses.

    Raises:
        BadInputError: a ``busy_share`` outside ``(0, 1]``.
    """

    def __init__(
        self,
        root: str,
        storage_options: dict[str, Any],
        run: str,
        generation: int,
        every: int,
        busy_share: float = 1.0,
    ) -> None:
        check_busy_share(busy_share)
        self._args = {
            "root": root,
            "options": storage_options,
            "run": run,
            "busy_share": busy_share,
        }
        self.generation = generation
        self.every = every
        self.busy_share = busy_share
        self.compactions = 0
        self.failures = 0
        self.triggered = 0
        """Committed dumps that asked for a compaction (every ``every``-th)."""
        self.skipped = 0
        """Triggers folded into a later one because a compaction was running (fallen behind)."""
        self.spans: list[tuple[float, float]] = []
        """``(start, end)`` of each compaction that completed, ``time.perf_counter`` seconds."""
        self.running_since: float | None = None
        """When the compaction now running started (``time.perf_counter``), else None."""
        self.last_report: dict[str, Any] | None = None
        """What the last compaction that completed printed: ``written``, ``dumps_read``, the
        scheduling ``policy`` and I/O priority class (``io_class``) it ran under, and its
        pacing (:meth:`~deltarec.artifacts.pacing.Pacer.report`): ``busy_share`` asked,
        ``busy_s`` worked, ``paced_s`` slept, ``pauses`` and ``checkpoints``."""
        self._committed = 0
        self._want: int | None = None
        self._cond = threading.Condition()
        self._stop = False
        self._proc: subprocess.Popen[str] | None = None
        self._thread = threading.Thread(target=self._loop, name="deltarec-compactor", daemon=True)
        self._thread.start()

    def committed(self, manifest: Manifest) -> None:
        """A dump was committed (called on the dump worker's thread: only counts)."""
        if manifest.generation != self.generation:
            return
        with self._cond:
            self._committed += 1
            if self._committed % self.every == 0:
                self.triggered += 1
                if self._want is not None:  # the one before still waits: fold it into this
                    self.skipped += 1
                self._want = manifest.seq
                self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._want is None and not self._stop:
                    self._cond.wait()
                if self._stop or self._want is None:
                    return
                seq, self._want = self._want, None
            self._run(seq)

    def _run(self, seq: int) -> None:
        args = {**self._args, "generation": self.generation, "seq": seq}
        started = time.perf_counter()
        try:
            with self._cond:
                if self._stop:
                    return
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", _PROGRAM],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                self.running_since = started
            out, err = self._proc.communicate(json.dumps(args))
            code = self._proc.returncode
        except OSError as e:
            out, err, code = "", str(e), -1
        self.running_since = None
        if code == 0:
            self.compactions += 1
            self.spans.append((started, time.perf_counter()))
            self.last_report = _report(out)
            log.info(
                "compacted generation %d through dump %d: %s", self.generation, seq, out.strip()
            )
        elif not self._stop:
            self.failures += 1
            last = err.strip().splitlines()[-1] if err.strip() else f"exit {code}"
            log.warning("compaction of generation %d through dump %d failed: %s",
                        self.generation, seq, last)  # fmt: skip

    def close(self, timeout: float = 10.0) -> None:
        """Stop: a compaction still running is ended (the previous state stays valid)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._thread.join(timeout)


def _report(out: str) -> dict[str, Any] | None:
    """The child's one JSON line (None if it printed something else: only logged)."""
    try:
        report = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return report if isinstance(report, dict) else None


def compactor_for(config: DumperConfig, generation: int, rank: int) -> BackgroundCompactor | None:
    """Rank 0's compactor where ``config.compact_every_dumps`` asks for one, else None."""
    every = config.compact_every_dumps
    if every is None or rank != 0:
        return None
    return BackgroundCompactor(
        config.artifacts,
        config.storage_options,
        config.run,
        generation,
        every,
        busy_share=config.compact_busy_share,
    )
