"""``deltarec provision`` and ``deltarec publish`` on a SQLite store."""

from __future__ import annotations

import json

import numpy as np

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.types import DumpKind, TableSpec
from deltarec.cli import main
from deltarec.stores import open_store
from deltarec.testing.dumps import new_generation, random_rows, write_dump

T = "sparse.ebc.user_id"
TABLES = {T: TableSpec(dim=4, num_embeddings=100)}


def _args(root, url, *extra):
    return ["--artifacts", root.uri, "--run", "ctr", "--store", url, *extra]


def test_provision_then_publish_only_what_the_store_lacks(tmp_path, capsys):
    root = ArtifactRoot(str(tmp_path / "art"))
    url = f"sqlite:///{tmp_path / 'store.db'}"
    info = new_generation(root, "ctr", TABLES, world_size=2)
    snap = {T: {r: random_rows(range(r, 20, 2), TABLES[T], seed=r) for r in range(2)}}
    write_dump(root, info, 0, snap, kind=DumpKind.SNAPSHOT)
    delta = {T: {0: random_rows([4], TABLES[T], seed=9)}}
    write_dump(root, info, 1, delta)

    assert main(["provision", *_args(root, url), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["views"][T] == {
        "view": "emb_ctr__sparse_ebc_user_id",
        "dim": 4,
        "dtype": "float32",
        "staging_view": None,
    }
    assert main(["provision", *_args(root, url)]) == 0  # idempotent

    assert main(["publish", *_args(root, url), "--json", str(tmp_path / "published.json")]) == 0
    out = json.loads((tmp_path / "published.json").read_text())
    assert out["rows"] == 21
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("dump ")]
    assert [x.split(":")[0] for x in lines] == ["dump 0 ranks 0-1", "dump 1 ranks 0-1"]
    assert "20 rows" in lines[0] and "1 rows" in lines[1]  # one line a dump, its parts summed
    parts = [(p["seq"], p["rank"], p["rows"]) for p in out["parts"]]
    assert parts == [(0, 0, 10), (0, 1, 10), (1, 0, 1), (1, 1, 0)]  # rank 1 had no row in dump 1
    with open_store(url) as store:
        got = store.read(T, np.array([4, 5]))
        np.testing.assert_array_equal(got.embedding[0], delta[T][0].embedding[0])
        np.testing.assert_array_equal(got.embedding[1], snap[T][1].embedding[2])
        assert store.generations("ctr") == [1]

    assert main(["publish", *_args(root, url)]) == 0
    assert "nothing pending" in capsys.readouterr().err


def test_provision_with_another_dim_fails_naming_both(tmp_path, capsys):
    root = ArtifactRoot(str(tmp_path / "art"))
    url = f"sqlite:///{tmp_path / 'store.db'}"
    new_generation(root, "ctr", TABLES, world_size=1)
    assert main(["provision", *_args(root, url)]) == 0
    new_generation(root, "ctr", {T: TableSpec(dim=8)}, world_size=1)
    assert main(["provision", *_args(root, url)]) == 2
    err = capsys.readouterr().err
    assert "emb_ctr__sparse_ebc_user_id" in err and "dim=4" in err and "dim=8" in err


def test_publish_rejects_bad_rows_and_bad_flags_with_exit_2(tmp_path, capsys):
    root = ArtifactRoot(str(tmp_path / "art"))
    url = f"sqlite:///{tmp_path / 'store.db'}"
    info = new_generation(root, "ctr", TABLES, world_size=1)
    bad = random_rows([1, 2, 3], TABLES[T])
    bad.embedding[1, 0] = np.nan
    write_dump(root, info, 1, {T: {0: bad}})
    assert main(["publish", *_args(root, url)]) == 2
    err = capsys.readouterr().err
    assert "'sparse.ebc.user_id' key 2" in err and "dump 1" in err and "NaN" in err
    assert main(["publish", *_args(root, url), "--ranks", "x"]) == 2
    assert main(["publish", *_args(root, "mysql://h/db")]) == 2
    assert "unknown scheme" in capsys.readouterr().err


def test_provision_and_publish_flags_are_frozen():
    import argparse

    from deltarec.cli import cmd_provision, cmd_publish

    def flags(module):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        return {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}

    spec = {"--artifacts", "--run", "--store", "--generation"}  # SPEC §7a
    assert flags(cmd_provision) == spec | {"--staged", "--json"}
    assert flags(cmd_publish) == spec | {
        "--mode",
        "--ranks",
        "--batch-mb",
        "--retry-deadline",
        "--read-p99-ms",
        "--no-yield-cpu",
        "--metrics-port",
        "--json",
    }
