"""ZCH ids the model answers with its fallback row, on PAI FeatureStore with ``contract=tzrec``.

TorchEasyRec publishes every ZCH id training looked up, held or not: an id the table does not
hold is written with the fallback row, the row the model answers it with. A trainer publishing
to ``featurestore://...?contract=tzrec`` turns the dumper's ``zch_misses`` on, so those ids are
dumped (``op = 1``, the fallback row) and FeatureStore, which cannot delete, writes them with
that row; a store that deletes applies them as deletes of keys it never held.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests._helpers import featurestore as fs_state
from tests._helpers.zch import ZchModel, kjts, model_parts, model_state

from deltarec.artifacts import ArtifactRoot
from deltarec.dump import make_train_hook
from deltarec.publish import DumpPublisher, RetryPolicy
from deltarec.stores import open_store
from deltarec.tracking.zch import discover_zch_sources
from deltarec.tracking.zch.cpu import presize_zch_history
from deltarec.verify import RowClass, VerifyOptions, verify

RUN = "z"
TABLES = ("mc_ebc.bag", "mc_ec.seq")
STORE = f"featurestore://{fs_state.PROJECT}/{fs_state.VIEW}?region=cn-hangzhou&contract=tzrec"
# Step 1 only profiles (eviction every 2 steps): every id misses. Step 2 admits the three most
# frequent ids (3 of 3 usable slots) and never 9; 50 comes later and is never admitted either.
STEPS = [[1, 1, 1, 2, 2, 2, 3, 3, 9], [1, 2], [9, 50, 2], [1, 1, 3, 3], [1, 2, 3, 9, 50]]
NEVER_ADMITTED = {9, 50}
TZREC_NAMES = {  # what TorchEasyRec names them: the MC module's inner collection, by its type
    "mc_ebc.bag": "mc_ebc._embedding_module.embedding_bags.bag",
    "mc_ec.seq": "mc_ec._embedding_module.embeddings.seq",
}


@pytest.fixture
def state(tmp_path, monkeypatch) -> str:
    path = str(tmp_path / "featurestore.db")
    fs_state.use_test_sdk(monkeypatch, path)
    return path


def _train_publishing_to(store: str, art: str) -> dict[str, dict[int, np.ndarray]]:
    """Train the ZCH model with the hook publishing to ``store``; the model's final state."""
    torch.manual_seed(0)
    model = ZchModel(zch_size=4, policy="lfu", interval=2)
    presize_zch_history(model, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = make_train_hook(
        artifacts=art, run=RUN, every_steps=2, store=store, fsync=False, chunk_rows=4
    )
    assert hook.config.zch_misses  # the store URL asked for them
    hook._sources = discover_zch_sources
    hook.on_start(model, 0, None)
    try:
        for step, ids in enumerate(STEPS, start=1):
            opt.zero_grad()
            model(*kjts(ids)).backward()
            opt.step()
            hook.after_step(step)
        hook.on_end(len(STEPS))
    finally:
        hook.close()
    return {t: model_state(m, w, 0, with_fallback=True) for t, (m, w) in model_parts(model).items()}


def test_ids_never_admitted_hold_the_fallback_row_on_featurestore_and_verify_passes(
    tmp_path, state
):
    art = str(tmp_path / "art")
    final = _train_publishing_to(STORE, art)
    stored = fs_state.stored_rows(state, fs_state.PROJECT, fs_state.VIEW, fs_state.VERSION)
    for table in TABLES:
        want = final[table]
        assert not NEVER_ADMITTED & set(want) and {1, 2, 3} <= set(want)
        name = TZREC_NAMES[table]
        rows = {key: np.array(v) for (pk, key), v in stored.items() if pk == name}
        assert set(rows) == {1, 2, 3} | NEVER_ADMITTED  # no -1: TorchEasyRec's invalid key
        # every id looked up in the last interval: the store holds what the model answers
        for key, row in rows.items():
            expect = want[-1] if key in NEVER_ADMITTED else want[key]
            np.testing.assert_allclose(row, expect, rtol=0, atol=1e-7, err_msg=f"{table} {key}")
        fallback = {k for k, r in rows.items() if np.allclose(r, want[-1], rtol=0, atol=1e-7)}
        assert fallback == NEVER_ADMITTED

    root = ArtifactRoot(art)
    with open_store(STORE, art, run=RUN) as store:
        checked = verify(root, RUN, store, options=VerifyOptions(sample=None))
        assert checked.passed, checked.failure_summary()
        assert all(checked.tables[t].counts[RowClass.MATCH] == 5 for t in TABLES)
        bag = TZREC_NAMES["mc_ebc.bag"]
        tampered = [float(v) + 0.5 for v in stored[(bag, 9)]]
        fs_state.set_row(state, fs_state.PROJECT, fs_state.VIEW, fs_state.VERSION, bag, 9, tampered)
        bad = verify(root, RUN, store, options=VerifyOptions(sample=None))
    assert not bad.passed
    (mismatch,) = bad.tables["mc_ebc.bag"].mismatches
    assert mismatch.key == 9 and mismatch.row_class is RowClass.DIFFERENT
    assert "fallback row" in mismatch.reason

    # The same artifacts on a store that deletes: the ids are deletes of keys never held.
    sqlite = f"sqlite:///{tmp_path}/emb.db"
    with open_store(sqlite, run=RUN) as store:
        DumpPublisher(store, root, RUN, retry=RetryPolicy(deadline_s=10)).publish_generation(1)
        on_sqlite = verify(root, RUN, store, options=VerifyOptions(sample=None))
        assert on_sqlite.passed, on_sqlite.failure_summary()
        held = store.read("mc_ebc.bag", np.array(sorted({-1, 1, 2, 3} | NEVER_ADMITTED)))
    assert held.found.tolist() == [True, True, True, True, False, False]


def test_only_a_tzrec_featurestore_url_turns_zch_misses_on_and_an_explicit_setting_wins(
    tmp_path,
):
    art = str(tmp_path / "art")

    def misses(store: str | None, **options: bool) -> bool:
        return bool(
            make_train_hook(artifacts=art, run=RUN, store=store, **options).config.zch_misses
        )

    assert misses(STORE)
    assert not misses(STORE.replace("&contract=tzrec", ""))
    assert not misses(f"sqlite:///{tmp_path}/emb.db")
    assert not misses(None)
    assert not misses(STORE, zch_misses=False)
    assert misses(None, zch_misses=True)
