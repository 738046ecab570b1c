"""A backlog of small dumps written several at a time leaves every store exactly as publishing
the dumps one by one would: rows, versions, deleted (evicted) keys, snapshots removing keys,
progress marks; and a publish killed in the middle of a group loses nothing when run again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from deltarec.artifacts import ArtifactRoot, DType, DumpKind, TableKind, TableSpec
from deltarec.publish import DumpPublisher
from deltarec.publish import publisher as publisher_module
from deltarec.stores import open_store
from deltarec.testing.dumps import new_generation, random_rows, write_dump

RUN = "ctr"
PLAIN, ZCH = "sparse.ebc.user_id", "sparse.zch.ad_id"
SPECS = {
    PLAIN: TableSpec(dim=8, num_embeddings=400),
    ZCH: TableSpec(dim=4, dtype=DType.INT8_ROWWISE, kind=TableKind.ZCH, zch_size=64),
}
SNAPSHOTS = (0, 7)


def _history(root: ArtifactRoot, dumps: int = 14) -> None:
    """Two ranks; a snapshot, deltas with evictions, a second snapshot of fewer keys, deltas.

    Keys repeat across dumps (200 of them, 40 a dump) so later dumps overwrite earlier rows, and
    an evicted ZCH id may come back in a later dump.
    """
    info = new_generation(root, RUN, SPECS, world_size=2)
    rng = np.random.default_rng(11)
    step = 0
    for seq in range(dumps):
        snapshot = seq in SNAPSHOTS
        rows = {}
        for table, spec in SPECS.items():
            n = 120 if snapshot and seq else 40
            keys = np.unique(rng.integers(-1 if table == ZCH else 0, 200, n))
            ops = np.zeros(len(keys), np.int8)
            if table == ZCH and not snapshot:
                ops[rng.random(len(keys)) < 0.2] = 1
            rows[table] = {
                r: random_rows(
                    keys[keys % 2 == r],
                    spec,
                    seed=int(rng.integers(1 << 30)),
                    ops=ops[keys % 2 == r],
                    step=step + 1,
                )
                for r in (0, 1)
            }
        kind = DumpKind.SNAPSHOT if snapshot else DumpKind.DELTA
        write_dump(root, info, seq, rows, kind=kind, first_step=step + 1, last_step=step + 10)
        step += 10


def _state(url: str) -> dict[str, object]:
    """What the store holds of the run: rows with versions, marks, snapshot records."""
    with open_store(url, run=RUN) as store:
        rows: dict[str, dict[int, tuple[int, bytes]]] = {}
        for table in SPECS:
            held: dict[int, tuple[int, bytes]] = {}
            for keys, got in store.scan_rows(table):
                for i in np.flatnonzero(got.found):
                    held[int(keys[i])] = (int(got.versions[i]), got.embedding[i].tobytes())
            rows[table] = held
        marks = {(m.seq, m.table, m.rank): (m.rows, m.complete) for m in store.progress(RUN, 1)}
        snaps = {
            (seq, t): store.snapshot(RUN, 1, seq, t) is not None for seq in SNAPSHOTS for t in SPECS
        }
    return {"rows": rows, "marks": marks, "snapshots": snaps}


def _publish(url: str, root: ArtifactRoot) -> list[tuple[int, int]]:
    with open_store(url, run=RUN) as store:
        parts = DumpPublisher(store, root, RUN).publish_generation(1)
    return sorted((p.seq, p.rank) for p in parts)


def _fresh(backend, suffix: str) -> str:
    """A second namespace of the same backend (another file, schema or key prefix)."""
    if backend.kind == "sqlite":
        return backend.url.replace("store.db", f"store-{suffix}.db")
    if backend.kind == "postgres":
        return backend.url.replace("?schema=", f"?schema={suffix}")
    return backend.url.replace("?prefix=", f"?prefix={suffix}")


def test_a_backlog_published_in_groups_equals_the_dumps_published_one_by_one(
    backend, tmp_path, monkeypatch
):
    root = ArtifactRoot(str(tmp_path / "art"))
    _history(root)
    groups: list[list[int]] = []
    real = publisher_module.backlog_group

    def seen(*args):
        group = real(*args)
        if group:
            groups.append([m.seq for m in group])
        return group

    monkeypatch.setattr(publisher_module, "backlog_group", seen)
    all_parts = [(s, r) for s in range(14) for r in (0, 1)]
    assert _publish(backend.url, root) == all_parts
    # the deltas between the snapshots went as groups; the snapshots on their own
    assert groups == [list(range(1, 7)), list(range(8, 14))]
    grouped = _state(backend.url)

    monkeypatch.setattr(publisher_module, "backlog_group", lambda *args: [])
    one_by_one = _fresh(backend, "single")
    assert _publish(one_by_one, root) == all_parts
    expected = _state(one_by_one)

    assert grouped["marks"] == expected["marks"]
    assert len(expected["marks"]) == 14 * 2 * 2
    assert all(complete for _, complete in expected["marks"].values())
    assert grouped["snapshots"] == expected["snapshots"]
    for table in SPECS:
        assert grouped["rows"][table] == expected["rows"][table], table
    # the second snapshot removed keys, and evicted ids are gone: the comparison saw both
    assert len(expected["rows"][PLAIN]) < 200
    assert _publish(backend.url, root) == []  # nothing left pending


def test_a_group_cut_short_is_published_again_and_leaves_the_store_as_one_by_one(
    backend, tmp_path, monkeypatch
):
    """A write of the group fails after its first table: run again, nothing is lost."""
    root = ArtifactRoot(str(tmp_path / "art"))
    _history(root, dumps=7)
    with open_store(backend.url, run=RUN) as store:
        pub = DumpPublisher(store, root, RUN)
        real_batches, real_parts = type(store).write_batches, type(store).write_parts

        def failing_on_second_table(write):
            """The group's write of its second table fails (after the first one's commit)."""

            def wrapped(self, table, batches, *args, **kwargs):
                marks = kwargs.get("mark") or (args[0] if args else None)
                seqs = {m.seq for m in (marks if isinstance(marks, list) else [marks]) if m}
                if table == ZCH and 6 in seqs:
                    raise ConnectionResetError("connection reset mid group")
                return write(self, table, batches, *args, **kwargs)

            return wrapped

        monkeypatch.setattr(type(store), "write_batches", failing_on_second_table(real_batches))
        monkeypatch.setattr(type(store), "write_parts", failing_on_second_table(real_parts))
        with pytest.raises(ConnectionResetError, match="mid group"):
            pub.publish_generation(1)
    monkeypatch.undo()
    assert _publish(backend.url, root)  # the rest of the backlog
    assert _publish(backend.url, root) == []
    one_by_one = _fresh(backend, "single")
    monkeypatch.setattr(publisher_module, "backlog_group", lambda *args: [])
    _publish(one_by_one, root)
    got, expected = _state(backend.url), _state(one_by_one)
    assert got == expected


def _wait_for(path_dir, proc: subprocess.Popen, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path_dir.exists() and any(path_dir.iterdir()):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("hit", [3, 4])
def test_a_publish_killed_in_the_middle_of_a_group_loses_nothing_and_publishes_again(tmp_path, hit):
    """kill -9 after the group's first or second table's write (fault point ``publish.batch``;
    snapshot 0 reaches it once per table before)."""
    root = ArtifactRoot(str(tmp_path / "art"))
    _history(root, dumps=7)
    url = f"sqlite:///{tmp_path / 'store.db'}"
    faults = tmp_path / "faults"
    env = dict(os.environ, DELTAREC_FAULT=f"publish.batch@{hit}", DELTAREC_FAULT_DIR=str(faults))
    argv = ["publish", "--artifacts", root.uri, "--run", RUN, "--store", url]
    code = f"from deltarec.cli import main; raise SystemExit(main({argv!r}))"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        assert _wait_for(faults, proc), "the publish ended before its fault point"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # killed between the tables: the second table of every dump in the group is left to do
    left = [(s, r) for s in range(1, 7) for r in (0, 1)] if hit == 3 else []
    assert _publish(url, root) == left
    assert _publish(url, root) == []
    one_by_one = f"sqlite:///{tmp_path / 'single.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(publisher_module, "backlog_group", lambda *args: [])
        _publish(one_by_one, root)
    assert _state(url) == _state(one_by_one)
