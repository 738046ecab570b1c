"""Multi-node training through the Kubeflow Training Operator (``PyTorchJob``, kubeflow.org/v1).

The train step of the pipeline runs ``torchrun`` in its own container for one node. For several
nodes it builds a ``PyTorchJob`` manifest (:func:`build_manifest`), creates it through the
Kubernetes API's ``CustomObjectsApi`` (:func:`create_or_follow`) and follows its status
(``PYTORCHJOB.wait``) until the job succeeds, fails or runs out of time.

Every pod runs ``torchrun --no-python -- deltarec train ...``; the operator sets ``PET_NODE_RANK``,
``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``, which torchrun reads from the environment.
Credentials reach the pods as ``envFrom`` Secret references, never as values.

The job lives no longer than the step that created it: it names the step's pod as its owner
(``ownerReferences``, from ``DELTAREC_POD_NAME``/``DELTAREC_POD_UID``, which the step's pod
sets from the Downward API), so Kubernetes' garbage collector deletes the job with the pod;
and :func:`run_train_job` deletes the job itself when it is stopped by a signal (SIGTERM when
the pod is deleted or the run is cancelled, SIGINT, SIGHUP) or leaves for any other reason
than the job's success or failure.

Only the Kubernetes API boundary is exercised by the tests (with a fake ``CustomObjectsApi``);
no cluster is started here.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from deltarec.errors import BadInputError
from deltarec.orchestrate.types import (
    CONTAINER_SECURITY_CONTEXT,
    CREDENTIAL_ENV,
    POD_SECURITY_CONTEXT,
    SCRATCH_DIRS,
    TrainJobFailedError,
)

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL, KIND = "kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"
CONTAINER_NAME = "pytorch"  # the Training Operator requires this container name
GPU_RESOURCE = "nvidia.com/gpu"
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
LAUNCHER_TOKEN_DIR = "/var/run/secrets/deltarec/launcher"
"""Where the KFP train-launcher step mounts the launcher account's token Secret
(:data:`~deltarec.orchestrate.types.LAUNCHER_TOKEN_SECRET`)."""
POD_NAME_ENV, POD_UID_ENV = "DELTAREC_POD_NAME", "DELTAREC_POD_UID"


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

    def delete_namespaced_custom_object(
        self,
        group: str,
        version: str,
        namespace: str,
        plural: str,
        name: str,
        *,
        propagation_policy: str = ...,
    ) -> Any:
        """Delete a custom object; raises an ``ApiException`` with status 404 if it is gone."""


@dataclass(frozen=True)
class OwnerPod:
    """The pod of the step that creates a job: the job's owner for garbage collection."""

    name: str
    uid: str

    def reference(self) -> dict[str, Any]:
        """The ``ownerReferences`` entry naming this pod."""
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": self.name,
            "uid": self.uid,
            "controller": False,
            "blockOwnerDeletion": False,
        }


def step_pod(environ: dict[str, str] | None = None) -> OwnerPod | None:
    """The step's own pod from ``DELTAREC_POD_NAME``/``DELTAREC_POD_UID``, else None."""
    env = os.environ if environ is None else environ
    name, uid = env.get(POD_NAME_ENV, ""), env.get(POD_UID_ENV, "")
    return OwnerPod(name, uid) if name and uid else None


@dataclass(frozen=True)
class JobResource:
    """A Kubeflow job kind (PyTorchJob, TrainJob) and the API calls both launchers make.

    Where the API serves the kind, how a job's state reads, and get, create or follow, delete
    and stop one job of it.
    """

    group: str
    version: str
    plural: str
    kind: str
    state_of: Callable[[dict[str, Any]], tuple[str, str]]
    """``(state, message)`` of a job object of this kind."""
    ended: tuple[str, ...]
    """The states a job of this kind ends in."""

    def get(self, api: CustomObjectsApiLike, namespace: str, name: str) -> dict[str, Any]:
        """The job object as the API has it now."""
        return api.get_namespaced_custom_object(
            self.group, self.version, namespace, self.plural, name
        )

    def create_or_follow(
        self, api: CustomObjectsApiLike, namespace: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """Create the job from ``body``, or return the existing one of the same name.

        Raises:
            TrainJobFailedError: it cannot be created, or the existing job of that name has
                already failed (delete it, or run the step under a new pipeline run).
        """
        try:
            created = api.create_namespaced_custom_object(
                self.group, self.version, namespace, self.plural, body
            )
            log.info("created %s %s/%s", self.kind, namespace, name)
            return created
        except Exception as e:
            if getattr(e, "status", None) != 409:
                problem = f"could not be created: {e}"
                raise TrainJobFailedError(namespace, name, problem, self.kind) from e
        existing = self.get(api, namespace, name)
        state, message = self.state_of(existing)
        if state == "Failed":
            problem = f"exists from an earlier attempt and failed: {message}"
            raise TrainJobFailedError(namespace, name, problem, self.kind)
        log.info("%s %s/%s exists (%s); following it", self.kind, namespace, name, state)
        return existing

    def wait(
        self,
        api: CustomObjectsApiLike,
        namespace: str,
        name: str,
        *,
        timeout_s: float,
        poll_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        failed_where: Callable[[], str] | None = None,
    ) -> dict[str, Any]:
        """Poll the job until it succeeds (the first of :attr:`ended`); its final object.

        Raises:
            TrainJobFailedError: the job failed (its reason and message, then what
                ``failed_where`` says, if given), or it did not finish within ``timeout_s``
                (with the last state seen).
        """
        deadline = clock() + timeout_s
        last = ""
        while True:
            job = self.get(api, namespace, name)
            state, message = self.state_of(job)
            if state != last:
                log.info("%s %s/%s: %s %s", self.kind, namespace, name, state, message)
                last = state
            if state == self.ended[0]:
                return job
            if state == "Failed":
                where = failed_where() if failed_where is not None else ""
                problem = f"failed: {message or 'no message'}" + (f"; {where}" if where else "")
                raise TrainJobFailedError(namespace, name, problem, self.kind)
            if clock() >= deadline:
                problem = f"did not finish within {timeout_s:.0f} s (last state {state})"
                raise TrainJobFailedError(namespace, name, problem, self.kind)
            sleep(poll_s)

    def run(
        self,
        api: CustomObjectsApiLike,
        namespace: str,
        name: str,
        body: dict[str, Any],
        *,
        timeout_s: float,
        poll_s: float,
        sleep: Callable[[float], None],
        failed_where: Callable[[], str] | None = None,
    ) -> dict[str, Any]:
        """Create (or follow) the job from ``body``, then :meth:`wait` for it.

        The job is deleted, unless it already ended, when SIGTERM, SIGINT or SIGHUP stops the
        call (as :class:`StepStopped`) or following it fails (API errors, timeouts).
        """
        with _signals_raise((signal.SIGTERM, signal.SIGINT, signal.SIGHUP)):
            self.create_or_follow(api, namespace, name, body)
            try:
                return self.wait(
                    api, namespace, name, timeout_s=timeout_s, poll_s=poll_s, sleep=sleep,
                    failed_where=failed_where,
                )  # fmt: skip
            except BaseException:
                self.stop_unfinished(api, namespace, name)
                raise

    def delete(self, api: CustomObjectsApiLike, namespace: str, name: str) -> bool:
        """Delete the job and its pods (foreground propagation); False if it was already gone."""
        try:
            api.delete_namespaced_custom_object(
                self.group, self.version, namespace, self.plural, name,
                propagation_policy="Foreground",
            )  # fmt: skip
        except Exception as e:
            if getattr(e, "status", None) == 404:
                return False
            raise
        log.warning(
            "deleted %s %s/%s: the step that created it is stopping", self.kind, namespace, name
        )
        return True

    def stop_unfinished(self, api: CustomObjectsApiLike, namespace: str, name: str) -> None:
        """Delete the job unless it already ended (a finished job is kept for its record)."""
        try:
            state, _ = self.state_of(self.get(api, namespace, name))
        except Exception as e:
            if getattr(e, "status", None) == 404:
                return
            state = "Unknown"
        if state not in self.ended:
            self.delete(api, namespace, name)


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
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in spec.env]
    env += [  # key by key: the pods get the credentials deltarec reads, not the whole Secret
        {"name": key, "valueFrom": {"secretKeyRef": {"name": s, "key": key, "optional": True}}}
        for s in spec.secrets
        for key in CREDENTIAL_ENV
    ]
    if env:
        container["env"] = env
    if spec.gpus_per_node > 0:
        container["resources"] = {"limits": {GPU_RESOURCE: spec.gpus_per_node}}
    container["securityContext"] = copy.deepcopy(CONTAINER_SECURITY_CONTEXT)
    container["volumeMounts"] = [{"name": n, "mountPath": p} for n, p in SCRATCH_DIRS.items()]
    return container


def _replica(spec: TrainJobSpec, replicas: int) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "containers": [_container(spec)],
        # the training program needs no Kubernetes API: no token in its pods
        "automountServiceAccountToken": False,
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
        "volumes": [{"name": n, "emptyDir": {}} for n in SCRATCH_DIRS],
    }
    if spec.service_account:
        pod["serviceAccountName"] = spec.service_account
    return {"replicas": replicas, "restartPolicy": "Never", "template": {"spec": pod}}


def build_manifest(spec: TrainJobSpec, owner: OwnerPod | None = None) -> dict[str, Any]:
    """The ``PyTorchJob`` object for ``spec`` (a plain dict, ready for the Kubernetes API).

    One ``Master`` replica and ``nodes - 1`` ``Worker`` replicas; ``nprocPerNode`` is the number
    of ranks per pod. Pods never restart on their own (``restartPolicy: Never``,
    ``backoffLimit: 0``): a failed rank fails the job, and the pipeline step with it. With
    ``owner`` the job is owned by that pod and garbage-collected with it.
    """
    replica_specs = {"Master": _replica(spec, 1)}
    if spec.nodes > 1:
        replica_specs["Worker"] = _replica(spec, spec.nodes - 1)
    metadata: dict[str, Any] = {
        "name": spec.name,
        "namespace": spec.namespace,
        "labels": {"app.kubernetes.io/part-of": "deltarec", **spec.labels},
    }
    if owner is not None:
        metadata["ownerReferences"] = [owner.reference()]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": metadata,
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
    meta = manifest["metadata"]
    return PYTORCHJOB.create_or_follow(api, meta["namespace"], meta["name"], manifest)


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


PYTORCHJOB = JobResource(GROUP, VERSION, PLURAL, KIND, job_state, ("Succeeded", "Failed"))


def current_namespace(default: str = "default") -> str:
    """The namespace of the pod this runs in (service account file), else ``default``."""
    for path in (os.path.join(LAUNCHER_TOKEN_DIR, "namespace"), SERVICE_ACCOUNT_NAMESPACE):
        try:
            with open(path, encoding="utf-8") as f:
                found = f.read().strip()
        except OSError:
            continue
        if found:
            return found
    return default


def load_cluster_config() -> str:
    """Configure the Kubernetes client; returns which identity it uses.

    The launcher account's token Secret mounted at :data:`LAUNCHER_TOKEN_DIR` (the KFP
    train-launcher step: the only one that may create jobs) comes first, then the pod's own
    service account, then ``~/.kube/config``.
    """
    from kubernetes import config
    from kubernetes.config.incluster_config import InClusterConfigLoader

    token = os.path.join(LAUNCHER_TOKEN_DIR, "token")
    if os.path.isfile(token):
        ca = os.path.join(LAUNCHER_TOKEN_DIR, "ca.crt")
        InClusterConfigLoader(token_filename=token, cert_filename=ca).load_and_set()
        return "launcher token"
    try:
        config.load_incluster_config()
        return "in-cluster service account"
    except config.ConfigException:
        config.load_kube_config()
        return "kubeconfig"


def kubernetes_api() -> CustomObjectsApiLike:  # pragma: no cover - needs a cluster
    """A ``CustomObjectsApi`` configured by :func:`load_cluster_config`."""
    from kubernetes import client

    load_cluster_config()
    return client.CustomObjectsApi()  # type: ignore[no-any-return]


class StepStopped(BaseException):
    """The step was stopped by a signal while its job ran (the job is deleted)."""


@contextmanager
def _signals_raise(signals: tuple[int, ...]) -> Iterator[None]:
    """Turn ``signals`` into :class:`StepStopped` while inside (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise StepStopped(f"stopped by signal {signal.Signals(signum).name}")

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def delete_job(api: CustomObjectsApiLike, namespace: str, name: str) -> bool:
    """Delete the job and its pods (foreground propagation); False if it was already gone."""
    return PYTORCHJOB.delete(api, namespace, name)


def run_train_job(
    spec: TrainJobSpec,
    api: CustomObjectsApiLike | None = None,
    *,
    poll_s: float = 15.0,
    sleep: Callable[[float], None] = time.sleep,
    owner: OwnerPod | None = None,
) -> dict[str, Any]:
    """Create (or follow) the PyTorchJob of ``spec`` and wait until it has succeeded.

    The job never outlives this call unless it finished: it is owned by ``owner`` (default:
    :func:`step_pod`), and it is deleted when this call is stopped by SIGTERM, SIGINT or
    SIGHUP or fails while following it (API errors, timeouts).

    Raises:
        TrainJobFailedError: the job failed or timed out.
        StepStopped: a signal stopped the step (after the job was deleted).
    """
    api = api if api is not None else kubernetes_api()
    owner = owner if owner is not None else step_pod()
    if owner is None:
        log.warning(
            "%s/%s unset: PyTorchJob %s is not owned by this step's pod and is deleted only if "
            "this process is stopped by a signal",
            POD_NAME_ENV,
            POD_UID_ENV,
            spec.name,
        )
    return PYTORCHJOB.run(
        api, spec.namespace, spec.name, build_manifest(spec, owner),
        timeout_s=spec.timeout_s + 300, poll_s=poll_s, sleep=sleep,
    )  # fmt: skip
