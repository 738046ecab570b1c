"""Freshness counts from the training step a dump holds, not from its commit."""

from __future__ import annotations

import time
import urllib.request

import pytest
import torch
from tests._helpers.dump import HandTables

from deltarec.artifacts import ArtifactRoot, parse_time
from deltarec.dump import Dumper, DumperConfig, make_train_hook
from deltarec.dump.encode import ParallelShardWriter
from deltarec.dump.env import TrainSettings
from deltarec.dump.hook import DumpHook
from deltarec.ports import free_port
from deltarec.publish import BackgroundPublisher, PublishMetrics
from deltarec.stats import quantile
from deltarec.stores import open_store
from deltarec.tracking.device_budget import DeviceBudget


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


def _scrape(port: int) -> dict[str, float]:
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in page.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.mark.parametrize("with_store", [False, True])
def test_the_trainers_metrics_endpoint_serves_the_dump_paths_counters(tmp_path, with_store):
    tables, port = HandTables(seed=3), free_port()
    cfg = DumperConfig(
        artifacts=str(tmp_path / "art"), run="m", snapshot=False, fsync=False, queue_bytes=1 << 20
    )
    store = f"sqlite:///{tmp_path / 'store.db'}" if with_store else None
    hook = DumpHook(cfg, store=store, sources=lambda m: tables.sources(), metrics_port=port)
    try:
        hook.on_start(torch.nn.Linear(1, 1), 0, None)
        assert hook.dumper is not None
        if with_store:  # rows handed to the publisher come out of the same host budget
            assert hook.dumper.plan.keep_rows_bytes == (1 << 20) // 32
            assert hook.publisher.max_queue_bytes == (1 << 20) // 16
        else:
            assert hook.dumper.plan.keep_rows_bytes == 0 and hook.publisher is None
        budget = hook.dumper.device_budget = DeviceBudget(0.0, capacity_bytes=100)
        assert budget.try_take(torch.device("cpu"), 60, "sparse.a")
        assert not budget.try_take(torch.device("cpu"), 60, "sparse.b")  # the buffer is full
        for step in (1, 2):
            tables.step(step)
            hook.dumper.dump_now(step)
        hook.dumper.wait_idle(timeout=60)
        got = _scrape(port)
    finally:
        hook.close()
    assert got["deltarec_dump_device_staging_full_total"] == 1
    assert got["deltarec_dump_device_staged_total"] == 1
    assert got["deltarec_dump_device_staging_bytes"] == 60
    assert got["deltarec_dump_device_staging_capacity_bytes"] == 100
    assert got["deltarec_dump_host_budget_bytes"] == 1 << 20
    assert 0 < got["deltarec_dump_host_peak_bytes"] <= 1 << 20
    assert got["deltarec_dump_host_held_bytes"] == 0  # every dump written
    assert got["deltarec_dumps_total"] == 2
    assert got["deltarec_dump_last_hold_seconds"] > 0
    assert "deltarec_dump_train_wait_seconds_total" in got
    assert ("deltarec_publish_retries_total" in got) == with_store  # the publisher's, beside
