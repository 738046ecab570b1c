"""Export must gather int64 MCH buffers as int64 (ShardedTensor.gather stages through float32)."""

from deltarec.testing.multiprocess import run_on_ranks

BIG_ID = 2**40 + 7  # not representable in float32


def _export_fresh_and_large_ids(rank: int, world_size: int) -> list[int] | None:
    import torch

    from deltarec.model import build_sharded_model, tiny_model_config
    from deltarec.train.export import table_rows

    sm = build_sharded_model(tiny_model_config(), torch.device("cpu"), seed=0)
    (table,) = [t for t in sm.tables if t.kind == "zch"]
    fresh = table_rows(sm, table)
    # Hold one large raw id in the first slot of rank 0's shard.
    mch = sm.mch_modules()[table.table_id]
    if rank == 0:
        mch._mch_sorted_raw_ids[0] = BIG_ID
    held = table_rows(sm, table)
    if rank != 0:
        assert fresh is None and held is None
        return None
    assert fresh is not None and held is not None
    assert fresh[0].tolist() == [-1], "a fresh ZCH table holds only the fallback row"
    return held[0].tolist()


def test_zch_export_keeps_int64_raw_ids_exact():
    keys = run_on_ranks(_export_fresh_and_large_ids, 2)[0]
    assert keys == [-1, BIG_ID]
