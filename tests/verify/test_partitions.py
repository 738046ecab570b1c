"""Verify fanned out over partitions (tables x key ranges) and combined by one gate."""

import numpy as np
import pytest

from deltarec.errors import BadInputError
from deltarec.ids import make_version
from deltarec.verify import VerifyOptions, verify
from deltarec.verify.partition import Partition, combine, partition_json, result_from_json

from .conftest import base_generation, tamper


def _base(lineage, store):
    """Generation 1 of emb keys 0..199, every 7th of them updated by the delta."""
    return base_generation(lineage, store, np.arange(200), np.arange(0, 200, 7))


def _keyed(result):
    """Everything a result says per table, key by key for the keys that did not MATCH."""
    return {
        name: (
            t.checked,
            t.store_keys_scanned,
            t.expected_keys,
            t.expected_present,
            {c.value: n for c, n in t.counts.items()},
            sorted((m.key, m.row_class.value, m.reason) for m in t.mismatches),
        )
        for name, t in result.tables.items()
    }


def _parts(lineage, store, n, **kw):
    return [
        verify(
            lineage.root,
            lineage.run,
            store,
            options=VerifyOptions(sample=None, partition=Partition(i, n), **kw),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("tampered", [False, True])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_combined_partitions_equal_a_single_verify_all_key_for_key(lineage, store, n, tampered):
    g = _base(lineage, store)
    if tampered:
        tamper(lineage, store, g, changed=3, deleted=120, stray=5000)
    whole = verify(
        lineage.root, lineage.run, store, options=VerifyOptions(sample=None, max_mismatches=100)
    )
    combined = combine(_parts(lineage, store, n, max_mismatches=100), max_mismatches=100)
    assert _keyed(combined) == _keyed(whole)
    assert combined.passed == whole.passed == (not tampered)
    assert combined.shards_checked == whole.shards_checked == 4
    assert [(d.seq, d.live_rows) for d in combined.dumps] == [
        (d.seq, d.live_rows) for d in whole.dumps
    ]
    assert combined.failure_summary() == whole.failure_summary()


def test_a_tampered_key_fails_its_partition_and_the_gate_whichever_partition_holds_it(
    lineage, store
):
    g = _base(lineage, store)
    expected = np.arange(200)
    for key in (0, 98, 196):  # keys of the delta (version v1), in different partitions
        v1 = make_version(g, 1)
        bad = lineage.expected_row(lineage.T_EMB, np.array([key]), 9.0 + key)
        store.write(lineage.T_EMB, np.array([key]), bad, np.zeros(1, np.int8), np.array([v1]))
        parts = _parts(lineage, store, 4)
        owner = [i for i in range(4) if Partition(i, 4).mask(expected, np.array([key]))[0]]
        assert len(owner) == 1
        failed = [i for i, r in enumerate(parts) if r.tables[lineage.T_EMB].failures]
        assert failed == owner
        gate = combine(parts)
        assert not gate.passed and f"key {key}" in gate.failure_summary()
        good = lineage.expected_row(lineage.T_EMB, np.array([key]), 1.0)
        store.write(lineage.T_EMB, np.array([key]), good, np.zeros(1, np.int8), np.array([v1]))
    assert combine(_parts(lineage, store, 4)).passed


def test_every_key_belongs_to_exactly_one_partition():
    expected = np.array([-1, 3, 8, 40, 41, 90, 1000], np.int64)
    probe = np.arange(-50, 2000, dtype=np.int64)
    for n in (1, 2, 3, 7, 9):
        owners = np.stack([Partition(i, n).mask(expected, probe) for i in range(n)])
        assert (owners.sum(axis=0) == 1).all(), n
        shares = [Partition(i, n).share(list(range(10))) for i in range(n)]
        assert sorted(x for s in shares for x in s) == list(range(10))
    empty = np.array([], np.int64)
    assert Partition(0, 3).mask(empty, probe).all()
    assert not Partition(2, 3).mask(empty, probe).any()


def test_a_partition_result_travels_as_json_and_combines_to_the_same_result(lineage, store):
    g = _base(lineage, store)
    tamper(lineage, store, g, changed=3, deleted=120, stray=5000)
    parts = _parts(lineage, store, 3)
    through_json = [result_from_json(partition_json(r)) for r in parts]
    direct, travelled = combine(parts), combine(through_json)
    assert _keyed(travelled) == _keyed(direct)
    for name, t in direct.tables.items():
        assert travelled.tables[name].live_by_version == t.live_by_version
    assert [d.live_rows for d in travelled.dumps] == [d.live_rows for d in direct.dumps]


def test_the_gate_refuses_partitions_that_do_not_cover_one_verification(lineage, store):
    _base(lineage, store)
    parts = _parts(lineage, store, 3)
    with pytest.raises(BadInputError, match=r"missing \[1\]"):
        combine([parts[0], parts[2]])
    with pytest.raises(BadInputError, match=r"twice \[0\]"):
        combine([parts[0], parts[0], parts[1], parts[2]])
    whole = verify(lineage.root, lineage.run, store, options=VerifyOptions(sample=None))
    with pytest.raises(BadInputError, match="not a partition"):
        combine([whole])
    other = verify(
        lineage.root, lineage.run, store, options=VerifyOptions(sample=5, partition=Partition(1, 3))
    )
    with pytest.raises(BadInputError, match=r"differ in \['mode', 'sample'\]"):
        combine([parts[0], other, parts[2]])
    with pytest.raises(BadInputError, match="no verify partition"):
        combine([])


@pytest.mark.parametrize("text", ["3/3", "-1/2", "1", "a/b", "0/0"])
def test_a_partition_that_is_not_i_of_n_is_bad_input(text):
    with pytest.raises(BadInputError, match="partition"):
        Partition.parse(text)


def test_a_partition_parses_from_i_slash_n():
    assert Partition.parse(" 2 / 8 ") == Partition(2, 8) and str(Partition(2, 8)) == "2/8"


def test_verify_partitions_from_the_command_line_combine_to_verify_all_and_allow_promote(
    lineage, sqlite_store, sqlite_url, tmp_path
):
    import json

    from deltarec.cli import main

    g = _base(lineage, sqlite_store)
    loc = ["--artifacts", lineage.root.uri, "--run", lineage.run, "--store", sqlite_url]
    paths = [tmp_path / f"part-{i}.json" for i in range(3)]
    for i, path in enumerate(paths):
        assert main(["verify", *loc, "--all", "--partition", f"{i}/3", "--json", str(path)]) == 0
    # a partition leaves no record: promote is refused until the gate combined them
    assert main(["promote", *loc, "--generation", str(g)]) == 1
    gate = tmp_path / "gate.json"
    assert main(["verify", *loc, "--combine", *map(str, paths), "--json", str(gate)]) == 0
    whole = tmp_path / "whole.json"
    assert main(["verify", *loc, "--all", "--no-record", "--json", str(whole)]) == 0
    combined, single = json.loads(gate.read_text()), json.loads(whole.read_text())
    assert combined["totals"] == single["totals"]
    for a, b in zip(combined["tables"], single["tables"], strict=True):
        assert {k: a[k] for k in ("table", "checked", "counts", "store_keys_scanned")} == {
            k: b[k] for k in ("table", "checked", "counts", "store_keys_scanned")
        }
    assert main(["promote", *loc, "--generation", str(g)]) == 0
    assert main(["verify", *loc, "--combine", str(paths[0]), str(paths[2])]) == 2
