"""Loaded by every step subprocess of the gate test (through PYTHONPATH): replaces the CLI
boundary of deltarec.orchestrate.steps with a fast fake, so kfp.local runs the real pipeline
wiring without training. ``FAKE_VERIFY_CODE`` is the exit code the fake verify returns;
promote calls are appended to ``FAKE_PROMOTE_LOG``."""

import json
import os

from deltarec.artifacts import ArtifactRoot, DumpKind, GenerationInfo, Manifest, TableSpec
from deltarec.orchestrate import steps


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def fake_train(argv):
    root = ArtifactRoot(_flag(argv, "--artifacts"))
    run = _flag(argv, "--run")
    info = root.allocate_generation(
        GenerationInfo(run=run, generation=1, world_size=2, tables={"sparse.t": TableSpec(4)})
    )
    for seq, last_step in enumerate((10, 20), start=1):
        root.commit_manifest(
            Manifest(run=run, generation=info.generation, seq=seq, kind=DumpKind.DELTA,
                     first_step=last_step - 9, last_step=last_step, world_size=2, shards=(),
                     tables={"sparse.t": 3})
        )  # fmt: skip
    return 0


def fake_cli(step, argv):
    if argv[0] == "train":
        assert argv[1:5] == ["--nproc-per-node", "2", "--device", "cpu"], argv
        return fake_train(argv)
    if argv[0] == "verify":
        code = int(os.environ["FAKE_VERIFY_CODE"])
        with open(_flag(argv, "--report"), "w", encoding="utf-8") as f:
            f.write("<html>fake verify</html>")
        with open(_flag(argv, "--json"), "w", encoding="utf-8") as f:
            json.dump({"passed": code == 0, "dumps": [{"lag_s": 0.5}, {"lag_s": 1.5}]}, f)
        return code
    if argv[0] == "promote":
        with open(os.environ["FAKE_PROMOTE_LOG"], "a", encoding="utf-8") as f:
            f.write(" ".join(argv) + "\n")
        return 0
    raise AssertionError(f"unexpected command {argv}")


steps.run_cli = fake_cli
