"""End to end: a real 2-rank training run publishing to SQLite, then verify, promote, rollback.

One spawn trains generation 1 (snapshot + deltas, published while training); the checks that
tamper with the store run on a copy of the store file, so the original stays promotable. A
second spawn restores the step-6 checkpoint and trains generation 2 (published too); rolling
back to generation 1 must then make the store equal generation 1's expected state again.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
from tests._helpers.train import tiny_train_config

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.lineage import expected_state
from deltarec.promote import promote, rollback
from deltarec.stores import open_store
from deltarec.testing.multiprocess import run_on_ranks
from deltarec.train.checkpoint_info import read_checkpoints
from deltarec.verify import RowClass, VerifyOptions, verify, write_record

pytestmark = pytest.mark.multiprocess

RUN = "e2e"
STEPS, EVERY, CKPT, BATCH = 12, 4, 6, 16


def _train(rank: int, world_size: int, tmp: str, store_url: str, resume_step: int | None):
    from deltarec.dump import make_train_hook
    from deltarec.train import run_training

    config = tiny_train_config(
        tmp, steps=STEPS, batch_size=BATCH, checkpoint_every=CKPT, resume_step=resume_step
    )
    hook = make_train_hook(artifacts=f"{tmp}/art", run=RUN, every_steps=EVERY, store=store_url)
    result = run_training(config, hooks=[hook])
    return result.step


def _all_keys_equal_expected(store, root, generation, seq):
    state = expected_state(root, RUN, generation, seq)
    for table, et in state.tables.items():
        got = store.read(table, et.keys)
        assert np.array_equal(got.found, et.present), table
        assert np.array_equal(got.embedding[et.present], et.load(et.present_keys())), table
        held = np.concatenate([*store.scan_keys(table), np.empty(0, np.int64)])
        assert np.array_equal(np.sort(held), et.present_keys()), table


def test_train_verify_tamper_promote_train_again_and_roll_back(tmp_path):
    store_url = f"sqlite:///{tmp_path}/store.db"
    root = ArtifactRoot(str(tmp_path / "art"))
    assert run_on_ranks(_train, 2, args=(str(tmp_path), store_url, None)) == [STEPS, STEPS]
    assert root.list_generations(RUN) == [1]
    # deltarec gc finds the checkpoints' generation: from the marker, and (a marker of older
    # versions, without lineage) from rank 0's hook states; the restore below reads the latter.
    workdir = f"{tmp_path}/work"
    found = [(c.step, c.lineage) for c in read_checkpoints(workdir)]
    assert found == [(CKPT, ((RUN, 1),)), (STEPS, ((RUN, 1),))]
    marker = pathlib.Path(workdir, "checkpoints", f"step-{CKPT:08d}", "COMPLETE")
    meta = json.loads(marker.read_text())
    del meta["lineage"]
    marker.write_text(json.dumps(meta))
    assert [(c.step, c.lineage) for c in read_checkpoints(workdir)] == found

    with open_store(store_url, run=RUN) as store:
        first = verify(
            root, RUN, store, store_url=store.describe(), options=VerifyOptions(sample=None)
        )
        assert first.passed, first.failure_summary()
        assert first.checked > 500 and first.totals()[RowClass.MATCH] == first.checked
        assert len(first.tables) >= 6 and first.dumps[0].kind == "snapshot"
        write_record(root, first)

    # Tamper on a copy of the store: one changed row, one deleted row.
    shutil.copy(tmp_path / "store.db", tmp_path / "tampered.db")
    table = "sparse.ebc.item_id"
    state = expected_state(root, RUN, 1)
    et = state.tables[table]
    key_a, key_b = (int(k) for k in et.present_keys()[[3, 10]])
    version_a = int(et.versions[et.index_of(np.array([key_a]))[0]])
    with open_store(f"sqlite:///{tmp_path}/tampered.db", run=RUN) as bad:
        row = et.load(np.array([key_a]))
        row[0, 0] += 0.5
        bad.write(table, np.array([key_a]), row, np.zeros(1, np.int8), [version_a])
        bad.delete(table, np.array([key_b]), version_a)
        tampered = verify(root, RUN, bad, options=VerifyOptions(sample=None))
    counts = tampered.tables[table].counts
    assert not tampered.passed
    assert (counts[RowClass.DIFFERENT], counts[RowClass.MISSING]) == (1, 1)
    by_class = {m.row_class: m.key for m in tampered.tables[table].mismatches}
    assert by_class == {RowClass.MISSING: key_b, RowClass.DIFFERENT: key_a}
    assert f"key {key_a}" in tampered.failure_summary()

    # Flip a byte in a shard: a sha256 failure naming it; then put the byte back.
    shard = pathlib.Path(root.shard_path(RUN, 1, 1, table, 1))
    original = shard.read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    shard.write_bytes(bytes(flipped))
    with open_store(store_url, run=RUN) as store:
        corrupt = verify(root, RUN, store, options=VerifyOptions(sample=200))
        assert not corrupt.passed
        (failure,) = corrupt.shard_failures
        assert failure.path.endswith(f"gen-000001/dump-000001/{table}/rank-00001.parquet")
        assert "sha256" in failure.problem
        shard.write_bytes(original)

        promoted = promote(root, RUN, store, 1)
        assert promoted.verified and promoted.pointer.seq == root.list_dumps(RUN, 1)[-1]

    # Generation 2: restored from the step-6 checkpoint, trained to the end, published.
    assert run_on_ranks(_train, 2, args=(str(tmp_path), store_url, CKPT)) == [STEPS, STEPS]
    assert root.read_generation(RUN, 2).parent.checkpoint_step == CKPT
    with open_store(store_url, run=RUN) as store:
        second = verify(root, RUN, store, options=VerifyOptions(sample=None))
        assert second.generation == 2 and second.passed, second.failure_summary()
        moved_on = verify(root, RUN, store, generation=1, options=VerifyOptions(sample=None))
        assert moved_on.totals()[RowClass.SUPERSEDED] > 0

        result = rollback(root, RUN, store, 1)
        assert result.generation == 3 and sum(result.restored.values()) > 0
        back = verify(root, RUN, store, generation=1, options=VerifyOptions(sample=None))
        assert back.passed, back.failure_summary()
        assert back.rollback_generations == [3]
        assert back.totals()[RowClass.SUPERSEDED] == 0
        _all_keys_equal_expected(store, root, 1, promoted.pointer.seq)
        pointer = store.get_serving(RUN)
        assert (pointer.generation, pointer.seq) == (1, promoted.pointer.seq)
