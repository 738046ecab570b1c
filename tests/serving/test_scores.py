"""Dense and sparse are one generation: the replica's scores equal the trainer's at that point.

Two CPU ranks train (the example model; the DLRM example) with delta dumps that carry the
dense state; then each rank scores a fixed batch with the trained model. The replica, loaded
at the final point, scores the same batches with an unsharded copy of the model whose dense
state and embedding rows are the replica's.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torchrec import KeyedJaggedTensor

from deltarec.artifacts import ArtifactRoot, codec
from deltarec.artifacts.dense import dense_of
from deltarec.artifacts.lineage import expected_state
from deltarec.serving.follow import FixedPointer, Follower, FollowOptions
from deltarec.serving.model import ServingModel
from deltarec.serving.replica import Replica
from deltarec.stores.types import ServingPointer
from deltarec.testing.multiprocess import run_on_ranks

pytestmark = pytest.mark.multiprocess

EXAMPLE_SRC = pathlib.Path(__file__).resolve().parents[2] / "examples" / "dlrm_team" / "src"
BATCH = 16


def _kjt(parts: tuple) -> KeyedJaggedTensor:
    keys, values, lengths = parts
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)


def _parts(kjt: KeyedJaggedTensor) -> tuple:
    return (kjt.keys(), kjt.values().clone(), kjt.lengths().clone())


def _held_zch_ids(artifacts: str, run: str) -> np.ndarray:
    root = ArtifactRoot(artifacts)
    state = expected_state(root, run, root.latest_generation(run))
    keys = state.tables["sparse.zch.ad_id"].present_keys()
    return keys[keys >= 0]


def _example_rank(rank: int, world_size: int, artifacts: str) -> dict:
    from deltarec.dump import make_train_hook
    from deltarec.model import build_sharded_model, tiny_model_config
    from deltarec.model.data import EVAL_STREAM, ClickStream
    from deltarec.train import TrainConfig, run_training

    model = tiny_model_config()
    export = f"{artifacts}/../export"
    cfg = TrainConfig(model=model, steps=30, batch_size=BATCH, log_every=1000, export_tables=export)
    sm = build_sharded_model(model, torch.device("cpu"), max_batch_size=BATCH)
    hook = make_train_hook(artifacts=artifacts, run="ex", every_steps=10, dense_every=1)
    run_training(cfg, hooks=[hook], model=sm)
    batch = ClickStream(model, cfg.data, BATCH, cfg.seed, rank, EVAL_STREAM).batch(0, at_step=30)
    # ZCH ids the model holds: an id it misses reads its own rank's fallback row in training
    # but key -1 (rank 0's) from serving (docs/zch.md), so the batch asks for held ids only.
    held = torch.from_numpy(_held_zch_ids(artifacts, "ex"))
    n = batch.ads.values().numel()
    ads = KeyedJaggedTensor.from_lengths_sync(
        keys=batch.ads.keys(), values=held[torch.arange(n) % len(held)], lengths=batch.ads.lengths()
    )
    sm.dmp.eval()
    with torch.no_grad():
        _, logits = sm.dmp(batch.dense, batch.bags, batch.history, ads, batch.labels)
    return {
        "logits": logits,
        "inputs": (batch.dense, _parts(batch.bags), _parts(batch.history), _parts(ads)),
        "labels": batch.labels,
    }


def test_a_replica_following_training_holds_the_final_tables_and_scores_like_the_trainer(
    tmp_path,
):
    from deltarec.model import ClickModel, tiny_model_config

    artifacts = str(tmp_path / "artifacts")
    root = ArtifactRoot(artifacts)
    replica = Replica(root, "ex")
    follower = Follower(  # follows generation 1 from its snapshot while the ranks train
        replica, FixedPointer(ServingPointer("ex", 1, 0, 1.0)), FollowOptions(poll_s=0.2)
    )
    follower.start()
    try:
        results = run_on_ranks(_example_rank, 2, args=(artifacts,), timeout_s=600)
    finally:
        follower.stop()
    follower.poll()
    g = root.latest_generation("ex")
    seqs = root.list_dumps("ex", g)
    assert replica.current.position.seq == seqs[-1] and follower.blocked is None
    assert replica.applied_dumps >= 1  # dumps were applied one by one, not loaded whole
    assert all(dense_of(root.read_manifest("ex", g, s)) is not None for s in seqs)
    with replica.pinned() as snap:  # key by key, the model's final tables (the export)
        for table, state in snap.tables.items():
            export = pq.read_table(tmp_path / "export" / f"{table}.parquet")
            keys = export.column("key").to_numpy()
            np.testing.assert_array_equal(state.keys_np, keys, err_msg=table)
            rows = codec.embedding_matrix(export.column("embedding"), state.spec.dtype)
            np.testing.assert_array_equal(state.read(keys)[2], rows, err_msg=table)
    scorer = ServingModel(
        replica, ClickModel(tiny_model_config(), 2, torch.device("cpu"), torch.device("meta"))
    )
    assert "sparse.zch.ad_id" in scorer.tables and "sparse.ec.history" in scorer.tables
    for r in results:
        dense, bags, history, ads = r["inputs"]
        _, logits = scorer.score(dense, _kjt(bags), _kjt(history), _kjt(ads), r["labels"])
        torch.testing.assert_close(logits, r["logits"], rtol=1e-5, atol=1e-5)
        assert logits.abs().sum() > 0


def _dlrm_rank(rank: int, world_size: int, artifacts: str, src: str) -> dict:
    sys.path.insert(0, src)
    from dlrm_team.data import make_batch
    from dlrm_team.model import build
    from dlrm_team.train import train_steps

    from deltarec.dump import make_train_hook

    dmp, dense_optimizer = build(torch.device("cpu"))
    hook = make_train_hook(artifacts=artifacts, run="dlrm", every_steps=5, dense_every=2)
    hook.on_start(dmp, step=0, restored_from=None)
    try:
        train_steps(dmp, dense_optimizer, hook, rank, 12, BATCH)
    finally:
        hook.close()
    batch = make_batch(999, rank, BATCH)
    m = dmp.module
    m.eval()
    with torch.no_grad():
        logits = m.dlrm(batch.dense, batch.sparse).squeeze(-1) + m.item_seq(batch.seq)
    return {"logits": logits, "inputs": (batch.dense, _parts(batch.sparse), _parts(batch.seq))}


def test_the_dlrm_examples_scores_from_the_replica_equal_the_trainers(tmp_path):
    artifacts = str(tmp_path / "artifacts")
    sys.path.insert(0, str(EXAMPLE_SRC))
    try:
        from dlrm_team.model import ClickDLRM

        results = run_on_ranks(_dlrm_rank, 2, args=(artifacts, str(EXAMPLE_SRC)), timeout_s=600)
        root = ArtifactRoot(artifacts)
        g = root.latest_generation("dlrm")
        seqs = root.list_dumps("dlrm", g)
        carry = [s for s in seqs if dense_of(root.read_manifest("dlrm", g, s)) is not None]
        assert carry != seqs and carry[0] == 0 and carry[-1] == seqs[-1]  # its own cadence
        replica = Replica(root, "dlrm")
        replica.install(replica.load(g, seqs[-1]))
        model = ClickDLRM()
        scorer = ServingModel(replica, model)
        for r in results:
            dense, sparse, seq = r["inputs"]

            def logits(d, s, q, _m=model):
                return _m.dlrm(d, s).squeeze(-1) + _m.item_seq(q)

            model.forward = logits  # the team's scores: the model without its loss
            got = scorer.score(dense, _kjt(sparse), _kjt(seq))
            torch.testing.assert_close(got, r["logits"], rtol=1e-5, atol=1e-5)
    finally:
        sys.path.remove(str(EXAMPLE_SRC))
        for name in [m for m in sys.modules if m == "dlrm_team" or m.startswith("dlrm_team.")]:
            del sys.modules[name]
