"""Records and errors of the orchestration layer.

The step entry points in :mod:`deltarec.orchestrate.steps` read and write KFP artifacts only
through the small :class:`ArtifactLike` / :class:`MetricsLike` protocols below, so they are
plain Python functions that tests call without KFP.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from deltarec.errors import BadInputError, DeltarecError


class ArtifactLike(Protocol):
    """What a step needs of a KFP ``Artifact``: a local path, a URI and a metadata dict."""

    path: str
    uri: str
    metadata: dict[str, Any]


class MetricsLike(ArtifactLike, Protocol):
    """What a step needs of a KFP ``Metrics`` artifact."""

    def log_metric(self, metric: str, value: float) -> None:
        """Record one scalar metric."""


PASS, FAIL = "PASS", "FAIL"
"""The verify step's verdicts; promote runs only on PASS, :func:`on_verify_failed` on FAIL."""


@dataclass(frozen=True)
class VerifyOutcome:
    """What the verify step found (handed to promote or to the FAIL branch).

    Attributes:
        verdict: ``"PASS"`` or ``"FAIL"``.
        run, generation, through_seq: what was verified.
        metrics: verify's KFP metrics plus ``freshness_p50_s``/``freshness_p99_s`` and, where
            the trainer published under a read budget, ``publish_held_back_s``.
        failure: one line naming what failed (empty on PASS).
        report_path: the HTML report, if one was written.
    """

    verdict: str
    run: str
    generation: int
    through_seq: int
    metrics: dict[str, float]
    failure: str = ""
    report_path: str | None = None

    @property
    def passed(self) -> bool:
        """True for a PASS."""
        return self.verdict == PASS

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (an XCom value, or KFP artifact metadata)."""
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> VerifyOutcome:
        """Read :meth:`to_json` back."""
        try:
            return cls(
                verdict=str(obj["verdict"]),
                run=str(obj["run"]),
                generation=int(obj["generation"]),
                through_seq=int(obj["through_seq"]),
                metrics={str(k): float(v) for k, v in dict(obj["metrics"]).items()},
                failure=str(obj.get("failure") or ""),
                report_path=obj.get("report_path"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise BadInputError(f"not a verify outcome: {e!r}") from e


@dataclass(frozen=True)
class GenerationRecord:
    """What the train step hands to verify and promote (the generation artifact's metadata).

    Attributes:
        run: the run name.
        generation: the generation the train step produced.
        last_seq: the newest committed dump of that generation.
        last_step: the training step of the newest committed dump.
        dumps: how many committed dumps the generation has.
        rows: rows over all committed dumps (all tables, all ranks).
        uri: the generation's directory under the artifact root.
    """

    run: str
    generation: int
    last_seq: int
    last_step: int
    dumps: int
    rows: int
    uri: str

    def to_metadata(self) -> dict[str, Any]:
        """The JSON-able dict stored as the artifact's metadata."""
        return asdict(self)

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], where: str) -> GenerationRecord:
        """Read a record back from artifact metadata; a missing field is a BadInputError."""
        try:
            return cls(
                run=str(metadata["run"]),
                generation=int(metadata["generation"]),
                last_seq=int(metadata["last_seq"]),
                last_step=int(metadata["last_step"]),
                dumps=int(metadata["dumps"]),
                rows=int(metadata["rows"]),
                uri=str(metadata["uri"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise BadInputError(f"{where}: not a deltarec generation artifact ({e!r})") from e


@dataclass(frozen=True)
class SecretEnv:
    """A Kubernetes Secret whose keys reach the steps as environment variables.

    Only the Secret's *name* and key names are ever written into a pipeline; the values stay
    in the cluster.

    Attributes:
        name: the Secret's name in the pipeline's namespace.
        key_to_env: Secret data key -> environment variable name.
        optional: when True a missing Secret (or key) is not an error.
    """

    name: str
    key_to_env: dict[str, str]
    optional: bool = True

    def __post_init__(self) -> None:
        if not _DNS1123.match(self.name):
            raise BadInputError(
                f"secret name {self.name!r} is not a Kubernetes name (lower-case a-z0-9 and -)"
            )
        for key, env in self.key_to_env.items():
            if not _SECRET_KEY.match(key) or not _ENV_NAME.match(env):
                raise BadInputError(
                    f"secret {self.name!r}: key {key!r} -> env {env!r} is not a valid mapping"
                )


CREDENTIAL_ENV = (
    "PGPASSWORD",
    "REDIS_PASSWORD",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "ALIBABA_CLOUD_ACCESS_KEY_ID",
    "ALIBABA_CLOUD_ACCESS_KEY_SECRET",
    "ALIBABA_CLOUD_SECURITY_TOKEN",
    "FEATUREDB_USERNAME",
    "FEATUREDB_PASSWORD",
    "FSSPEC_OSS_KEY",
    "FSSPEC_OSS_SECRET",
    "FSSPEC_OSS_TOKEN",
    "OSS_ENDPOINT",  # not secret: where an oss:// bucket is (ossfs reads it from the environment)
)
"""Keys of the default credentials Secret; each becomes the environment variable of that name.

The one list: docs/featurestore.md and docs/artifact-roots.md name these, every step of the KFP
pipeline and the Airflow DAG mounts them, and TrainJob and PyTorchJob pods get them key by key
(never the whole Secret: a key outside this list stays out of the pods)."""

DEFAULT_SECRET = "deltarec-credentials"
"""The Secret the chart references and the pipeline mounts (optional) by default."""

LAUNCHER_TOKEN_SECRET = "deltarec-launcher-token"
"""The chart's Secret holding the launcher account's token (``rbac.launcherTokenSecret``): a
KFP run has one service account for every step, so the compiled pipeline mounts this Secret,
optionally, into the train-launcher step alone, the one step that may create jobs."""

RUN_AS_USER = 10001
"""The images' user (``USER 10001`` in images/*/Dockerfile) and the chart's ``runAsUser``."""

POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS_USER,
    "runAsGroup": RUN_AS_USER,
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""The pod ``securityContext`` of every pod deltarec creates (the chart's, and the training
job pods' of :mod:`~deltarec.orchestrate.pytorchjob` and :mod:`~deltarec.orchestrate.trainjob`)."""

CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
"""The container ``securityContext`` of those pods; writable places are :data:`SCRATCH_DIRS`."""

SCRATCH_DIRS = {"tmp": "/tmp", "home": "/home/deltarec"}
"""``emptyDir`` volumes (name -> mount path) of a job pod under a read-only root: temporary
files, and the images' home and working directory (caches, relative checkpoint dirs)."""

_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def default_secrets() -> tuple[SecretEnv, ...]:
    """The credentials Secret mounted when nothing else is configured."""
    return (SecretEnv(DEFAULT_SECRET, {k: k for k in CREDENTIAL_ENV}, optional=True),)


class StepFailedError(DeltarecError):
    """A pipeline step's deltarec command failed; names the step and the exit code."""

    def __init__(self, step: str, code: int, detail: str = "") -> None:
        self.step = step
        self.code = code
        extra = f": {detail}" if detail else ""
        super().__init__(f"step {step!r} failed with exit code {code}{extra}")


class TrainJobFailedError(DeltarecError):
    """The TrainJob (or PyTorchJob) of a multi-node train step failed or did not finish."""

    def __init__(self, namespace: str, name: str, problem: str, kind: str = "PyTorchJob") -> None:
        self.namespace = namespace
        self.name = name
        self.kind = kind
        super().__init__(f"{kind} {namespace}/{name}: {problem}")
