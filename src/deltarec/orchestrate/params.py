"""The pipeline's parameters, validated before anything is compiled, submitted or run.

:class:`PipelineParams` is the one place a pipeline parameter is declared: the KFP pipeline's
signature, the Airflow DAG's ``params``, the ``deltarec pipeline`` flags' names and the step
functions' input all derive from its fields. A KFP or Airflow run hands the whole object from
step to step as one JSON object (:meth:`PipelineParams.arguments`), read back with
:meth:`PipelineParams.from_arguments`.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deltarec.credentials import check_no_credentials, redact_url, urls_in
from deltarec.errors import BadInputError, ConfigError, validation_problems
from deltarec.ids import validate_run
from deltarec.publish.types import PublishMode, check_publish_mode


class PipelineParams(BaseModel):
    """Arguments of one pipeline run (the pipeline's parameters, by the same names)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    run_name: str
    """The run (lineage) name, ``[A-Za-z0-9_.-]``."""
    artifact_root: str = Field(min_length=1)
    """Where generations are written: a local path (local runs) or an fsspec URI (``s3://``)."""
    store_url: str = Field(min_length=1)
    """The online store, e.g. ``sqlite:///store.db`` or ``postgresql://user@host:5432/db``.
    Never holds a password: credentials reach the steps from a Kubernetes Secret."""
    steps: int = Field(1000, ge=1)
    """Training steps of this generation."""
    dump_every_steps: int = Field(100, ge=0)
    """Dump cadence in steps; 0 turns the step trigger off."""
    dump_every_minutes: float = Field(0.0, ge=0.0)
    """Dump cadence in minutes; 0 turns the time trigger off."""
    publish_mode: PublishMode = PublishMode.DIRECT
    """``direct`` publishes into the live views, ``staged`` into staging views made live by
    promote."""
    read_p99_ms: float = Field(0.0, ge=0.0)
    """A read-latency budget for the trainer's background publisher: the p99 of serving reads,
    in milliseconds, that publishing holds itself within (docs/publish.md); 0: no budget."""
    dense_every: int = Field(0, ge=0)
    """Commit the model's dense state with every N-th dump (``deltarec train --dense-every``,
    ``DELTAREC_DENSE_EVERY``): dense and sparse state promoted and rolled back as one
    generation, scored together by the replicas (docs/serving.md); 0: sparse rows only."""
    sample_size: int = Field(10000, ge=0)
    """Keys per table that verify reads back; 0 reads every key."""
    ranks_per_node: int = Field(2, ge=1)
    """Training processes per node (torchrun ``--nproc-per-node``)."""
    nodes: int = Field(1, ge=1)
    """Nodes; above 1 the train step creates a Kubeflow Trainer TrainJob (or a PyTorchJob, see
    ``launcher``) from a CPU launcher task."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs per node (the one-node train pod's, or each TrainJob node's); 0 trains on CPU
    with gloo."""
    launcher: Literal["trainjob", "pytorchjob"] = "trainjob"
    """What a multi-node train step creates: ``trainjob`` (Kubeflow Trainer v2, the default) or
    ``pytorchjob`` (the Training Operator v1)."""
    training_runtime: str = "torch-distributed"
    """The Kubeflow Trainer ``ClusterTrainingRuntime`` a TrainJob refers to."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """The trainer's Prometheus metrics port (rank r serves on port + local rank); 0: off."""
    verify_partitions: int = Field(1, ge=1, le=1024)
    """Verify fans out over this many partitions (a key range of every table each), combined
    by one gate."""
    compact_min_dumps: int = Field(50, ge=0)
    """Compact the trained generation (after train, before verify) when at least this many
    committed dumps follow the newest base of its lineage (SPEC §3a, docs/history.md); 0: the
    pipeline never compacts."""
    compact_partition_rows: int = Field(4_000_000, ge=0)
    """A table with more rows than this (an estimate from the manifests) is compacted by
    several tasks in parallel, a key range of about this many rows each, then committed by
    one; 0: never fan out."""
    gc_mode: Literal["delete", "dry-run", "off"] = "delete"
    """Retention after promote (``deltarec gc``): ``delete`` deletes the dumps and bases a
    newer base covers and nothing needs, ``dry-run`` only lists them with the reasons, ``off``
    skips the step."""
    gc_keep_promotions: int = Field(3, ge=0)
    """Retention keeps what the store's newest N promotions (rollback targets) read."""
    checkpoint_dir: str = ""
    """The trainer's checkpoint directory (``--workdir``); empty keeps the trainer's default."""
    train_extra_args: str = ""
    """More arguments of the training program, shell-quoted (e.g. ``--batch-size 256``): flags
    of ``deltarec train`` for the example model, else the entry point's own ``sys.argv``."""
    entry_point: str = ""
    """The training program: ``package.module:function`` importable in the trainer image,
    or a command line (shell-quoted). Empty trains deltarec's example model (``deltarec
    train``). The program gets the dump, publish and store settings from the ``DELTAREC_*``
    environment variables (``deltarec.api.TrainSettings``) and builds its hook with
    ``deltarec.api.hook_from_env()``; see docs/api.md."""
    tables: str = ""
    """The tables the training program dumps, as a JSON object ``{table id: {"dim": D,
    "dtype": ..., "kind": ...}}``: provision creates their views on a fresh run. Empty: the
    example model's tables for the example model; for another entry point the views of a
    fresh run are created by the training ranks from the first generation's
    GENERATION.json."""
    row_encodings: str = ""
    """How dumped rows are encoded: a default and/or ``table=encoding`` entries, comma
    separated, of ``float32``, ``float16``, ``int8_rowwise`` (``deltarec train
    --row-encodings``); empty: float32."""
    webhook_url: str = ""
    """Called (HTTP POST, JSON) with verify's summary when verify fails; empty: no call. Like
    every parameter it is stored in plain text: no password or token in it (refused)."""

    @model_validator(mode="after")
    def _check(self) -> PipelineParams:
        validate_run(self.run_name)
        if self.dump_every_steps == 0 and self.dump_every_minutes == 0:
            raise ValueError(
                "dump_every_steps and dump_every_minutes are both 0: the generation would have "
                "only its final dump; set at least one cadence"
            )
        check_no_credentials("store_url", self.store_url)
        check_no_credentials("artifact_root", self.artifact_root)
        check_publish_mode(self.store_url, self.publish_mode)
        if self.entry_point.strip():
            parse_entry_point(self.entry_point)
        if self.tables.strip():
            table_specs(self.tables)
        if self.webhook_url and urllib.parse.urlsplit(self.webhook_url).scheme not in (
            "http",
            "https",
        ):
            raise ValueError(f"webhook_url {redact_url(self.webhook_url)!r} is not an http(s) URL")
        check_no_credentials("webhook_url", self.webhook_url)
        for name, value in self:  # a URL anywhere in another parameter (extra args, entry point)
            if isinstance(value, str):
                for url in urls_in(value):
                    check_no_credentials(name, url)
        return self

    def arguments(self) -> dict[str, Any]:
        """The pipeline arguments (every field, by parameter name)."""
        return self.model_dump(mode="json")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every parameter name, in declaration order."""
        return tuple(cls.model_fields)

    @classmethod
    def parameter_types(cls) -> dict[str, type]:
        """Every parameter's type as an engine declares it: ``int``, ``float``, else ``str``.

        The KFP pipeline's signature and the ``params`` component's inputs use it (a
        ``Literal`` of strings or a ``str`` enum is a ``str`` parameter).
        """
        numbers: dict[Any, type] = {int: int, float: float}
        return {name: numbers.get(info.annotation, str) for name, info in cls.model_fields.items()}

    @classmethod
    def summary(cls, name: str) -> str:
        """The first sentence of parameter ``name``'s doc, on one line (engines' help texts)."""
        doc = " ".join((cls.model_fields[name].description or "").split())
        return re.split(r"(?<=\.)(?<!e\.g\.)\s", doc, maxsplit=1)[0]

    @classmethod
    def from_arguments(cls, values: dict[str, Any]) -> PipelineParams:
        """The parameters of a JSON object as an engine hands it on.

        KFP renders the parameters inside a struct as strings (an int as ``"7.0"``), so
        each value is converted to its field's type first.

        Raises:
            ConfigError: a missing, unknown or invalid parameter (names it).
        """
        converted: dict[str, Any] = {}
        for name, value in values.items():
            field = cls.model_fields.get(name)
            if field is None or not isinstance(value, str):
                converted[name] = value
            elif field.annotation is int:
                converted[name] = _number(name, value, int)
            elif field.annotation is float:
                converted[name] = _number(name, value, float)
            else:
                converted[name] = value
        return parse_params(**converted)


def _number(name: str, text: str, kind: type) -> Any:
    try:
        number = float(text)
    except ValueError as e:
        raise ConfigError(f"pipeline parameters: {name}: {text!r} is not a number") from e
    if kind is int:
        if not number.is_integer():
            raise ConfigError(f"pipeline parameters: {name}: {text!r} is not an integer")
        return int(number)
    return number


_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def parse_entry_point(text: str) -> tuple[str, ...]:
    """What a training entry point runs: ``("function", "mod:fn")`` or ``("command", *argv)``.

    Raises:
        ValueError: an empty or unparsable command line.
    """
    import shlex

    text = text.strip()
    if _FUNCTION.match(text):
        return ("function", text)
    try:
        argv = shlex.split(text)
    except ValueError as e:
        raise ValueError(f"entry_point {text!r}: {e}") from e
    if not argv:
        raise ValueError("entry_point is empty")
    return ("command", *argv)


def table_specs(text: str) -> dict[str, Any]:
    """The ``tables`` parameter as ``{table id: TableSpec}``.

    Raises:
        ValueError: not a JSON object of table entries (names the table).
    """
    from deltarec.artifacts.types import TableSpec
    from deltarec.ids import validate_table_id

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"tables is not JSON: {e}") from e
    if not isinstance(obj, dict) or not obj:
        raise ValueError("tables must be a non-empty JSON object {table id: {dim, ...}}")
    out: dict[str, Any] = {}
    for table, entry in obj.items():
        try:
            validate_table_id(table)
            if not isinstance(entry, dict):
                raise ValueError(f"{entry!r} is not an object")
            out[table] = TableSpec.from_json(entry, path=f"table {table!r}")
            if "num_embeddings" in entry and out[table].num_embeddings < 1:
                raise ValueError(
                    f"num_embeddings must be at least 1, got {entry['num_embeddings']}"
                )
        except (BadInputError, ValueError) as e:
            raise ValueError(f"tables[{table!r}]: {e}") from e
    return out


def parse_params(**values: Any) -> PipelineParams:
    """Build :class:`PipelineParams`; every problem becomes one :class:`ConfigError`."""
    try:
        return PipelineParams(**values)
    except ValidationError as e:
        raise ConfigError(f"pipeline parameters: {validation_problems(e)}") from e
    except BadInputError as e:
        raise ConfigError(f"pipeline parameters: {e}") from e
