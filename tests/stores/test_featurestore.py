"""PAI FeatureStore through the strict test SDK (``tests/stores/sdk``): what it guarantees.

The SDK double has the classes, methods and keyword names TorchEasyRec's uploader and readback
tool call, and nothing else; its rows live in a file, so commands started as processes see them.
"""

from __future__ import annotations

import json
import threading
import time
import types

import numpy as np
import pytest
from tests._helpers import featurestore as fs_state

from deltarec.artifacts import ArtifactRoot, codec
from deltarec.artifacts.types import DType, TableKind, TableSpec
from deltarec.cli import main
from deltarec.errors import ConfigError, StoreError, StoreUnavailableError, ViewMismatchError
from deltarec.ids import make_version
from deltarec.publish import DumpPublisher, PublishMetrics, RetryPolicy
from deltarec.stores import open_store, parse_store_url
from deltarec.stores.featurestore.store import FeatureStoreStore
from deltarec.testing.dumps import new_generation, random_rows, write_dump
from deltarec.verify import RowClass, VerifyOptions, verify

FS_PROJECT, FS_VIEW, FS_VERSION = fs_state.PROJECT, fs_state.VIEW, fs_state.VERSION
T = "sparse.ebc.user_id"
Z = "sparse.zch.ad_id"
EBC = "EmbeddingBagCollection"
TABLES = {
    T: TableSpec(dim=4, module_type=EBC),
    Z: TableSpec(dim=4, dtype=DType.INT8_ROWWISE, kind=TableKind.ZCH, module_type=EBC),
}
FAST = RetryPolicy(initial_s=0.01, max_s=0.05, deadline_s=10)


@pytest.fixture(params=fs_state.SURFACES)
def state(request, tmp_path, monkeypatch) -> str:
    """The test SDK's state file, on each surface: merged TorchEasyRec's calls, and those plus
    ``project.get_feature_view``."""
    path = str(tmp_path / "featurestore.db")
    fs_state.use_test_sdk(monkeypatch, path, surface=request.param)
    return path


@pytest.fixture
def control_plane(tmp_path, monkeypatch) -> str:
    """The test SDK with ``project.get_feature_view`` (what the TTL/shard checks need)."""
    path = str(tmp_path / "featurestore.db")
    fs_state.use_test_sdk(monkeypatch, path, surface="control-plane")
    return path


def own(store: FeatureStoreStore, run: str = "r") -> FeatureStoreStore:
    """``store`` as a handle of ``run`` (what ``open_store(url, run=...)`` makes)."""
    store.run = run
    return store


def url(tmp_path, **options) -> str:
    opts = {"region": "cn-hangzhou", "registry": f"sqlite:///{tmp_path}/reg.db", **options}
    return f"featurestore://{FS_PROJECT}/{FS_VIEW}?" + "&".join(f"{k}={v}" for k, v in opts.items())


def publish(tmp_path, store, rows, tables=TABLES):
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", tables, world_size=1)
    write_dump(root, info, 1, {t: {0: r} for t, r in rows.items()})
    DumpPublisher(store, root, "r", retry=FAST).publish_generation(1)
    return root


def first_rows():
    return {
        T: random_rows(range(50), TABLES[T], 1),
        Z: random_rows([-1, 5, 9], TABLES[Z], 2, ops=np.array([0, 1, 0], np.int8)),
    }


def test_a_published_generation_verifies_by_value_and_a_tampered_row_fails(tmp_path, state):
    with open_store(url(tmp_path), run="r") as store:
        root = publish(tmp_path, store, first_rows())
        sampled = verify(root, "r", store, options=VerifyOptions(sample=1000))
        assert sampled.passed, sampled.failure_summary()
        assert sampled.tables[T].counts[RowClass.MATCH] == 50
        assert sampled.tables[Z].counts[RowClass.MATCH] == 3  # evicted id 5 holds the fallback row
        every = verify(root, "r", store, options=VerifyOptions(sample=None))
        assert every.passed and every.tables[T].store_keys_scanned is None
        assert any("cannot list its keys" in n for n in every.notes)
        fs_state.set_row(state, FS_PROJECT, FS_VIEW, FS_VERSION, T, 7, [9.0, 9.0, 9.0, 9.0])
        fs_state.set_row(state, FS_PROJECT, FS_VIEW, FS_VERSION, Z, 5, [1.0, 2.0, 3.0, 4.0])
        bad = verify(root, "r", store, options=VerifyOptions(sample=None))
    assert not bad.passed
    assert [m.key for m in bad.tables[T].mismatches] == [7]
    assert bad.tables[T].mismatches[0].row_class is RowClass.DIFFERENT
    assert "fallback row" in bad.tables[Z].mismatches[0].reason


def test_rank_zero_creates_entity_and_view_with_torcheasyrec_defaults_once(tmp_path, state):
    with open_store(url(tmp_path), run="r") as store:
        store.provision(TABLES)
        store.provision(TABLES)
    with open_store(url(tmp_path), run="r") as again:
        again.provision(TABLES)
    meta = fs_state.connect(state).execute("SELECT entity, ttl, shard_count, replication_count "
                                           "FROM views").fetchall()  # fmt: skip
    assert meta == [("deltarec_key", 15 * 86400, 20, 1)]
    clients = fs_state.calls(state, "client")
    assert clients and all(
        c["has_token"] and c["featuredb_username"] == "fdb-user" for c in clients
    )
    assert all("secret" not in json.dumps(c) for c in clients)


def _faults_left(state: str, op: str) -> int:
    """How many of the faults injected for ``op`` are not consumed yet."""
    conn = fs_state.connect(state)
    try:
        row = conn.execute("SELECT remaining FROM faults WHERE op = ?", (op,)).fetchone()
    finally:
        conn.close()
    return 0 if row is None else int(row[0])


def _wait_for(condition, message: str, timeout_s: float = 30.0) -> None:
    """Poll ``condition`` until it holds; fail with ``message`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(message)
        time.sleep(0.02)


def test_other_ranks_wait_for_rank_zero_and_a_concurrent_view_is_picked_up(tmp_path, state):
    config = parse_store_url(url(tmp_path, create_wait_s=20))
    waiting = own(FeatureStoreStore(config, rank=1))
    done: list[object] = []
    # count rank 1's look-ups of the view: each consumes one of these no-op faults
    lookup = "get_dynamic_embedding_feature_view"
    fs_state.inject_fault(state, lookup, 2, "hang 0")
    thread = threading.Thread(target=lambda: done.append(waiting.provision(TABLES)))
    thread.start()
    _wait_for(
        lambda: _faults_left(state, lookup) == 0,
        "rank 1 did not look for the view twice (i.e. wait for rank 0) within 30 s",
    )
    assert not done and not fs_state.connect(state).execute("SELECT * FROM views").fetchall()
    with own(FeatureStoreStore(config, rank=0)) as creator:
        creator.provision(TABLES)
    thread.join(20)
    assert done, "rank 1 did not pick up the view rank 0 created"
    waiting.close()
    # another job creates the view between our look-up and our create: its view is used
    other = parse_store_url(url(tmp_path, registry=f"sqlite:///{tmp_path}/reg2.db"))
    fs_state.inject_fault(state, "create_dynamic_embedding_feature_view", 1, "race")
    with own(FeatureStoreStore(other.model_copy(update={"view": "emb2"}), rank=0)) as late:
        late.provision(TABLES)
        rows = random_rows(range(3), TABLES[T], 1)
        late.write(T, rows.keys, rows.embedding, rows.ops, np.full(3, make_version(1, 1)))
        assert late.read(T, rows.keys).found.all()


def test_an_existing_view_of_another_field_type_is_refused_naming_both(tmp_path, state):
    with open_store(url(tmp_path), run="r") as store:
        store.provision({T: TABLES[T]})
    with (
        pytest.raises(ViewMismatchError, match=r"ARRAY<FLOAT>.*ARRAY<UINT8>"),
        open_store(
            url(tmp_path, contract="tzrec", registry=f"sqlite:///{tmp_path}/r2.db"), run="r"
        ) as s,
    ):
        s.provision({Z: TABLES[Z]})
    with (
        pytest.raises(ConfigError, match=r"ARRAY<FLOAT>.*ARRAY<UINT8>"),
        open_store(
            url(tmp_path, contract="tzrec", registry=f"sqlite:///{tmp_path}/r3.db"), run="r"
        ) as s,
    ):
        s.provision(TABLES)


def test_an_existing_views_ttl_or_shards_other_than_asked_for_are_refused_naming_both(
    tmp_path, control_plane
):
    with open_store(url(tmp_path, ttl_s=7 * 86400), run="r") as store:  # created with a 7-day TTL
        store.provision({T: TABLES[T]})
    for asked, named in [({"ttl_s": 86400 * 15}, r"ttl 604800.*ttl 1296000 \(ttl_s\)"),
                         ({"shard_count": 10}, r"shard_count 20.*shard_count 10")]:  # fmt: skip
        with (
            pytest.raises(ViewMismatchError, match=named),
            open_store(url(tmp_path, **asked), run="r") as s,
        ):
            s.provision({T: TABLES[T]})
    with open_store(url(tmp_path, shard_count=20), run="r") as s:  # defaults take the view's values
        s.provision({T: TABLES[T]})
        assert s.read(T, np.arange(3)).found.sum() == 0


def test_writes_follow_the_sdk_batches_window_and_flush_summary(tmp_path, state):
    spec = TableSpec(dim=4)
    rows = random_rows(range(2500), spec, 3)
    with open_store(url(tmp_path, batch_size=300), run="r") as store:
        store.provision({T: spec})
        store.write(T, rows.keys, rows.embedding, rows.ops, np.full(2500, make_version(1, 1)))
        np.testing.assert_array_equal(store.read(T, rows.keys).embedding, rows.embedding)
    flushes = fs_state.calls(state, "write_flush")
    # 9 batches of <= 300 rows, 4 in flight (the view's _max_workers), then write_flush
    assert [f["total_batches"] for f in flushes if f["total_batches"]][:3] == [4, 4, 1]
    assert sum(f["success_records"] for f in flushes) == 2500


def test_failed_flush_is_retried_on_a_new_client_and_auth_errors_fail_at_once(tmp_path, state):
    spec = TableSpec(dim=4)
    rows = random_rows(range(10), spec, 3)
    fetched: list[int] = []

    class Chain:
        def get_credential(self):
            fetched.append(1)
            return types.SimpleNamespace(
                access_key_id="ak", access_key_secret="sk", security_token="sts"
            )

    store = own(FeatureStoreStore(parse_store_url(url(tmp_path)), credentials=Chain()))
    store.provision({T: spec})
    fs_state.inject_fault(state, "write_flush", 2, "429 Throttling.User")
    metrics = PublishMetrics()
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", {T: spec}, world_size=1)
    write_dump(root, info, 1, {T: {0: rows}})
    DumpPublisher(store, root, "r", retry=FAST, metrics=metrics).publish_generation(1)
    assert metrics.value("deltarec_publish_retries_total") == 2
    assert len(fetched) == 3  # credentials fetched again for every new client
    np.testing.assert_array_equal(store.read(T, rows.keys).embedding, rows.embedding)
    fs_state.inject_fault(state, "write_features", 1, "403 InvalidAccessKeyId.NotFound")
    with pytest.raises(
        StoreError, match=r"view 'emb' table 'sparse.ebc.user_id'.*credentials"
    ) as e:
        store.write(T, rows.keys, rows.embedding, rows.ops, np.full(10, make_version(1, 2)))
    assert not isinstance(e.value, StoreUnavailableError)
    fs_state.inject_fault(state, "get_online_features", 1, "network: connection reset")
    with pytest.raises(StoreUnavailableError):
        store.read(T, rows.keys)
    store.close()


def test_tzrec_contract_names_tables_and_writes_int8_as_uint8_rows(tmp_path, state):
    z = "emb_group.mc_ebc.ad_id"
    spec = TableSpec(dim=4, dtype=DType.INT8_ROWWISE, kind=TableKind.ZCH, module_type=EBC)
    rows = random_rows([-1, 5, 9], spec, 2, ops=np.array([0, 1, 0], np.int8))
    with open_store(url(tmp_path, contract="tzrec"), run="r") as store:
        root = publish(tmp_path, store, {z: rows}, {z: spec})
        checked = verify(root, "r", store, options=VerifyOptions(sample=None))
        assert checked.passed and checked.tables[z].checked == 2
        assert any("does not hold key -1" in n for n in checked.notes)
    stored = fs_state.stored_rows(state, FS_PROJECT, FS_VIEW, FS_VERSION)
    name = "emb_group.mc_ebc._embedding_module.embedding_bags.ad_id"
    assert sorted(stored) == [(name, 5), (name, 9)]  # -1 is TorchEasyRec's invalid key
    assert stored[(name, 9)] == rows.embedding[2].tolist() and len(stored[(name, 9)]) == 8
    values = codec.decode(rows.embedding, DType.INT8_ROWWISE, 4)
    assert np.allclose(codec.dequantize_int8_rowwise(np.array([stored[(name, 9)]]), 4), values[2])


def test_options_the_sdk_cannot_use_and_a_missing_registry_are_refused(tmp_path, state):
    with pytest.raises(ConfigError, match="datasource"):
        parse_store_url("featurestore://proj/emb?region=x&datasource=fdb")
    with pytest.raises(ConfigError, match="credentials never go in the URL"):
        parse_store_url("featurestore://ak:secret@proj/emb?region=cn-hangzhou")
    bare = "featurestore://proj/emb?region=cn-hangzhou"
    with pytest.raises(ConfigError, match="registry"):
        open_store(bare)
    with pytest.raises(ConfigError, match="not a local path"):
        open_store(bare, "s3://bucket/art")
    with open_store(bare, str(tmp_path / "art"), run="r") as store:
        store.provision(TABLES)
    assert (tmp_path / "art" / "_registry" / "featurestore-proj-emb.db").exists()
    with open_store(bare, str(tmp_path / "art"), run="r") as again:
        assert set(again.views()) == {T, Z}


def test_cli_round_trip_provision_publish_verify_all_promote(tmp_path, state, capsys):
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", TABLES, world_size=1)
    write_dump(root, info, 1, {t: {0: r} for t, r in first_rows().items()})
    store = "featurestore://proj/emb?region=cn-hangzhou"
    loc = ["--artifacts", root.uri, "--run", "r", "--store", store]
    assert main(["provision", *loc]) == 0
    assert main(["provision", *loc, "--staged"]) == 2  # refused with a message, no traceback
    assert "does not support staging views" in capsys.readouterr().err
    assert main(["publish", *loc, "--generation", "1"]) == 0
    out = tmp_path / "verify.json"
    assert main(["verify", *loc, "--all", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["passed"] and doc["totals"]["MATCH"] == 53 and doc["notes"]
    assert main(["promote", *loc, "--generation", "1"]) == 0
    fs_state.set_row(state, FS_PROJECT, FS_VIEW, FS_VERSION, T, 3, [0.5, 0.5, 0.5, 0.5])
    capsys.readouterr()
    assert main(["verify", *loc, "--all"]) == 1
    err = capsys.readouterr().err
    assert "DIFFERENT 1" in err and "Traceback" not in err


def test_an_older_point_verifies_and_rollback_restores_it(tmp_path, state, capsys):
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", TABLES, world_size=1)
    one = first_rows()
    write_dump(root, info, 1, {t: {0: r} for t, r in one.items()})
    store = "featurestore://proj/emb?region=cn-hangzhou"
    loc = ["--artifacts", root.uri, "--run", "r", "--store", store]
    assert main(["publish", *loc]) == 0
    assert main(["verify", *loc, "--all"]) == 0
    assert main(["promote", *loc, "--generation", "1"]) == 0
    two = {  # dump 2 changes keys 0..4, adds 50..54, evicts ZCH id 9
        T: random_rows([0, 1, 2, 3, 4, 50, 51, 52, 53, 54], TABLES[T], 7),
        Z: random_rows([9], TABLES[Z], 8, ops=np.array([1], np.int8)),
    }
    write_dump(root, info, 2, {t: {0: r} for t, r in two.items()})
    assert main(["publish", *loc]) == 0
    older = tmp_path / "older.json"
    assert main(["verify", *loc, "--all", "--through-seq", "1", "--json", str(older)]) == 0
    assert json.loads(older.read_text())["totals"]["SUPERSEDED"] == 6  # 5 rows and 1 eviction
    assert main(["rollback", *loc, "--to-generation", "1"]) == 0
    after = tmp_path / "after.json"
    point = ["--generation", "1", "--through-seq", "1"]
    assert main(["verify", *loc, "--all", *point, "--json", str(after)]) == 0
    doc = json.loads(after.read_text())
    assert doc["passed"] and doc["rollback_generations"] == [2]
    with open_store(store, root.uri, run="r") as s:
        back = s.read(T, np.arange(5))
        np.testing.assert_array_equal(back.embedding, one[T].embedding[:5])
        assert s.registry.get_serving("r").note.startswith("rollback to generation 1")
    fs_state.set_row(state, FS_PROJECT, FS_VIEW, FS_VERSION, T, 0, [7.0, 7.0, 7.0, 7.0])
    assert main(["verify", *loc, "--all", *point]) == 1  # a rollback row is never excused
    assert "Traceback" not in capsys.readouterr().err


def test_the_test_sdk_refuses_what_the_real_one_would(tmp_path, state):
    import feature_store_py

    with pytest.raises(TypeError):  # an unknown keyword
        feature_store_py.FeatureStoreClient(access_key_id="a", access_key_secret="b", regoin="x")
    client = feature_store_py.FeatureStoreClient(
        access_key_id="a", access_key_secret="b", region="cn-hangzhou"
    )
    with open_store(url(tmp_path), run="r") as store:
        store.provision({T: TABLES[T]})
    view = client.get_project(FS_PROJECT).get_dynamic_embedding_feature_view(FS_VIEW)
    row = {"embedding_name": T, "key_id": 1, "embedding": [0.0] * 4}
    with pytest.raises(TypeError):
        view.write_features(data=[row], version="v", write_mode="MERGE", ts=1, timeout=3)
    with pytest.raises(feature_store_py.FeatureStoreError, match="BatchTooLarge"):
        view.write_features(data=[row] * 1001, version="v", write_mode="MERGE", ts=1)
    with pytest.raises(feature_store_py.FeatureStoreError, match="InvalidVersion"):
        view.write_features(data=[row], version="default", write_mode="MERGE", ts=1)
    assert not hasattr(view, "delete") and not hasattr(view, "read_features")
    assert hasattr(feature_store_py.Project, "get_feature_view") is False


def test_closing_waits_for_the_writer_to_drain_no_longer_than_the_shutdown_timeout(
    tmp_path, state, monkeypatch
):
    store = open_store(url(tmp_path, shutdown_timeout_s=0.3), run="r")
    store.provision({T: TABLES[T]})
    fs_state.inject_fault(state, "close", 1, "hang 30")
    import feature_store_py

    release, ended = threading.Event(), threading.Event()

    def hang(seconds: float) -> None:  # the SDK's hang lasts until the test ends it
        release.wait(seconds)
        ended.set()

    monkeypatch.setattr(feature_store_py, "time", types.SimpleNamespace(sleep=hang))
    with pytest.raises(StoreError, match=r"did not drain within 0.3s.*deltarec publish"):
        store.close()
    assert not ended.is_set()  # it gave up while the writer still hung
    release.set()
