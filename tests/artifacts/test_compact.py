"""Compaction (SPEC §3a): bases read back by plain pyarrow and compared with an own replay."""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from deltarec.artifacts import ArtifactRoot, DType, DumpKind, Parent, TableKind, TableSpec
from deltarec.artifacts.base import list_bases, read_base
from deltarec.artifacts.compact import compact
from deltarec.artifacts.lineage import expected_state
from deltarec.cli import main
from deltarec.ids import make_version
from deltarec.testing.dumps import new_generation, random_rows, write_dump

RUN = "ctr"
PLAIN, ZCH = "sparse.ebc.user_id", "sparse.zch.ad_id"
SPECS = {
    PLAIN: TableSpec(dim=8, num_embeddings=400),
    ZCH: TableSpec(dim=4, dtype=DType.INT8_ROWWISE, kind=TableKind.ZCH, zch_size=64),
}


class History:
    """Dumps written with the test helpers, and this test's own replay of them."""

    def __init__(self, root: ArtifactRoot) -> None:
        self.root = root
        self.state: dict[str, dict[int, tuple[int, int, int, bytes]]] = {t: {} for t in SPECS}
        self.step = 0
        self.rng = np.random.default_rng(5)

    def generation(self, parent: Parent | None = None):
        return new_generation(self.root, RUN, SPECS, world_size=2, parent=parent)

    def dump(self, info, seq, kind=DumpKind.DELTA, n=30, evict=0):
        first, self.step = self.step + 1, self.step + 10
        rows = {}
        version = make_version(info.generation, seq)
        if kind is DumpKind.SNAPSHOT:
            for t in SPECS:
                for k, (v, _, s, e) in self.state[t].items():
                    if v < version:  # removed by the snapshot: absent, no row
                        self.state[t][k] = (v, 1, s, bytes(len(e)))
        for t, spec in SPECS.items():
            keys = np.unique(self.rng.integers(-1 if t == ZCH else 0, 200, n))
            ops = np.zeros(len(keys), np.int8)
            if evict and t == ZCH:
                ops[:evict] = 1
            per_rank = {}
            for r in range(2):
                mine = keys % 2 == r
                sr = random_rows(
                    keys[mine],
                    spec,
                    seed=int(self.rng.integers(1 << 30)),
                    ops=ops[mine],
                    step=self.step,
                )
                per_rank[r] = sr
                for k, o, e in zip(sr.keys.tolist(), sr.ops.tolist(), sr.embedding, strict=True):
                    self.state[t][k] = (version, o, self.step, e.tobytes())
            rows[t] = per_rank
        write_dump(self.root, info, seq, rows, kind=kind, first_step=first, last_step=self.step)


def _read_base_independently(root: ArtifactRoot, base_dir: str):
    """BASE.json and its parts as SPEC §3a says, with plain json and pyarrow."""
    with open(posixpath.join(base_dir, "BASE.json")) as f:
        meta = json.load(f)
    got: dict[str, dict[int, tuple[int, int, int, bytes]]] = {t: {} for t in meta["tables"]}
    last_max: dict[str, int] = {}
    for part in meta["parts"]:
        path = posixpath.join(base_dir, part["path"])
        assert part["path"].startswith(part["table"] + "/part-") and part["path"].endswith(
            ".parquet"
        )
        with open(path, "rb") as f:
            data = f.read()
        assert hashlib.sha256(data).hexdigest() == part["sha256"] and len(data) == part["bytes"]
        table = pq.read_table(path)
        assert table.column_names == ["key", "embedding", "op", "step", "version"]
        keys = table.column("key").to_numpy()
        assert (np.diff(keys) > 0).all()  # sorted by key, one row a key
        assert keys[0] == part["min_key"] and keys[-1] == part["max_key"]
        assert part["min_key"] > last_max.get(part["table"], -(1 << 62))  # disjoint ranges
        last_max[part["table"]] = part["max_key"]
        width = table.schema.field("embedding").type.list_size
        emb = table.column("embedding").combine_chunks().values.to_numpy().reshape(-1, width)
        for i, k in enumerate(keys.tolist()):
            got[part["table"]][k] = (
                int(table.column("version")[i].as_py()),
                int(table.column("op")[i].as_py()),
                int(table.column("step")[i].as_py()),
                emb[i].tobytes(),
            )
    return meta, got


def _same(replay, got):
    for t, rows in replay.items():
        assert set(got[t]) == set(rows), t
        for k, (v, op, s, e) in rows.items():
            assert got[t][k] == (v, op, s, e), (t, k)


def test_a_base_holds_the_newest_row_per_key_as_an_independent_replay_finds_it(tmp_path):
    h = History(ArtifactRoot(str(tmp_path / "art")))
    info = h.generation()
    h.dump(info, 0, DumpKind.SNAPSHOT, n=120)
    for seq in range(1, 6):
        h.dump(info, seq, evict=2)
    result = compact(h.root, RUN, part_rows=40)
    assert result.written and result.dumps_read == 6 and result.base.base is None
    base_dir = h.root.base_dir(RUN, info.generation, 5)
    meta, got = _read_base_independently(h.root, base_dir)
    assert meta["through_version"] == make_version(info.generation, 5) and meta["base"] is None
    assert meta["lineage"] == [{"generation": 1, "through_seq": 5, "cutoff_step": None}]
    assert len(meta["parts"]) > 2
    assert {t: v["rows"] for t, v in meta["tables"].items()} == {
        t: len(r) for t, r in h.state.items()
    }
    _same(h.state, got)


def test_the_next_base_is_built_from_the_previous_base_and_the_dumps_after_it(tmp_path):
    h = History(ArtifactRoot(str(tmp_path / "art")))
    info = h.generation()
    h.dump(info, 0, DumpKind.SNAPSHOT, n=120)
    for seq in range(1, 4):
        h.dump(info, seq, evict=1)
    compact(h.root, RUN)
    for seq in range(0, 4):  # what retention may delete: the second base must not need it
        shutil.rmtree(h.root.dump_dir(RUN, info.generation, seq))
    for seq in range(4, 7):
        h.dump(info, seq)
    h.dump(info, 7, DumpKind.SNAPSHOT, n=50)  # a snapshot after the base removes keys of it
    h.dump(info, 8)
    second = compact(h.root, RUN)
    assert second.dumps_read == 5 and second.base.base == (info.generation, 3)
    _, got = _read_base_independently(h.root, h.root.base_dir(RUN, info.generation, 8))
    _same(h.state, got)
    assert list_bases(h.root, RUN) == [(1, 3), (1, 8)]


def test_readers_starting_from_a_base_expect_what_the_full_replay_expects(tmp_path):
    h = History(ArtifactRoot(str(tmp_path / "art")))
    parent = h.generation()
    h.dump(parent, 0, DumpKind.SNAPSHOT, n=100)
    for seq in range(1, 5):
        h.dump(parent, seq, evict=1)
    cutoff = h.step - 10  # the child restores from the checkpoint before dump 4
    child = h.generation(Parent(parent.generation, cutoff))
    h.step = cutoff
    for seq in range(1, 4):
        h.dump(child, seq)
    full = expected_state(h.root, RUN, child.generation, 2)
    full_rows = {t: full.tables[t].load(full.tables[t].keys) for t in SPECS}
    compact(h.root, RUN, parent.generation, 2)  # a base of the parent, under the cutoff
    compact(h.root, RUN, child.generation, 1)
    for seq in range(0, 4):  # the base folds them; dump 4 is past the cutoff
        shutil.rmtree(h.root.dump_dir(RUN, parent.generation, seq))
    shutil.rmtree(h.root.dump_dir(RUN, child.generation, 1))
    fast = expected_state(h.root, RUN, child.generation, 2)
    assert fast.base is not None and fast.base.through_seq == 1
    assert [m.seq for m in fast.manifests] == [2]
    for t in SPECS:
        a, b = full.tables[t], fast.tables[t]
        np.testing.assert_array_equal(a.keys, b.keys)
        np.testing.assert_array_equal(a.versions, b.versions)
        np.testing.assert_array_equal(a.ops, b.ops)
        np.testing.assert_array_equal(a.steps, b.steps)
        np.testing.assert_array_equal(full_rows[t], b.load(b.keys))
    meta = read_base(h.root, RUN, child.generation, 1)
    assert [(e.generation, e.through_seq, e.cutoff_step) for e in meta.lineage] == [
        (parent.generation, 3, cutoff),
        (child.generation, 1, None),
    ]


def test_the_cli_compacts_and_a_second_run_finds_the_base_committed(tmp_path, capsys):
    h = History(ArtifactRoot(str(tmp_path / "art")))
    info = h.generation()
    for seq in range(0, 3):
        h.dump(info, seq)
    argv = ["compact", "--artifacts", h.root.uri, "--run", RUN, "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["written"] and out["through_seq"] == 2 and out["dumps_read"] == 3
    assert main(argv) == 0
    assert not json.loads(capsys.readouterr().out)["written"]


@pytest.mark.parametrize("point", ["compact.part@2", "compact.base_json"])
def test_a_compaction_killed_at_any_point_leaves_the_previous_state_and_a_rerun_completes(
    tmp_path, point
):
    h = History(ArtifactRoot(str(tmp_path / "art")))
    info = h.generation()
    for seq in range(0, 4):
        h.dump(info, seq, n=80)
    before = expected_state(h.root, RUN, info.generation)
    env = {
        **os.environ,
        "DELTAREC_FAULT": point,
        "DELTAREC_FAULT_DIR": str(tmp_path / "faults"),
    }
    cli = "import sys; from deltarec.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = [sys.executable, "-c", cli, "compact", "--artifacts", h.root.uri, "--run", RUN]
    proc = subprocess.Popen([*argv, "--part-rows", "20"], env=env)
    (tmp_path / "faults").mkdir()
    deadline = time.monotonic() + 60
    name = point.split("@")[0]
    while not any(p.startswith(name) for p in os.listdir(tmp_path / "faults")):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list_bases(h.root, RUN) == []  # an incomplete base covers nothing
    after = expected_state(h.root, RUN, info.generation)
    assert after.base is None
    np.testing.assert_array_equal(before.tables[PLAIN].keys, after.tables[PLAIN].keys)
    assert compact(h.root, RUN, part_rows=20).written
    _, got = _read_base_independently(h.root, h.root.base_dir(RUN, info.generation, 3))
    _same(h.state, got)


def test_verify_promote_inspect_and_a_replica_start_from_the_base_once_dumps_are_gone(
    tmp_path, capsys
):
    h = History(ArtifactRoot(str(tmp_path / "art")))
    info = h.generation()
    h.dump(info, 0, DumpKind.SNAPSHOT, n=100)
    for seq in range(1, 6):
        h.dump(info, seq, evict=1)
    url = f"sqlite:///{tmp_path / 'store.db'}"
    loc = ["--artifacts", h.root.uri, "--run", RUN]
    assert main(["publish", *loc, "--store", url]) == 0
    compact(h.root, RUN, through_seq=4)
    for seq in range(0, 5):
        shutil.rmtree(h.root.dump_dir(RUN, info.generation, seq))
    report = tmp_path / "verify.json"
    assert main(["verify", *loc, "--store", url, "--all", "--json", str(report)]) == 0
    out = json.loads(report.read_text())
    assert out["passed"] is True and out["version"] == make_version(info.generation, 5)
    assert main(["promote", *loc, "--store", url, "--generation", str(info.generation)]) == 0
    capsys.readouterr()
    assert main(["inspect", *loc, "--json"]) == 0
    seen = json.loads(capsys.readouterr().out)
    assert [(b["generation"], b["through_seq"]) for b in seen["bases"]] == [(info.generation, 4)]
    assert [d["seq"] for d in seen["generations"][0]["dumps"]] == [5]

    from deltarec.serving.replica import Replica

    replica = Replica(h.root, RUN)
    replica.install(replica.load(info.generation, 5))
    for t in SPECS:
        keys = np.array(sorted(h.state[t]), np.int64)
        found, versions, _ = replica.read(t, keys)
        want = [h.state[t][k][1] == 0 for k in keys.tolist()]
        assert found.tolist() == want
        assert versions[found].tolist() == [h.state[t][k][0] for k in keys[found].tolist()]


def _verify_all(tmp_path, h, url) -> dict:
    report = tmp_path / "verify.json"
    loc = ["--artifacts", h.root.uri, "--run", RUN, "--store", url]
    assert main(["verify", *loc, "--all", "--json", str(report)]) in (0, 1)
    return json.loads(report.read_text())


def test_an_empty_store_and_a_lagging_one_are_published_from_the_base(tmp_path, capsys):
    h = History(ArtifactRoot(str(tmp_path / "art")))
    info = h.generation()
    h.dump(info, 0, DumpKind.SNAPSHOT, n=100)
    h.dump(info, 1, evict=1)
    lagging = f"sqlite:///{tmp_path / 'lagging.db'}"
    loc = ["--artifacts", h.root.uri, "--run", RUN]
    assert main(["publish", *loc, "--store", lagging]) == 0
    for seq in range(2, 7):
        h.dump(info, seq, evict=1)
    compact(h.root, RUN, through_seq=5)
    for seq in range(0, 6):
        shutil.rmtree(h.root.dump_dir(RUN, info.generation, seq))
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    for url in (empty, lagging):
        capsys.readouterr()
        assert main(["publish", *loc, "--store", url, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert [p["seq"] for p in out["parts"]] == [6, 6]  # the base, then the dump after it
        result = _verify_all(tmp_path, h, url)
        assert result["passed"] is True, result
        capsys.readouterr()
        assert main(["publish", *loc, "--store", url, "--json"]) == 0  # nothing left
        assert json.loads(capsys.readouterr().out)["parts"] == []


def test_a_backlog_of_small_dumps_is_published_several_at_a_time_and_verifies(tmp_path, capsys):
    h = History(ArtifactRoot(str(tmp_path / "art")))
    info = h.generation()
    h.dump(info, 0, DumpKind.SNAPSHOT, n=100)
    for seq in range(1, 30):
        h.dump(info, seq, evict=1)
    url = f"sqlite:///{tmp_path / 'store.db'}"
    loc = ["--artifacts", h.root.uri, "--run", RUN, "--store", url]
    capsys.readouterr()
    assert main(["publish", *loc, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted((p["seq"], p["rank"]) for p in out["parts"]) == [
        (s, r) for s in range(30) for r in range(2)
    ]
    from deltarec.stores import open_store

    with open_store(url, run=RUN) as store:
        marks = store.registry.progress(RUN, info.generation)
    assert {(m.seq, m.table, m.rank) for m in marks if m.complete} == {
        (s, t, r) for s in range(30) for t in SPECS for r in range(2)
    }
    assert _verify_all(tmp_path, h, url)["passed"] is True
    capsys.readouterr()
    assert main(["publish", *loc, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parts"] == []


def test_a_restore_republishes_the_same_keys_once_a_base_replaced_the_dumps(tmp_path):
    from deltarec.artifacts.lineage import keys_published_after

    h = History(ArtifactRoot(str(tmp_path / "art")))
    info = h.generation()
    h.dump(info, 0, DumpKind.SNAPSHOT, n=100)
    for seq in range(1, 7):
        h.dump(info, seq, evict=1)
    restore = Parent(info.generation, 35)  # a checkpoint inside dump 3's steps
    before = keys_published_after(h.root, RUN, restore)
    compact(h.root, RUN, through_seq=5)
    for seq in range(0, 6):
        shutil.rmtree(h.root.dump_dir(RUN, info.generation, seq))
    after = keys_published_after(h.root, RUN, restore)
    assert sorted(after) == sorted(before)
    for t in before:
        np.testing.assert_array_equal(after[t], before[t])


def test_a_point_older_than_every_base_whose_dumps_are_gone_is_refused_not_guessed(tmp_path):
    from deltarec.errors import BadInputError

    h = History(ArtifactRoot(str(tmp_path / "art")))
    info = h.generation()
    for seq in range(0, 6):
        h.dump(info, seq)
    compact(h.root, RUN, through_seq=4)
    for seq in (0, 1):  # a gc cut short: the base covers them, dumps 2-4 are still there
        shutil.rmtree(h.root.dump_dir(RUN, info.generation, seq))
    assert expected_state(h.root, RUN, info.generation, 4).base is not None  # the base's point
    with pytest.raises(BadInputError, match=r"dumps 1-1, needed to read generation 1 through"):
        expected_state(h.root, RUN, info.generation, 2)
    for seq in (2, 3, 4):
        shutil.rmtree(h.root.dump_dir(RUN, info.generation, seq))
    with pytest.raises(BadInputError, match=r"has no committed dump 2"):
        expected_state(h.root, RUN, info.generation, 2)
