"""Loaded by every step subprocess of the gate test (through PYTHONPATH): replaces the typed
train, verify (partition and gate) and promote functions of deltarec.orchestrate.steps with
fast fakes of the same signatures (the gate checks it got every partition of the plan), so
kfp.local runs the real pipeline wiring without training. ``FAKE_VERDICT`` is the verdict the
fake gate returns; promote calls are appended to ``FAKE_PROMOTE_LOG``; the FAIL branch
(``steps.on_verify_failed``) is the real one."""

import os

from deltarec.artifacts import ArtifactRoot, TableSpec
from deltarec.orchestrate import steps
from deltarec.testing.dumps import new_generation, random_rows, write_dump


def fake_train(params, *, job_id="", secrets=(), runner=None):
    assert params.ranks_per_node == 2 and params.nodes == 1, params
    assert job_id and list(secrets) == [""], (job_id, secrets)
    root = ArtifactRoot(params.artifact_root)
    run = params.run_name
    spec = TableSpec(4)
    info = new_generation(root, run, {"sparse.t": spec}, world_size=2)
    for seq, last_step in enumerate((10, 20), start=1):  # 3 rows of rank 0 per dump
        rows = {"sparse.t": {0: random_rows(range(3), spec, seed=seq, step=last_step)}}
        write_dump(root, info, seq, rows, first_step=last_step - 9, last_step=last_step)
    return steps.generation_record(root, run, info.generation)


def fake_verify_part(params, record, partition):
    return {"partition": partition, "generation": record.generation}


def fake_verify_gate(params, record, partitions, *, report_path=None, json_path=None):
    assert all(isinstance(p, dict) for p in partitions), partitions
    plan = [f"{i}/{params.verify_partitions}" for i in range(params.verify_partitions)]
    assert sorted(p["partition"] for p in partitions) == plan, partitions
    assert {p["generation"] for p in partitions} == {record.generation}, partitions
    verdict = os.environ["FAKE_VERDICT"]
    with open(report_path, "w", encoding="utf-8") as f:
        f.write("<html>fake verify</html>")
    return steps.VerifyOutcome(
        verdict=verdict, run=record.run, generation=record.generation,
        through_seq=record.last_seq,
        metrics={"passed": float(verdict == "PASS"), "freshness_p50_s": 1.0},
        failure="" if verdict == "PASS" else "sparse.t: 1 DIFFERENT", report_path=report_path,
    )  # fmt: skip


class _Pointer:
    def __init__(self, generation):
        self.generation = generation


class _Promoted:
    def __init__(self, generation):
        self.pointer = _Pointer(generation)


def fake_promote(params, record, *, force=False):
    with open(os.environ["FAKE_PROMOTE_LOG"], "a", encoding="utf-8") as f:
        f.write(f"{record.run} {record.generation} {record.last_seq} {params.store_url}\n")
    return _Promoted(record.generation)


steps.train = fake_train
steps.verify_part = fake_verify_part
steps.verify_gate = fake_verify_gate
steps.promote = fake_promote
