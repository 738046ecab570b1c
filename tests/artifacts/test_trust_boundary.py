"""The artifact root is a trust boundary (SPEC §3): a manifest names only its own shards.

Whoever writes a manifest must not make a reader (publish, verify, the replica) open a file
outside the dump it describes, another table's or rank's shard, a device or a FIFO, nor learn the
digest of a file it could not read itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os

import numpy as np
import pytest
from tests._helpers.artifacts import Lineage, sqlite_url_in

from deltarec.artifacts import ArtifactRoot, DType, check_shard, read_shard
from deltarec.artifacts.wholeshard import read_whole_shard
from deltarec.cli import main
from deltarec.errors import ArtifactError, ChecksumError, InvalidIdentifierError
from deltarec.ids import validate_table_id


def _lineage(tmp_path) -> tuple[Lineage, int, str]:
    lin = Lineage.under(tmp_path)
    g = lin.first_generation()
    return lin, g, lin.root.dump_dir(lin.run, g, 1)


def _rewrite_manifest(dump_dir: str, edit) -> None:
    path = os.path.join(dump_dir, "MANIFEST.json")
    with open(path) as f:
        obj = json.load(f)
    edit(obj)
    with open(path, "w") as f:
        json.dump(obj, f)


@pytest.mark.parametrize(
    "bad_path",
    [
        "../../../../secret.txt",
        "/etc/passwd",
        "sparse.zch.ad_id/rank-00000.parquet",  # another table's shard
        "sparse.ebc.user_id/rank-00001.parquet",  # another rank's shard
        "sparse.ebc.user_id/./rank-00000.parquet",
        "sparse.ebc.user_id/../../../other-run/gen-000001/dump-000001/x/rank-00000.parquet",
    ],
)
def test_a_manifest_naming_any_path_but_its_own_shards_is_refused_naming_the_manifest(
    tmp_path, bad_path
):
    lin, g, ddir = _lineage(tmp_path)

    def edit(obj):
        for s in obj["shards"]:
            if s["table"] == lin.T_EMB:
                s["path"] = bad_path

    _rewrite_manifest(ddir, edit)
    with pytest.raises(ArtifactError) as e:
        lin.root.read_manifest(lin.run, g, 1)
    assert "MANIFEST.json" in str(e.value) and "may name only its own shards" in str(e.value)


def test_a_manifest_with_a_rank_beyond_its_world_or_a_shard_listed_twice_is_refused(tmp_path):
    lin, g, ddir = _lineage(tmp_path)
    _rewrite_manifest(ddir, lambda o: o["shards"].append(dict(o["shards"][0])))
    with pytest.raises(ArtifactError, match="listed twice"):
        lin.root.read_manifest(lin.run, g, 1)

    def beyond(obj):
        s = obj["shards"][0]
        s["rank"] = 3
        s["path"] = f"{s['table']}/rank-00003.parquet"

    _rewrite_manifest(ddir, beyond)
    with pytest.raises(ArtifactError, match="rank 3 of world size 1"):
        lin.root.read_manifest(lin.run, g, 1)


@pytest.mark.parametrize("name", [".", ".."])
def test_dot_and_dot_dot_are_not_table_ids(name):
    with pytest.raises(InvalidIdentifierError):
        validate_table_id(name)


def _emb_shard(lin: Lineage, g: int):
    m = lin.root.read_manifest(lin.run, g, 1)
    return next(s for s in m.shards if s.table == lin.T_EMB)


@pytest.mark.parametrize("target", ["/dev/zero", "secret"])
def test_a_shard_that_is_a_link_is_not_read(tmp_path, target):
    lin, g, ddir = _lineage(tmp_path)
    shard = _emb_shard(lin, g)
    path = os.path.join(ddir, shard.path)
    if target == "secret":
        target = str(tmp_path / "secret.txt")
        with open(target, "w") as f:
            f.write("top secret")
        os.chmod(target, 0o600)
    os.replace(path, path + ".orig")
    os.symlink(target, path)
    for read in (
        check_shard,
        lambda r, d, s: read_shard(r, d, s, DType.FLOAT32),
        lambda r, d, s: read_whole_shard(r, d, s, DType.FLOAT32),
    ):
        with pytest.raises(ArtifactError, match="not a regular file"):
            read(lin.root, ddir, shard)


def test_a_shard_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    lin, g, ddir = _lineage(tmp_path)
    shard = _emb_shard(lin, g)
    path = os.path.join(ddir, shard.path)
    os.remove(path)
    os.mkfifo(path)
    with pytest.raises(ArtifactError, match="not a regular file"):
        check_shard(lin.root, ddir, shard)
    with pytest.raises(ArtifactError, match="not a regular file"):
        read_whole_shard(lin.root, ddir, shard, DType.FLOAT32)


def test_a_table_folder_linked_to_another_runs_dump_is_not_read(tmp_path):
    lin, g, ddir = _lineage(tmp_path)
    other = Lineage(ArtifactRoot(str(tmp_path / "other")), run="theirs")
    og = other.first_generation()
    odir = other.root.dump_dir(other.run, og, 1)
    shard = _emb_shard(lin, g)
    table_dir = os.path.join(ddir, lin.T_EMB)
    os.rename(table_dir, table_dir + ".orig")
    os.symlink(os.path.join(odir, lin.T_EMB), table_dir)
    with pytest.raises(ArtifactError, match="outside its directory"):
        read_shard(lin.root, ddir, shard, DType.FLOAT32)
    with pytest.raises(ArtifactError, match="outside its directory"):
        read_whole_shard(lin.root, ddir, shard, DType.FLOAT32)


def test_a_shard_not_matching_its_manifest_is_reported_without_its_real_digest(tmp_path):
    lin, g, ddir = _lineage(tmp_path)
    shard = _emb_shard(lin, g)
    path = os.path.join(ddir, shard.path)
    data = b"x" * 1234
    with open(path, "wb") as f:
        f.write(data)
    real = hashlib.sha256(data).hexdigest()
    for read in (check_shard, lambda r, d, s: read_whole_shard(r, d, s, DType.FLOAT32)):
        with pytest.raises(ChecksumError) as e:
            read(lin.root, ddir, shard)
        assert real not in str(e.value) and "1234" not in str(e.value)
        assert shard.sha256 in str(e.value)


def test_a_shard_read_whole_is_decoded_from_the_bytes_checked_and_refused_when_longer(tmp_path):
    lin, g, ddir = _lineage(tmp_path)
    shard = _emb_shard(lin, g)
    whole = read_whole_shard(lin.root, ddir, shard, DType.FLOAT32)
    streamed = read_shard(lin.root, ddir, shard, DType.FLOAT32)
    np.testing.assert_array_equal(whole.keys, streamed.keys)
    np.testing.assert_array_equal(whole.embedding, streamed.embedding)
    with open(os.path.join(ddir, shard.path), "ab") as f:
        f.write(b"\0")  # one byte more than the manifest says: refused, not read past it
    with pytest.raises(ChecksumError, match=shard.sha256):
        read_whole_shard(lin.root, ddir, shard, DType.FLOAT32)


def test_publish_and_verify_refuse_a_manifest_pointing_outside_its_dump(tmp_path, capsys):
    lin, _, ddir = _lineage(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("password=hunter2\n")
    os.chmod(secret, 0o600)

    def edit(obj):
        obj["shards"][0]["path"] = os.path.relpath(secret, ddir)

    _rewrite_manifest(ddir, edit)
    store = sqlite_url_in(tmp_path)
    common = ["--artifacts", lin.root.path, "--run", lin.run, "--store", store]
    assert main(["provision", *common]) == 0
    capsys.readouterr()
    # publish refuses the input (2); verify reports a failed check (1) naming the manifest
    for cmd, code in ((["publish"], 2), (["verify", "--all"], 1)):
        assert main([*cmd, *common]) == code, cmd
        out = capsys.readouterr()
        text = out.out + out.err
        assert "MANIFEST.json" in text and "may name only its own shards" in text, text
        assert "Traceback" not in text and "hunter2" not in text


def _verify_all(lin: Lineage, tmp_path) -> tuple[int, str]:
    """``verify --all`` of the lineage against a store it was never published to."""
    store = sqlite_url_in(tmp_path)
    common = ["--artifacts", lin.root.path, "--run", lin.run, "--store", store]
    assert main(["provision", *common]) == 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["verify", "--all", "--no-record", *common])
    return code, out.getvalue()


@pytest.mark.parametrize("target", ["/dev/zero", "secret"])
def test_verify_reads_no_shard_that_is_a_link_and_names_it(tmp_path, target):
    lin, g, ddir = _lineage(tmp_path)
    shard = _emb_shard(lin, g)
    path = os.path.join(ddir, shard.path)
    if target == "secret":
        target = str(tmp_path / "secret.txt")
        with open(target, "w") as f:
            f.write("password=hunter2\n")
        os.chmod(target, 0o600)
    os.replace(path, path + ".orig")
    os.symlink(target, path)
    code, text = _verify_all(lin, tmp_path)
    assert code == 1 and "not a regular file" in text and shard.path in text, text
    assert "Traceback" not in text and "hunter2" not in text


def test_verify_decodes_no_shard_whose_bytes_differ_from_its_manifest(tmp_path):
    # another rank's valid parquet in place of this shard: the digest refuses it before its
    # keys are decoded, so none of its rows is taken for what the store must hold
    lin, g, ddir = _lineage(tmp_path)
    shard = _emb_shard(lin, g)
    other = next(
        s
        for s in lin.root.read_manifest(lin.run, g, 1).shards
        if s.path != shard.path and s.bytes != shard.bytes
    )
    with open(os.path.join(ddir, other.path), "rb") as f:
        data = f.read()
    with open(os.path.join(ddir, shard.path), "wb") as f:
        f.write(data)
    code, text = _verify_all(lin, tmp_path)
    assert code == 1 and shard.sha256 in text and shard.path in text, text
    assert hashlib.sha256(data).hexdigest() not in text and "Traceback" not in text
