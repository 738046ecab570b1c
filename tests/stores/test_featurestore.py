"""The PAI FeatureStore backend against a fake ``feature_store_py`` at the SDK boundary.

The real SDK is not on PyPI and needs an Alibaba Cloud account; the fake implements the calls
the backend makes (client, project, entity, DynamicEmbedding view, MERGE writes with
timestamps, flush summaries, online reads) with FeatureStore's documented semantics.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from deltarec.artifacts import ArtifactRoot, codec
from deltarec.artifacts.types import DType, TableKind, TableSpec
from deltarec.errors import ConfigError, StoreUnavailableError, ViewMismatchError
from deltarec.publish import DumpPublisher, PublishMetrics, RetryPolicy
from deltarec.stores import parse_store_url
from deltarec.stores.featurestore import FeatureStoreStore
from deltarec.testing.dumps import new_generation, random_rows, write_dump

T = "sparse.ebc.user_id"
Z = "sparse.zch.ad_id"
TABLES = {
    T: TableSpec(dim=4),
    Z: TableSpec(dim=4, dtype=DType.INT8_ROWWISE, kind=TableKind.ZCH),
}


class FakeView:
    pk_field, sk_field, embedding_field = "embedding_name", "key_id", "embedding"

    def __init__(self, arrow: bool = True) -> None:
        self.rows: dict[tuple[str, str, int], tuple[int, np.ndarray]] = {}
        self.pending = 0
        self.fail_next_flush = 0
        self.calls: list[str] = []
        if not arrow:  # an SDK wheel without the columnar call
            self.write_features_arrow = None  # type: ignore[assignment]

    def _merge(self, version, pk, sk, ts, value):  # type: ignore[no-untyped-def]
        old = self.rows.get((version, pk, sk))
        if old is None or old[0] <= ts:  # MERGE: the newest timestamp wins
            self.rows[(version, pk, sk)] = (ts, np.asarray(value, np.float32))
        self.pending += 1

    def write_features_arrow(self, *, batch, version, write_mode, ts):  # type: ignore[no-untyped-def]
        assert write_mode == "MERGE"
        self.calls.append("arrow")
        for pk, sk, emb in zip(
            batch.column("embedding_name").to_pylist(),
            batch.column("key_id").to_pylist(),
            batch.column("embedding").to_pylist(),
            strict=True,
        ):
            self._merge(version, pk, sk, ts, emb)

    def write_features(self, *, data, version, write_mode, ts):  # type: ignore[no-untyped-def]
        assert write_mode == "MERGE"
        self.calls.append("rows")
        for row in data:
            self._merge(version, row["embedding_name"], row["key_id"], ts, row["embedding"])

    def write_flush(self):  # type: ignore[no-untyped-def]
        n, self.pending = self.pending, 0
        failed = n if self.fail_next_flush else 0
        self.fail_next_flush = max(0, self.fail_next_flush - 1)
        return {
            "total_batches": 1,
            "failed_batches": int(bool(failed)),
            "total_records": n,
            "success_records": n - failed,
            "failed_records": failed,
            "errors": [],
        }

    def get_online_features(self, *, feature_name, keys, version):  # type: ignore[no-untyped-def]
        out = []
        for k in keys:
            hit = self.rows.get((version, feature_name, k))
            if hit is not None:
                out.append({"sk": k, "embedding": hit[1].tolist()})
        return out

    def close(self, wait=True):  # type: ignore[no-untyped-def]
        self.calls.append("close")


class FakeProject:
    def __init__(self, view: FakeView | None) -> None:
        self.view = view
        self.entities: dict[str, str] = {}
        self.created: list[dict] = []
        self.arrow = True

    def get_dynamic_embedding_feature_view(self, name):  # type: ignore[no-untyped-def]
        return self.view

    def create_dynamic_embedding_feature_view(self, **kwargs):  # type: ignore[no-untyped-def]
        self.created.append(kwargs)
        self.view = FakeView(self.arrow)
        return self.view

    def get_entity(self, name):  # type: ignore[no-untyped-def]
        return self.entities.get(name)

    def create_entity(self, name, join_id):  # type: ignore[no-untyped-def]
        self.entities[name] = join_id


def fake_sdk(project: FakeProject) -> types.ModuleType:
    module = types.ModuleType("feature_store_py")
    module.clients = []  # type: ignore[attr-defined]

    class FeatureStoreClient:
        def __init__(self, **kwargs):  # type: ignore[no-untyped-def]
            module.clients.append(kwargs)  # type: ignore[attr-defined]

        def get_project(self, name):  # type: ignore[no-untyped-def]
            return project if name == "proj" else None

    module.FeatureStoreClient = FeatureStoreClient  # type: ignore[attr-defined]
    return module


class FakeCredentials:
    def get_credential(self):  # type: ignore[no-untyped-def]
        return types.SimpleNamespace(
            access_key_id="ak", access_key_secret="sk", security_token="sts"
        )


def open_fs(tmp_path, project, view_name="emb"):  # type: ignore[no-untyped-def]
    url = f"featurestore://proj/{view_name}?region=cn-hangzhou&registry=sqlite:///{tmp_path}/reg.db"
    return FeatureStoreStore(
        parse_store_url(url), sdk=fake_sdk(project), credentials=FakeCredentials()
    )


def test_provision_creates_view_and_entity_once_and_checks_dims(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("FEATUREDB_USERNAME", "fdb-user")
    monkeypatch.setenv("FEATUREDB_PASSWORD", "fdb-pass")
    project = FakeProject(None)
    sdk = fake_sdk(project)
    url = f"featurestore://proj/emb?region=cn-hangzhou&registry=sqlite:///{tmp_path}/reg.db"
    store = FeatureStoreStore(parse_store_url(url), sdk=sdk, credentials=FakeCredentials())
    store.provision(TABLES)
    store.provision(TABLES)
    assert len(project.created) == 1
    created = project.created[0]
    assert (created["name"], created["pk_field_name"], created["sk_field_name"]) == (
        "emb",
        "embedding_name",
        "key_id",
    )
    assert project.entities == {"deltarec_key": "deltarec_key_id"}
    assert sdk.clients[0]["featuredb_username"] == "fdb-user"  # type: ignore[attr-defined]
    assert sdk.clients[0]["access_key_id"] == "ak"  # type: ignore[attr-defined]
    with pytest.raises(ViewMismatchError, match=r"dim=4.*dim=8"):
        store.provision({T: TableSpec(dim=8)})
    store.close()


@pytest.mark.parametrize("arrow", [True, False], ids=["write_features_arrow", "write_features"])
def test_dump_published_through_the_sdk_reads_back(tmp_path, arrow):  # type: ignore[no-untyped-def]
    project = FakeProject(None)
    project.arrow = arrow
    store = open_fs(tmp_path, project)
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", TABLES, world_size=1)
    rows = {
        T: {0: random_rows(range(2500), TABLES[T], 1)},
        Z: {0: random_rows([-1, 5, 9], TABLES[Z], 2, ops=[0, 1, 0])},
    }
    write_dump(root, info, 1, rows)
    DumpPublisher(store, root, "r").publish_generation(1)
    assert project.view is not None
    assert {c for c in project.view.calls if c != "close"} == {"arrow" if arrow else "rows"}
    got = store.read(T, np.arange(2500))
    np.testing.assert_array_equal(got.embedding, rows[T][0].embedding)
    z = store.read(Z, np.array([-1, 5, 9]))
    assert z.found.all()  # the evicted id holds the row passed (the fallback row)
    want = codec.decode(rows[Z][0].embedding, DType.INT8_ROWWISE, 4)
    back = codec.decode(z.embedding, DType.INT8_ROWWISE, 4)  # stored as float32, re-encoded
    assert (np.abs(want - back) <= 2 * codec.tolerance(DType.INT8_ROWWISE, want)[:, None]).all()
    assert all(m.complete for m in store.registry.progress("r", 1))
    assert DumpPublisher(store, root, "r").publish_generation(1) == []
    store.close()


def test_failed_flush_is_retried_as_transient(tmp_path):  # type: ignore[no-untyped-def]
    project = FakeProject(None)
    store = open_fs(tmp_path, project)
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", {T: TABLES[T]}, world_size=1)
    rows = random_rows(range(10), TABLES[T], 3)
    write_dump(root, info, 1, {T: {0: rows}})
    store.provision({T: TABLES[T]})
    project.view.fail_next_flush = 2  # type: ignore[union-attr]
    metrics = PublishMetrics()
    retry = RetryPolicy(initial_s=0.01, max_s=0.02, deadline_s=10)
    DumpPublisher(store, root, "r", retry=retry, metrics=metrics).publish_generation(1)
    assert metrics.value("deltarec_publish_retries_total") == 2
    np.testing.assert_array_equal(store.read(T, rows.keys).embedding, rows.embedding)
    with pytest.raises(StoreUnavailableError):
        project.view.fail_next_flush = 1  # type: ignore[union-attr]
        store.write(T, rows.keys, rows.embedding, rows.ops, np.full(10, 5, np.int64))
    store.close()


def test_credentials_in_the_url_and_unsupported_operations_are_refused(tmp_path):  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="credentials never go in the URL"):
        parse_store_url("featurestore://ak:secret@proj/emb?region=cn-hangzhou")
    with pytest.raises(ConfigError, match="unknown option 'colour'"):
        parse_store_url("featurestore://proj/emb?region=x&colour=red")
    store = open_fs(tmp_path, FakeProject(None))
    store.provision(TABLES)
    with pytest.raises(NotImplementedError, match="featurestore"):
        list(store.scan_keys(T))
    with pytest.raises(NotImplementedError, match="featurestore"):
        store.merge_staging("r", 1)
    store.close()
