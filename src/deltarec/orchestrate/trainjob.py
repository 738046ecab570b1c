"""Multi-node training through Kubeflow Trainer v2: a ``TrainJob`` (trainer.kubeflow.org/v1alpha1).

The default launcher of a train step with ``nodes > 1`` (``launcher=trainjob``; the Training
Operator v1 PyTorchJob of :mod:`deltarec.orchestrate.pytorchjob` is ``launcher=pytorchjob``).
:func:`build_train_job` builds the job with the official typed models (``kubeflow-trainer-api``):
a reference to a ``ClusterTrainingRuntime`` (``torch-distributed`` by default) that starts
torchrun on every node, the trainer's image, command, nodes, processes per node and resources per
node (GPUs), the ``DELTAREC_*`` settings, and the credentials Secrets key by key as the other
steps get them (``secretKeyRef``, optional). :func:`run_train_job` creates it or follows the one
of the same stable name (a retried step never starts a second one), waits for ``Complete`` or
``Failed`` and names the failing node and its reason (from the job's pods), and deletes the job
when the step is stopped (SIGTERM, SIGINT, SIGHUP) or fails while following it. The job is owned
by the step's pod (``ownerReferences``), so it never outlives it.

Tested at the Kubernetes API boundary with the official models, and end to end through the SDK's
local process backend (tests/orchestrate/test_trainjob_local.py); no cluster is started here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from deltarec.errors import BadInputError, ConfigError
from deltarec.orchestrate.pytorchjob import (
    CustomObjectsApiLike,
    JobResource,
    OwnerPod,
    step_pod,
)
from deltarec.orchestrate.pytorchjob import TrainJobSpec as JobSpec
from deltarec.orchestrate.types import (
    CONTAINER_SECURITY_CONTEXT,
    CREDENTIAL_ENV,
    POD_SECURITY_CONTEXT,
    SCRATCH_DIRS,
)

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL, KIND = "trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob"
DEFAULT_RUNTIME = "torch-distributed"
GPU_RESOURCE = "nvidia.com/gpu"
TRAINER_CONTAINER = "node"  # the trainer container of the torch runtimes
MANAGER = "deltarec"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
JOB_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"


class CoreV1ApiLike(Protocol):
    """The one call of ``kubernetes.client.CoreV1Api`` this module uses."""

    def list_namespaced_pod(self, namespace: str, *, label_selector: str = ...) -> Any:
        """The pods matching ``label_selector`` (a ``V1PodList``)."""


def _models() -> Any:
    try:
        import kubeflow_trainer_api.models as models
    except ImportError as e:  # pragma: no cover - the kfp extra installs it
        raise ConfigError(
            "launcher trainjob needs the Kubeflow Trainer API models: pip install "
            "'deltarec[kfp]' (kubeflow-trainer-api)"
        ) from e
    return models


@dataclass(frozen=True)
class TrainJobSettings:
    """What a TrainJob adds to the common multi-node job spec.

    Attributes:
        runtime: the ``ClusterTrainingRuntime`` (or namespaced ``TrainingRuntime``) to use.
        runtime_kind: ``ClusterTrainingRuntime`` or ``TrainingRuntime``.
        cpus_per_node: CPU request per node (None: the runtime's).
        memory_per_node: memory request per node, e.g. ``"32Gi"`` (None: the runtime's).
    """

    runtime: str = DEFAULT_RUNTIME
    runtime_kind: str = "ClusterTrainingRuntime"
    cpus_per_node: str | None = None
    memory_per_node: str | None = None


def _command(spec: JobSpec) -> tuple[list[str], list[str]]:
    """The trainer container's command and args: torchrun over this node's processes.

    The torch runtime sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` and the
    rendezvous address, which torchrun reads from the environment.
    """
    device = "cuda" if spec.gpus_per_node > 0 else "cpu"
    args = list(spec.train_args)
    if spec.program == ("deltarec", "train"):
        args = ["--device", device, *args]
    return ["torchrun", "--no-python", "--", *spec.program], args


def build_train_job(
    spec: JobSpec, settings: TrainJobSettings | None = None, owner: OwnerPod | None = None
) -> Any:
    """The ``TrainJob`` of ``spec`` (a ``TrainerV1alpha1TrainJob``; ``.to_dict()`` for the API).

    ``spec.nodes`` nodes of ``spec.procs_per_node`` processes, ``spec.gpus_per_node`` GPUs
    each (limits and requests); ``spec.env`` as plain variables and every key of
    :data:`~deltarec.orchestrate.types.CREDENTIAL_ENV` of each Secret in ``spec.secrets`` as an
    optional ``secretKeyRef``; the hardened security contexts, scratch volumes and
    ``spec.service_account`` through a runtime patch (:func:`_pod_patch`);
    ``activeDeadlineSeconds`` from ``spec.timeout_s``; owned by ``owner``.
    """
    m = _models()
    settings = settings or TrainJobSettings()
    command, args = _command(spec)
    env = [m.IoK8sApiCoreV1EnvVar(name=k, value=v) for k, v in spec.env]
    env += [
        m.IoK8sApiCoreV1EnvVar(
            name=key,
            value_from=m.IoK8sApiCoreV1EnvVarSource(
                secret_key_ref=m.IoK8sApiCoreV1SecretKeySelector(name=s, key=key, optional=True)
            ),
        )
        for s in spec.secrets
        for key in CREDENTIAL_ENV
    ]
    amounts: dict[str, Any] = {}
    if spec.gpus_per_node > 0:
        amounts[GPU_RESOURCE] = str(spec.gpus_per_node)
    if settings.cpus_per_node:
        amounts["cpu"] = settings.cpus_per_node
    if settings.memory_per_node:
        amounts["memory"] = settings.memory_per_node
    quantities = {k: m.IoK8sApimachineryPkgApiResourceQuantity(v) for k, v in amounts.items()}
    resources = (
        m.IoK8sApiCoreV1ResourceRequirements(limits=quantities, requests=quantities)
        if quantities
        else None
    )
    trainer = m.TrainerV1alpha1Trainer(
        image=spec.image,
        command=command,
        args=args,
        env=env or None,
        num_nodes=spec.nodes,
        num_proc_per_node=spec.procs_per_node,
        resources_per_node=resources,
    )
    node = m.TrainerV1alpha1ReplicatedJobPatch(
        name=TRAINER_CONTAINER,
        template=m.TrainerV1alpha1JobTemplatePatch(
            spec=m.TrainerV1alpha1JobSpecPatch(
                template=m.TrainerV1alpha1PodTemplatePatch(spec=_pod_patch(spec))
            )
        ),
    )
    patches = [
        m.TrainerV1alpha1RuntimePatch(
            manager=MANAGER,
            training_runtime_spec=m.TrainerV1alpha1TrainingRuntimeSpecPatch(
                template=m.TrainerV1alpha1JobSetTemplatePatch(
                    spec=m.TrainerV1alpha1JobSetSpecPatch(replicated_jobs=[node])
                )
            ),
        )
    ]
    owners = None
    if owner is not None:
        owners = [
            m.IoK8sApimachineryPkgApisMetaV1OwnerReference(
                api_version="v1",
                kind="Pod",
                name=owner.name,
                uid=owner.uid,
                controller=False,
                block_owner_deletion=False,
            )
        ]
    return m.TrainerV1alpha1TrainJob(
        api_version=f"{GROUP}/{VERSION}",
        kind=KIND,
        metadata=m.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
            name=spec.name,
            namespace=spec.namespace,
            labels={"app.kubernetes.io/part-of": "deltarec", **spec.labels},
            owner_references=owners,
        ),
        spec=m.TrainerV1alpha1TrainJobSpec(
            runtime_ref=m.TrainerV1alpha1RuntimeRef(
                name=settings.runtime, kind=settings.runtime_kind, api_group=GROUP
            ),
            trainer=trainer,
            active_deadline_seconds=int(spec.timeout_s),
            runtime_patches=patches,
        ),
    )


def _pod_patch(spec: JobSpec) -> Any:
    """The node pods' hardening, as a pod spec patch.

    The pod and container security contexts of :mod:`~deltarec.orchestrate.types`, scratch
    ``emptyDir`` volumes under the read-only root, and the service account (if any).
    """
    m = _models()
    container = m.TrainerV1alpha1ContainerPatch.from_dict(
        {
            "name": TRAINER_CONTAINER,
            "securityContext": CONTAINER_SECURITY_CONTEXT,
            "volumeMounts": [{"name": n, "mountPath": p} for n, p in SCRATCH_DIRS.items()],
        }
    )
    return m.TrainerV1alpha1PodSpecPatch.from_dict(
        {
            "securityContext": POD_SECURITY_CONTEXT,
            "volumes": [{"name": n, "emptyDir": {}} for n in SCRATCH_DIRS],
            "containers": [container.to_dict()],
            **({"serviceAccountName": spec.service_account} if spec.service_account else {}),
        }
    )


def job_state(job: dict[str, Any]) -> tuple[str, str]:
    """``(state, message)`` of a TrainJob from its typed status.

    ``Complete`` or ``Failed`` when such a condition is true (with its reason and message),
    ``Suspended`` likewise, else ``Running`` once a child job is active and ``Created``
    before.
    """
    status = _models().TrainerV1alpha1TrainJob.from_dict(job).status
    conditions = (status.conditions or []) if status else []
    true = {c.type: c for c in conditions if c.status == "True"}
    for state in ("Failed", "Complete", "Suspended"):
        if state in true:
            c = true[state]
            return state, " ".join(x for x in (c.reason, c.message) if x)
    if status and any(j.active for j in status.jobs_status or []):
        return "Running", ""
    return "Created", ""


TRAINJOB = JobResource(GROUP, VERSION, PLURAL, KIND, job_state, ("Complete", "Failed"))


def failing_node(core: CoreV1ApiLike, namespace: str, name: str) -> str:
    """The failed nodes of a TrainJob and why (``"node 1 (pod p): Error, exit code 3"``).

    Read from the job's pods (the JobSet's label); empty when none has failed.
    """
    from kubernetes.client import V1Pod

    pods = core.list_namespaced_pod(namespace, label_selector=f"{JOBSET_NAME_LABEL}={name}")
    out = []
    items: list[V1Pod] = list(pods.items or [])
    for pod in sorted(items, key=lambda p: p.metadata.name):
        if pod.status is None or pod.status.phase != "Failed":
            continue
        index = (pod.metadata.labels or {}).get(JOB_INDEX_LABEL, "?")
        why = [pod.status.reason or ""]
        for cs in pod.status.container_statuses or []:
            term = cs.state.terminated if cs.state else None
            if term is not None and term.exit_code:
                why.append(f"{cs.name}: {term.reason or 'terminated'}, exit code {term.exit_code}")
                if term.message:
                    why.append(term.message.strip().splitlines()[-1])
        detail = "; ".join(w for w in why if w) or "failed"
        out.append(f"node {index} (pod {pod.metadata.name}): {detail}")
    return "; ".join(out)


def create_or_follow(api: CustomObjectsApiLike, job: Any) -> dict[str, Any]:
    """Create the TrainJob, or follow the existing one of the same name (idempotent step).

    Raises:
        TrainJobFailedError: the existing job of that name has already failed (delete it, or
            run the step under a new pipeline run, to train again), or it cannot be created.
    """
    meta = job.metadata
    return TRAINJOB.create_or_follow(api, meta.namespace, meta.name, job.to_dict())


def delete_job(api: CustomObjectsApiLike, namespace: str, name: str) -> bool:
    """Delete the TrainJob and its pods (foreground); False if it was already gone."""
    return TRAINJOB.delete(api, namespace, name)


def kubernetes_apis() -> tuple[CustomObjectsApiLike, CoreV1ApiLike]:  # pragma: no cover
    """``CustomObjectsApi`` and ``CoreV1Api`` configured by ``load_cluster_config``."""
    from kubernetes import client

    from deltarec.orchestrate.pytorchjob import load_cluster_config

    load_cluster_config()
    return client.CustomObjectsApi(), client.CoreV1Api()


def run_train_job(
    spec: JobSpec,
    settings: TrainJobSettings | None = None,
    api: CustomObjectsApiLike | None = None,
    core: CoreV1ApiLike | None = None,
    *,
    poll_s: float = 15.0,
    sleep: Callable[[float], None] = time.sleep,
    owner: OwnerPod | None = None,
) -> dict[str, Any]:
    """Create (or follow) the TrainJob of ``spec`` and wait until it is complete.

    The job never outlives this call unless it finished: it is owned by ``owner`` (default:
    the step's pod), and deleted when this call is stopped by SIGTERM, SIGINT or SIGHUP or
    fails while following it.

    Raises:
        TrainJobFailedError: the job failed (naming the failing node) or timed out.
        StepStopped: a signal stopped the step (after the job was deleted).
    """
    if spec.nodes < 1:
        raise BadInputError(f"TrainJob {spec.name!r}: nodes must be >= 1")
    if api is None:
        api, core = kubernetes_apis()
    owner = owner if owner is not None else step_pod()
    job = build_train_job(spec, settings, owner)
    meta = job.metadata

    def nodes() -> str:
        return failing_node(core, spec.namespace, spec.name) if core is not None else ""

    return TRAINJOB.run(
        api, meta.namespace, meta.name, job.to_dict(),
        timeout_s=spec.timeout_s + 300, poll_s=poll_s, sleep=sleep, failed_where=nodes,
    )  # fmt: skip


__all__ = [
    "DEFAULT_RUNTIME",
    "TrainJobSettings",
    "build_train_job",
    "create_or_follow",
    "delete_job",
    "failing_node",
    "job_state",
    "run_train_job",
]
