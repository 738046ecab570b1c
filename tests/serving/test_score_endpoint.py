"""``deltarec serve --score``: scores from the served point's dense and sparse state.

A generation of the example model (its rows and its dense state, as a trainer with
``--dense-every`` commits them) is served; ``POST /v1/score`` must answer the scores the model
itself computes from the same weights, name the point it read, and refuse a point without
dense state, a malformed body and a replica started without ``--score``.
"""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from tests._helpers.artifacts import Lineage

from deltarec import artifacts
from deltarec.artifacts import DumpKind, ShardRows, codec
from deltarec.artifacts.dense import DenseCapture, DenseCommitRoot
from deltarec.dump.dense import dense_state
from deltarec.model import tiny_model_config
from deltarec.model.click_model import HISTORY, ZCH_TABLE, ClickModel
from deltarec.model.tables import declared_tables, model_tables
from deltarec.serving.follow import FixedPointer, Follower
from deltarec.serving.http import ReplicaServer
from deltarec.serving.replica import Replica
from deltarec.serving.score import ExampleScorer
from deltarec.stores.types import ServingPointer

RUN = "click"
ZCH_IDS = np.array([-1, 10, 20, 30], np.int64)


def _weights(model, config):
    """Table id -> (keys, float32 rows) of the model's embedding tables, as a snapshot holds."""
    state = model.state_dict()
    out = {}
    for t in model_tables(config, 1):
        weight = state[t.weight_key].detach().numpy()
        if t.kind == "zch":
            out[t.table_id] = (ZCH_IDS, weight[: len(ZCH_IDS)])
        else:
            out[t.table_id] = (np.arange(len(weight), dtype=np.int64), weight)
    return out


def _generation(tmp_path, with_dense=True):
    torch.manual_seed(0)
    config = tiny_model_config()
    model = ClickModel(config, 1, torch.device("cpu"))
    lineage = Lineage.under(tmp_path)
    lineage.run, lineage.specs = RUN, declared_tables(config, 1)
    g = lineage.generation()
    shards = {}
    for table, (keys, rows) in _weights(model, config).items():
        enc = codec.encode(rows, lineage.specs[table].dtype)
        n = len(keys)
        shards[table] = {0: ShardRows(keys, enc, np.zeros(n, np.int8), np.full(n, 10, np.int64))}
    root = lineage.root
    if with_dense:
        capture = DenseCapture()
        root = DenseCommitRoot(lineage.root.uri, None, capture)
        buf = io.BytesIO()
        torch.save(dense_state(model), buf)
        capture.settle(10, buf.getvalue)
    info = lineage.root.read_generation(RUN, g)
    artifacts.write_dump(root, info, 0, DumpKind.SNAPSHOT, shards, 1, 10)
    return lineage, g, config, model


def _request(config, batch=3):
    rng = np.random.default_rng(1)
    features = {
        name: [rng.integers(0, t.num_embeddings, t.ids_per_sample).tolist() for _ in range(batch)]
        for name, t in config.tables.items()
    }
    features[HISTORY] = [rng.integers(0, 400, k).tolist() for k in (0, 2, 4)][:batch]
    features[ZCH_TABLE] = [[10], [20, 30], [-1]][:batch]
    dense = rng.standard_normal((batch, config.dense_features)).round(3).tolist()
    return {"dense": dense, "features": features}


def _expected(model, config, scorer, body):
    """The model's own scores from its own weights (its ZCH ids read from the same rows)."""
    inputs = scorer.parse(json.dumps(body).encode(), 1 << 16)
    model.eval()
    with torch.no_grad():
        pooled = model.sparse.ebc(inputs.bags).values()
        seq = model.sparse.ec(inputs.history)[HISTORY]
        lengths = seq.lengths()
        sample = torch.repeat_interleave(torch.arange(len(lengths)), lengths.long())
        hist = torch.zeros(len(lengths), seq.values().shape[1]).index_add(0, sample, seq.values())
        hist = hist / lengths.clamp(min=1).unsqueeze(1)
        zch_weight = model.sparse.zch._embedding_module.embedding_bags[ZCH_TABLE].weight
        slot = {int(k): i for i, k in enumerate(ZCH_IDS)}
        ads = inputs.ads[ZCH_TABLE]
        rows = zch_weight[[slot[int(i)] for i in ads.values()]]
        ad_sample = torch.repeat_interleave(torch.arange(len(ads.lengths())), ads.lengths().long())
        zch = torch.zeros(len(ads.lengths()), rows.shape[1]).index_add(0, ad_sample, rows)
        x = torch.cat([model.dense_arch(inputs.dense), pooled, hist, zch], 1)
        return torch.sigmoid(model.over_arch(x).squeeze(1)).tolist()


def _post(server, body, path="/v1/score"):
    url = f"http://{server.host}:{server.port}{path}"
    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _served(lineage, g, scorer_config=None):
    replica = Replica(lineage.root, RUN)
    follower = Follower(replica, FixedPointer(ServingPointer(RUN, g, 0, 1.0)))
    follower.poll()
    scorer = ExampleScorer(replica, scorer_config) if scorer_config is not None else None
    return ReplicaServer(follower, scorer=scorer), scorer


def test_score_answers_the_models_own_scores_from_the_served_point(tmp_path):
    lineage, g, config, model = _generation(tmp_path)
    server, scorer = _served(lineage, g, config)
    body = _request(config)
    with server:
        status, answer = _post(server, body)
        assert status == 200, answer
        assert (answer["generation"], answer["seq"]) == (g, 0)
        assert np.allclose(answer["scores"], _expected(model, config, scorer, body), atol=1e-5)
        status, answer = _post(server, {**body, "features": {"colour": [[1]] * 3}})
        assert status == 400 and "unknown features ['colour']" in answer["error"]
        status, answer = _post(server, {**body, "dense": [[float("nan")] * 8]})
        assert status == 400


def test_a_point_without_dense_state_is_not_scored_and_names_the_option(tmp_path):
    lineage, g, config, _ = _generation(tmp_path, with_dense=False)
    server, _ = _served(lineage, g, config)
    with server:
        status, answer = _post(server, _request(config))
    assert status == 503 and "--dense-every" in answer["error"]


def test_a_replica_started_without_score_has_no_score_endpoint(tmp_path):
    lineage, g, config, _ = _generation(tmp_path)
    server, _ = _served(lineage, g)
    with server:
        status, _ = _post(server, _request(config))
    assert status == 404


@pytest.mark.parametrize("argv, problem", [(["--model-config", "m.json"], "give both")])
def test_serve_refuses_model_config_without_score(argv, problem, capsys):
    from deltarec.cli import main

    code = main(["serve", "--artifacts", "/a", "--run", "r", "--store", "sqlite:///x", *argv])
    assert code == 2 and problem in capsys.readouterr().err
