import numpy as np

from deltarec.artifacts import DumpKind
from deltarec.verify import RowClass, verify


def _base(lineage, store):
    """Generation 1: snapshot of keys 0..99 (+ ZCH ids), a delta updating 0..9, evicting id 7."""
    g = lineage.generation()
    zch_keys = np.array([-1, 3, 7, 11, 19], np.int64)
    lineage.dump(
        g,
        0,
        {lineage.T_EMB: (np.arange(100), 0.0), lineage.T_ZCH: (zch_keys, 0.0)},
        kind=DumpKind.SNAPSHOT,
    )
    lineage.dump(
        g,
        1,
        {
            lineage.T_EMB: (np.arange(10), 1.0),
            lineage.T_ZCH: (np.array([-1, 7]), 1.0, np.array([0, 1])),
        },
    )
    lineage.publish(store, g)
    return g


def test_published_generation_verifies_with_every_key_matching(lineage, store):
    g = _base(lineage, store)
    result = verify(lineage.root, lineage.run, store, generation=g, sample=None)
    assert result.passed, result.failure_summary()
    emb = result.tables[lineage.T_EMB]
    assert emb.checked == 100 and emb.counts[RowClass.MATCH] == 100
    zch = result.tables[lineage.T_ZCH]
    assert zch.expected_keys == 5 and zch.expected_present == 4
    assert zch.counts[RowClass.MATCH] == 5
    assert result.shards_checked == 4 and not result.shard_failures
    assert [d.seq for d in result.dumps] == [0, 1]
