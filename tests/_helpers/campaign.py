"""Crash campaigns against a real ``deltarec train --nproc-per-node 2`` (the reliability tests).

:class:`Campaign` runs the example model as a user does (its own process session, a SQLite or
PostgreSQL store, checkpoints, exported final tables), holds it at a fault point
(:mod:`deltarec.faults`) or lets it run for a random time, kills the whole process
tree with SIGKILL, checks that no rank outlives its launcher, restarts it, and at the end
compares the store with the model's exported tables key by key.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from deltarec.faults import DIR_ENV, ENV


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X")


@dataclass
class Trainer:
    """One launch of ``deltarec train --nproc-per-node 2`` in its own session."""

    proc: subprocess.Popen[bytes]
    log: Path
    started: float = field(default_factory=time.monotonic)

    def ranks(self) -> list[int]:
        """Pids of the rank processes (the grandchildren: launcher -> torchrun -> ranks)."""
        tree = descendants(self.proc.pid)
        torchrun = [p for p in tree if _ppid(p) == self.proc.pid]
        return [p for p in tree if _ppid(p) in torchrun]

    def wait_ranks(self, n: int = 2, timeout: float = 120.0) -> list[int]:
        """Wait until ``n`` rank processes run; returns their pids."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ranks = self.ranks()
            if len(ranks) >= n:
                return ranks
            if self.proc.poll() is not None:
                raise RuntimeError(f"trainer exited {self.proc.returncode}: {self.tail()}")
            time.sleep(0.1)
        raise TimeoutError(f"{n} ranks did not start within {timeout} s: {self.tail()}")

    def kill_tree(self, orphan_timeout: float = 10.0) -> float:
        """SIGKILL the launcher's process group; return seconds until every rank was gone.

        Raises:
            AssertionError: a rank outlived its launcher by ``orphan_timeout`` seconds.
        """
        ranks = self.ranks()
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        killed = time.monotonic()
        while any(alive(p) for p in ranks):
            if time.monotonic() - killed > orphan_timeout:
                left = [p for p in ranks if alive(p)]
                for p in left:
                    os.kill(p, signal.SIGKILL)
                raise AssertionError(f"ranks {left} outlived their launcher by {orphan_timeout} s")
            time.sleep(0.05)
        return time.monotonic() - killed

    def signal_tree(self, sig: int) -> None:
        """Send ``sig`` to the launcher, torchrun and every rank (e.g. SIGSTOP / SIGCONT)."""
        for p in [self.proc.pid, *descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)

    def wait(self, timeout: float = 600.0) -> int:
        """Wait for the launcher to exit; returns its exit code."""
        return self.proc.wait(timeout)

    def tail(self, n: int = 3000) -> str:
        """The end of the trainer's log, without torch's tracing chatter, after the lines that
        name an error (the first rank to fail often logged it long before the end)."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        lines = [ln for ln in text.splitlines() if "is_fx_tracing" not in ln]
        errors = [ln for ln in lines if "Error" in ln or "error:" in ln][:20]
        head = "\n".join(errors)[:3000] + "\n...\n" if errors else ""
        return head + "\n".join(lines)[-n:]


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return -1
    return int(stat[stat.rfind(")") + 2 :].split()[1])


@dataclass
class Campaign:
    """One run of the example model, started, killed and restarted until it completes.

    Args:
        workdir: holds checkpoints, artifacts, exports, logs and fault markers.
        store: the store URL the trainer publishes to.
        steps, batch_size, dump_every, checkpoint_every: the training flags.
        lease_ttl: ``--lease-ttl`` (None: the default).
    """

    workdir: Path
    store: str
    steps: int = 60
    batch_size: int = 32
    dump_every: int = 10
    checkpoint_every: int = 20
    lease_ttl: float | None = None
    run: str = "campaign"
    launches: int = 0
    kills: list[dict[str, object]] = field(default_factory=list)

    @property
    def artifacts(self) -> Path:
        """The artifact root."""
        return self.workdir / "artifacts"

    @property
    def export(self) -> Path:
        """Where the completing launch exports the final tables."""
        return self.workdir / "export"

    @property
    def faults(self) -> Path:
        """Where a held process leaves its fault marker."""
        return self.workdir / "faults"

    def argv(self) -> list[str]:
        """The ``deltarec train`` command line, the same for every launch."""
        argv = [
            sys.executable, "-c", "import sys; from deltarec.cli import main; sys.exit(main())",
            "train", "--nproc-per-node", "2", "--steps", str(self.steps),
            "--batch-size", str(self.batch_size), "--workdir", str(self.workdir / "ckpt"),
            "--artifacts", str(self.artifacts), "--run", self.run,
            "--dump-every-steps", str(self.dump_every),
            "--checkpoint-every", str(self.checkpoint_every), "--store", self.store,
            "--export-tables", str(self.export), "--log-every", "20",
        ]  # fmt: skip
        if self.lease_ttl is not None:
            argv += ["--lease-ttl", str(self.lease_ttl)]
        return argv

    def start(self, fault: str | None = None) -> Trainer:
        """Launch the trainer in a new session, held at ``fault`` (``POINT@N[:R]``) if given."""
        self.launches += 1
        env = dict(os.environ)
        env.pop(ENV, None)
        if fault:
            env[ENV] = fault
            env[DIR_ENV] = str(self.faults)
        log = self.workdir / f"launch-{self.launches:02d}.log"
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                self.argv(), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return Trainer(proc, log)

    def wait_fault(self, trainer: Trainer, point: str, timeout: float = 120.0) -> bool:
        """Wait until a process of ``trainer`` is held at ``point``; False if it exited first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.faults.exists() and any(self.faults.glob(f"{point}.*")):
                return True
            if trainer.proc.poll() is not None:
                return False
            time.sleep(0.05)
        raise TimeoutError(f"no process reached {point} within {timeout} s: {trainer.tail()}")

    def kill(self, trainer: Trainer, moment: str) -> float:
        """Kill ``trainer``'s tree; record the moment and how fast its ranks were gone."""
        gone = trainer.kill_tree()
        for marker in self.faults.glob("*") if self.faults.exists() else []:
            marker.unlink()
        self.kills.append({"moment": moment, "ranks_gone_s": round(gone, 3)})
        return gone

    def compare(self) -> tuple[int, int, dict[str, int]]:
        """Compare the store with the exported final tables, key by key.

        Returns:
            ``(keys checked, keys lost, {table: keys lost})``; a key is lost when the store
            lacks it or holds other values. Keys the store holds that the model has not are
            counted as lost too (a stale row serving would read).
        """
        import pyarrow.parquet as pq

        from deltarec.artifacts import codec
        from deltarec.stores import open_store

        store = open_store(self.store, run=self.run)
        checked, lost, per_table = 0, 0, {}
        try:
            views = store.views()
            for path in sorted(self.export.glob("*.parquet")):
                table = path.name[: -len(".parquet")]
                data = pq.read_table(path)
                keys = data.column("key").to_numpy()
                want = np.stack(data.column("embedding").to_numpy(zero_copy_only=False))
                view = views[table]
                got = store.read(table, keys)
                values = codec.decode(got.embedding, view.dtype, view.dim)
                bad = ~got.found | ~np.all(values == want.astype(np.float32), axis=1)
                held = np.concatenate([*store.scan_keys(table), np.empty(0, np.int64)])
                extra = np.setdiff1d(held, keys).size
                per_table[table] = int(bad.sum()) + int(extra)
                checked += int(keys.size)
                lost += per_table[table]
        finally:
            store.close()
        return checked, lost, per_table
