"""The settings a training program gets from the pipeline: ``DELTAREC_*`` environment variables.

The pipeline's train step (KFP or Airflow, one node or a PyTorchJob) runs a team's training
program with the dump, publish and store settings in the environment, one variable per field
of :class:`TrainSettings` (``DELTAREC_`` + the field name in upper case)::

    DELTAREC_ARTIFACTS=s3://bucket/artifacts  DELTAREC_RUN=ctr-main
    DELTAREC_DUMP_EVERY_STEPS=100             DELTAREC_DUMP_EVERY_MINUTES=
    DELTAREC_STORE=postgresql://trainer@db:5432/emb  DELTAREC_PUBLISH_MODE=direct
    DELTAREC_STEPS=1000                       DELTAREC_CHECKPOINT_DIR=

The program builds its hook with :func:`deltarec.dump.hook.hook_from_env` (which reads them
through :meth:`TrainSettings.from_env`) and may read ``steps`` and ``checkpoint_dir`` for its
own loop. An empty or unset optional variable means "not set". Nothing here imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deltarec.errors import ConfigError, validation_problems
from deltarec.publish.types import PublishMode

ENV_PREFIX = "DELTAREC_"
"""Prefix of every variable; the rest is the :class:`TrainSettings` field name upper-cased."""


class TrainSettings(BaseModel):
    """Dump, publish and store settings of one training run (the ``DELTAREC_*`` variables)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    artifacts: str = Field(min_length=1)
    """Artifact root (local path or fsspec URI)."""
    run: str = Field(min_length=1)
    """Run name (``[A-Za-z0-9_.-]``)."""
    dump_every_steps: int | None = Field(default=None, ge=1)
    """Dump every N steps; None: no step cadence."""
    dump_every_minutes: float | None = Field(default=None, gt=0)
    """Dump every M minutes; None: no time cadence."""
    store: str | None = None
    """Store URL to publish to while training; None: artifacts only."""
    publish_mode: PublishMode = PublishMode.DIRECT
    """``direct`` (live views) or ``staged`` (per-generation staging views)."""
    steps: int | None = Field(default=None, ge=1)
    """Training steps the pipeline asks for (the program's own loop reads it)."""
    checkpoint_dir: str | None = None
    """Where the program keeps its checkpoints; None: the program's default."""
    row_encodings: str | None = None
    """Row encodings of the dumps: a default and/or ``table=encoding`` entries
    (:func:`~deltarec.dump.config.parse_row_encodings`); None: float32."""
    read_p99_ms: float | None = Field(default=None, gt=0)
    """A read-latency budget for the background publisher, milliseconds
    (``DumperConfig.read_p99_ms``); None: none."""
    spread_steps: int | None = Field(default=None, ge=1)
    """Read each dump's rows over about this many steps after it, copy on write
    (``DumperConfig.spread_steps``); None: at the dump step."""
    dense_every: int | None = Field(default=None, ge=1)
    """Commit the model's dense (non-embedding) state with every N-th dump, so a dump is dense
    and sparse state of one step and a replica serves and scores the promoted pair
    (docs/serving.md); None: sparse rows only."""
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    """Serve Prometheus metrics on this port plus the process's ``LOCAL_RANK``: the dump
    path's and, with a store, the background publisher's (those of ``deltarec publish``);
    None: not served."""

    @classmethod
    def env_name(cls, field: str) -> str:
        """The environment variable of ``field``."""
        if field not in cls.model_fields:
            raise KeyError(field)
        return ENV_PREFIX + field.upper()

    def to_env(self) -> dict[str, str]:
        """The variables to set for a training program (unset fields are left out)."""
        return {
            self.env_name(name): str(value)
            for name, value in self.model_dump(mode="json").items()
            if value is not None
        }

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TrainSettings:
        """Read the settings from ``environ`` (default: ``os.environ``).

        Raises:
            ConfigError: a required variable is missing or a value is invalid (names the
                variable).
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            raw = env.get(cls.env_name(name), "").strip()
            if raw:
                values[name] = raw
        try:
            return cls(**values)
        except ValidationError as e:
            problems = validation_problems(e, lambda loc: cls.env_name(str(loc[0])) if loc else "")
            raise ConfigError(f"training settings from the environment: {problems}") from e

    def hook_arguments(self) -> dict[str, Any]:
        """The keyword arguments of :func:`deltarec.dump.make_train_hook` these settings give."""
        from deltarec.dump.config import parse_row_encodings

        encodings: dict[str, Any] = {}
        if self.row_encodings:
            default, tables = parse_row_encodings(self.row_encodings)
            encodings["table_dtypes"] = tables
            if default is not None:
                encodings["default_dtype"] = default
        return {
            **encodings,
            "artifacts": self.artifacts,
            "run": self.run,
            "every_steps": self.dump_every_steps,
            "every_minutes": self.dump_every_minutes,
            "store": self.store,
            "publish_mode": self.publish_mode,
            "metrics_port": self.metrics_port,
            **({} if self.read_p99_ms is None else {"read_p99_ms": self.read_p99_ms}),
            **({} if self.spread_steps is None else {"spread_steps": self.spread_steps}),
            **({} if self.dense_every is None else {"dense_every": self.dense_every}),
        }
