"""The pipeline's parameters, validated before anything is compiled, submitted or run."""

from __future__ import annotations

import urllib.parse
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deltarec.errors import BadInputError, ConfigError
from deltarec.ids import validate_run

_SECRET_WORDS = ("password", "passwd", "secret", "token", "access_key", "accesskey", "credential")


class PipelineParams(BaseModel):
    """Arguments of one pipeline run (the pipeline's parameters, by the same names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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
    publish_mode: Literal["direct", "staged"] = "direct"
    """``direct`` publishes into the live views, ``staged`` into staging views made live by
    promote."""
    sample_size: int = Field(10000, ge=0)
    """Keys per table that verify reads back; 0 reads every key."""
    ranks_per_node: int = Field(2, ge=1)
    """Training processes per node (torchrun ``--nproc-per-node``)."""
    nodes: int = Field(1, ge=1)
    """Nodes; above 1 the train step creates a Training Operator PyTorchJob."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs per node; 0 trains on CPU with gloo."""
    checkpoint_dir: str = ""
    """The trainer's checkpoint directory (``--workdir``); empty keeps the trainer's default."""
    train_extra_args: str = ""
    """More ``deltarec train`` arguments, shell-quoted (e.g. ``--batch-size 256``)."""

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
        return self

    def arguments(self) -> dict[str, Any]:
        """The pipeline arguments (every field, by parameter name)."""
        return self.model_dump()


def check_no_credentials(name: str, url: str) -> None:
    """Reject a URL that carries a password or a secret-looking query parameter.

    Pipeline parameters are stored in plain text by KFP; credentials must come from Secrets.
    """
    parsed = urllib.parse.urlsplit(url)
    if parsed.password:
        raise ValueError(
            f"{name} carries a password; remove it and put it into the credentials Secret "
            "(for PostgreSQL the PGPASSWORD key)"
        )
    for key, _ in urllib.parse.parse_qsl(parsed.query):
        if any(w in key.lower().replace("-", "_") for w in _SECRET_WORDS):
            raise ValueError(f"{name} has the query parameter {key!r}; pass it through a Secret")


def parse_params(**values: Any) -> PipelineParams:
    """Build :class:`PipelineParams`; every problem becomes one :class:`ConfigError`."""
    try:
        return PipelineParams(**values)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'params'}: {err['msg']}"
            for err in e.errors()
        )
        raise ConfigError(f"pipeline parameters: {problems}") from e
    except BadInputError as e:
        raise ConfigError(f"pipeline parameters: {e}") from e
