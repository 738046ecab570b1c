"""The hook with a store, ``deltarec inspect``, and an S3-compatible artifact root (SeaweedFS)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tests._helpers.dump import HandTables, read_dump

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.lineage import expected_state
from deltarec.cli import main as cli_main
from deltarec.dump import Dumper, DumperConfig, DumpHook, make_train_hook
from deltarec.errors import ConfigError


def _run_hook(hook: DumpHook, tables: HandTables, steps: int) -> None:
    hook.on_start(None, 0, None)  # type: ignore[arg-type]
    try:
        for step in range(1, steps + 1):
            tables.step(step)
            hook.after_step(step)
            if step == 3:
                hook.before_eval()
                tables.step(0, record=True)  # evaluation lookups
                hook.after_eval()
        hook.on_end(steps)
    finally:
        hook.close()


def test_the_hook_publishes_every_committed_dump_to_the_store(tmp_path):
    from deltarec.stores import open_store

    tables = HandTables(seed=11)
    url = f"sqlite:///{tmp_path}/store.db"
    cfg = DumperConfig(artifacts=str(tmp_path / "art"), run="pub", every_steps=2, fsync=False)
    hook = DumpHook(cfg, store=url, sources=lambda model: tables.sources())
    _run_hook(hook, tables, 5)
    store = open_store(url)
    try:
        for t, w in tables.weights.items():
            keys = np.arange(w.shape[0], dtype=np.int64) + tables.offsets[t]
            got = store.read(t, keys)
            assert got.found.all(), t
            assert np.array_equal(got.embedding.view(np.float32), w.numpy()), t
    finally:
        store.close()


def test_make_train_hook_rejects_unknown_options(tmp_path):
    with pytest.raises(ConfigError, match="no_such_option"):
        make_train_hook(artifacts=str(tmp_path), run="r", no_such_option=1)
    with pytest.raises(ConfigError, match="publish_mode"):
        make_train_hook(artifacts=str(tmp_path), run="r", publish_mode="sideways")


def test_inspect_lists_generations_dumps_tables_rows_bytes_and_steps(tmp_path, capsys):
    tables = HandTables(seed=12)
    cfg = DumperConfig(artifacts=str(tmp_path), run="ins", every_steps=2, fsync=False)
    hook = DumpHook(cfg, sources=lambda model: tables.sources())
    _run_hook(hook, tables, 4)
    assert cli_main(["inspect", "--artifacts", str(tmp_path), "--run", "ins", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (gen,) = report["generations"]
    assert gen["generation"] == 1 and gen["parent"] is None and gen["world_size"] == 1
    assert [d["kind"] for d in gen["dumps"]] == ["snapshot", "delta", "delta", "final"]
    assert [(d["first_step"], d["last_step"]) for d in gen["dumps"]] == [
        (0, 0),
        (1, 2),
        (3, 4),
        (4, 4),
    ]
    root = ArtifactRoot(str(tmp_path))
    for d in gen["dumps"]:
        m = root.read_manifest("ins", 1, d["seq"])
        assert d["rows"] == sum(m.tables.values())
        assert d["bytes"] == sum(s.bytes for s in m.shards) > 0 or d["rows"] == 0
        assert d["tables"]["sparse.a"]["rows"] == m.tables["sparse.a"]
    assert gen["steps"] == [0, 4] and gen["incomplete_dumps"] == []
    assert cli_main(["inspect", "--artifacts", str(tmp_path), "--run", "ins"]) == 0
    text = capsys.readouterr().out
    assert "generation 1" in text and "snapshot" in text and "sparse.a" in text
    assert cli_main(["inspect", "--artifacts", str(tmp_path), "--run", "nope"]) == 2
    assert (
        cli_main(["inspect", "--artifacts", str(tmp_path), "--run", "ins", "--generation", "7"])
        == 2
    )


@pytest.fixture
def s3_root(s3_server):
    """An empty prefix in a fresh bucket of the real S3-compatible server (SeaweedFS)."""
    uri, opts = s3_server.fresh_uri()
    return f"{uri}/artifacts", opts


@pytest.mark.integration
def test_dumps_commit_and_restart_cleanly_on_an_s3_compatible_root(s3_root, monkeypatch):
    uri, opts = s3_root
    tables = HandTables(seed=13)
    cfg = DumperConfig(artifacts=uri, run="s3", every_steps=2, storage_options=opts)
    d = Dumper(cfg, tables.sources())
    info = d.start(step=0)
    for step in range(1, 5):
        tables.step(step)
        d.maybe_dump(step)
    d.final_dump(4)
    d.close()
    root = ArtifactRoot(uri, opts)
    assert root.list_dumps("s3", info.generation) == [0, 1, 2, 3]
    state = expected_state(root, "s3", info.generation)
    for t, w in tables.weights.items():
        et = state.tables[t]
        assert np.array_equal(et.load(et.keys), w.numpy()[et.keys - tables.offsets[t]])
    # a crash before the manifest: no manifest; the next start removes the directory
    d2 = Dumper(cfg, tables.sources())
    d2.start(step=4)
    d2.wait_idle(timeout=60)
    monkeypatch.setattr(ArtifactRoot, "commit_manifest", _crash)
    tables.step(5)
    d2.dump_now(5)
    with pytest.raises(Exception, match="killed"):
        d2.wait_idle(timeout=60)
    d2.close()
    monkeypatch.undo()
    assert root.list_incomplete_dumps("s3", 2) == [1]
    d3 = Dumper(cfg, tables.sources())
    assert d3.start(step=4).generation == 3
    d3.close()
    assert root.list_incomplete_dumps("s3", 2) == []
    assert read_dump(root, "s3", 2, 0)["sparse.a"][0].size == tables.weights["sparse.a"].shape[0]


def _crash(self, manifest):
    raise RuntimeError("killed between shard writes and manifest")
