"""The example model's configuration, synthetic stream and ZCH export logic (one process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from deltarec.model import ClickStream, DataConfig, ModelConfig, model_tables, tiny_model_config
from deltarec.model.data import EVAL_STREAM, zipf_ids
from deltarec.train.export import _zch_rows


def _same_batch(a, b) -> bool:
    return (
        torch.equal(a.dense, b.dense)
        and torch.equal(a.labels, b.labels)
        and all(
            torch.equal(x.values(), y.values()) and torch.equal(x.lengths(), y.lengths())
            for x, y in ((a.bags, b.bags), (a.history, b.history), (a.ads, b.ads))
        )
    )


def test_batches_depend_only_on_seed_rank_and_index():
    cfg = tiny_model_config()
    a = ClickStream(cfg, DataConfig(), 16, seed=3, rank=1)
    b = ClickStream(cfg, DataConfig(), 16, seed=3, rank=1)
    assert _same_batch(a.batch(7), b.batch(7))
    assert not _same_batch(a.batch(7), a.batch(8))
    assert not _same_batch(a.batch(7), ClickStream(cfg, DataConfig(), 16, seed=3, rank=0).batch(7))
    assert not _same_batch(
        a.batch(7), ClickStream(cfg, DataConfig(), 16, 3, 1, EVAL_STREAM).batch(7)
    )


def test_batch_shapes_ids_in_range_and_finite_length_per_rank():
    cfg = tiny_model_config()
    stream = ClickStream(cfg, DataConfig(batches_per_rank=5, batches_by_rank={1: 2}), 16, 0, 1)
    batch = stream.batch(1)
    assert batch.dense.shape == (16, cfg.dense_features) and batch.labels.shape == (16,)
    assert set(batch.labels.tolist()) <= {0.0, 1.0}
    for name, t in cfg.tables.items():
        jt = batch.bags[name]
        assert jt.lengths().tolist() == [t.ids_per_sample] * 16
        assert int(jt.values().min()) >= 0 and int(jt.values().max()) < t.num_embeddings
    assert int(batch.history.lengths().max()) <= cfg.history.ids_per_sample
    assert int(batch.ads.values().max()) < cfg.zch.raw_id_space
    assert stream.has(1) and not stream.has(2)
    with pytest.raises(IndexError, match="rank 1 has 2 batches"):
        stream.batch(2)


def test_zipf_ids_are_skewed_and_zch_popularity_drifts():
    rng = np.random.default_rng(0)
    ids = zipf_ids(rng, 1000, 1.2, 20_000)
    _, counts = np.unique(ids, return_counts=True)
    assert counts.max() > 50 * np.median(counts)  # a few hot ids, a long tail
    cfg = tiny_model_config()
    stream = ClickStream(cfg, DataConfig(), 256, 0, 0)
    early = set(stream.batch(0).ads.values().tolist())
    late = set(stream.batch(3 * cfg.zch.drift_every).ads.values().tolist())
    assert len(early & late) < len(early) / 2


def test_model_config_rejects_unknown_keys_and_bad_combinations():
    with pytest.raises(ValidationError, match="extra"):
        ModelConfig.model_validate({"zch": {"zch_size": 4}})
    with pytest.raises(ValidationError, match="reserved"):
        tiny_model_config(
            tables={"ad_id": {"num_embeddings": 9, "dim": 16, "sharding": "row_wise"}}
        )
    with pytest.raises(ValidationError, match="history"):
        tiny_model_config(
            history={"num_embeddings": 9, "dim": 16, "sharding": "column_wise", "ids_per_sample": 2}
        )


def test_table_ids_follow_owning_module_and_table_name():
    ids = [t.table_id for t in model_tables(ModelConfig(), world_size=2)]
    assert ids == [
        "sparse.ebc.user_id",
        "sparse.ebc.item_id",
        "sparse.ebc.category",
        "sparse.ebc.query",
        "sparse.ebc.geo",
        "sparse.ec.history",
        "sparse.zch.ad_id",
    ]
    zch = model_tables(ModelConfig(), world_size=2)[-1]
    assert (zch.kind, zch.zch_size, zch.num_embeddings) == ("zch", 512, 512)


def test_zch_export_keys_raw_ids_skips_empty_and_unreachable_entries_and_adds_fallback():
    empty = torch.iinfo(torch.int64).max
    # two shards of 4 slots; shard 0 holds 10 and 30, shard 1 holds 70 (its 4th entry is the
    # unreachable last one: searchsorted never looks at it)
    raw = torch.tensor([10, 30, empty, empty, 70, empty, empty, 99])
    slots = torch.tensor([1, 0, 2, 3, 6, 4, 5, 7])
    weight = torch.arange(8, dtype=torch.float32).unsqueeze(1).repeat(1, 2)
    keys, rows = _zch_rows(weight, raw, slots, world_size=2)
    assert keys.tolist() == [-1, 10, 30, 70]
    assert rows[:, 0].tolist() == [3.0, 1.0, 0.0, 6.0]  # -1 -> shard 0's miss slot (row 3)
