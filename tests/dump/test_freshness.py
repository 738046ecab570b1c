"""Freshness counts from the training step a dump holds, not from its commit."""

from __future__ import annotations

import time
import urllib.request

import pytest
from tests._helpers.dump import HandTables

from deltarec.artifacts import ArtifactRoot, parse_time
from deltarec.dump import Dumper, DumperConfig, make_train_hook
from deltarec.dump.encode import ParallelShardWriter
from deltarec.dump.env import TrainSettings
from deltarec.publish import BackgroundPublisher, PublishMetrics
from deltarec.publish.metrics import quantile
from deltarec.stores import open_store
from deltarec.testing.servers import free_port


def test_freshness_counts_from_the_dump_step_and_the_trainers_publisher_serves_it(
    tmp_path, monkeypatch
):
    slow = ParallelShardWriter._append

    def slow_append(self, data):  # the worker takes a while to write: commit comes later
        time.sleep(0.1)
        slow(self, data)

    monkeypatch.setattr(ParallelShardWriter, "_append", slow_append)
    tables = HandTables(seed=11)
    cfg = DumperConfig(artifacts=str(tmp_path / "art"), run="f", snapshot=False, fsync=False)
    d = Dumper(cfg, tables.sources())
    d.start(step=0)
    tables.step(1)
    before = time.time()
    d.dump_now(1)
    manifest = d._worker.wait_committed(1, timeout=60) if d._worker else None
    d.close()
    assert manifest is not None
    taken = parse_time(manifest.extra["taken_at"])
    assert before <= taken <= parse_time(manifest.created_at) - 0.3  # 2 tables x >= 2 writes
    assert ArtifactRoot(str(tmp_path / "art")).read_manifest("f", 1, 1).extra == manifest.extra

    url, port, metrics = f"sqlite:///{tmp_path / 'store.db'}", free_port(), PublishMetrics()
    pub = BackgroundPublisher(
        url, str(tmp_path / "art"), "f", 0, 1, metrics=metrics, metrics_port=port
    )
    pub.submit(manifest, None)
    pub.close(timeout=30)
    (part,) = pub.results
    assert part.freshness_s is not None and part.lag_s is not None
    assert part.freshness_s >= part.lag_s + 0.3
    with open_store(url) as store:
        (record,) = store.freshness("f", 1)
    assert record.committed_at == pytest.approx(taken)
    p99 = metrics.value("deltarec_publish_freshness_p99_seconds")
    assert p99 == metrics.value("deltarec_publish_freshness_p50_seconds") == part.freshness_s
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "deltarec_publish_freshness_p99_seconds" in page
    assert "deltarec_publish_lag_seconds" in page


def test_the_training_settings_carry_the_publishers_metrics_port(tmp_path):
    env = {"DELTAREC_ARTIFACTS": str(tmp_path), "DELTAREC_RUN": "r"}
    env["DELTAREC_METRICS_PORT"] = "9464"
    args = TrainSettings.from_env(env).hook_arguments()
    assert args["metrics_port"] == 9464
    assert make_train_hook(**args).metrics_port == 9464


def test_freshness_quantiles_are_nearest_rank():
    values = [float(x) for x in range(1, 101)]
    assert quantile(values, 0.5) == 50.0 and quantile(values, 0.99) == 99.0
    assert quantile([3.0], 0.99) == 3.0 and quantile(values, 1.0) == 100.0
