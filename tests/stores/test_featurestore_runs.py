"""PAI FeatureStore with many runs, a legacy SDK, a missing SDK, and two trainers racing.

Through the strict test SDK (``tests/stores/sdk``): each run writes under its own FeatureStore
``version``, serving reads the promoted run's, and the fence holds the registry's transaction
around every write.
"""

from __future__ import annotations

import sys
import threading
import time
import urllib.parse
import uuid

import numpy as np
import pytest
from tests._helpers import featurestore as fs_state

from deltarec.artifacts import ArtifactRoot, codec
from deltarec.artifacts.types import DType, TableKind, TableSpec
from deltarec.cli import main
from deltarec.errors import BadInputError, ConfigError, StaleGenerationError, ViewMismatchError
from deltarec.ids import make_version
from deltarec.stores import ProgressMark, open_store
from deltarec.testing.dumps import new_generation, random_rows, write_dump

T = "sparse.ebc.user_id"
Z = "sparse.zch.ad_id"
EBC = "EmbeddingBagCollection"
SPEC = {T: TableSpec(dim=4, module_type=EBC)}
INT8 = {Z: TableSpec(dim=4, dtype=DType.INT8_ROWWISE, kind=TableKind.ZCH, module_type=EBC)}


def _url(tmp_path, **options) -> str:
    opts = {"region": "cn-hangzhou", "registry": f"sqlite:///{tmp_path}/reg.db", **options}
    query = "&".join(f"{k}={v}" for k, v in opts.items())
    return f"featurestore://{fs_state.PROJECT}/{fs_state.VIEW}?{query}"


def _write(store, keys, value: float, generation: int = 1, mark: bool = True) -> None:
    k = np.asarray(keys, np.int64)
    emb = codec.encode(np.full((len(k), 4), value, np.float32), DType.FLOAT32)
    store.write(
        T, k, emb, np.zeros(len(k), np.int8),
        np.full(len(k), make_version(generation, 1), np.int64),
        mark=ProgressMark(store.run, generation, 1, T, 0, len(k), True) if mark else None,
    )  # fmt: skip


def _values(store, keys) -> list[float | None]:
    got = store.read(T, np.asarray(keys, np.int64))
    values = codec.decode(got.embedding, DType.FLOAT32, 4)[:, 0]
    return [float(v) if f else None for v, f in zip(values, got.found, strict=True)]


@pytest.fixture(params=fs_state.SURFACES)
def state(request, tmp_path, monkeypatch) -> str:
    path = str(tmp_path / "featurestore.db")
    fs_state.use_test_sdk(monkeypatch, path, surface=request.param)
    return path


def test_two_runs_keep_their_own_rows_and_serving_reads_the_promoted_runs_version(tmp_path, state):
    url = _url(tmp_path)
    with open_store(url, run="one") as one, open_store(url, run="two") as two:
        one.provision(SPEC)
        one.registry.register_generation("one", 2)
        _write(one, [1, 2, 3], 1.0, generation=2)  # a higher version than anything of two
        two.provision(SPEC)
        two.registry.register_generation("two", 1)
        _write(two, [2, 3, 4], 2.0, generation=1)
        assert _values(one, [1, 2, 3, 4]) == [1.0, 1.0, 1.0, None]
        assert _values(two, [1, 2, 3, 4]) == [None, 2.0, 2.0, 2.0]
        assert one.version_of("one") == fs_state.VERSION
        assert two.version_of("two") == fs_state.version_of("two")
        stored = fs_state.stored_rows(state, fs_state.PROJECT, fs_state.VIEW, "deltarec@two")
        assert sorted(k for _, k in stored) == [2, 3, 4]
    with open_store(url) as serving:
        assert serving.registry.serving_runs() == {T: "one"}  # the first run to provision
        assert serving.serving_versions() == {T: fs_state.VERSION}
        assert _values(serving, [2, 4]) == [1.0, None]
        with pytest.raises(BadInputError, match="needs a run"):
            _write(serving, [9], 9.0, mark=False)
        serving.registry.set_serving("two", 1, 1)
        assert serving.registry.serving_runs() == {T: "two"}
        assert serving.serving_versions() == {T: "deltarec@two"}
        assert _values(serving, [2, 4]) == [2.0, 2.0]
    with open_store(url, run="two") as two, pytest.raises(BadInputError, match="run 'one'"):
        two.write(
            T, np.array([5], np.int64), codec.encode(np.ones((1, 4), np.float32), DType.FLOAT32),
            np.zeros(1, np.int8), np.full(1, make_version(1, 2), np.int64),
            mark=ProgressMark("one", 1, 2, T, 0, 1, True),  # a mark of another run
        )  # fmt: skip


def test_rows_written_under_the_single_default_version_stay_the_first_runs(tmp_path, state):
    import feature_store_py

    url = _url(tmp_path)
    with open_store(url, run="old") as old:  # the view and a registered run, as before
        old.provision(SPEC)
        old.registry.register_generation("old", 1)
    client = feature_store_py.FeatureStoreClient(
        access_key_id="ak", access_key_secret="sk", region="cn-hangzhou"
    )
    view = client.get_project(fs_state.PROJECT).get_dynamic_embedding_feature_view(fs_state.VIEW)
    row = {"embedding_name": T, "key_id": 7, "embedding": [3.0] * 4}
    view.write_features(data=[row], version=fs_state.VERSION, write_mode="MERGE", ts=1)
    view.write_flush()
    with open_store(url, run="new") as new:  # a new run arrives first
        new.provision(SPEC)
        assert new.version_of("new") == "deltarec@new"
        assert new.version_of("old") == fs_state.VERSION
        assert _values(new, [7]) == [None]
    with open_store(url, run="old") as old:
        assert _values(old, [7]) == [3.0]


def test_a_legacy_untyped_view_takes_float_rows_and_refuses_int8_saying_why(tmp_path, monkeypatch):
    fs_state.use_test_sdk(monkeypatch, str(tmp_path / "featurestore.db"), surface="untyped")
    with open_store(_url(tmp_path), run="r") as store:
        store.provision(SPEC)
        _write(store, [1, 2], 4.0)  # no Arrow writes in this SDK: write_features
        assert _values(store, [1, 2]) == [4.0, 4.0]
    tzrec = _url(tmp_path, contract="tzrec", registry=f"sqlite:///{tmp_path}/r2.db")
    with (
        pytest.raises(ViewMismatchError, match=r"legacy float view.*2\.2\.8.*ARRAY<UINT8>"),
        open_store(tzrec, run="r") as store,
    ):
        store.provision(INT8)


@pytest.fixture(params=["sqlite", "postgres"])
def registry(request, tmp_path) -> str:
    """A registry URL: SQLite (the default's kind) or PostgreSQL (a real server), URL-quoted."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/reg.db"
    pg = request.getfixturevalue("postgres_server")
    schema = f"fs{uuid.uuid4().hex[:10]}"
    return urllib.parse.quote(f"{pg.url}?schema={schema}&connect_timeout=5", safe="")


def test_a_writer_superseded_while_writing_finishes_that_write_and_then_writes_nothing(
    tmp_path, state, registry
):
    url = _url(tmp_path, registry=registry)
    old, new = open_store(url, run="ctr"), open_store(url, run="ctr")
    try:
        old.provision(SPEC)
        old.registry.register_generation("ctr", 1)
        _write(old, [1, 2], 1.0, generation=1)
        fs_state.inject_fault(state, "write_features", 1, "hang 1.5")  # the next write is slow
        seen: list[bool] = []

        def register() -> None:
            new.registry.register_generation("ctr", 2)
            # registering waited for the write in flight: the write's transaction ends after
            # the hang, which began after ``floor`` (the thread that wrote may not have run
            # again yet, so its own "done" is not the measure)
            seen.append(time.monotonic() >= floor + 1.5)

        writer = threading.Thread(target=_write, args=(old, [1, 2], 1.5), kwargs={"generation": 1})
        floor = time.monotonic()
        writer.start()
        for _ in range(600):  # until the slow write is inside the SDK
            now = time.monotonic()
            if _hanging(state) or not writer.is_alive():
                break
            floor = now  # the hang had not begun when this look began
            time.sleep(0.01)
        assert writer.is_alive()
        racer = threading.Thread(target=register)
        racer.start()
        writer.join(30)
        racer.join(30)
        assert seen == [True]
        _write(new, [2, 3], 2.0, generation=2)
        with pytest.raises(StaleGenerationError, match="generation 1"):
            _write(old, [1, 2, 3], 9.0, generation=1)
        with pytest.raises(StaleGenerationError):  # a write without a mark is fenced too
            _write(old, [3], 9.0, generation=1, mark=False)
        assert _values(new, [1, 2, 3]) == [1.5, 2.0, 2.0]
        marks = new.registry.progress("ctr", 1)
        assert [m.rows for m in marks] == [2]  # the refused writes recorded no mark
    finally:
        old.close()
        new.close()


def _hanging(state: str) -> bool:
    """Whether the injected ``hang`` of ``write_features`` has been taken (the write is in)."""
    with fs_state.connect(state) as conn:
        row = conn.execute("SELECT remaining FROM faults WHERE op = 'write_features'").fetchone()
    return row is not None and row[0] == 0


def test_every_command_names_a_missing_sdk_and_a_failed_provision_leaves_no_registry(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "feature_store_py", None)  # not installed
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", SPEC, world_size=1)
    write_dump(root, info, 1, {T: {0: random_rows(range(5), SPEC[T], 1)}})
    url = "featurestore://proj/emb?region=cn-hangzhou"
    with pytest.raises(ConfigError, match="feature_store_py"):
        open_store(url, root.uri, run="r")
    loc = ["--artifacts", root.uri, "--run", "r", "--store", url]
    for command in (
        ["provision"],
        ["publish"],
        ["verify", "--all"],
        ["promote", "--generation", "1"],
    ):
        capsys.readouterr()
        assert main([*command, *loc]) == 2, command
        err = capsys.readouterr().err
        assert "feature_store_py" in err and "not provisioned" not in err, (command, err)
        assert "Traceback" not in err
    assert not (tmp_path / "art" / "_registry").exists()
    train = ["train", "--artifacts", str(tmp_path / "art2"), "--run", "r", "--store", url]
    assert main([*train, "--steps", "2"]) == 2  # before any rank starts
    err = capsys.readouterr().err
    assert err.count("feature_store_py") == 1 and "Traceback" not in err
    monkeypatch.delitem(sys.modules, "feature_store_py")
    fs_state.use_test_sdk(monkeypatch, str(tmp_path / "featurestore.db"))
    missing = url.replace("//proj/", "//no_such_project/")
    assert main(["provision", *loc[:-1], missing]) == 2
    assert "no_such_project" in capsys.readouterr().err
    assert not (tmp_path / "art" / "_registry").exists()


def test_staged_mode_on_featurestore_is_refused_once_where_the_mode_is_chosen(tmp_path, capsys):
    from deltarec.orchestrate.params import parse_params

    url = "featurestore://proj/emb?region=cn-hangzhou"
    why = "publish mode 'staged' needs staging views, which PAI FeatureStore does not have"
    with pytest.raises(ConfigError, match=f"pipeline parameters: {why}"):
        parse_params(run_name="r", artifact_root=str(tmp_path), store_url=url,
                     publish_mode="staged")  # fmt: skip
    assert parse_params(run_name="r", artifact_root=str(tmp_path), store_url=url).publish_mode == (
        "direct"
    )
    argv = ["train", "--artifacts", str(tmp_path / "art"), "--run", "r", "--store", url,
            "--publish-mode", "staged", "--steps", "2"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count(why) == 1 and "Traceback" not in err
    assert not (tmp_path / "art").exists()  # refused before anything started


def test_a_registry_is_one_views_alone_another_view_or_a_sql_store_on_it_is_refused(
    tmp_path, state, registry
):
    """Two views, or a view and a SQL store serving its own views, in one registry would share
    runs, marks and serving: the first claims the registry and the others are refused at open,
    naming what holds it; the first serves exactly as before."""
    url = _url(tmp_path, registry=registry)
    with open_store(url, run="ctr") as store:
        store.provision(SPEC)
        store.registry.register_generation("ctr", 1)
        _write(store, [1, 2], 1.0)
    held = rf"holds the registry of featurestore://{fs_state.PROJECT}/{fs_state.VIEW}\?region="
    other = url.replace(f"/{fs_state.VIEW}?", "/other?")
    with pytest.raises(
        BadInputError, match=held + rf".*not of featurestore://{fs_state.PROJECT}/o"
    ):
        _provision(other)
    sql = urllib.parse.unquote(registry)
    with pytest.raises(BadInputError, match=held + r".*not of a store of its own views \(prefix"):
        open_store(sql, run="ctr")
    with open_store(url) as serving:  # nothing of the first view's registry changed
        assert _values(serving, [1, 2, 3]) == [1.0, 1.0, None]
        assert [m.rows for m in serving.registry.progress("ctr", 1)] == [2]
        assert serving.registry.serving_runs() == {T: "ctr"}
        with serving.registry.transaction() as cur:  # as a registry from before the claim
            serving.registry.execute(cur, "DELETE FROM deltarec_featurestore_view")
    with pytest.raises(BadInputError, match="holds the registry of a FeatureStore view, not of a"):
        open_store(sql, run="ctr")
    with open_store(url) as serving:  # the view claims it again
        assert _values(serving, [1, 2, 3]) == [1.0, 1.0, None]
    with pytest.raises(BadInputError, match=held):
        _provision(other)


def test_a_feature_view_is_refused_a_registry_a_sql_store_serves_its_own_views_from(
    tmp_path, state, registry
):
    sql = urllib.parse.unquote(registry)
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "sql", SPEC, world_size=1)
    write_dump(root, info, 0, {T: {0: random_rows(range(5), SPEC[T], 1)}})
    assert main(["publish", "--artifacts", root.uri, "--run", "sql", "--store", sql]) == 0
    with open_store(sql) as serving:
        before = serving.read(T, np.arange(6, dtype=np.int64))
    with pytest.raises(BadInputError, match=r"a SQL store's own views \(prefix 'emb_'\), not of "):
        _provision(_url(tmp_path, registry=registry))
    with open_store(sql) as serving:  # the SQL store serves as before
        after = serving.read(T, np.arange(6, dtype=np.int64))
        assert before.found.tolist() == [True] * 5 + [False]
        np.testing.assert_array_equal(after.embedding, before.embedding)
        np.testing.assert_array_equal(after.versions, before.versions)


def _provision(url: str) -> None:
    with open_store(url, run="ctr") as store:
        store.provision(SPEC)
