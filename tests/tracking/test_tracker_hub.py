"""The tracker hub never drops a lookup silently (one process, tables driven by hand)."""

from __future__ import annotations

import pytest
import torch

from deltarec.artifacts import ArtifactRoot, TableKind, TableSpec
from deltarec.dump import Dumper, DumperConfig
from deltarec.tracking.errors import TrackingError
from deltarec.tracking.plain import RowShardSource
from deltarec.tracking.tracker import ManualTracker, TrackerHub


def _table(hub: TrackerHub, path: str, table_id: str) -> RowShardSource:
    spec = TableSpec(dim=4, kind=TableKind.PLAIN, num_embeddings=50, sharding="table_wise")
    return RowShardSource(table_id, spec, hub, path, torch.randn(50, 4), 0)


def test_a_lookup_filed_under_an_unknown_path_stops_the_dump_naming_table_and_path(tmp_path):
    tracker = ManualTracker()
    owners = {"seq.history": ["seq.ec.history"]}
    hub = TrackerHub(
        tracker,
        {"seq.ec.embeddings.history"},
        explain=lambda path: owners.get(path, []),
    )
    source = _table(hub, "seq.ec.embeddings.history", "seq.ec.history")
    dumper = Dumper(DumperConfig(artifacts=str(tmp_path), run="r", fsync=False), [source])
    dumper.start(step=0)
    try:
        tracker.record("seq.ec.embeddings.history", torch.tensor([1, 2]))
        tracker.record("seq.history", torch.tensor([3, 4, 5]))  # torchrec's misfiled lookups
        with pytest.raises(TrackingError) as e:
            dumper.dump_now(1)
    finally:
        dumper.close()
    assert e.value.tables == ["seq.ec.history"] and e.value.paths == ["seq.history"]
    assert "'seq.ec.history'" in str(e.value) and "'seq.history'" in str(e.value)
    assert "3 id(s)" in str(e.value)
    assert ArtifactRoot(str(tmp_path)).list_dumps("r", 1) == [0]  # only the snapshot


def test_an_unknown_path_no_table_explains_is_still_an_error():
    tracker = ManualTracker()
    hub = TrackerHub(tracker, {"a"})
    tracker.record("a", torch.tensor([1]))
    tracker.record("mystery", torch.tensor([2]))
    with pytest.raises(TrackingError, match=r"'mystery' .*no known table's features"):
        hub.poll()


def test_paths_other_sources_track_are_left_to_them_and_known_ids_are_kept():
    tracker = ManualTracker()
    hub = TrackerHub(tracker, {"a"}, ignored={"zch._managed_collision_modules.ad"})
    tracker.record("a", torch.tensor([4, 1, 4]))
    tracker.record("zch._managed_collision_modules.ad", torch.tensor([7]))
    ids = hub.take("a", 10)
    assert ids is not None and ids.tolist() == [1, 4]


def test_evaluation_lookups_of_recorders_are_dropped_like_the_trackers():
    tracker, recorder = ManualTracker(), ManualTracker()
    hub = TrackerHub(tracker, {"a", "b"}, recorders=[recorder], tracker_fqns={"a"})
    tracker.record("a", torch.tensor([1]))
    recorder.record("b", torch.tensor([2]))
    hub.hold()
    tracker.record("a", torch.tensor([8]))
    recorder.record("b", torch.tensor([9]))
    hub.drop_recorded()
    a, b = hub.take("a", 10), hub.take("b", 10)
    assert a is not None and a.tolist() == [1]
    assert b is not None and b.tolist() == [2]
    # a recorder's table is not one torchrec's tracker may report
    tracker.record("b", torch.tensor([3]))
    with pytest.raises(TrackingError, match="'b'"):
        hub.poll()


def test_lookups_recorded_before_a_generation_starts_are_forgotten_unchecked():
    tracker = ManualTracker()
    hub = TrackerHub(tracker, {"a"})
    tracker.record("a", torch.tensor([1]))
    tracker.record("seq.history", torch.tensor([2]))  # before the snapshot: nothing to miss
    hub.discard_all()
    tracker.record("a", torch.tensor([3]))
    ids = hub.take("a", 10)
    assert ids is not None and ids.tolist() == [3]
