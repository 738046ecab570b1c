"""Verification records are bound to the store's identity, never to its URL as typed.

A record made for one store must never open another store's promote gate: the same relative
SQLite URL in another directory, a copy of the store elsewhere, a store made anew at the same
place, another schema or key prefix on the same server.
"""

import os
import pathlib
import shutil

import numpy as np
import pytest
from tests._helpers.artifacts import RUN

from deltarec.errors import ArtifactError
from deltarec.ids import make_version
from deltarec.promote import NotVerifiedError, promote
from deltarec.stores import open_store
from deltarec.verify import VerifyOptions, read_record, verify, write_record
from deltarec.verify.records import store_id

from .conftest import base_generation


def _record(lineage, store, generation):
    result = verify(
        lineage.root,
        lineage.run,
        store,
        generation=generation,
        store_url=store.describe(),
        options=VerifyOptions(sample=None),
    )
    assert result.passed, result.failure_summary()
    write_record(lineage.root, result)
    return result


def test_a_relative_sqlite_url_verified_in_one_directory_opens_no_gate_in_another(
    lineage, tmp_path, monkeypatch
):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    with open_store("sqlite:///store.db", run=RUN) as store:
        g = base_generation(lineage, store)
        _record(lineage, store, g)
    monkeypatch.chdir(tmp_path / "b")
    with open_store("sqlite:///store.db", run=RUN) as other:
        lineage.publish(other, g)
        other.delete(lineage.T_EMB, np.array([5]), make_version(g, 1))
        assert other.describe() == "sqlite:///store.db"  # the URL as typed is the same
        assert read_record(lineage.root, lineage.run, g, 1, other) is None
        with pytest.raises(NotVerifiedError, match="never verified"):
            promote(lineage.root, lineage.run, other, g)
    # the verified file itself, named by its absolute path, is the same store
    with open_store(f"sqlite:///{tmp_path / 'a' / 'store.db'}", run=RUN) as same:
        assert promote(lineage.root, lineage.run, same, g).verified


def test_a_copy_of_a_verified_sqlite_store_elsewhere_opens_no_gate(lineage, sqlite_url, tmp_path):
    with open_store(sqlite_url, run=RUN) as store:
        g = base_generation(lineage, store)
        _record(lineage, store, g)
    original = sqlite_url.removeprefix("sqlite:///")
    copy = tmp_path / "copy" / "store.db"
    copy.parent.mkdir()
    shutil.copy(original, copy)
    with open_store(f"sqlite:///{copy}", run=RUN) as other:
        assert other.registry.store_uuid() is not None
        with pytest.raises(NotVerifiedError):
            promote(lineage.root, lineage.run, other, g)


def test_a_store_made_anew_at_the_verified_place_opens_no_gate(lineage, sqlite_url):
    with open_store(sqlite_url, run=RUN) as store:
        g = base_generation(lineage, store)
        _record(lineage, store, g)
        before = store_id(store)
    os.remove(sqlite_url.removeprefix("sqlite:///"))
    with open_store(sqlite_url, run=RUN) as anew:
        lineage.publish(anew, g)
        assert store_id(anew) != before
        with pytest.raises(NotVerifiedError):
            promote(lineage.root, lineage.run, anew, g)


@pytest.mark.parametrize("backend", ["postgres", "redis"])
def test_another_schema_or_prefix_on_the_same_server_opens_no_gate(lineage, request, backend):
    server = request.getfixturevalue(f"{backend}_server")
    option = "schema" if backend == "postgres" else "prefix"
    tail = "" if backend == "postgres" else ":"
    urls = [f"{server.url}?{option}=idt{i}{os.getpid()}{tail}" for i in range(2)]
    with open_store(urls[0], run=RUN) as store:
        g = base_generation(lineage, store)
        _record(lineage, store, g)
    with open_store(urls[1], run=RUN) as other:
        lineage.publish(other, g)
        assert other.describe() == store.describe()  # the same URL without its options
        with pytest.raises(NotVerifiedError):
            promote(lineage.root, lineage.run, other, g)
    with open_store(urls[0], run=RUN) as same:
        assert promote(lineage.root, lineage.run, same, g).verified


def test_a_record_made_for_another_store_under_its_name_is_refused(lineage, sqlite_url, tmp_path):
    with open_store(sqlite_url, run=RUN) as store:
        g = base_generation(lineage, store)
        path = write_record(lineage.root, _record(lineage, store, g))
        verified_id = store_id(store)
    with open_store(f"sqlite:///{tmp_path / 'other.db'}", run=RUN) as other:
        lineage.publish(other, g)
        # a record copied under the other store's name still names the store it was made for
        renamed = path.replace(verified_id, store_id(other))
        lineage.root.write_bytes_atomic(renamed, pathlib.Path(path).read_bytes())
        with pytest.raises(ArtifactError, match="store id"):
            promote(lineage.root, lineage.run, other, g)
