"""Proof from the replica: verify reads rows back over HTTP (replica://), status and metrics."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deltarec.cli import main as cli_main
from deltarec.errors import BadInputError, UnsupportedError
from deltarec.serving.follow import FixedPointer, Follower
from deltarec.serving.http import ReplicaServer
from deltarec.serving.replica import Replica
from deltarec.stores import open_store
from deltarec.stores.types import ServingPointer
from deltarec.verify import RowClass, VerifyOptions, verify

from .conftest import RUN, T_EMB, T_ZCH


@pytest.fixture
def served(outbox):
    g = outbox.first_generation()
    follower = Follower(Replica(outbox.root, RUN), FixedPointer(ServingPointer(RUN, g, 1, 1.0)))
    follower.poll()
    with ReplicaServer(follower) as server:
        yield g, follower, server


def test_verify_all_reads_every_row_back_from_a_running_replica_and_passes(outbox, served):
    g, _, server = served
    with open_store(server.url, run=RUN) as store:
        result = verify(
            outbox.root,
            RUN,
            store,
            generation=g,
            store_url=server.url,
            options=VerifyOptions(sample=None),
        )
    assert result.passed, result.failure_summary()
    emb = result.tables[T_EMB]
    assert emb.counts[RowClass.MATCH.value] == 50 and emb.store_keys_scanned == 50
    assert result.tables[T_ZCH].counts[RowClass.MATCH.value] == 4  # 3 held + evicted id 7


def test_verify_fails_when_the_replica_does_not_hold_the_point(outbox, served):
    g, follower, server = served
    outbox.dump(g, 2, {T_EMB: (np.array([1, 2]), 7.0)})  # committed, not applied (pinned)
    follower.options = type(follower.options)(follow=False)
    with open_store(server.url, run=RUN) as store:
        result = verify(
            outbox.root, RUN, store, generation=g, through_seq=2, options=VerifyOptions(sample=None)
        )
    assert not result.passed
    assert result.tables[T_EMB].counts[RowClass.DIFFERENT.value] == 2


def test_the_cli_verifies_a_replica_by_its_url(outbox, served, capsys):
    g, _, server = served
    code = cli_main(
        ["verify", "--artifacts", outbox.root.uri, "--run", RUN, "--store", server.url,
         "--generation", str(g), "--all", "--json", "-", "--no-record"]
    )  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["passed"] and out["store"] == server.url


def test_the_replica_store_is_read_only_and_serves_its_own_run_only(served):
    _, _, server = served
    with open_store(server.url, run=RUN) as store:
        with pytest.raises(UnsupportedError, match="read-only"):
            store.registry.set_serving(RUN, 1, 1)
        with pytest.raises(UnsupportedError, match="read-only"):
            store.write(T_EMB, np.array([1]), np.zeros((1, 8), np.float32), np.zeros(1), np.ones(1))
    with open_store(server.url, run="other") as store, pytest.raises(BadInputError, match="other"):
        store.read(T_EMB, np.array([1]))


def test_status_and_metrics_expose_the_position_and_the_lag(outbox, served):
    g, follower, server = served
    follower.options = type(follower.options)(follow=False)
    outbox.dump(g, 2, {T_EMB: (np.array([1]), 2.0)})
    follower.poll()
    base = f"http://{server.host}:{server.port}"
    with urllib.request.urlopen(base + "/v1/status") as r:
        status = json.loads(r.read())
    assert (status["generation"], status["seq"], status["lag_dumps"]) == (g, 1, 1)
    assert status["newest_seq"] == 2 and status["lag_s"] > 0
    req = urllib.request.Request(
        base + "/v1/lookup", json.dumps({"table": T_EMB, "ids": [3]}).encode(), method="POST"
    )
    with urllib.request.urlopen(req) as r:
        assert len(json.loads(r.read())["rows"][0]) == 8
    with urllib.request.urlopen(base + "/metrics") as r:
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.read().decode())
            for s in family.samples
        }
    assert samples[("deltarec_replica_version", ())] == g << 32 | 1
    assert samples[("deltarec_replica_lag_dumps", ())] == 1
    assert samples[("deltarec_replica_lookups_total", (("table", T_EMB),))] == 1


def test_replica_urls_name_a_host_and_port_and_nothing_else():
    from deltarec.errors import ConfigError
    from deltarec.stores import parse_store_url

    config = parse_store_url("replica://replica.ml.svc:9000?timeout_s=5")
    assert (config.type, config.host, config.port, config.timeout_s) == (
        "replica", "replica.ml.svc", 9000, 5.0
    )  # fmt: skip
    assert parse_store_url("replica://localhost").port == 8470
    for bad in ("replica://h:1/table", "replica://user@h:1", "replica://h:1?db=0"):
        with pytest.raises(ConfigError, match="replica"):
            parse_store_url(bad)
