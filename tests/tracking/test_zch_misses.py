"""ZCH ids looked up but not held: dumped with op 1 and the fallback row only when asked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests._helpers.zch import ZchModel, kjts, model_state, presized_model

from deltarec.tracking.types import SourceOptions, TouchedRows
from deltarec.tracking.zch import ZchTableSource, discover_zch_sources
from deltarec.tracking.zch import recorder as zch_recorder


def _train(model: ZchModel, opt: torch.optim.Optimizer, ids: list[int]) -> None:
    opt.zero_grad()
    model(*kjts(ids)).backward()
    opt.step()


def _by_key(got: TouchedRows) -> dict[int, tuple[int, np.ndarray]]:
    keys = got.keys.tolist()
    assert len(set(keys)) == len(keys), "a key appears twice in one collect"
    return dict(zip(keys, zip(got.ops.tolist(), got.rows.numpy(), strict=True), strict=True))


def _check_against_model(got: dict[int, tuple[int, np.ndarray]], state: dict) -> None:
    """op 0: the id is held and has its row; op 1: not held, the fallback row (key -1's)."""
    for key, (op, row) in got.items():
        if op == 0:
            np.testing.assert_array_equal(row, state[key], err_msg=f"row of {key}")
        else:
            assert key not in state, f"{key} is held but dumped with op 1"
            np.testing.assert_array_equal(row, state[-1], err_msg=f"fallback row of {key}")


@pytest.mark.parametrize("compact_every", [None, 4])
@pytest.mark.parametrize("misses", [True, False])
def test_ids_never_admitted_are_dumped_with_the_fallback_row_only_when_asked(
    misses: bool, compact_every: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if compact_every is not None:  # lookups compacted to one entry per id every few ids
        monkeypatch.setattr(zch_recorder, "_COMPACT_MIN", compact_every)
    torch.manual_seed(0)
    model, opt = presized_model(4, "lfu", history=16, interval=2)  # 3 usable slots, LFU
    sources = {s.table_id: s for s in discover_zch_sources(model)}
    source = sources["mc_ebc.bag"]
    assert isinstance(source, ZchTableSource)
    for s in sources.values():
        s.configure(SourceOptions(zch_misses=misses))
    mch = model.mc_ebc._managed_collision_collection._managed_collision_modules["bag"]
    weight = model.mc_ebc._embedding_module.embedding_bags["bag"].weight

    # Step 1 only profiles: every id misses. Step 2's eviction admits the three most
    # frequent ids (3 among them, a miss at step 1) and leaves 9 out.
    _train(model, opt, [1, 1, 1, 2, 2, 2, 3, 3, 9])
    _train(model, opt, [1, 2])
    state = model_state(mch, weight, 0, with_fallback=True)
    assert {1, 2, 3} <= set(state) and 9 not in state
    first = _by_key(source.collect())
    _check_against_model(first, state)
    assert {k for k, (op, _) in first.items() if op == 0} == {-1, 1, 2, 3}
    assert {k for k, (op, _) in first.items() if op == 1} == ({9} if misses else set())

    # 9 and 50 miss again (50 for the first time); 1, 2 and 3 keep their slots. Id 2 was
    # held at its last lookup and has no event: it keeps its row.
    _train(model, opt, [9, 50, 2])
    _train(model, opt, [1, 1, 3, 3])
    state = model_state(mch, weight, 0, with_fallback=True)
    assert {1, 2, 3} <= set(state) and not {9, 50} & set(state)
    second = _by_key(source.collect())
    _check_against_model(second, state)
    assert {k for k, (op, _) in second.items() if op == 0} == {-1, 1, 2, 3}
    assert {k for k, (op, _) in second.items() if op == 1} == ({9, 50} if misses else set())

    # Nothing missed since: no id and no fallback row is sent again.
    _train(model, opt, [1, 2])
    assert sorted(source.collect().keys.tolist()) == [1, 2]
    for s in sources.values():
        s.close()


def test_an_id_admitted_then_evicted_in_one_interval_is_dumped_once_with_op_1() -> None:
    torch.manual_seed(0)
    model = ZchModel(zch_size=4, policy="lru")  # 3 usable slots, eviction every step
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sources = {s.table_id: s for s in discover_zch_sources(model)}
    source = sources["mc_ec.seq"]
    for s in sources.values():
        s.configure(SourceOptions(zch_misses=True))
    mch = model.mc_ec._managed_collision_collection._managed_collision_modules["seq"]
    weight = model.mc_ec._embedding_module.embeddings["seq"].weight
    _train(model, opt, [1, 2, 3])
    source.collect()
    _train(model, opt, [4, 2, 3])  # admits 4, evicts 1
    _train(model, opt, [5, 6, 2, 3, 1])  # 4 evicted again; 1 and the new ids compete
    state = model_state(mch, weight, 0, with_fallback=True)
    got = _by_key(source.collect())
    _check_against_model(got, state)
    looked_up = {1, 2, 3, 4, 5, 6}
    assert set(got) - {-1} == looked_up
    assert {k for k, (op, _) in got.items() if op == 1} == looked_up - set(state)
    assert got[4][0] == 1  # admitted, then evicted: not held, the fallback row
    for s in sources.values():
        s.close()


def test_a_looked_up_raw_id_minus_one_that_misses_is_not_dumped_as_the_fallback_key() -> None:
    model, opt = presized_model(4, "lfu", history=16, interval=2)
    sources = {s.table_id: s for s in discover_zch_sources(model)}
    for s in sources.values():
        s.configure(SourceOptions(zch_misses=True))
    _train(model, opt, [-1, 7])  # both miss (the first step only profiles)
    got = _by_key(sources["mc_ebc.bag"].collect())
    assert set(got) == {-1, 7} and got[-1][0] == 0 and got[7][0] == 1
    for s in sources.values():
        s.close()
