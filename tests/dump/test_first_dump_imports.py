"""No module is imported by the dumps after ``on_start``: an import on the dump worker holds the
GIL while it runs, and the training thread waits for it (fsspec's import at the first commit's
fence was a 50-60 ms step on an H200 host)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from deltarec.api import (
        ManualTracker, RowShardSource, TableKind, TableSpec, TrackerHub, TrainSettings,
        hook_from_env,
    )

    work, encoder = sys.argv[1], sys.argv[2]
    w = torch.randn(50_000, 8)
    tracker = ManualTracker()
    hub = TrackerHub(tracker, {"t0"})

    def sources(model):
        spec = TableSpec(dim=8, kind=TableKind.PLAIN, num_embeddings=w.shape[0])
        return [RowShardSource("model.t0", spec, hub, "t0", w, row_offset=0)]

    env = TrainSettings(artifacts=work, run="imports", dump_every_steps=5).to_env()
    hook = hook_from_env(sources=sources, environ=env, encoder=encoder)
    hook.on_start(torch.nn.Module(), step=0, restored_from=None)
    before = set(sys.modules)
    for step in range(1, 16):  # three dumps, each committed
        tracker.record("t0", torch.randint(0, w.shape[0], (500,)))
        hook.after_step(step)
    hook.dumper.wait_idle()
    new = sorted(set(sys.modules) - before)
    committed = len(hook.dumper.root.list_dumps("imports", hook.dumper.generation.generation))
    hook.on_end(15)
    hook.close()
    print(json.dumps({"new": new, "committed": committed}))
    """
)


@pytest.mark.parametrize("encoder", ["thread", "process"])
def test_dumps_after_start_import_nothing(tmp_path, encoder):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "art"), encoder],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["committed"] >= 3  # the snapshot and the dumps: the commit path ran
    assert got["new"] == []
