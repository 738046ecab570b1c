"""Multi-node training through the Kubeflow Training Operator (``PyTorchJob``, kubeflow.org/v1).

The train step of the pipeline runs ``torchrun`` in its own container for one node. For several
nodes it builds a ``PyTorchJob`` manifest (:func:`build_manifest`), creates it through the
Kubernetes API's ``CustomObjectsApi`` (:func:`create_or_follow`) and follows its status
(:func:`wait_for_job`) until the job succeeds, fails or runs out of time.

Every pod runs ``torchrun --no-python -- deltarec train ...``; the operator sets ``PET_NODE_RANK``,
``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``, which torchrun reads from the environment.
Credentials reach the pods as ``envFrom`` Secret references, never as values.

Only the Kubernetes API boundary is exercised by the tests (with a fake ``CustomObjectsApi``);
no cluster is started here.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from deltarec.errors import BadInputError
from deltarec.orchestrate.types import TrainJobFailedError

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL, KIND = "kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"
CONTAINER_NAME = "pytorch"  # the Training Operator requires this container name
GPU_RESOURCE = "nvidia.com/gpu"
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class CustomObjectsApiLike(Protocol):
    """The two calls of ``kubernetes.client.CustomObjectsApi`` this module uses."""

    def create_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """Create a custom object; raises an ``ApiException`` with status 409 if it exists."""

    def get_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, name: str
    ) -> dict[str, Any]:
        """Read a custom object."""


@dataclass(frozen=True)
class TrainJobSpec:
    """What one multi-node training job needs.

    Attributes:
        name: the PyTorchJob's name (DNS-1123, <= 63 characters); see :func:`job_name`.
        namespace: the Kubernetes namespace.
        image: the trainer image.
        nodes: number of pods (1 Master + ``nodes - 1`` Workers), >= 1.
        procs_per_node: training processes (ranks) per pod, >= 1.
        gpus_per_node: GPUs requested per pod; 0 trains on CPU with gloo.
        train_args: arguments after ``deltarec train`` (without ``--device``).
        secrets: names of Secrets whose keys become the pods' environment (optional refs).
        service_account: the pods' service account, or None for the namespace default.
        timeout_s: the job's ``activeDeadlineSeconds``; the operator fails it afterwards.
        labels: extra metadata labels.
        program: what torchrun starts on every rank: ``deltarec train`` (the example model,
            which gets ``--device`` first) or a team's entry point (see ``steps.program``).
        env: extra environment of the pods (the ``DELTAREC_*`` settings of an entry point;
            never a credential).
    """

    name: str
    namespace: str
    image: str
    nodes: int
    procs_per_node: int
    gpus_per_node: int
    train_args: tuple[str, ...]
    secrets: tuple[str, ...] = ()
    service_account: str | None = None
    timeout_s: int = 24 * 3600
    labels: dict[str, str] = field(default_factory=dict)
    program: tuple[str, ...] = ("deltarec", "train")
    env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.procs_per_node < 1 or self.gpus_per_node < 0:
            raise BadInputError(
                f"PyTorchJob {self.name!r}: nodes={self.nodes}, procs_per_node="
                f"{self.procs_per_node}, gpus_per_node={self.gpus_per_node}: need nodes >= 1, "
                "procs_per_node >= 1 and gpus_per_node >= 0"
            )
        if not _DNS1123.match(self.name):
            raise BadInputError(f"PyTorchJob name {self.name!r} is not a DNS-1123 label")


_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def job_name(run: str, job_id: str) -> str:
    """A stable PyTorchJob name for one pipeline run's train step.

    The same ``(run, job_id)`` always gives the same name, so a retried step finds the job it
    created earlier instead of starting a second one.
    """
    stem = re.sub(r"[^a-z0-9-]+", "-", run.lower()).strip("-")[:40] or "run"
    digest = hashlib.sha256(f"{run}/{job_id}".encode()).hexdigest()[:10]
    return f"deltarec-{stem}-{digest}".replace("--", "-")


def _container(spec: TrainJobSpec) -> dict[str, Any]:
    device = "cuda" if spec.gpus_per_node > 0 else "cpu"
    # "--" ends torchrun's own options: without it torchrun's parser takes the training
    # flag --run for an abbreviation of its --run-path.
    command = ["torchrun", "--nnodes", str(spec.nodes), "--nproc-per-node"]
    command += [str(spec.procs_per_node), "--no-python", "--", *spec.program]
    args = list(spec.train_args)
    if spec.program == ("deltarec", "train"):
        args = ["--device", device, *args]
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "args": args,
    }
    if spec.env:
        container["env"] = [{"name": k, "value": v} for k, v in spec.env]
    if spec.secrets:
        container["envFrom"] = [{"secretRef": {"name": s, "optional": True}} for s in spec.secrets]
    if spec.gpus_per_node > 0:
        container["resources"] = {"limits": {GPU_RESOURCE: spec.gpus_per_node}}
    return container


def _replica(spec: TrainJobSpec, replicas: int) -> dict[str, Any]:
    pod: dict[str, Any] = {"containers": [_container(spec)]}
    if spec.service_account:
        pod["serviceAccountName"] = spec.service_account
    return {"replicas": replicas, "restartPolicy": "Never", "template": {"spec": pod}}


def build_manifest(spec: TrainJobSpec) -> dict[str, Any]:
    """The ``PyTorchJob`` object for ``spec`` (a plain dict, ready for the Kubernetes API).

    One ``Master`` replica and ``nodes - 1`` ``Worker`` replicas; ``nprocPerNode`` is the number
    of ranks per pod. Pods never restart on their own (``restartPolicy: Never``,
    ``backoffLimit: 0``): a failed rank fails the job, and the pipeline step with it.
    """
    replica_specs = {"Master": _replica(spec, 1)}
    if spec.nodes > 1:
        replica_specs["Worker"] = _replica(spec, spec.nodes - 1)
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {
            "name": spec.name,
            "namespace": spec.namespace,
            "labels": {"app.kubernetes.io/part-of": "deltarec", **spec.labels},
        },
        "spec": {
            "nprocPerNode": str(spec.procs_per_node),
            "runPolicy": {
                "backoffLimit": 0,
                "cleanPodPolicy": "None",
                "activeDeadlineSeconds": int(spec.timeout_s),
            },
            "pytorchReplicaSpecs": replica_specs,
        },
    }


def create_or_follow(api: CustomObjectsApiLike, manifest: dict[str, Any]) -> dict[str, Any]:
    """Create the job, or return the existing one of the same name (idempotent step).

    Raises:
        TrainJobFailedError: the existing job of that name has already failed (delete it, or
            run the step under a new pipeline run, to train again).
    """
    ns, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    try:
        created = api.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, manifest)
        log.info("created PyTorchJob %s/%s", ns, name)
        return created
    except Exception as e:
        if getattr(e, "status", None) != 409:
            raise TrainJobFailedError(ns, name, f"could not be created: {e}") from e
    existing = api.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    state, message = job_state(existing)
    if state == "Failed":
        raise TrainJobFailedError(ns, name, f"exists from an earlier attempt and failed: {message}")
    log.info("PyTorchJob %s/%s exists (%s); following it", ns, name, state)
    return existing


def job_state(job: dict[str, Any]) -> tuple[str, str]:
    """``(state, message)`` of a PyTorchJob from its status conditions.

    The state is the type of the newest condition whose status is ``"True"`` (``Created``,
    ``Running``, ``Restarting``, ``Succeeded``, ``Failed``), or ``Pending`` when there is none.
    """
    conditions = (job.get("status") or {}).get("conditions") or []
    true = [c for c in conditions if str(c.get("status")) == "True"]
    if not true:
        return "Pending", ""
    final = [c for c in true if c.get("type") in ("Succeeded", "Failed")]
    newest = final[-1] if final else true[-1]
    detail = " ".join(str(newest.get(k) or "") for k in ("reason", "message")).strip()
    return str(newest.get("type")), detail


def wait_for_job(
    api: CustomObjectsApiLike,
    namespace: str,
    name: str,
    *,
    timeout_s: float,
    poll_s: float = 15.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Poll the job until it succeeds; return its final object.

    Raises:
        TrainJobFailedError: the job failed (with the operator's reason and message), or it
            did not finish within ``timeout_s`` (with the last state seen).
    """
    deadline = clock() + timeout_s
    last = ""
    while True:
        job = api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        state, message = job_state(job)
        if state != last:
            log.info("PyTorchJob %s/%s: %s %s", namespace, name, state, message)
            last = state
        if state == "Succeeded":
            return job
        if state == "Failed":
            raise TrainJobFailedError(namespace, name, f"failed: {message or 'no message'}")
        if clock() >= deadline:
            raise TrainJobFailedError(
                namespace, name, f"did not finish within {timeout_s:.0f} s (last state {state})"
            )
        sleep(poll_s)


def current_namespace(default: str = "default") -> str:
    """The namespace of the pod this runs in (service account file), else ``default``."""
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE, encoding="utf-8") as f:
            return f.read().strip() or default
    except OSError:
        return default


def kubernetes_api() -> CustomObjectsApiLike:  # pragma: no cover - needs a cluster
    """A ``CustomObjectsApi`` from the in-cluster config, else from ``~/.kube/config``."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CustomObjectsApi()  # type: ignore[no-any-return]


def run_train_job(
    spec: TrainJobSpec,
    api: CustomObjectsApiLike | None = None,
    *,
    poll_s: float = 15.0,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Create (or follow) the PyTorchJob of ``spec`` and wait until it has succeeded.

    Raises:
        TrainJobFailedError: the job failed or timed out.
    """
    api = api if api is not None else kubernetes_api()
    create_or_follow(api, build_manifest(spec))
    return wait_for_job(
        api, spec.namespace, spec.name, timeout_s=spec.timeout_s + 300, poll_s=poll_s, sleep=sleep
    )
