"""The Airflow DAG's tasks: JSON in (XCom), one step function, JSON out (XCom).

Each function here takes the run's parameters (``conf``: ``params`` is a reserved name in an
Airflow task's context) and what earlier tasks pushed, as the JSON values XCom holds, calls
one function of :mod:`deltarec.orchestrate.steps` and returns a JSON value. The DAG
(:mod:`deltarec.orchestrate.airflow_dag`) runs them in-process (local runs) or in a
KubernetesPodOperator pod on the pipeline's images, through this module's command line::

    python -m deltarec.orchestrate.airflow_task STEP --params JSON [--input JSON] [--job-id ID]
        [--secrets NAMES]

which writes the return value to ``/airflow/xcom/return.json`` (the operator's XCom sidecar
reads it; ``--xcom PATH`` elsewhere). Nothing here imports Airflow.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from deltarec.orchestrate import steps
from deltarec.orchestrate.params import PipelineParams
from deltarec.orchestrate.types import GenerationRecord

XCOM_PATH = "/airflow/xcom/return.json"
"""Where a KubernetesPodOperator pod leaves its XCom value (``do_xcom_push=True``)."""


def _params(conf: Mapping[str, Any]) -> PipelineParams:
    return PipelineParams.from_arguments(dict(conf))


def check_params(conf: Mapping[str, Any]) -> dict[str, Any]:
    """The run's parameters, validated (the DAG's first task)."""
    return _params(conf).arguments()


def provision(conf: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`steps.provision`; returns the :class:`~steps.ProvisionResult` as JSON."""
    return asdict(steps.provision(_params(conf)))


def train(conf: Mapping[str, Any], job_id: str = "", secrets: Sequence[str] = ()) -> dict[str, Any]:
    """:func:`steps.train`; returns the :class:`GenerationRecord` as JSON."""
    record = steps.train(_params(conf), job_id=job_id, secrets=secrets)
    return record.to_metadata()


def report_uri(record: GenerationRecord) -> str:
    """Where verify's HTML report goes: beside the generation in the artifact root."""
    return f"{record.uri.rstrip('/')}/verify-report-{record.last_seq:06d}.html"


def verify(conf: Mapping[str, Any], generation: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`steps.verify`; returns the :class:`~steps.VerifyOutcome` as JSON."""
    p = _params(conf)
    record = GenerationRecord.from_metadata(dict(generation), "the train task's XCom")
    return steps.verify(p, record, report_path=report_uri(record)).to_json()


def verify_plan(conf: Mapping[str, Any]) -> list[str]:
    """:func:`steps.verify_plan`: the partitions the verify task is mapped over."""
    return steps.verify_plan(_params(conf))


def verify_partition(
    conf: Mapping[str, Any], generation: Mapping[str, Any], partition: str
) -> dict[str, Any]:
    """:func:`steps.verify_part`: one partition's verify JSON document."""
    record = GenerationRecord.from_metadata(dict(generation), "the train task's XCom")
    return steps.verify_part(_params(conf), record, partition)


def verify_gate(
    conf: Mapping[str, Any], generation: Mapping[str, Any], partitions: Sequence[Any]
) -> dict[str, Any]:
    """:func:`steps.verify_gate` over the mapped partitions; the :class:`~steps.VerifyOutcome`."""
    p = _params(conf)
    record = GenerationRecord.from_metadata(dict(generation), "the train task's XCom")
    docs = [json.loads(d) if isinstance(d, str) else dict(d) for d in partitions]
    return steps.verify_gate(p, record, docs, report_path=report_uri(record)).to_json()


def compact_plan(conf: Mapping[str, Any], generation: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`steps.compact_plan`: whether and how the generation is compacted (its items)."""
    record = GenerationRecord.from_metadata(dict(generation), "the train task's XCom")
    return steps.compact_plan(_params(conf), record)


def compact_partition(conf: Mapping[str, Any], item: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`steps.compact_part`: one partition (tables and key range) of the planned base."""
    return steps.compact_part(_params(conf), dict(item))


def compact(conf: Mapping[str, Any], plan: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`steps.compact_apply`: nothing, a compaction in this task, or the fan-out's commit."""
    return steps.compact_apply(_params(conf), dict(plan))


def gc(conf: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`steps.retain`: retention after promote; prints every path and its reason."""
    out = steps.retain(_params(conf))
    for row in out.get("paths", []):
        print(json.dumps(row))
    return {k: v for k, v in out.items() if k != "paths"}


def choose(outcome: Mapping[str, Any]) -> str:
    """The branch after verify: ``promote`` on PASS, ``verify_failed`` on FAIL."""
    return "promote" if steps.VerifyOutcome.from_json(outcome).passed else "verify_failed"


def promote(conf: Mapping[str, Any], generation: Mapping[str, Any]) -> int:
    """:func:`steps.promote`; returns the promoted generation."""
    record = GenerationRecord.from_metadata(dict(generation), "the train task's XCom")
    return steps.promote(_params(conf), record).pointer.generation


def verify_failed(conf: Mapping[str, Any], outcome: Mapping[str, Any]) -> None:
    """:func:`steps.on_verify_failed`, then fail the task (and the run) with the outcome.

    Raises:
        VerifyFailedError: always, after the staging views were dropped or serving was
            rolled back and the webhook was called.
    """
    result = steps.VerifyOutcome.from_json(outcome)
    action = steps.on_verify_failed(_params(conf), result)
    raise steps.VerifyFailedError(result, action)


def rollback(conf: Mapping[str, Any], to_generation: int) -> int:
    """:func:`steps.rollback`; returns the generation restored."""
    p = _params(conf)
    return steps.rollback(p, to_generation).to_generation


def main(argv: Sequence[str] | None = None) -> int:
    """The pod's entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m deltarec.orchestrate.airflow_task")
    parser.add_argument("step", choices=["provision", "train", "compact_plan", "compact_partition",
                                         "compact", "verify", "verify_partition", "verify_gate",
                                         "promote", "verify_failed", "gc"])  # fmt: skip
    parser.add_argument("--params", required=True, help="the run's parameters (JSON)")
    parser.add_argument("--input", default="null", help="the upstream task's XCom (JSON)")
    parser.add_argument("--job-id", default="", help="the DAG run's id (train)")
    parser.add_argument("--secrets", default="", help="Secret names for the multi-node job's pods")
    parser.add_argument("--partition", default="0/1", help="the partition I/N (verify_partition)")
    parser.add_argument("--partitions", default="[]", help="the partitions' XCom (verify_gate)")
    parser.add_argument("--item", default="{}", help="a compaction partition (compact_partition)")
    parser.add_argument("--xcom", default=XCOM_PATH, help="where the result is written")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    conf = json.loads(args.params)
    upstream = json.loads(args.input)
    if args.step == "provision":
        result: Any = provision(conf)
    elif args.step == "train":
        result = train(conf, args.job_id, args.secrets.split(","))
    elif args.step == "compact_plan":
        result = compact_plan(conf, upstream)
    elif args.step == "compact_partition":
        result = compact_partition(conf, json.loads(args.item))
    elif args.step == "compact":
        result = compact(conf, upstream)
    elif args.step == "gc":
        result = gc(conf)
    elif args.step == "verify":
        result = verify(conf, upstream)
    elif args.step == "verify_partition":
        result = verify_partition(conf, upstream, args.partition)
    elif args.step == "verify_gate":
        result = verify_gate(conf, upstream, json.loads(args.partitions))
    elif args.step == "promote":
        result = promote(conf, upstream)
    else:
        verify_failed(conf, upstream)
    os.makedirs(os.path.dirname(args.xcom) or ".", exist_ok=True)
    with open(args.xcom, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
