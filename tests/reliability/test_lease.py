"""The run lease (one writer per run) on a local disk and on an S3-compatible object store."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts import lease as lease_module
from deltarec.artifacts.lease import (
    LeaseHeldError,
    LeaseLostError,
    LeaseRecord,
    RunLease,
    check_free,
    current_holder,
    epoch_file,
)
from deltarec.errors import BadInputError


def _foreign_record(run: str, epoch: int, renewed_ago: float, ttl: float = 30.0) -> LeaseRecord:
    now = time.time()
    return LeaseRecord(
        run=run,
        epoch=epoch,
        host="trainer-elsewhere",
        pid=4242,
        since=now - renewed_ago - 100,
        renewed_at=now - renewed_ago,
        ttl_s=ttl,
        generation=7,
        pid_ns="pid:[1]",
    )


def _plant(root: ArtifactRoot, record: LeaseRecord) -> None:
    path = epoch_file(root, record.run, record.epoch)
    assert root.create_exclusive(path, json.dumps(record.to_json()).encode())


def _roots(tmp_path, s3_uri=None):
    if s3_uri is None:
        return ArtifactRoot(str(tmp_path / "art"))
    return ArtifactRoot(s3_uri[0], s3_uri[1])


def _held_then_released(root: ArtifactRoot) -> None:
    first = RunLease.acquire(root, "ctr", ttl_s=30)
    first.set_generation(3)
    with pytest.raises(LeaseHeldError) as err:
        RunLease.acquire(root, "ctr", ttl_s=30)
    message = str(err.value)
    assert f"pid {first.record.pid}" in message and f"host {first.record.host}" in message
    assert "since 20" in message and "generation 3" in message
    with pytest.raises(LeaseHeldError):
        check_free(root, "ctr")
    first.release()
    second = RunLease.acquire(root, "ctr", ttl_s=30)
    assert second.record.epoch == 2
    second.check()
    with pytest.raises(LeaseLostError, match="taken over"):
        first.check()
    second.release()


def test_a_held_lease_refuses_a_second_holder_naming_host_pid_and_since(tmp_path):
    _held_then_released(_roots(tmp_path))


@pytest.mark.integration
def test_the_lease_works_the_same_on_an_s3_compatible_object_store(tmp_path, s3_uri):
    root = _roots(tmp_path, s3_uri)
    _held_then_released(root)
    _plant(root, _foreign_record("ctr", 3, renewed_ago=100))
    taker = RunLease.acquire(root, "ctr", ttl_s=30)
    assert taker.record.epoch == 4


def test_an_expired_lease_is_taken_over_and_its_old_holder_is_fenced(tmp_path):
    root = _roots(tmp_path)
    _plant(root, _foreign_record("ctr", 1, renewed_ago=5))
    with pytest.raises(LeaseHeldError, match="host trainer-elsewhere pid 4242"):
        RunLease.acquire(root, "ctr")
    old = RunLease(root, _foreign_record("ctr", 1, renewed_ago=60))
    holder = current_holder(root, "ctr")
    assert holder is not None and holder.epoch == 1
    # the holder stopped renewing (hung): after its ttl, a new trainer takes over
    root.replace_bytes(
        epoch_file(root, "ctr", 1),
        json.dumps(_foreign_record("ctr", 1, renewed_ago=31).to_json()).encode(),
    )
    new = RunLease.acquire(root, "ctr")
    assert new.record.epoch == 2
    with pytest.raises(LeaseLostError, match=f"pid {new.record.pid}"):
        old.check()
    old.renew()  # a renewal of the old holder does not take the run back
    assert old.lost is not None
    new.check()


class _FakeClock:
    """The lease module's ``time``: ``time()`` and ``monotonic()`` move only when the test
    calls :meth:`advance`; everything else (``sleep``, ``gmtime``, ...) is the real module."""

    def __init__(self) -> None:
        self.wall = time.time()
        self.mono = 1000.0

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds

    def __getattr__(self, name: str):
        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch) -> _FakeClock:
    fake = _FakeClock()
    monkeypatch.setattr(lease_module, "time", fake)
    return fake


def test_a_holder_that_cannot_renew_for_its_ttl_fences_itself(tmp_path, clock):
    root = _roots(tmp_path)
    lease = RunLease.acquire(root, "ctr", ttl_s=0.3)
    clock.advance(0.2)
    lease.check()
    clock.advance(0.2)
    with pytest.raises(LeaseLostError, match="not renewed"):
        lease.check()


def test_renewing_keeps_a_short_lease_alive_and_release_frees_it(tmp_path, clock):
    root = _roots(tmp_path)
    lease = RunLease.acquire(root, "ctr", ttl_s=0.4)
    lease.start_renewing()
    # three steps of 0.3 s (0.9 s in all, past the ttl), each followed by a renewal
    for _ in range(3):
        clock.advance(0.3)
        deadline = time.monotonic() + 30.0
        while current_holder(root, "ctr").renewed_at != clock.wall:
            assert time.monotonic() < deadline, "the lease was not renewed within 30 s"
            time.sleep(0.01)
    lease.check()
    with pytest.raises(LeaseHeldError):
        RunLease.acquire(root, "ctr", ttl_s=0.4)
    lease.release()
    assert RunLease.acquire(root, "ctr").record.epoch == 2


def test_a_crashed_holder_on_this_machine_is_taken_over_at_once(tmp_path):
    root = _roots(tmp_path)
    proc = subprocess.Popen(["sleep", "0"])
    proc.wait()
    lease = RunLease.acquire(root, "ctr", ttl_s=3600)
    dead = LeaseRecord(**{**lease.record.to_json(), "pid": proc.pid, "epoch": 2})
    _plant(root, dead)  # the newest holder: a process of this machine that has exited
    assert RunLease.acquire(root, "ctr", ttl_s=3600).record.epoch == 3


def test_of_trainers_racing_for_an_expired_lease_exactly_one_wins(tmp_path):
    root = _roots(tmp_path)
    _plant(root, _foreign_record("ctr", 1, renewed_ago=100))
    barrier = threading.Barrier(8)
    won: list[int] = []
    refused: list[str] = []

    def contender() -> None:
        mine = ArtifactRoot(root.uri)
        barrier.wait()
        try:
            won.append(RunLease.acquire(mine, "ctr").record.epoch)
        except LeaseHeldError as e:
            refused.append(str(e))

    threads = [threading.Thread(target=contender) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert won == [2] and len(refused) == 7


def test_an_artifact_root_that_is_not_writable_is_named_when_taking_the_lease(tmp_path):
    if os.geteuid() == 0:  # root writes anywhere but in sysfs
        where = Path("/sys/fs") / "deltarec-lease-test"
    else:
        where = tmp_path / "ro"
        where.mkdir()
        where.chmod(0o555)
    with pytest.raises(BadInputError, match=str(where)):
        RunLease.acquire(ArtifactRoot(str(where / "art")), "ctr")
