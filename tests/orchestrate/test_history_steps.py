"""The pipeline's compact and gc steps (library functions the components call)."""

from __future__ import annotations

import math

from tests.artifacts.test_compact import RUN, History

from deltarec.artifacts import ArtifactRoot, DumpKind
from deltarec.artifacts.compact_parts import estimate_rows
from deltarec.cli import main
from deltarec.orchestrate import steps
from deltarec.orchestrate.params import PipelineParams


def test_the_compact_and_gc_steps_fold_the_run_and_delete_what_the_base_covers(tmp_path):
    h = History(ArtifactRoot(str(tmp_path / "art")))
    info = h.generation()
    h.dump(info, 0, DumpKind.SNAPSHOT, n=60)
    for seq in range(1, 5):
        h.dump(info, seq)
    url = f"sqlite:///{tmp_path / 'store.db'}"
    assert main(["publish", "--artifacts", h.root.uri, "--run", RUN, "--store", url]) == 0
    params = PipelineParams(run_name=RUN, artifact_root=h.root.uri, store_url=url)
    out = steps.compact_run(params)
    assert (out["generation"], out["through_seq"], out["dumps_read"]) == (info.generation, 4, 5)
    assert steps.gc_run(params, dry_run=True)["deleted"] == 0
    done = steps.gc_run(params)
    assert done["deleted"] == 4 and h.root.committed_seqs(RUN, info.generation) == [4]
    reasons = {r["reason"] for r in done["paths"] if not r["delete"]}
    assert "the newest dump of generation 1 (the chain's end)" in reasons


def _params(h, url, **change):
    return PipelineParams(run_name=RUN, artifact_root=h.root.uri, store_url=url, **change)


def test_the_compaction_plan_skips_short_histories_folds_small_tables_and_fans_out_large_ones(
    tmp_path,
):
    h = History(ArtifactRoot(str(tmp_path / "art")))
    info = h.generation()
    for seq in range(0, 4):
        h.dump(info, seq, n=60)
    record = steps.generation_record(h.root, RUN, info.generation)
    url = f"sqlite:///{tmp_path / 'store.db'}"
    plan = steps.compact_plan(_params(h, url), record)  # default: 50 dumps after the base
    assert plan["decision"] == "skip" and "fewer than compact_min_dumps = 50" in plan["reason"]
    off = steps.compact_plan(_params(h, url, compact_min_dumps=0), record)
    assert off["decision"] == "skip" and "off" in off["reason"]
    one = steps.compact_plan(_params(h, url, compact_min_dumps=4), record)
    assert one["decision"] == "one-step" and one["items"] == []
    fan = steps.compact_plan(
        _params(h, url, compact_min_dumps=4, compact_partition_rows=70), record
    )
    assert fan["decision"] == "fan-out" and fan["through_seq"] == 3
    est = estimate_rows(h.root, RUN, 1, 3)
    counts: dict[str, set[str]] = {}
    for item in fan["items"]:
        for table in item["tables"]:
            counts.setdefault(table, set()).add(item["key_range"])
    for table, n in est.items():  # a large table in ceil(estimate / 70) key ranges, else one
        want = math.ceil(n / 70) if n > 70 else 1
        assert counts[table] == {f"{i}/{want}" for i in range(want)}, (table, n)
    assert max(len(c) for c in counts.values()) > 1
    p = _params(h, url, compact_min_dumps=4, compact_partition_rows=70)
    for item in fan["items"]:
        steps.compact_part(p, item)
    done = steps.compact_apply(p, fan)
    assert done["written"] and (done["generation"], done["through_seq"]) == (1, 3)
    assert steps.compact_plan(p, record)["decision"] == "skip"  # committed already


def test_retention_after_promote_follows_gc_mode(tmp_path):
    h = History(ArtifactRoot(str(tmp_path / "art")))
    info = h.generation()
    for seq in range(0, 4):
        h.dump(info, seq)
    url = f"sqlite:///{tmp_path / 'store.db'}"
    assert main(["publish", "--artifacts", h.root.uri, "--run", RUN, "--store", url]) == 0
    steps.compact_run(_params(h, url))
    assert steps.retain(_params(h, url, gc_mode="off")) == {"mode": "off", "compacted": None}
    dry = steps.retain(_params(h, url, gc_mode="dry-run"))
    assert dry["deleted"] == 0 and sum(r["delete"] for r in dry["paths"]) == 3
    assert h.root.committed_seqs(RUN, info.generation) == [0, 1, 2, 3]
    assert steps.retain(_params(h, url))["deleted"] == 3
    assert h.root.committed_seqs(RUN, info.generation) == [3]
