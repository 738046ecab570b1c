"""The pipeline's steps as library functions: one step library for both engines and the CLI.

Each step takes the run's :class:`~deltarec.orchestrate.params.PipelineParams` (and what an
earlier step produced) and returns a typed record. The KFP components
(:mod:`deltarec.orchestrate.components`), the Airflow tasks
(:mod:`deltarec.orchestrate.airflow_dag`) and the ``deltarec`` commands call these functions;
no step goes back through the command line. Only training crosses a process boundary: torchrun
on one node, a PyTorchJob on several.

* :func:`provision` creates the store views (on a fresh run from the declared tables);
* :func:`train` runs the training program and describes the generation it wrote (defined in
  :mod:`deltarec.orchestrate.train_step`, the one step with a process boundary);
* :func:`verify` reads the generation back from the store (:class:`VerifyOutcome`);
* :func:`promote` makes a verified generation serving's current one;
* :func:`on_verify_failed` is the FAIL branch: it drops the staging views (staged), rolls
  serving back to the run's last promoted generation only if the run serves (direct), and
  calls the webhook with who served before and after;
* :func:`rollback` restores serving to an earlier promoted generation.

Every step is idempotent in the sense of SPEC §7: provision and promote may be repeated, verify
only reads, and a multi-node train step follows the PyTorchJob it created earlier.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.types import TableSpec
from deltarec.dump.config import check_row_encoding, parse_row_encodings
from deltarec.errors import BadInputError, CheckFailedError, ConfigError
from deltarec.model.config import ModelConfig
from deltarec.model.tables import declared_tables as model_declared_tables
from deltarec.orchestrate.failure import (
    FailureAction,
    VerifyFailedError,
    call_webhook,
    on_verify_failed,
)
from deltarec.orchestrate.history_steps import (
    compact_apply,
    compact_part,
    compact_plan,
    compact_run,
    gc_run,
    retain,
)
from deltarec.orchestrate.params import PipelineParams, table_specs
from deltarec.orchestrate.train_step import (
    generation_record,
    program,
    run_process,
    torchrun_command,
    train,
    train_args,
    train_settings_env,
)
from deltarec.orchestrate.types import (
    FAIL,
    PASS,
    ArtifactLike,
    GenerationRecord,
    MetricsLike,
    VerifyOutcome,
)
from deltarec.promote import (
    PromoteResult,
    RollbackResult,
    Serving,
    who_serves,
)
from deltarec.promote.run import promote_generation
from deltarec.promote.run import rollback as rollback_generation
from deltarec.stats import quantile
from deltarec.stores import open_store
from deltarec.stores.provision import ProvisionResult, provision_generation, provision_tables
from deltarec.verify import VerifyResult, dumps_json, kfp_metrics, render_html
from deltarec.verify.fanout import combine_partitions, verify_partition
from deltarec.verify.partition import Partition, partition_json, result_from_json
from deltarec.verify.run import run_verification

__all__ = [
    "FAIL",
    "PASS",
    "FailureAction",
    "NotServingError",
    "ServingCheck",
    "VerifyFailedError",
    "VerifyOutcome",
    "call_webhook",
    "compact_apply",
    "compact_part",
    "compact_plan",
    "compact_run",
    "declared_tables",
    "gc_run",
    "generation_record",
    "log_outcome",
    "on_verify_failed",
    "outcome_of",
    "program",
    "promote",
    "provision",
    "read_outcome",
    "read_record",
    "record_of",
    "retain",
    "rollback",
    "run_process",
    "torchrun_command",
    "train",
    "train_args",
    "train_output",
    "train_settings_env",
    "verify",
    "verify_gate",
    "verify_part",
    "verify_plan",
    "verify_serving",
    "write_record",
]

log = logging.getLogger(__name__)


# ---- provision ---------------------------------------------------------------------------------
def declared_tables(params: PipelineParams) -> dict[str, TableSpec]:
    """The tables a fresh run will dump, as far as the parameters say.

    The ``tables`` parameter when set; for the example model (no entry point) its tables
    (:func:`deltarec.model.tables.declared_tables`) from its configuration (``--model-config``
    in ``train_extra_args`` is honoured); else none (the training ranks create the views from
    the first GENERATION.json).
    """
    if params.tables.strip():
        return table_specs(params.tables)
    if params.entry_point.strip():
        return {}
    config = ModelConfig()
    extra = shlex.split(params.train_extra_args)
    if "--model-config" in extra[:-1]:
        path = extra[extra.index("--model-config") + 1]
        try:
            with open(path, encoding="utf-8") as f:
                config = ModelConfig.model_validate(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"train_extra_args --model-config {path}: {e}") from e
    default, dtypes = parse_row_encodings(params.row_encodings)
    specs = model_declared_tables(
        config, params.ranks_per_node * params.nodes, default_dtype=default, dtypes=dtypes
    )
    for table, spec in specs.items():
        check_row_encoding(table, spec.dim, spec.dtype)
    return specs


def provision(params: PipelineParams) -> ProvisionResult:
    """Create the store views of the run before training (idempotent).

    A run with generations: the tables of its newest generation (GENERATION.json). A fresh
    run: the tables :func:`declared_tables` finds; with none, nothing is created and the
    training ranks create the views from the first generation's GENERATION.json.
    """
    root = ArtifactRoot(params.artifact_root)
    if root.list_generations(params.run_name):
        result, _ = provision_generation(params.artifact_root, params.run_name, params.store_url)
        return result
    tables = declared_tables(params)
    if not tables:
        log.info("fresh run %r declares no tables; the training ranks create the views",
                 params.run_name)  # fmt: skip
        return ProvisionResult(params.run_name, None, {})
    return provision_tables(
        params.store_url, params.run_name, tables, artifacts=params.artifact_root
    )


# ---- verify ------------------------------------------------------------------------------------
def outcome_of(result: VerifyResult, report_path: str | None = None) -> VerifyOutcome:
    """The :class:`VerifyOutcome` of a verification result."""
    metrics = dict(kfp_metrics(result))
    lags = sorted(d.lag_s for d in result.dumps if d.lag_s is not None)
    if lags:
        metrics["freshness_p50_s"] = quantile(lags, 0.50)
        metrics["freshness_p99_s"] = quantile(lags, 0.99)
    return VerifyOutcome(
        verdict=PASS if result.passed else FAIL,
        run=result.run,
        generation=result.generation,
        through_seq=result.through_seq if result.through_seq is not None else -1,
        metrics=metrics,
        failure="" if result.passed else result.failure_summary(),
        report_path=report_path,
    )


def verify(
    params: PipelineParams,
    record: GenerationRecord,
    *,
    report_path: str | None = None,
    json_path: str | None = None,
) -> VerifyOutcome:
    """Verify the generation train produced (through its newest dump) against the store.

    ``sample_size <= 0`` compares every key. ``report_path`` receives the HTML report and
    ``json_path`` verify's JSON document (local paths or fsspec URIs).
    """
    result = run_verification(
        params.artifact_root,
        record.run,
        params.store_url,
        generation=record.generation,
        through_seq=record.last_seq,
        sample=None if params.sample_size <= 0 else params.sample_size,
    )
    _write_outputs(result, report_path, json_path, render_html, dumps_json)
    outcome = outcome_of(result, report_path)
    _add_held_back(outcome, params)
    log.info("verify: run %s generation %d: %s %s", outcome.run, outcome.generation,
             outcome.verdict, outcome.failure)  # fmt: skip
    return outcome


def verify_plan(params: PipelineParams) -> list[str]:
    """The partitions verify fans out over: ``["0/N", ..., "N-1/N"]`` (``verify_partitions``)."""
    n = params.verify_partitions
    return [f"{i}/{n}" for i in range(n)]


def verify_part(params: PipelineParams, record: GenerationRecord, partition: str) -> dict[str, Any]:
    """Verify one partition (``"I/N"``) of the generation train produced; its JSON document.

    Leaves no verification record: :func:`verify_gate` combines the partitions and writes it.
    """
    part = Partition.parse(partition)
    result = verify_partition(
        params.artifact_root, record.run, params.store_url, part,
        generation=record.generation, through_seq=record.last_seq,
        sample=None if params.sample_size <= 0 else params.sample_size,
    )  # fmt: skip
    verdict = "passed" if result.passed else result.failure_summary()
    log.info("verify partition %s of run %s generation %d: %s", part, record.run,
             record.generation, verdict)  # fmt: skip
    return partition_json(result)


def verify_gate(
    params: PipelineParams,
    record: GenerationRecord,
    partitions: Sequence[Mapping[str, Any]],
    *,
    report_path: str | None = None,
    json_path: str | None = None,
) -> VerifyOutcome:
    """The gate: combine the partitions' documents into one verification (PASS or FAIL).

    Writes the verification record promote requires, the HTML report and the JSON document.

    Raises:
        BadInputError: the documents are not the partitions of this generation's verify.
    """
    result = combine_partitions(
        params.artifact_root, [result_from_json(dict(d)) for d in partitions]
    )
    if (result.run, result.generation) != (record.run, record.generation):
        raise BadInputError(
            f"verify partitions of run {result.run!r} generation {result.generation} do not "
            f"belong to run {record.run!r} generation {record.generation}"
        )
    _write_outputs(result, report_path, json_path, render_html, dumps_json)
    outcome = outcome_of(result, report_path)
    _add_held_back(outcome, params)
    log.info("verify gate: run %s generation %d over %d partitions: %s %s", outcome.run,
             outcome.generation, len(partitions), outcome.verdict, outcome.failure)  # fmt: skip
    return outcome


def _add_held_back(outcome: VerifyOutcome, params: PipelineParams) -> None:
    """``publish_held_back_s``: what the trainer's read budget held back, where one ran."""
    from deltarec.publish.budgetreport import held_back_s

    root = ArtifactRoot(params.artifact_root)
    held = held_back_s(root, outcome.run, outcome.generation)
    if held is not None:
        outcome.metrics["publish_held_back_s"] = held


def _write_outputs(
    result: Any, report_path: str | None, json_path: str | None, html: Any, doc: Any
) -> None:
    for path, render in ((report_path, html), (json_path, doc)):
        if path:
            fs, local = fsspec.core.url_to_fs(path)
            fs.makedirs(fs._parent(local), exist_ok=True)
            with fs.open(local, "w", encoding="utf-8") as f:
                f.write(render(result))


@dataclass(frozen=True)
class ServingCheck:
    """What the scheduled check of serving looked at, and its verdicts.

    Attributes:
        serving: who served the store when the check started.
        outcomes: one verification per serving run checked (at its serving pointer).
    """

    serving: Serving
    outcomes: list[VerifyOutcome]

    @property
    def passed(self) -> bool:
        """True if every serving run checked passed."""
        return bool(self.outcomes) and all(o.passed for o in self.outcomes)


class NotServingError(CheckFailedError):
    """The run a check was asked about does not serve (names the run that does)."""


def verify_serving(
    artifacts: str,
    run: str | None,
    store_url: str,
    sample_size: int,
    *,
    report_path: str | None = None,
    json_path: str | None = None,
) -> ServingCheck:
    """Verify what serving reads: the chart's scheduled check.

    Who serves is read from the store (:func:`~deltarec.promote.who_serves`). Without ``run``
    every serving run is verified at the generation and dump its serving pointer names (the
    check follows a take-over); with ``run``, that run must serve. ``sample_size <= 0``
    compares every key. With several serving runs, the report and JSON of each go to the
    paths with ``.<run>`` before the extension.

    Raises:
        NotServingError: ``run`` does not serve (the message names who does).
        BadInputError: no run serves, or a serving run was never promoted.
    """
    with open_store(store_url, artifacts) as s:
        serving = who_serves(s)
    if run is not None and not serving.serves(run):
        raise NotServingError(serving.not_serving(run))
    runs = [run] if run is not None else serving.runs
    if not runs:
        raise BadInputError(f"no run serves {store_url}: nothing to verify")
    outcomes = []
    for r in runs:
        pointer = serving.pointers.get(r)
        if pointer is None:
            raise BadInputError(
                f"run {r!r} serves {', '.join(serving.tables_of(r))} but has no promoted "
                "generation in the store: promote one first"
            )
        result = run_verification(
            artifacts, r, store_url, generation=pointer.generation, through_seq=pointer.seq,
            sample=None if sample_size <= 0 else sample_size, record=False,
        )  # fmt: skip
        many = len(runs) > 1
        report, doc = (_per_run(p, r) if many else p for p in (report_path, json_path))
        _write_outputs(result, report, doc, render_html, dumps_json)
        outcomes.append(outcome_of(result, report))
        log.info("verify-serving: run %s generation %d dump %d: %s %s", r, pointer.generation,
                 pointer.seq, outcomes[-1].verdict, outcomes[-1].failure)  # fmt: skip
    return ServingCheck(serving, outcomes)


def _per_run(path: str | None, run: str) -> str | None:
    """``path`` with ``.<run>`` before its extension (None stays None)."""
    if path is None:
        return None
    head, dot, ext = path.rpartition(".")
    return f"{head}.{run}.{ext}" if dot and "/" not in ext else f"{path}.{run}"


# ---- promote / rollback / the FAIL branch ------------------------------------------------------
def promote(
    params: PipelineParams, record: GenerationRecord, *, force: bool = False
) -> PromoteResult:
    """Make the verified generation (through its newest dump) serving's current one.

    Merges the staging views in ``staged`` mode. Refused (``NotVerifiedError``) without a
    passing verification record unless ``force``.
    """
    return promote_generation(
        params.artifact_root, record.run, params.store_url, record.generation,
        through_seq=record.last_seq, force=force,
    )  # fmt: skip


def rollback(params: PipelineParams, to_generation: int) -> RollbackResult:
    """Restore serving to ``to_generation`` at the dump it was last promoted at."""
    return rollback_generation(
        params.artifact_root, params.run_name, params.store_url, to_generation
    )


# ---- KFP artifacts -----------------------------------------------------------------------------
def write_record(output: ArtifactLike, record: GenerationRecord) -> None:
    """Store ``record`` as the generation artifact: a JSON file plus the same fields as metadata."""
    os.makedirs(os.path.dirname(output.path) or ".", exist_ok=True)
    with open(output.path, "w", encoding="utf-8") as f:
        json.dump(record.to_metadata(), f, indent=2)
    output.metadata.update(record.to_metadata())


def train_output(
    params: Mapping[str, Any], credentials_secret: str, job_id: str, generation: ArtifactLike
) -> dict[str, Any]:
    """The train components' body: :func:`train`, the record into ``generation``, its dict.

    Args:
        params: the pipeline's parameters (``PipelineParams`` fields, as the engine passes them).
        credentials_secret: comma-separated Secret names (for a multi-node job's pods).
        job_id: the pipeline run's id (names a multi-node job, so a retry follows it).
        generation: the output artifact that receives the ``GenerationRecord``.
    """
    record = train(
        PipelineParams.from_arguments(dict(params)),
        job_id=job_id,
        secrets=credentials_secret.split(","),
    )
    write_record(generation, record)
    return record.to_metadata()


def record_of(value: Mapping[str, Any] | str) -> GenerationRecord:
    """The :class:`GenerationRecord` a train step output as a dict.

    Also takes that dict as JSON text, as an engine may hand a parameter on inside a loop.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise BadInputError(f"the train step's output is not JSON: {e}") from e
    if not isinstance(value, Mapping):
        raise BadInputError(f"the train step's output is not a record: {value!r}")
    return GenerationRecord.from_metadata(dict(value), "the train step's output")


def read_record(generation: ArtifactLike) -> GenerationRecord:
    """The :class:`GenerationRecord` of a generation artifact (metadata, else its JSON file)."""
    if generation.metadata.get("generation") is not None:
        return GenerationRecord.from_metadata(dict(generation.metadata), generation.uri)
    try:
        with open(generation.path, encoding="utf-8") as f:
            return GenerationRecord.from_metadata(json.load(f), generation.path)
    except (OSError, json.JSONDecodeError) as e:
        raise BadInputError(f"{generation.uri}: cannot read the generation record: {e}") from e


def log_outcome(outcome: VerifyOutcome, metrics: MetricsLike, report: ArtifactLike) -> None:
    """Put a verify outcome on verify's KFP outputs (metrics; the report's metadata)."""
    for name, value in sorted(outcome.metrics.items()):
        metrics.log_metric(name, value)
    report.metadata.update(
        {"run": outcome.run, "generation": outcome.generation, "verdict": outcome.verdict}
    )
    report.metadata["outcome"] = outcome.to_json()


def read_outcome(report: ArtifactLike) -> VerifyOutcome:
    """The :class:`VerifyOutcome` :func:`log_outcome` left on the report artifact."""
    if "outcome" not in report.metadata:
        raise BadInputError(f"{report.uri}: the report carries no verify outcome")
    return VerifyOutcome.from_json(report.metadata["outcome"])
