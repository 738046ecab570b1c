"""Store URLs, configs and view names (SPEC §5)."""

from __future__ import annotations

import numpy as np
import pytest

from deltarec.artifacts import codec
from deltarec.artifacts.types import DType, TableSpec
from deltarec.errors import BadInputError, ConfigError, InvalidIdentifierError
from deltarec.ids import make_version
from deltarec.stores import (
    PostgresConfig,
    RedisConfig,
    SqliteConfig,
    open_store,
    parse_config,
    parse_store_url,
    redact_url,
    view_name,
)
from deltarec.stores.naming import view_names


def test_urls_parse_into_backend_configs():
    assert parse_store_url("sqlite:///rel/store.db") == SqliteConfig(path="rel/store.db")
    assert parse_store_url("sqlite:////abs/store.db").path == "/abs/store.db"
    pg = parse_store_url("postgresql://ml@db.local:6432/feat?layout=float4[]&prefix=e_")
    assert isinstance(pg, PostgresConfig)
    assert (pg.user, pg.host, pg.port, pg.dbname, pg.layout, pg.prefix) == (
        "ml",
        "db.local",
        6432,
        "feat",
        "float4[]",
        "e_",
    )
    rd = parse_store_url("redis://cache:6380/3")
    assert isinstance(rd, RedisConfig) and (rd.host, rd.port, rd.db) == ("cache", 6380, 3)
    fs = parse_store_url("featurestore://proj/emb?region=cn-hangzhou")
    assert (fs.type, fs.project, fs.view, fs.region) == (
        "featurestore",
        "proj",
        "emb",
        "cn-hangzhou",
    )
    assert parse_config({"type": "sqlite", "path": "x.db"}) == SqliteConfig(path="x.db")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://h/db", "unknown scheme 'mysql'"),
        ("store.db", "is not a URL"),
        ("sqlite:///x.db?colour=red", "unknown option 'colour'"),
        ("postgresql://h/db?layout=vector", "layout"),
        ("postgresql://h/db?prefix=Bad-Prefix", "invalid view prefix"),
        ("postgresql://h/db?schema=drop;table", "invalid schema name"),
        ("redis://h:1/x", "not a number"),
        ("redis://:pw@h:1/0", "REDIS_PASSWORD"),
        ("featurestore://proj/emb", "region"),
    ],
)
def test_bad_urls_are_rejected_naming_the_problem(url, message):
    with pytest.raises(ConfigError, match=message):
        parse_store_url(url)


def test_passwords_never_appear_in_config_text():
    url = "postgresql://ml:s3cret@h:5432/db"
    config = parse_store_url(url)
    assert "s3cret" not in repr(config) and "s3cret" not in redact_url(url)
    assert "s3cret" not in str(config.model_dump())


def test_view_names_follow_the_spec_and_long_ones_get_a_hash():
    assert view_name("sparse.ebc.user_id") == "emb_sparse_ebc_user_id"
    assert view_name("Sparse.EBC-x.y", prefix="p_") == "p_sparse_ebc_x_y"
    long_a, long_b = "m." + "a" * 80 + ".t1", "m." + "a" * 80 + ".t2"
    na, nb = view_name(long_a), view_name(long_b)
    assert len(na) == 63 and len(nb) == 63 and na != nb and na[:54] == nb[:54]
    with pytest.raises(BadInputError, match="both map to the view name 'emb_a_b'"):
        view_names(["a.b", "a-b"])
    with pytest.raises(InvalidIdentifierError):
        view_name("bad table!")


@pytest.mark.parametrize("walk", [False, True], ids=["nested-loop", "merge-join"])
def test_postgres_float4_array_layout_round_trips_and_refuses_int8(
    postgres_server, monkeypatch, walk
):
    from deltarec.stores.sql import postgres as pgstore

    monkeypatch.setattr(pgstore, "_WALK_MIN_BYTES", 0 if walk else 1 << 60)
    walked: list[bool] = []
    real = pgstore.PostgresStore._walks
    monkeypatch.setattr(
        pgstore.PostgresStore,
        "_walks",
        staticmethod(lambda *args: walked.append(real(*args)) or walked[-1]),
    )
    schema = "arrays_walk" if walk else "arrays"
    url = f"{postgres_server.url}?schema={schema}&layout=float4[]"
    with open_store(url, run="r") as store:
        store.provision({"t.f32": TableSpec(dim=3), "t.f16": TableSpec(dim=3, dtype=DType.FLOAT16)})
        for table, dtype in (("t.f32", DType.FLOAT32), ("t.f16", DType.FLOAT16)):
            emb = codec.encode(np.array([[1.5, -2.0, 3.25], [0.0, 1.0, 2.0]], np.float32), dtype)
            keys = np.array([7, 8], np.int64)
            store.write(table, keys, emb, np.zeros(2, np.int8), np.full(2, make_version(1, 1)))
            got = store.read(table, keys)
            np.testing.assert_array_equal(got.embedding, emb)
            [(scanned, rows)] = list(store.scan_rows(table))
            assert scanned.tolist() == [7, 8]
            np.testing.assert_array_equal(rows.embedding, emb)
            # keys 7 and 8 are there now: this write goes through the batch table and merge
            newer = emb[::-1].copy()
            store.write(table, keys, newer, np.zeros(2, np.int8), np.full(2, make_version(1, 2)))
            np.testing.assert_array_equal(store.read(table, keys).embedding, newer)
        assert walked == [walk, walk]  # the two merges
        with pytest.raises(ConfigError, match="float4"):
            store.provision({"t.q": TableSpec(dim=3, dtype=DType.INT8_ROWWISE)})
    import psycopg

    with psycopg.connect(postgres_server.url) as conn:
        row = conn.execute(f"SELECT embedding FROM {schema}.emb_t_f32 WHERE key = 8").fetchone()
    assert row == ([1.5, -2.0, 3.25],)  # a plain query sees float4[] values
