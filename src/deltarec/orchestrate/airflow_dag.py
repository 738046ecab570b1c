"""The deltarec pipeline as an Airflow 3 DAG: the same steps and images as the Kubeflow one.

params -> provision -> train (or train_launcher) -> compact_plan -> compact_partition x M
    (dynamic task mapping; none unless a table is large) -> compact -> verify_plan ->
    verify_partition x N (dynamic task mapping) -> verify (the gate) -> branch ->
    promote -> gc (PASS) | verify_failed (FAIL)

* ``params`` validates the run's ``dag_run.conf`` / DAG params (:class:`PipelineParams`'s
  fields, the DAG's ``params``) and pushes them as one JSON object; every later task pulls it.
* ``compact_plan`` decides whether and how the trained generation is compacted
  (``compact_min_dumps``, ``compact_partition_rows``); ``compact_partition`` is mapped over its
  partitions (zero of them: skipped), and ``compact`` (trigger rule ``none_failed``) compacts
  in one task or commits the fan-out's base, before verify. ``gc`` runs after promote
  (``gc_mode``, ``gc_keep_promotions``).
* ``train`` pushes the :class:`GenerationRecord`; ``verify_plan`` the partitions
  (``verify_partitions``), over which ``verify_partition`` is mapped (``.expand``); ``verify``
  combines their documents into the :class:`VerifyOutcome` (XCom, as the KFP pipeline passes
  artifacts); ``branch`` picks promote or verify_failed.
* ``verify_failed`` drops the staging views (staged) or rolls serving back to the last
  promoted generation (direct), calls the webhook and fails, so the DAG run ends failed; the
  verify report lies beside the generation in the artifact root (``verify-report-<seq>.html``).

Two builds of one shape (:func:`build_dag`): ``kubernetes`` runs provision, train, verify,
promote and verify_failed as ``KubernetesPodOperator`` pods on ``TOOLS_IMAGE`` /
``TRAINER_IMAGE`` (``python -m deltarec.orchestrate.airflow_task STEP``), with the credentials
Secrets' keys as environment variables as the KFP pipeline mounts them; for several nodes a
separate ``train_launcher`` pod on the tools image (no GPU) creates the TrainJob or PyTorchJob,
as the KFP ``train_launcher`` task does. ``local`` runs the
same task functions (:mod:`deltarec.orchestrate.airflow_task`) in-process, for ``dag.test()``.
``params`` and ``branch`` always run in the Airflow worker (deltarec without torch).

Importing this module imports Airflow (the ``airflow`` extra); nothing in deltarec's core does.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from deltarec.errors import BadInputError
from deltarec.orchestrate import airflow_task
from deltarec.orchestrate.images import TOOLS_IMAGE, TRAINER_IMAGE
from deltarec.orchestrate.params import PipelineParams
from deltarec.orchestrate.types import SecretEnv, default_secrets

DAG_ID = "deltarec"
DEFAULT_DAG_FILE = "deltarec_dag.py"
MODES = ("kubernetes", "local")

_PARAMS_XCOM = "{{ ti.xcom_pull(task_ids='params') | tojson }}"
# the record of whichever train task ran: the one-node train pod or the multi-node launcher
_TRAIN_XCOM = (
    "{{ (ti.xcom_pull(task_ids='train') or ti.xcom_pull(task_ids='train_launcher')) | tojson }}"
)

_DAG_FILE = '''"""The deltarec pipeline as an Airflow DAG.

Written by `deltarec pipeline compile --engine airflow`.
Put this file into the DAGs folder of an Airflow 3 deployment whose workers have deltarec
installed (`pip install deltarec[airflow]`; no torch needed there), and trigger it with the
pipeline parameters as the run's conf, e.g. {{"run_name": "ctr", "artifact_root":
"s3://bucket/art", "store_url": "postgresql://trainer@db:5432/emb"}}. See docs/airflow.md.
"""

from deltarec.orchestrate.airflow_dag import build_dag

dag = build_dag(mode={mode!r}, secrets={secrets!r}, namespace={namespace!r})
'''


def dag_params() -> dict[str, Any]:
    """The DAG's ``params``: one ``Param`` per :class:`PipelineParams` field, with its doc."""
    from airflow.sdk import Param

    types = {int: "integer", float: "number"}
    out: dict[str, Any] = {}
    for name, info in PipelineParams.model_fields.items():
        kind = types.get(info.annotation, "string")  # type: ignore[arg-type]
        doc = PipelineParams.summary(name)
        if info.is_required():
            out[name] = Param(type=kind, description=doc)
        else:
            out[name] = Param(info.default, type=kind, description=doc)
    return out


SecretSpec = dict[str, Any]
"""A Secret as the DAG file writes it: ``{"name": ..., "key_to_env": {...}, "optional": ...}``."""


def _secret_specs(secrets: Sequence[SecretEnv] | Sequence[SecretSpec] | None) -> list[SecretSpec]:
    chosen = default_secrets() if secrets is None else secrets
    out = []
    for s in chosen:
        env = s if isinstance(s, SecretEnv) else SecretEnv(**s)  # validates a written spec
        out.append({"name": env.name, "key_to_env": dict(env.key_to_env), "optional": env.optional})
    return out


def build_dag(
    *,
    mode: str = "kubernetes",
    secrets: Sequence[SecretEnv] | Sequence[SecretSpec] | None = None,
    namespace: str | None = None,
    dag_id: str = DAG_ID,
) -> Any:
    """The deltarec DAG.

    Args:
        mode: ``kubernetes`` (pods on the pipeline images) or ``local`` (in-process tasks).
        secrets: Secrets whose keys reach the pods as environment variables, key by key as
            the KFP pipeline mounts them (:class:`SecretEnv`, or its fields as a dict); None
            for the default credentials Secret. PyTorchJob pods get them as ``envFrom``.
        namespace: the pods' namespace; None for the operator's default (in-cluster: its own).
        dag_id: the DAG's id.

    Pods: ``train_route`` picks one of two train tasks by ``nodes``: with one node the ``train``
    pod on ``TRAINER_IMAGE`` requests ``gpus_per_node`` GPUs; with several the
    ``train_launcher`` pod on ``TOOLS_IMAGE``, with no GPU, creates and follows the
    TrainJob/PyTorchJob (the job's nodes hold the GPUs). Later tasks read the record of
    whichever ran. Locally one in-process ``train`` task does either.
    """
    from airflow.sdk import DAG, task

    if mode not in MODES:
        raise BadInputError(f"airflow DAG mode {mode!r} is not one of {MODES}")
    specs = _secret_specs(secrets)
    with DAG(
        dag_id,
        schedule=None,
        params=dag_params(),
        description="provision -> train -> verify -> promote, or drop staging / roll back",
        tags=["deltarec"],
        max_active_runs=1,
        default_args={"retries": 0},
    ) as dag:

        @task(task_id="params")
        def params(**context: Any) -> dict[str, Any]:
            return airflow_task.check_params(dict(context["params"]))

        @task.branch(task_id="branch")
        def branch(outcome: dict[str, Any]) -> str:
            return airflow_task.choose(outcome)

        checked = params()
        if mode == "local":
            tasks = _local_tasks(checked)
        else:
            tasks = _pod_tasks(specs, namespace, checked)
            checked >> tasks["provision"]
        if mode == "local":
            tasks["provision"] >> tasks["train"]
        choice = branch(tasks["verify"].output if mode != "local" else tasks["verify"])
        tasks["verify"] >> choice
        choice >> [tasks["promote"], tasks["verify_failed"]]
    return dag


def _announced(task_id: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, printing the task markers kfp.local prints (the demo's progress reads them)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        print(f"Executing task '{task_id}'", flush=True)
        status = "FAILURE"
        try:
            result = fn(*args, **kwargs)
            status = "SUCCESS"
            return result
        finally:
            print(f"Task '{task_id}' finished with status {status}", flush=True)

    return run


def _local_tasks(checked: Any) -> dict[str, Any]:
    from airflow.sdk import task

    def local(task_id: str, fn: Callable[..., Any]) -> Any:
        return task(task_id=task_id)(_announced(task_id, fn))

    provision = local("provision", airflow_task.provision)(checked)
    train = local("train", _train_local)(checked)
    cplan = local("compact_plan", airflow_task.compact_plan)(checked, train)
    cparts = (
        task(task_id="compact_partition")(_announced("compact_partition", _compact_partition))
        .partial(conf=checked)
        .expand(item=task(task_id="compact_items")(compact_items)(cplan))
    )
    compacted = task(task_id="compact", trigger_rule="none_failed")(
        _announced("compact", airflow_task.compact)
    )(checked, cplan)
    cparts >> compacted
    plan = local("verify_plan", airflow_task.verify_plan)(checked)
    compacted >> plan
    parts = (
        task(task_id="verify_partition")(_announced("verify_partition", _verify_partition))
        .partial(conf=checked, generation=train)
        .expand(partition=plan)
    )
    verify = local("verify", _verify_gate)(checked, train, parts)
    promote = local("promote", airflow_task.promote)(checked, train)
    promote >> local("gc", airflow_task.gc)(checked)
    failed = local("verify_failed", airflow_task.verify_failed)(checked, verify)
    return {
        "provision": provision, "train": train, "verify": verify, "promote": promote,
        "verify_failed": failed,
    }  # fmt: skip


def compact_items(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The partitions a compaction plan fans out over (none unless it says ``fan-out``)."""
    return list(plan.get("items") or [])


def _compact_partition(conf: dict[str, Any], item: dict[str, Any]) -> dict[str, Any]:
    return airflow_task.compact_partition(conf, item)


def _verify_partition(
    conf: dict[str, Any], generation: dict[str, Any], partition: str
) -> dict[str, Any]:
    return airflow_task.verify_partition(conf, generation, partition)


def _verify_gate(
    conf: dict[str, Any], generation: dict[str, Any], partitions: Any
) -> dict[str, Any]:
    return airflow_task.verify_gate(conf, generation, list(partitions))


def _train_local(conf: dict[str, Any], **context: Any) -> dict[str, Any]:
    return airflow_task.train(conf, job_id=str(context.get("run_id") or ""))


_TRAIN_GPUS = "{{ ti.xcom_pull(task_ids='params')['gpus_per_node'] | int }}"


def _pod_tasks(
    secrets: Sequence[SecretSpec], namespace: str | None, checked: Any
) -> dict[str, Any]:
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from airflow.sdk import task
    from kubernetes.client import models as k8s

    env_vars = [
        k8s.V1EnvVar(
            name=env,
            value_from=k8s.V1EnvVarSource(
                secret_key_ref=k8s.V1SecretKeySelector(
                    name=s["name"], key=key, optional=s["optional"]
                )
            ),
        )
        for s in secrets
        for key, env in s["key_to_env"].items()
    ]
    names = ",".join(s["name"] for s in secrets)
    # the steps need no Kubernetes API (no token mounted); only the launcher creates jobs
    service_account = os.environ.get("DELTAREC_AIRFLOW_SERVICE_ACCOUNT") or None
    launcher_account = os.environ.get("DELTAREC_AIRFLOW_LAUNCHER_SERVICE_ACCOUNT") or None

    def pod(step: str, image: str, upstream: str | None = None, **extra: Any) -> Any:
        task_id = extra.pop("task_id", step)
        account = extra.pop("service_account_name", service_account)
        automount = extra.pop("automount_service_account_token", False)
        arguments = [step, "--params", _PARAMS_XCOM]
        if upstream == "train":
            arguments += ["--input", _TRAIN_XCOM]
        elif upstream:
            arguments += ["--input", f"{{{{ ti.xcom_pull(task_ids='{upstream}') | tojson }}}}"]
        arguments += extra.pop("arguments", [])
        return KubernetesPodOperator(
            task_id=task_id,
            name=f"deltarec-{task_id.replace('_', '-')}",
            namespace=namespace,
            image=image,
            cmds=["python", "-m", "deltarec.orchestrate.airflow_task"],
            arguments=arguments,
            env_vars=env_vars,
            service_account_name=account,
            automount_service_account_token=automount,
            do_xcom_push=True,
            get_logs=True,
            on_finish_action="delete_pod",
            **extra,
        )

    def mapped(step: str, cmd_args: list[str], arguments: Any) -> Any:
        """One pod per item of ``arguments`` (a dynamically mapped task), running ``step``."""
        return KubernetesPodOperator.partial(
            task_id=step,
            name=f"deltarec-{step.replace('_', '-')}",
            namespace=namespace,
            image=TOOLS_IMAGE,
            cmds=["python", "-m", "deltarec.orchestrate.airflow_task", step, *cmd_args],
            env_vars=env_vars,
            service_account_name=service_account,
            automount_service_account_token=False,
            do_xcom_push=True,
            get_logs=True,
            on_finish_action="delete_pod",
        ).expand(arguments=arguments)

    train_args = ["--job-id", "{{ run_id }}", "--secrets", names]
    # one node: the train pod on the trainer image holds the GPUs; several: a CPU launcher pod
    # on the tools image creates the TrainJob/PyTorchJob and follows it (its nodes hold them)
    train = pod(
        "train",
        TRAINER_IMAGE,
        arguments=train_args,
        container_resources=k8s.V1ResourceRequirements(limits={"nvidia.com/gpu": _TRAIN_GPUS}),
    )
    launcher = pod(
        "train",
        TOOLS_IMAGE,
        arguments=train_args,
        task_id="train_launcher",
        service_account_name=launcher_account,
        automount_service_account_token=True,
    )

    @task.branch(task_id="train_route")
    def route(conf: dict[str, Any]) -> str:
        return "train" if int(conf["nodes"]) == 1 else "train_launcher"

    routed = route(checked)
    routed >> [train, launcher]

    cplan = pod(
        "compact_plan", TOOLS_IMAGE, upstream="train", trigger_rule="none_failed_min_one_success"
    )
    [train, launcher] >> cplan

    @task(task_id="compact_items")
    def items(plan: dict[str, Any]) -> list[list[str]]:
        return [["--item", json.dumps(i)] for i in compact_items(plan)]

    cparts = mapped("compact_partition", ["--params", _PARAMS_XCOM], items(cplan.output))
    compacted = pod("compact", TOOLS_IMAGE, upstream="compact_plan", trigger_rule="none_failed")
    [cplan, cparts] >> compacted

    @task(task_id="verify_plan", trigger_rule="none_failed_min_one_success")
    def plan(conf: dict[str, Any]) -> list[list[str]]:
        return [["--partition", p] for p in airflow_task.verify_plan(conf)]

    partitions = plan(checked)
    compacted >> partitions
    parts = mapped(
        "verify_partition", ["--params", _PARAMS_XCOM, "--input", _TRAIN_XCOM], partitions
    )
    gate = pod(
        "verify",
        TOOLS_IMAGE,
        upstream="train",
        arguments=[
            "--partitions",
            "{{ ti.xcom_pull(task_ids='verify_partition') | list | tojson }}",
        ],
    )
    gate.arguments[0] = "verify_gate"
    parts >> gate
    provision = pod("provision", TOOLS_IMAGE)
    provision >> routed
    promote = pod("promote", TOOLS_IMAGE, upstream="train")
    promote >> pod("gc", TOOLS_IMAGE)
    return {
        "provision": provision,
        "train": [train, launcher],
        "verify": gate,
        "promote": promote,
        "verify_failed": pod("verify_failed", TOOLS_IMAGE, upstream="verify"),
    }


def write_dag_file(
    path: str = DEFAULT_DAG_FILE,
    secrets: Sequence[SecretEnv] | None = None,
    *,
    mode: str = "kubernetes",
    namespace: str | None = None,
) -> str:
    """Write a DAG file for an Airflow DAGs folder; returns the path. Does not import Airflow."""
    if mode not in MODES:
        raise BadInputError(f"airflow DAG mode {mode!r} is not one of {MODES}")
    specs = _secret_specs(secrets)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(_DAG_FILE.format(mode=mode, secrets=specs, namespace=namespace))
    return path


def conf_of(params: PipelineParams) -> str:
    """The run's conf (JSON) for ``airflow dags trigger deltarec --conf``."""
    return json.dumps(params.arguments())
