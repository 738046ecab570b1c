"""The pipeline's compact and gc steps (library functions the components call)."""

from __future__ import annotations

from tests.artifacts.test_compact import RUN, History

from deltarec.artifacts import ArtifactRoot, DumpKind
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
