"""ZCH table sources on an unsharded model: raw ids, admissions, evictions, key -1, row checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests._helpers.zch import (
    ZchModel,
    apply,
    assert_same_state,
    kjts,
    model_parts,
    model_state,
    presized_model,
    stream,
)

from deltarec.artifacts.types import TableKind
from deltarec.tracking.zch import (
    ZchRowRangeError,
    ZchTableSource,
    ZchTrackingError,
    discover_zch_sources,
    zch_embedding_fqns,
)


def _train(model: ZchModel, opt: torch.optim.Optimizer, ids: list[int]) -> None:
    opt.zero_grad()
    model(*kjts(ids)).backward()
    opt.step()


def _sources(model: ZchModel) -> dict[str, ZchTableSource]:
    sources = discover_zch_sources(model)
    assert all(isinstance(s, ZchTableSource) for s in sources)
    return {s.table_id: s for s in sources}  # type: ignore[misc]


def _fresh_table(
    table: str, zch_size: int, policy: str
) -> tuple[ZchModel, torch.optim.Optimizer, ZchTableSource]:
    """A fresh model, its SGD optimizer and the source of its table ``table``."""
    model = ZchModel(zch_size=zch_size, policy=policy)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), _sources(model)[table]


@pytest.mark.parametrize("policy", ["lru", "lfu", "dlfu"])
def test_replayed_collects_equal_the_model_state_after_every_interval(policy: str) -> None:
    torch.manual_seed(0)
    model, opt = presized_model(8, policy, history=64)
    sources = _sources(model)
    assert set(sources) == {"mc_ebc.bag", "mc_ec.seq"}
    replay: dict[str, dict[int, np.ndarray]] = {t: {} for t in sources}
    step = 0
    for _interval in range(6):
        for _ in range(3):
            _train(model, opt, stream(step, seed=1))
            step += 1
        for table, source in sources.items():
            counts = apply(replay[table], source.collect())
            mch, weight = model_parts(model)[table]
            assert_same_state(replay[table], model_state(mch, weight, 0, with_fallback=True))
            assert counts["evicted"] > 0, f"{table}: no eviction in this interval"
    for source in sources.values():
        source.close()


def test_spec_says_zch_with_global_sizes_and_fqns_name_both_module_paths() -> None:
    model = ZchModel(zch_size=8, policy="lru")
    sources = _sources(model)
    spec = sources["mc_ebc.bag"].spec
    assert (spec.kind, spec.zch_size, spec.num_embeddings, spec.dim) == (TableKind.ZCH, 8, 8, 4)
    assert spec.sharding == "row_wise"
    assert zch_embedding_fqns(model) == {
        "mc_ebc._embedding_module.embedding_bags.bag",
        "mc_ebc._managed_collision_collection._managed_collision_modules.bag",
        "mc_ec._embedding_module.embeddings.seq",
        "mc_ec._managed_collision_collection._managed_collision_modules.seq",
    }
    for source in sources.values():
        source.close()


def test_id_admitted_after_the_last_collect_is_dumped_without_a_new_lookup() -> None:
    model, opt = presized_model(8, "lru", history=8, interval=2)
    source = _sources(model)["mc_ebc.bag"]
    mch, weight = model_parts(model)["mc_ebc.bag"]
    _train(model, opt, [7])  # a miss: 7 waits in the eviction history
    first = source.collect()
    assert first.keys.tolist() == [-1]  # the fallback row (first collect), no id yet
    _train(model, opt, [8])  # eviction step: admits 7 and 8; only 8 is looked up
    second = source.collect()
    assert second.keys.tolist() == [7, 8]  # no miss since the first collect: no -1
    assert second.ops.tolist() == [0, 0]
    want = model_state(mch, weight, 0, with_fallback=True)
    for key, row in zip(second.keys.tolist(), second.rows.numpy(), strict=True):
        np.testing.assert_array_equal(row, want[key])
    source.close()


def test_evicted_id_gets_op_1_with_the_fallback_row_and_readmitted_id_its_new_row() -> None:
    model, opt, source = _fresh_table("mc_ebc.bag", zch_size=4, policy="lru")  # 3 usable slots
    mch, weight = model_parts(model)["mc_ebc.bag"]
    _train(model, opt, [1, 2, 3])
    source.collect()
    _train(model, opt, [4, 2, 3])  # evicts 1 (least recently used)
    _train(model, opt, [1, 3, 4])  # re-admits 1, evicts 2
    got = source.collect()
    by_key = dict(
        zip(got.keys.tolist(), zip(got.ops.tolist(), got.rows.numpy(), strict=True), strict=True)
    )
    state = model_state(mch, weight, 0, with_fallback=True)
    assert by_key[1][0] == 0
    np.testing.assert_array_equal(by_key[1][1], state[1])
    assert by_key[2][0] == 1 and 2 not in state
    np.testing.assert_array_equal(by_key[2][1], state[-1])
    assert -1 not in by_key  # no lookup missed since the first collect: fallback unchanged
    source.close()


def test_read_keys_gives_rows_of_held_ids_and_fallback_for_others() -> None:
    model, opt, source = _fresh_table("mc_ec.seq", zch_size=4, policy="lru")
    mch, weight = model_parts(model)["mc_ec.seq"]
    _train(model, opt, [10, 20, 30, 40])  # 40 misses: 3 usable slots
    got = source.read_keys(torch.tensor([40, 10, -1, 20, 10]))
    state = model_state(mch, weight, 0, with_fallback=True)
    held = {k for k in (10, 20, 30, 40) if k in state}
    assert got.keys.tolist() == [-1, 10, 20, 40]
    assert got.ops.tolist() == [0] + [0 if k in held else 1 for k in (10, 20, 40)]
    for key, op, row in zip(got.keys.tolist(), got.ops.tolist(), got.rows.numpy(), strict=True):
        np.testing.assert_array_equal(row, state[key if op == 0 else -1])
    chunks = list(source.snapshot(chunk_rows=2))
    snap: dict[int, np.ndarray] = {}
    for chunk in chunks:
        assert len(chunk) <= 2
        apply(snap, chunk)
    assert_same_state(snap, state)
    source.close()


def test_out_of_range_remapped_row_raises_naming_table_and_rows() -> None:
    model, opt, source = _fresh_table("mc_ebc.bag", zch_size=8, policy="lru")
    mch, _ = model_parts(model)["mc_ebc.bag"]
    _train(model, opt, [5, 6])
    pos = int(torch.searchsorted(mch._mch_sorted_raw_ids, torch.tensor(6)))
    mch._mch_remapped_ids_mapping[pos] = 1234  # as if a mismatched checkpoint was loaded
    with pytest.raises(ZchRowRangeError, match=r"'mc_ebc\.bag'.*\[0, 8\).*\[1234\]") as err:
        model(*kjts([6, 5]))
    assert err.value.table == "mc_ebc.bag" and err.value.rows == [1234]
    with pytest.raises(ZchRowRangeError, match=r"\[1234\]"):
        list(source.snapshot(chunk_rows=10))
    with pytest.raises(ZchRowRangeError, match=r"\[1234\]"):
        source.read_keys(torch.tensor([5, 6]))
    source.close()


def test_close_restores_the_module_methods_and_a_second_source_may_then_track() -> None:
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    class_remap = MCHManagedCollisionModule.remap
    model = ZchModel(zch_size=8, policy="lru")
    mch, _ = model_parts(model)["mc_ebc.bag"]
    sources = _sources(model)
    assert "remap" in mch.__dict__ and MCHManagedCollisionModule.remap is class_remap
    with pytest.raises(ZchTrackingError, match="already tracked"):
        discover_zch_sources(model)
    assert "remap" in mch.__dict__  # the failed discovery left the open source alone
    for source in sources.values():
        source.close()
    assert "remap" not in mch.__dict__ and "_update_and_evict" not in mch.__dict__
    again = _sources(model)
    for source in again.values():
        source.close()


def test_lookups_between_before_eval_and_after_eval_are_not_dumped() -> None:
    model, opt = presized_model(8, "lfu", history=16)
    source = _sources(model)["mc_ebc.bag"]
    _train(model, opt, [1, 2])
    assert source.collect().keys.tolist() == [-1, 1, 2]
    source.before_eval()
    with torch.no_grad():
        model(*kjts([1, 2, 99]))  # still in train mode: the MCH profiles, nothing is trained
        model.eval()
        model(*kjts([2, 98]))
        model.train()
    source.after_eval()
    assert source.collect().keys.tolist() == [99]  # admitted by the train-mode pass: real
    _train(model, opt, [2])
    assert source.collect().keys.tolist() == [2]
    source.discard()
    _train(model, opt, [1])
    source.discard()
    assert source.collect().keys.tolist() == [-1]  # after discard the fallback is re-sent
    source.close()


def test_collect_reads_no_mapping_buffer_so_its_cost_does_not_grow_with_zch_size() -> None:
    model, opt, source = _fresh_table("mc_ec.seq", zch_size=4, policy="lru")
    mch, weight = model_parts(model)["mc_ec.seq"]
    _train(model, opt, [1, 2, 3])
    _train(model, opt, [4, 5, 1])  # evicts two ids, admits 4 and 5
    want = model_state(mch, weight, 0, with_fallback=True)
    names = ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping")
    hidden = {name: mch._buffers.pop(name) for name in names}
    try:
        got = source.collect()
    finally:
        mch._buffers.update(hidden)
    replay: dict[int, np.ndarray] = {}
    counts = apply(replay, got)
    assert counts["evicted"] == 2
    assert_same_state(replay, want)
    source.close()


def test_a_held_raw_id_minus_one_is_refused_as_it_collides_with_the_fallback_key() -> None:
    from deltarec.tracking.zch import ZchKeyCollisionError

    model, opt, source = _fresh_table("mc_ebc.bag", zch_size=8, policy="lru")
    _train(model, opt, [3, -1])
    with pytest.raises(ZchKeyCollisionError, match=r"'mc_ebc\.bag'.*raw feature id -1"):
        source.collect()
    source.close()
