"""Bad input (SPEC §10, docs/reliability.md): each case exits 2 (bad input) or 1 (a check
failed) with a message naming the file or view, and changes nothing committed - neither the
store's rows and marks nor the artifacts."""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.types import DumpKind, TableSpec
from deltarec.cli import main
from deltarec.publish import DumpPublisher
from deltarec.stores import open_store
from deltarec.testing.dumps import new_generation, random_rows, write_dump

T = "sparse.ebc.user_id"
SPEC = {T: TableSpec(dim=4)}


class Committed:
    """A run ``ctr`` whose dumps 0 and 1 are published into a SQLite store, and a committed
    dump 2 not published yet (the one the cases damage)."""

    def __init__(self, tmp_path: Path) -> None:
        self.art = tmp_path / "art"
        self.db = tmp_path / "store.db"
        self.url = f"sqlite:///{self.db}"
        root = ArtifactRoot(str(self.art))
        info = new_generation(root, "ctr", SPEC, world_size=1)
        snap = write_dump(root, info, 0, {T: {0: random_rows(range(50), SPEC[T])}},
                          kind=DumpKind.SNAPSHOT)  # fmt: skip
        delta = write_dump(root, info, 1, {T: {0: random_rows(range(10), SPEC[T], seed=1)}})
        self.dump2 = write_dump(root, info, 2, {T: {0: random_rows(range(5, 60), SPEC[T], 2)}})
        self.shard = self.art / "ctr" / "gen-000001" / "dump-000002" / T / "rank-00000.parquet"
        with open_store(self.url, run="ctr") as store:
            publisher = DumpPublisher(store, root, "ctr")
            publisher.publish_dump(snap, 0)
            publisher.publish_dump(delta, 0)

    def state(self) -> tuple[str, str]:
        """A digest of every row and mark in the store, and of every committed artifact file
        (verify's own records under ``verifications/`` aside)."""
        conn = sqlite3.connect(self.db)
        try:
            tables = [
                r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
            ]
            h = hashlib.sha256()
            for t in sorted(tables):
                cols = [r[1] for r in conn.execute(f'PRAGMA table_info("{t}")')]
                keep = [c for c in cols if c not in ("updated_at", "written_at", "registered_at")]
                for row in conn.execute(f'SELECT {", ".join(keep)} FROM "{t}" ORDER BY 1, 2'):
                    h.update(repr(row).encode())
        finally:
            conn.close()
        files = hashlib.sha256()
        for p in sorted(self.art.rglob("*")):
            if p.is_file() and "verifications" not in p.parts:
                files.update(str(p.relative_to(self.art)).encode() + p.read_bytes())
        return h.hexdigest(), files.hexdigest()


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out + out.err


def _publish(c: Committed, capsys, *extra: str) -> tuple[int, str]:
    return _cli(["publish", "--artifacts", str(c.art), "--run", "ctr", "--store", c.url, *extra],
                capsys)  # fmt: skip


@pytest.fixture
def run(tmp_path) -> Committed:
    return Committed(tmp_path)


def test_a_corrupt_shard_is_named_and_nothing_of_its_dump_is_published(run, capsys):
    data = bytearray(run.shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    run.shard.write_bytes(bytes(data))
    before = run.state()
    code, text = _publish(run, capsys)
    assert code == 2 and str(run.shard) in text and "sha256" in text, text
    assert run.state() == before
    code, text = _cli(["verify", "--artifacts", str(run.art), "--run", "ctr", "--store", run.url,
                       "--all"], capsys)  # fmt: skip
    assert code in (1, 2) and "rank-00000.parquet" in text, text
    assert run.state() == before


def test_a_truncated_shard_is_named_and_nothing_of_its_dump_is_published(run, capsys):
    data = run.shard.read_bytes()
    run.shard.write_bytes(data[: len(data) // 3])
    before = run.state()
    code, text = _publish(run, capsys)
    assert code == 2 and str(run.shard) in text, text
    assert run.state() == before


def test_a_manifest_naming_a_missing_shard_is_named_and_nothing_is_published(run, capsys):
    run.shard.unlink()
    before = run.state()
    code, text = _publish(run, capsys)
    assert code == 2 and str(run.shard) in text and "missing" in text, text
    assert run.state() == before


def test_a_generation_file_of_another_run_is_named_and_nothing_is_published(run, tmp_path, capsys):
    other = ArtifactRoot(str(tmp_path / "other"))
    foreign = new_generation(other, "ads", SPEC, world_size=1)
    root = ArtifactRoot(str(run.art))
    mine = new_generation(root, "ctr", SPEC, world_size=1)
    write_dump(root, mine, 0, {T: {0: random_rows(range(3), SPEC[T])}})
    path = Path(root.generation_file("ctr", mine.generation))
    shutil.copy(other.generation_file("ads", foreign.generation), path)
    before = run.state()
    for argv in (["--generation", "2"], []):
        code, text = _publish(run, capsys, *argv)
        assert code == 2 and str(path) in text and "'ads'" in text, text
    code, text = _cli(["inspect", "--artifacts", str(run.art), "--run", "ctr"], capsys)
    assert code == 2 and str(path) in text, text
    assert run.state() == before


def test_a_store_view_of_another_dim_is_named_and_nothing_is_written(run, tmp_path, capsys):
    url = f"sqlite:///{tmp_path}/other.db"
    with open_store(url, run="ctr") as store:
        store.provision({T: TableSpec(dim=8)})
        store.write(T, np.array([1], np.int64), np.zeros((1, 8), np.float32),
                    np.zeros(1, np.int8), np.array([7], np.int64))  # fmt: skip
    code, text = _cli(["publish", "--artifacts", str(run.art), "--run", "ctr", "--store", url],
                      capsys)  # fmt: skip
    assert code == 2 and "emb_ctr__sparse_ebc_user_id" in text and "dim=8" in text, text
    with open_store(url) as store:
        assert store.registry.generations("ctr") == []
        got = store.read(T, np.arange(60, dtype=np.int64))
        assert got.found.tolist() == [False, True] + [False] * 58


@pytest.fixture
def unwritable(tmp_path) -> Path:
    """A directory this process cannot create anything in (sysfs when running as root)."""
    if os.geteuid() == 0:
        return Path("/sys/fs") / f"deltarec-{uuid.uuid4().hex[:8]}"
    path = tmp_path / "read-only"
    path.mkdir()
    path.chmod(0o555)
    return path


@pytest.mark.multiprocess
def test_an_artifact_root_that_is_not_writable_stops_the_trainer_before_it_trains(
    unwritable, tmp_path
):
    work = tmp_path / "work"
    cmd = [
        sys.executable, "-c", "import sys; from deltarec.cli import main; sys.exit(main())",
        "train", "--nproc-per-node", "2", "--steps", "5", "--batch-size", "8",
        "--workdir", str(work), "--checkpoint-every", "1",
        "--artifacts", str(unwritable / "art"), "--run", "ctr",
        "--store", f"sqlite:///{tmp_path}/store.db",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    text = done.stdout + done.stderr
    assert done.returncode == 2 and str(unwritable / "art") in text, text[-3000:]
    assert "not writable" in text, text[-3000:]
    assert not (work / "checkpoints").exists() or not any((work / "checkpoints").iterdir())
    assert not Path(f"{tmp_path}/store.db").exists() or _no_rows(tmp_path / "store.db")


def _no_rows(db: Path) -> bool:
    conn = sqlite3.connect(db)
    try:
        names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return all(
            conn.execute(f'SELECT COUNT(*) FROM "{n}"').fetchone()[0] == 0
            for n in names
            if n.startswith("emb_")
        )
    finally:
        conn.close()


def test_the_lease_record_is_named_when_it_is_not_json(run, capsys):
    lease = run.art / "ctr" / "LEASE"
    lease.mkdir()
    (lease / "epoch-000001.json").write_text("{not json")
    code, text = _cli(["train", "--nproc-per-node", "2", "--artifacts", str(run.art), "--run",
                       "ctr"], capsys)  # fmt: skip
    assert code == 2 and "epoch-000001.json" in text and "not valid JSON" in text, text
