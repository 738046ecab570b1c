"""The chain, compaction and retention on a real S3-compatible object store (SeaweedFS)."""

from __future__ import annotations

import numpy as np
import pytest
from tests.artifacts.test_compact import RUN, SPECS, History

from deltarec.artifacts import ArtifactRoot, DumpKind
from deltarec.artifacts.base import list_bases
from deltarec.artifacts.compact import compact
from deltarec.artifacts.lineage import expected_state
from deltarec.artifacts.retention import Needs, apply, plan
from deltarec.errors import MissingDumpError

pytestmark = pytest.mark.integration


@pytest.fixture
def h(s3_server) -> History:
    uri, opts = s3_server.fresh_uri()
    return History(ArtifactRoot(uri, opts))


def test_on_s3_a_missing_dump_is_refused_and_a_base_replaces_the_dumps_gc_deletes(h):
    info = h.generation()
    h.dump(info, 0, DumpKind.SNAPSHOT, n=60)
    for seq in range(1, 6):
        h.dump(info, seq, evict=1)
    full = expected_state(h.root, RUN, info.generation)
    rows = {t: full.tables[t].load(full.tables[t].keys) for t in SPECS}
    assert compact(h.root, RUN, through_seq=4, part_rows=25).written
    assert list_bases(h.root, RUN) == [(info.generation, 4)]
    decisions = plan(h.root, RUN, Needs())
    assert sorted(d.seq for d in decisions if d.delete and d.kind == "dump") == [0, 1, 2, 3, 4]
    assert apply(h.root, RUN, decisions) == 5
    fresh = ArtifactRoot(h.root.uri, h.root.fs.storage_options)  # no listing cache
    assert fresh.list_dumps(RUN, info.generation) == [5]
    listed = fresh.fs.ls(fresh.gen_dir(RUN, info.generation), detail=False)
    assert sorted(p.rsplit("/", 1)[-1] for p in listed) == ["GENERATION.json", "dump-000005"]
    state = expected_state(fresh, RUN, info.generation)
    assert state.base is not None and [m.seq for m in state.manifests] == [5]
    for t in SPECS:
        np.testing.assert_array_equal(state.tables[t].keys, full.tables[t].keys)
        np.testing.assert_array_equal(state.tables[t].versions, full.tables[t].versions)
        np.testing.assert_array_equal(state.tables[t].load(state.tables[t].keys), rows[t])
    h.dump(info, 6)
    h.dump(info, 7)
    fresh.fs.rm(fresh.manifest_file(RUN, info.generation, 6))
    with pytest.raises(MissingDumpError, match="dump 6 is missing"):
        ArtifactRoot(h.root.uri, h.root.fs.storage_options).list_dumps(RUN, info.generation)
