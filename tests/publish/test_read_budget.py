"""The read-latency budget: probes of serving keys, transactions that shrink, nothing lost."""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.types import TableSpec
from deltarec.errors import ConfigError
from deltarec.faults import SLOW_ENV, slowdown
from deltarec.ids import make_version
from deltarec.publish import DumpPublisher, PublishMetrics
from deltarec.publish import budget as budget_module
from deltarec.publish.budget import (
    MIN_UNIT_ROWS,
    ReadBudget,
    Throttle,
    check_budget,
    throttled,
)
from deltarec.publish.budgetreport import held_back_s
from deltarec.stores import open_store
from deltarec.testing.dumps import new_generation, random_rows, write_dump

T = "sparse.ebc.item_id"
SPEC = TableSpec(dim=32, num_embeddings=1_000_000)
UNIT = 32 * 4 + budget_module.ROW_OVERHEAD  # bytes a row counts for in a transaction's size
STRIDE = 8 + 32 * 4  # bytes a row takes in Redis (its version, then its values)
_PREFIXES = itertools.count()


def _dump(tmp_path, rows: int, seed: int = 1):  # type: ignore[no-untyped-def]
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", {T: SPEC}, world_size=1)
    keys = np.random.default_rng(seed).permutation(1_000_000)[:rows]
    data = random_rows(keys, SPEC, seed=seed)
    return root, write_dump(root, info, 1, {T: {0: data}}), data


def _check_everything_landed(store, manifest, data, marks) -> None:  # type: ignore[no-untyped-def]
    got = store.read(T, data.keys)
    assert got.found.all()
    np.testing.assert_array_equal(got.embedding, data.embedding)
    assert set(got.versions.tolist()) == {make_version(1, 1)}
    rows = [m.rows for m in marks]
    assert rows == sorted(rows) and rows[-1] == len(data) and marks[-1].complete
    assert not any(m.complete for m in marks[:-1])
    (done,) = [m for m in store.registry.progress("r", 1) if m.table == T]
    assert (done.rows, done.complete) == (len(data), True)


# ---- the policy ------------------------------------------------------------------------------
def test_probes_over_the_target_raise_the_pause_by_the_excess_up_to_its_longest():
    policy = ReadBudget(0.001, max_bytes=64 << 20, blocking=False)
    judge = budget_module.JUDGE
    pause = policy.step(1000, 1 << 20, 0.08, [0.0015] * judge)  # 1.5 times the budget
    assert pause == pytest.approx(budget_module.MIN_DUTY * 1.5 * 0.08)
    policy.step(1000, 1 << 20, 0.08, [0.1] * judge)  # far over: at most MAX_STEP a judgement
    assert policy.duty == pytest.approx(budget_module.MIN_DUTY * 1.5 * budget_module.MAX_STEP)
    for _ in range(20):
        pause = policy.step(1000, 1 << 20, 0.04, [0.1] * judge)
    assert pause == pytest.approx(budget_module.MAX_DUTY * 0.04)
    assert policy.step(1000, 1 << 20, 1.0, [0.1] * judge) == budget_module.MAX_PAUSE_S


def test_probes_under_the_target_drop_the_pause_once_the_slow_ones_left_the_window():
    policy = ReadBudget(0.001, max_bytes=64 << 20, blocking=False)
    policy.step(1000, 1 << 20, 0.01, [0.005] * budget_module.JUDGE)
    duty = policy.duty
    assert policy.step(1000, 1 << 20, 0.01, [0.0002] * budget_module.JUDGE) > 0.0
    assert policy.duty == duty  # the window's p99 over, the new probes' under: held
    for _ in range(budget_module.WINDOW // budget_module.JUDGE):
        pause = policy.step(1000, 1 << 20, 0.01, [0.0002] * budget_module.JUDGE)
    assert pause == 0.0 and policy.duty == 0.0  # fallen below MIN_DUTY


def test_sql_transactions_take_a_quarter_second_at_the_rate_measured():
    policy = ReadBudget(0.001, max_bytes=256 << 20, blocking=False)
    assert policy.bytes == budget_module.START_BYTES
    policy.step(10_000, 10_000 * UNIT, 0.1, [])  # 100k rows a second
    assert policy.bytes == pytest.approx(budget_module.TXN_S * 100_000 * UNIT, abs=2)
    slow = ReadBudget(0.001, max_bytes=256 << 20, blocking=False)
    slow.step(10, 10 * UNIT, 1.0, [])  # 10 rows a second: the floor
    assert slow.bytes == budget_module.MIN_UNBLOCKED_BYTES


def test_one_slow_probe_among_a_window_moves_nothing():
    policy = ReadBudget(0.001, max_bytes=64 << 20, blocking=False)
    during = [0.0004] * (budget_module.WINDOW - 1) + [0.25]
    assert policy.step(1000, policy.bytes, 0.01, during) == 0.0
    assert policy.duty == 0.0 and policy.last_p99_s == pytest.approx(0.0004)


def test_reads_slowed_with_nothing_written_raise_the_target_not_the_pauses():
    quiet = [0.002] * budget_module.MIN_QUIET  # the machine's own noise: 2 ms
    noisy = ReadBudget(0.001, max_bytes=64 << 20, blocking=False)
    assert noisy.step(1000, 1 << 20, 0.01, [0.0022] * budget_module.JUDGE, quiet) == 0.0
    assert noisy.target_s() == pytest.approx(0.001 + 0.002 - 0.0005)
    calm = ReadBudget(0.001, max_bytes=64 << 20, blocking=False)  # no noise measured
    assert calm.step(1000, 1 << 20, 0.01, [0.0022] * budget_module.JUDGE) > 0.0
    assert calm.target_s() == 0.001


def test_too_few_probes_change_nothing():
    policy = ReadBudget(0.001, max_bytes=64 << 20, blocking=False)
    assert policy.step(1000, 1 << 20, 0.01, [0.5] * (budget_module.JUDGE - 1)) == 0.0
    assert policy.duty == 0.0 and policy.last_p99_s is None


def test_a_blocking_stores_units_hold_the_server_within_their_share_by_its_time_per_row():
    policy = ReadBudget(0.002, max_bytes=64 << 20, blocking=True, units=True)
    assert policy.unit_rows == budget_module.START_UNIT_ROWS  # nothing known of the store yet
    assert policy.bytes == budget_module.UNIT_TXN_BYTES
    # the client took a second (its own work), the server 2 us a row: only the server counts
    policy.step(15000, 15000 * UNIT, 1.0, [0.0002] * 8, held_s=15000 * 2e-6)
    share = budget_module.UNIT_SHARE * (0.002 - 0.0002)
    assert policy.unit_rows == int(share / 2e-6)  # 450 rows: 0.9 ms of the server
    noisy = ReadBudget(0.002, max_bytes=64 << 20, blocking=True, units=True)
    noisy.step(15000, 15000 * UNIT, 1.0, [0.0002] * 8, [0.02] * 64, held_s=15000 * 2e-6)
    assert noisy.target_s() > 0.02 and noisy.unit_rows <= policy.unit_rows  # noise: no longer
    policy.step(15000, 15000 * UNIT, 1.0, [0.0002] * 8, held_s=15000 * 1e-3)
    policy.step(15000, 15000 * UNIT, 1.0, [0.0002] * 8, held_s=15000 * 1e-3)
    assert policy.unit_rows == MIN_UNIT_ROWS  # a slow server: the fewest rows, still moving
    whole = ReadBudget(0.002, max_bytes=64 << 20, blocking=True)  # no units: transactions
    assert whole.bytes == budget_module.MIN_BYTES and whole.unit_rows is None
    whole.step(15000, 15000 * UNIT, 1.0, [0.0002] * 8, held_s=15000 * 2e-6)
    assert whole.bytes == int(share / 2e-6) * UNIT


def test_over_the_target_a_blocking_stores_units_shrink_before_any_pause():
    policy = ReadBudget(0.002, max_bytes=64 << 20, blocking=True, units=True)
    judge = budget_module.JUDGE
    held = 15000 * 2e-6  # the server: 2 us a row
    policy.step(15000, 15000 * UNIT, 0.1, [], held_s=held)
    full = policy.unit_rows
    assert full is not None and policy.share == budget_module.UNIT_SHARE
    pause = policy.step(15000, 15000 * UNIT, 0.1, [0.003] * judge, held_s=held)  # 1.5x
    assert pause == 0.0 and policy.duty == 0.0
    assert policy.share == pytest.approx(budget_module.UNIT_SHARE / 1.5)
    assert policy.unit_rows is not None and policy.unit_rows < full  # shorter units
    for _ in range(8):  # far over: the share falls to its floor
        pause = policy.step(15000, 15000 * UNIT, 0.1, [0.1] * judge, held_s=held)
    assert policy.share == budget_module.MIN_UNIT_SHARE
    # every read during the writes is slow: no pause the publisher makes dilutes them to a p99
    assert pause == 0.0 and policy.duty == 0.0 and policy.futile > 0


def _one_slow_in(n: int, slow: float) -> list[float]:
    return [0.0002] * (n - 1) + [slow]


def test_units_at_their_floor_pause_as_long_as_dilutes_the_slow_reads_to_a_p99():
    policy = ReadBudget(0.002, max_bytes=64 << 20, blocking=True, units=True)
    judge = budget_module.JUDGE
    held = 15000 * 1e-3  # a slow server, 1 ms a row: units of the fewest rows, 8 ms
    for _ in range(4):  # 1 read in 64 at 10 ms: what such a unit makes a read wait
        pause = policy.step(15000, 15000 * UNIT, 0.1, _one_slow_in(judge, 0.01), held_s=held)
    assert policy.unit_rows == MIN_UNIT_ROWS
    # 1/64 of the writes' reads slow: a pause of 0.5625 of each write leaves 1 % of all
    assert policy.duty == pytest.approx(100 / judge - 1)
    assert pause == pytest.approx(policy.duty * 0.1)
    assert policy.futile == 0
    two = [0.0002] * (judge - 2) + [0.01, 0.01]  # 1/32: it would take 2.1 times the write
    for _ in range(4):
        pause = policy.step(15000, 15000 * UNIT, 0.1, two, held_s=held)
    assert pause == 0.0 and policy.duty == 0.0 and policy.futile > 0


def test_reads_far_slower_than_a_unit_pause_the_writes_and_keep_the_units():
    policy = ReadBudget(0.002, max_bytes=64 << 20, blocking=True, units=True)
    judge = budget_module.JUDGE
    held = 15000 * 2e-6  # 2 us a row: units of 0.9 ms at most
    # most reads 0.2 ms, 1 in 64 at 20 ms: no unit of 0.9 ms makes a read wait that long
    for _ in range(4):
        pause = policy.step(15000, 15000 * UNIT, 0.1, _one_slow_in(judge, 0.02), held_s=held)
    assert pause > 0.0 and policy.duty == pytest.approx(100 / judge - 1)
    full = int(budget_module.UNIT_SHARE * (0.002 - 0.0002) / 2e-6)  # the share, less a read
    assert policy.share == budget_module.UNIT_SHARE and policy.unit_rows == full


def test_under_the_target_the_pauses_go_first_then_the_units_grow_back():
    policy = ReadBudget(0.002, max_bytes=64 << 20, blocking=True, units=True)
    judge = budget_module.JUDGE
    held = 15000 * 2e-6
    policy.step(15000, 15000 * UNIT, 0.1, [], held_s=held)
    policy.duty, policy.share = 0.5, budget_module.MIN_UNIT_SHARE  # as a slow spell left them
    policy.step(15000, 15000 * UNIT, 0.1, [0.0017] * judge, held_s=held)  # within the target
    # the writes' own reads are within it: nothing to dilute, the pause goes at once
    assert policy.duty == 0.0 and policy.share == budget_module.MIN_UNIT_SHARE
    policy.step(15000, 15000 * UNIT, 0.1, [0.0017] * judge, held_s=held)  # over 3/4 of it
    assert policy.share == budget_module.MIN_UNIT_SHARE
    for _ in range(8):  # well under the target
        policy.step(15000, 15000 * UNIT, 0.1, [0.0002] * judge, held_s=held)
    assert policy.duty == 0.0 and policy.share == budget_module.UNIT_SHARE


def test_a_store_whose_writes_do_not_block_reads_is_only_paused():
    policy = ReadBudget(0.001, max_bytes=64 << 20, blocking=False)
    policy.step(1000, 1 << 20, 0.08, [0.0015] * budget_module.JUDGE)
    assert policy.share == budget_module.UNIT_SHARE and policy.duty > 0.0


def test_a_budget_must_be_positive_milliseconds():
    assert check_budget(None) is None and check_budget(2.5) == 2.5
    with pytest.raises(ConfigError, match="--read-p99-ms must be a positive number"):
        check_budget(0, "--read-p99-ms")


def test_the_slow_point_reads_milliseconds_per_megabyte(monkeypatch):
    assert slowdown("redis.exec") == 0.0
    monkeypatch.setenv(SLOW_ENV, "redis.exec:250")
    assert slowdown("redis.exec") == 0.25 and slowdown("other") == 0.0
    monkeypatch.setenv(SLOW_ENV, "redis.exec:fast")
    with pytest.raises(ValueError, match="expected POINT:MS"):
        slowdown("redis.exec")


# ---- against real stores ---------------------------------------------------------------------
# A throttle made on the test's own thread does not yield the CPU: unprivileged, a thread that
# lowered its priority cannot raise it back, and the rest of the session would run lowered.
def test_without_a_budget_the_publisher_is_left_as_it_was(tmp_path):
    root, _, _ = _dump(tmp_path, 10)
    store = open_store(f"sqlite:///{tmp_path}/s.db", run="r")
    pub = DumpPublisher(store, root, "r")
    before = (pub.batch_bytes, pub.after_batch)
    assert throttled(pub, None) is None
    assert (pub.batch_bytes, pub.after_batch) == before
    store.close()


def test_a_budget_on_a_redis_that_fsyncs_its_file_warns_that_it_cannot_hold_those_stalls(
    tmp_path, redis_server, caplog
):
    root, _, _ = _dump(tmp_path, 10)
    store = open_store(f"{redis_server.url}?prefix=budget{next(_PREFIXES)}:", run="r")
    pub = DumpPublisher(store, root, "r")
    with caplog.at_level("WARNING", logger=budget_module.__name__):
        Throttle(pub, 5.0, yield_cpu=False).close()
    (warning,) = [r.getMessage() for r in caplog.records if "append-only" in r.getMessage()]
    assert store.describe() in warning and "appendfsync everysec" in warning
    store.close()


def test_the_probe_starts_with_the_throttle_and_reads_nothing_until_the_first_write(tmp_path):
    root, manifest, data = _dump(tmp_path, 500, seed=4)
    store = open_store(f"sqlite:///{tmp_path}/s.db", run="r")
    marks: list = []
    pub = DumpPublisher(store, root, "r", after_batch=lambda m, n: marks.append(m))
    throttle = Throttle(pub, 50.0, probe_interval_s=0.002, yield_cpu=False)
    try:
        probe = throttle._probe
        assert probe is not None and probe.alive()  # started before any write
        time.sleep(0.5)
        assert probe.take() == []  # no name yet: nothing read
        pub.publish_generation(1)
    finally:
        report = throttle.close()
    _check_everything_landed(store, manifest, data, marks)
    assert report.probes >= budget_module.BASELINE_PROBES  # aimed at the first write
    assert not probe.alive()
    with pytest.raises(ValueError, match="a serving name of 1 to"):
        probe.aim("")
    store.close()


def test_where_serving_holds_rows_the_noise_is_measured_before_the_first_write(tmp_path):
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", {T: SPEC}, world_size=1)
    keys = np.arange(2000)
    write_dump(root, info, 1, {T: {0: random_rows(keys, SPEC, seed=1)}})
    data = random_rows(keys, SPEC, seed=2)
    manifest = write_dump(root, info, 2, {T: {0: data}})
    store = open_store(f"sqlite:///{tmp_path}/s.db", run="r")
    DumpPublisher(store, root, "r").publish_dump(root.read_manifest("r", 1, 1), 0)
    marks: list = []
    pub = DumpPublisher(store, root, "r", after_batch=lambda m, n: marks.append(m))
    pub.batch_bytes = 32 << 10  # several transactions
    writes: list[float] = []
    inner = store.apply
    store.apply = lambda w: (writes.append(time.monotonic()), inner(w))[1]  # type: ignore[method-assign]
    throttle = Throttle(pub, 50.0, probe_interval_s=0.002, yield_cpu=False)
    assert throttle._probe is not None
    taken: list[tuple[float, float]] = []
    take = throttle._probe.take
    throttle._probe.take = lambda: (got := take(), taken.extend(got))[0]  # type: ignore[method-assign]
    try:
        pub.publish_dump(manifest, 0)
    finally:
        throttle.close()
    before = [at for at, _ in taken if at < writes[0]]
    assert len(before) >= budget_module.BASELINE_PROBES  # the noise before the first write
    assert len(marks) > 2
    got = store.read(T, keys)
    np.testing.assert_array_equal(got.embedding, data.embedding)
    assert set(got.versions.tolist()) == {make_version(1, 2)}
    store.close()


def test_the_redis_probe_samples_few_keys_at_a_time(redis_server):
    import redis

    from deltarec.publish import probe as probe_module

    name = f"budget{next(_PREFIXES)}:keys"
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    client.hset(name, mapping={str(k): b"x" for k in range(2000)})
    try:
        target = probe_module.ProbeTarget(
            "redis", {"host": "127.0.0.1", "port": redis_server.port}, name
        )
        read, sample = probe_module._reader(target)
        keys = sample()
        assert 0 < len(keys) <= probe_module.REDIS_KEYS < 64  # HRANDFIELD runs alone: kept short
        assert set(keys) <= set(range(2000)) and read(keys[0]) == b"x"
    finally:
        client.delete(name)
        client.close()


def test_a_budget_on_sqlite_warns_of_no_server_stall(tmp_path, caplog):
    root, _, _ = _dump(tmp_path, 10)
    store = open_store(f"sqlite:///{tmp_path}/s.db", run="r")
    with caplog.at_level("WARNING", logger=budget_module.__name__):
        Throttle(DumpPublisher(store, root, "r"), 5.0, yield_cpu=False).close()
    assert not [r for r in caplog.records if "append-only" in r.getMessage()]
    store.close()


def test_a_slowed_redis_gets_small_units_probed_reads_and_loses_nothing(
    tmp_path, redis_server, monkeypatch
):
    monkeypatch.setenv(SLOW_ENV, "redis.exec:400")  # 400 ms a megabyte, on the server
    root, manifest, data = _dump(tmp_path, 6000)
    store = open_store(f"{redis_server.url}?prefix=budget{next(_PREFIXES)}:", run="r")
    marks, units = [], [budget_module.START_UNIT_ROWS]
    metrics = PublishMetrics()

    def hook(mark, n):  # type: ignore[no-untyped-def]
        marks.append(mark)
        units.append(store.unit_rows)  # the next transaction's

    pub = DumpPublisher(store, root, "r", metrics=metrics, after_batch=hook)
    monkeypatch.setattr(budget_module, "UNIT_TXN_BYTES", 64 << 10)  # several transactions
    monkeypatch.setattr(budget_module, "MIN_QUIET", 10**9)  # the target is the budget alone
    budget_ms = 20.0  # well above the noise of a write's round trips on a loaded machine
    with Throttle(pub, budget_ms, yield_cpu=False) as throttle:  # the test's own thread
        pub.publish_generation(1)
    report = throttle.close()
    _check_everything_landed(store, manifest, data, marks)
    slowest_s = max(units[: len(marks)]) * STRIDE * 0.4 / 1e6  # the slow point's wait, a unit
    assert slowest_s <= budget_ms / 1000  # no unit held the readers past the budget
    assert max(units) < budget_module.MAX_UNIT_ROWS  # sized down from the server's time
    assert len(marks) > 5
    assert report.probes > 0 and report.probe_p50_ms is not None
    assert report.smallest_unit_rows == min(units) and report.last_unit_rows == units[-1]
    assert report.transactions == len(marks)  # every committed transaction, timed
    assert report.writing_s >= marks[-1].rows * STRIDE * 0.4 / 1e6  # the slow point's waits
    assert report.server_s is not None  # of which the server's own (its scripts), counted
    assert marks[-1].rows * STRIDE * 0.4 / 1e6 <= report.server_s <= report.writing_s
    assert (pub.batch_bytes, pub.after_batch) == (store.capabilities.batch_bytes, hook)
    assert store.unit_rows is None and not store.server_timing  # a transaction per batch again
    assert metrics.value("deltarec_publish_read_probe_p99_seconds") > 0
    # the last write held the server (its scripts) at least for the slow point's waits
    rows = marks[-1].rows - marks[-2].rows
    assert store.last_write_held_s >= rows * STRIDE * 0.4 / 1e6
    store.close()


def test_an_unattainable_budget_on_redis_writes_on_in_the_least_units_without_pauses(
    tmp_path, redis_server, monkeypatch, caplog
):
    monkeypatch.setenv(SLOW_ENV, "redis.exec:400")  # every unit holds the readers
    root, manifest, data = _dump(tmp_path, 3000)
    store = open_store(f"{redis_server.url}?prefix=budget{next(_PREFIXES)}:", run="r")
    marks: list = []
    pub = DumpPublisher(store, root, "r", after_batch=lambda mark, n: marks.append(mark))
    monkeypatch.setattr(budget_module, "UNIT_TXN_BYTES", 16 << 10)  # many judgements
    monkeypatch.setattr(budget_module, "JUDGE", 1)  # judged on every probe
    monkeypatch.setattr(budget_module, "MIN_QUIET", 10**9)  # the target is the budget alone
    pauses: list[float] = []
    step = ReadBudget.step
    monkeypatch.setattr(
        ReadBudget, "step", lambda self, *a, **k: pauses.append(step(self, *a, **k)) or pauses[-1]
    )
    budget_ms = 0.001  # 1 us: no read is that fast
    with (
        caplog.at_level("WARNING", logger=budget_module.__name__),
        Throttle(pub, budget_ms, yield_cpu=False) as throttle,
    ):
        pub.publish_generation(1)
    report = throttle.close()
    _check_everything_landed(store, manifest, data, marks)
    assert report.futile_judgements > 0
    assert report.smallest_unit_rows == MIN_UNIT_ROWS  # the units shrank as far as they go
    assert len(pauses) == len(marks) and max(pauses) == 0.0  # no pause: every read is slow
    (warning,) = [r for r in caplog.records if "too often for pauses" in r.getMessage()]
    assert "writing on without pauses" in warning.getMessage()
    store.close()


def test_an_unattainable_budget_pauses_postgres_transactions_and_loses_nothing(
    tmp_path, postgres_server, monkeypatch
):
    monkeypatch.setattr(budget_module, "START_BYTES", 64 << 10)
    monkeypatch.setattr(budget_module, "MIN_UNBLOCKED_BYTES", 8 << 10)
    monkeypatch.setattr(budget_module, "TXN_S", 1e-6)  # the smallest transactions: many
    monkeypatch.setattr(budget_module, "JUDGE", 1)  # judged on every probe: however fast it runs
    monkeypatch.setattr(budget_module, "MAX_PAUSE_S", 0.02)  # the test stays short
    monkeypatch.setattr(budget_module, "MIN_QUIET", 10**9)  # no noise raises the target
    root, manifest, data = _dump(tmp_path, 4000, seed=2)
    url = f"{postgres_server.url}?schema=budget{tmp_path.name[-12:]}"
    store = open_store(url, run="r")
    marks = []
    metrics = PublishMetrics()
    pub = DumpPublisher(store, root, "r", metrics=metrics, after_batch=lambda m, n: marks.append(m))
    throttle = Throttle(pub, 0.0001, yield_cpu=False)  # 0.1 us: every probe read is over it
    pub.publish_generation(1)
    report = throttle.close()
    _check_everything_landed(store, manifest, data, marks)
    sizes = np.diff([0] + [m.rows for m in marks]) * UNIT
    assert sizes[0] > 32 << 10  # started at START_BYTES ...
    assert report.smallest_batch_bytes == 8 << 10  # ... then sized by the rate: the floor
    assert sizes[-2] <= 8 << 10
    assert report.held_back_s > 0
    assert metrics.value("deltarec_publish_held_back_seconds_total") == pytest.approx(
        report.held_back_s, abs=1e-3
    )
    assert report.probe_p99_ms is not None and report.probe_p99_ms > 0.0001
    store.close()


def test_probes_between_two_dumps_count_as_noise_not_as_writing(tmp_path, redis_server):
    import time

    root, manifest, data = _dump(tmp_path, 500, seed=5)
    store = open_store(f"{redis_server.url}?prefix=budget{next(_PREFIXES)}:", run="r")
    pub = DumpPublisher(store, root, "r")
    throttle = Throttle(pub, 50.0, yield_cpu=False)
    pub.publish_dump(manifest, 0)  # the probe starts, then its baseline
    time.sleep(0.5)  # no write: what the probe reads now is the machine's noise
    second = write_dump(root, root.read_generation("r", 1), 2, {T: {0: data.slice(0, 100)}})
    pub.publish_dump(second, 0)  # a second write: a few milliseconds
    policy = throttle.policy
    assert len(policy._quiet) >= budget_module.BASELINE_PROBES + 20  # baseline, then idle
    assert len(policy._during) < 20
    throttle.close()
    assert "apply" not in vars(store)  # the store's own apply again
    store.close()


def test_the_trainers_background_publisher_publishes_under_its_budget(tmp_path, redis_server):
    from deltarec.publish import BackgroundPublisher

    root, manifest, data = _dump(tmp_path, 3000, seed=3)
    url = f"{redis_server.url}?prefix=budget{next(_PREFIXES)}:"
    bg = BackgroundPublisher(url, root.uri, "r", 0, 1, read_p99_ms=50.0)
    bg.submit(manifest, None)
    bg.close(timeout=120)
    assert bg.throttle is not None
    report = bg.throttle.close()
    assert report.read_p99_ms == 50.0 and report.probes > 0
    assert held_back_s(root, "r", 1) == report.held_back_s  # what verify's KFP metrics carry
    assert held_back_s(root, "r", 2) is None
    assert [p.rows for p in bg.results] == [3000]
    with open_store(url, run="r") as store:
        got = store.read(T, data.keys)
        assert got.found.all() and set(got.versions.tolist()) == {make_version(1, 1)}


def test_the_budget_reaches_the_trainer_from_the_pipeline_and_the_environment():
    from deltarec.dump.env import TrainSettings
    from deltarec.orchestrate.params import PipelineParams
    from deltarec.orchestrate.train_step import train_args, train_settings_env

    params = PipelineParams(
        run_name="r", artifact_root="/a", store_url="sqlite:///s.db", read_p99_ms=2.5
    )
    args = train_args(params)
    assert args[args.index("--read-p99-ms") + 1] == "2.5"
    settings = TrainSettings.from_env(train_settings_env(params))
    assert settings.hook_arguments()["read_p99_ms"] == 2.5
    assert "--read-p99-ms" not in train_args(params.model_copy(update={"read_p99_ms": 0.0}))
    assert "read_p99_ms" not in TrainSettings(artifacts="/a", run="r").hook_arguments()


def test_publish_under_a_budget_says_what_it_held_back(tmp_path, capsys):
    from deltarec.cli import main

    root, _, data = _dump(tmp_path, 2000, seed=4)
    url = f"sqlite:///{tmp_path}/s.db"
    args = ["publish", "--artifacts", root.uri, "--run", "r", "--store", url, "--json"]
    # the test's own thread keeps its priority (the yielding threads are tested below)
    assert main([*args, "--read-p99-ms", "20", "--no-yield-cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] == 2000
    assert out["budget"]["read_p99_ms"] == 20.0 and out["budget"]["probes"] > 0
    assert out["budget"]["held_back_s"] >= 0.0
    assert main([*args, "--read-p99-ms", "0"]) == 2
    assert "--read-p99-ms must be a positive number of milliseconds" in capsys.readouterr().err
    with open_store(url, run="r") as store:
        assert store.read(T, data.keys).found.all()


# ---- the publisher's threads yield the CPU -----------------------------------------------------
def _on_a_thread(work) -> None:  # type: ignore[no-untyped-def]
    """``work()`` on a thread of its own (the test's thread keeps its priority); its error."""
    import threading

    error: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as e:  # raised again on the test's thread
            error.append(e)

    thread = threading.Thread(target=run, name="test-publisher")
    thread.start()
    thread.join(120)
    assert not thread.is_alive() and not error, error


def _priorities_while_publishing(tmp_path, redis_server, yield_cpu: bool | None):  # type: ignore[no-untyped-def]
    """The priorities of the publishing thread, its helper threads and the probe mid-publish.

    ``yield_cpu`` None: no budget.
    """
    import os
    import threading

    from deltarec.publish import yieldcpu

    root, manifest, data = _dump(tmp_path, 3000, seed=6)
    store = open_store(f"{redis_server.url}?prefix=budget{next(_PREFIXES)}:", run="r")
    seen: dict[str, object] = {}
    marks = []
    throttles: list[Throttle | None] = []

    def hook(mark, n):  # type: ignore[no-untyped-def]
        marks.append(mark)
        if seen:
            return
        seen["publisher"] = yieldcpu.thread_priority()
        seen["helpers"] = {
            t.name: yieldcpu.thread_priority(t.native_id)
            for t in threading.enumerate()
            if t.name.startswith(("publish-read", "shard-sha256")) and t.native_id
        }
        probe = throttles[0]._probe if throttles and throttles[0] else None
        if probe is not None:
            pid = probe._process.pid
            assert pid is not None
            seen["probe"] = yieldcpu.Priority(os.sched_getscheduler(pid), os.getpriority(0, pid))

    pub = DumpPublisher(store, root, "r", after_batch=hook)
    pub.batch_bytes = 64 << 10  # several transactions

    def publish() -> None:  # the throttle is made on the publishing thread, as the CLI does
        throttles.append(None if yield_cpu is None else Throttle(pub, 50.0, yield_cpu=yield_cpu))
        try:
            pub.publish_generation(1)
        finally:
            if throttles[0] is not None:
                throttles[0].close()

    _on_a_thread(publish)
    _check_everything_landed(store, manifest, data, marks)
    store.close()
    return seen


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_IDLE"), reason="Linux scheduling only")
def test_under_a_budget_the_publishers_threads_run_at_the_lowest_priority_the_probe_does_not(
    tmp_path, redis_server
):
    import os

    from deltarec.publish import yieldcpu

    mine = yieldcpu.thread_priority()
    seen = _priorities_while_publishing(tmp_path, redis_server, yield_cpu=True)
    publisher = seen["publisher"]
    assert isinstance(publisher, yieldcpu.Priority) and publisher.policy == os.SCHED_IDLE
    helpers = seen["helpers"]
    assert isinstance(helpers, dict) and helpers  # the read-ahead thread at least
    assert {p.policy for p in helpers.values()} == {os.SCHED_IDLE}
    assert seen["probe"] == mine  # the probe times reads at serving's priority
    assert yieldcpu.thread_priority() == mine  # the test's own thread never changed


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_IDLE"), reason="Linux scheduling only")
@pytest.mark.parametrize("yield_cpu", [None, False], ids=["no budget", "budget, no-yield-cpu"])
def test_without_a_budget_or_with_yield_cpu_off_the_publisher_keeps_its_priority(
    tmp_path, redis_server, yield_cpu
):
    from deltarec.publish import yieldcpu

    mine = yieldcpu.thread_priority()
    seen = _priorities_while_publishing(tmp_path, redis_server, yield_cpu=yield_cpu)
    assert seen["publisher"] == mine
    helpers = seen["helpers"]
    assert isinstance(helpers, dict) and helpers and set(helpers.values()) == {mine}


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_IDLE"), reason="Linux scheduling only")
def test_a_kept_thread_runs_jobs_of_its_own_priority_only():
    import os

    from deltarec import threads
    from deltarec.publish import yieldcpu

    def priority_of_a_job() -> yieldcpu.Priority | None:
        got: list[yieldcpu.Priority | None] = []
        threads.start(lambda: got.append(yieldcpu.thread_priority()), "test-job").join(10)
        return got[0]

    normal = priority_of_a_job()  # leaves a kept thread of normal priority idle
    lowered: list[yieldcpu.Priority | None] = []

    def on_a_lowered_thread() -> None:
        assert yieldcpu.lower() == normal
        lowered.append(priority_of_a_job())  # not the normal one left idle

    _on_a_thread(on_a_lowered_thread)
    assert lowered[0] is not None and lowered[0].policy == os.SCHED_IDLE
    assert priority_of_a_job() == normal  # never the lowered kept thread left idle
