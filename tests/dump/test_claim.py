"""Rank 0's claim at start: the lease first, then a generation; a failure leaves the run free."""

from __future__ import annotations

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.lease import RunLease
from deltarec.artifacts.types import TableSpec
from deltarec.dump.claim import GenerationClaim
from deltarec.dump.config import DumperConfig

TABLES = {"t": TableSpec(dim=4)}


def _claim(tmp_path, on_generation=None) -> tuple[ArtifactRoot, GenerationClaim]:
    root = ArtifactRoot(str(tmp_path / "art"))
    config = DumperConfig(artifacts=root.uri, run="r")
    return root, GenerationClaim(root, config, 2, TABLES, None, on_generation)


def test_a_claim_holds_the_lease_and_allocates_the_next_generation(tmp_path):
    _, claim = _claim(tmp_path)
    kept: list[RunLease | None] = []
    status, info = claim.run(kept.append)
    assert status == "ok" and info["generation"] == 1 and info["world_size"] == 2
    assert len(kept) == 1 and kept[0] is not None and kept[0].record.generation == 1
    kept[0].release()
    status, info = claim.run(kept.append)
    assert status == "ok" and info["generation"] == 2
    kept[-1].release()  # type: ignore[union-attr]


def test_a_run_another_writer_holds_is_refused_and_no_lease_is_kept(tmp_path):
    root, claim = _claim(tmp_path)
    holder = RunLease.acquire(root, "r", ttl_s=30)
    kept: list[RunLease | None] = []
    status, why = claim.run(kept.append)
    assert status == "held" and f"pid {holder.record.pid}" in why
    assert kept == [] and root.list_generations("r") == []
    holder.release()


def test_a_failing_generation_hook_releases_the_lease_it_took(tmp_path):
    def refuse(info):  # type: ignore[no-untyped-def]
        raise RuntimeError("no room for generation")

    root, claim = _claim(tmp_path, refuse)
    kept: list[RunLease | None] = []
    status, why = claim.run(kept.append)
    assert status == "error" and why == "RuntimeError: no room for generation"
    assert len(kept) == 2 and kept[0] is not None and kept[1] is None
    RunLease.acquire(root, "r", ttl_s=30).release()  # free again at once


def test_a_bad_lease_ttl_is_an_error_outcome_not_an_exception(tmp_path):
    root = ArtifactRoot(str(tmp_path / "art"))
    config = DumperConfig.model_construct(artifacts=root.uri, run="r", lease_ttl_s=0.0)
    status, why = GenerationClaim(root, config, 1, TABLES, None, None).run(lambda lease: None)
    assert status == "error" and "ttl_s must be positive" in why
