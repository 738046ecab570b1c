"""The deltarec pipeline: provision -> train -> compact -> verify -> promote -> gc, or FAIL.

On a failed verify, verify_failed runs instead of promote and gc.

:func:`build_pipeline` assembles the components of :mod:`deltarec.orchestrate.components`
with the Kubernetes Secrets whose keys the steps receive as environment variables
(kfp-kubernetes ``use_secret_as_env``: only the Secret's name and key names are written into
the pipeline). :func:`compile_pipeline` writes the YAML; :func:`submit` sends it to a KFP
endpoint.

This module is not written with postponed annotations: KFP reads the pipeline function's
parameter types at definition time.
"""

import inspect
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from deltarec.errors import ConfigError
from deltarec.orchestrate.params import PipelineParams
from deltarec.orchestrate.pytorchjob import LAUNCHER_TOKEN_DIR
from deltarec.orchestrate.types import LAUNCHER_TOKEN_SECRET, SecretEnv, default_secrets

PIPELINE_NAME = "deltarec"
DEFAULT_OUTPUT = "deltarec-pipeline.yaml"


def pipeline_signature(return_annotation: Any) -> inspect.Signature:
    """The pipeline function's signature: one parameter per ``PipelineParams`` field."""
    params = []
    types = PipelineParams.parameter_types()
    for name, info in PipelineParams.model_fields.items():
        annotation = types[name]
        default = inspect.Parameter.empty if info.is_required() else info.default
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        params.append(inspect.Parameter(name, kind, annotation=annotation, default=default))
    return inspect.Signature(params, return_annotation=return_annotation)


def build_pipeline(secrets: Sequence[SecretEnv] | None = None, *, accelerators: bool = True) -> Any:
    """The pipeline function (a KFP ``GraphComponent``), ready to compile or run locally.

    provision -> train -> compact_plan -> (fan-out) compact_partition x N -> compact_commit |
    (else) compact -> verify -> (PASS) promote -> gc | (FAIL) verify_failed, which drops the
    staging views or rolls serving back, calls the webhook and ends the run failed. The
    pipeline's parameters are :class:`PipelineParams`'s fields; every component receives them
    together as one ``params`` struct.

    Args:
        secrets: Secrets mounted as environment into every step (and referenced by the
            pods of a multi-node job); None mounts :func:`default_secrets`.
        accelerators: request ``gpus_per_node`` GPUs for the one-node train task. kfp.local
            ignores accelerators and cannot resolve the request inside a condition, so local
            runs leave it out.
    """
    from kfp import dsl, kubernetes

    from deltarec.orchestrate import components as c

    secrets = tuple(default_secrets() if secrets is None else secrets)
    secret_names = ",".join(s.name for s in secrets)
    names = PipelineParams.names()

    class Outputs(NamedTuple):
        verdict: str
        generation: dict
        metrics: dsl.Metrics
        report: dsl.HTML

    def with_secrets(task: Any, name: str) -> Any:
        task.set_caching_options(False)  # every step acts on live state; never reuse a result
        task.set_display_name(name)
        for s in secrets:
            kubernetes.use_secret_as_env(task, s.name, dict(s.key_to_env), optional=s.optional)
        return task

    def compaction(params: Any, generation: Any) -> Any:
        """compact_plan, then a fan-out and its commit, or one compact task (SPEC §3a)."""
        cplan = with_secrets(c.compact_plan(params=params, generation=generation), "compact-plan")
        with dsl.If(cplan.outputs["decision"] == "fan-out", name="compact-fan-out"):
            with dsl.ParallelFor(cplan.outputs["items"], name="compact-partitions") as item:
                part = with_secrets(c.compact_partition(item=item), "compact-partition")
            commit = with_secrets(
                c.compact_commit(
                    params=params, plan=cplan.outputs["plan"], partitions=dsl.Collected(part.output)
                ),
                "compact-commit",
            )
        with dsl.Else(name="compact-in-one-task"):
            one = with_secrets(c.compact(params=params, plan=cplan.outputs["plan"]), "compact")
        return dsl.OneOf(commit.output, one.output)

    def deltarec_pipeline(*values: Any) -> Outputs:
        args = dict(zip(names, values, strict=True))
        checked = c.params_component()(**args)
        checked.set_caching_options(False)
        checked.set_display_name("params")
        params = checked.output
        prov = with_secrets(c.provision(params=params), "provision")
        train_args = {
            "params": params,
            "credentials_secret": secret_names,
            "job_id": dsl.PIPELINE_JOB_ID_PLACEHOLDER,
        }
        with dsl.If(args["nodes"] == 1, name="one-node"):
            train = with_secrets(c.train(**train_args).after(prov), "train")
            if accelerators:
                train.set_accelerator_type("nvidia.com/gpu")
                train.set_accelerator_limit(args["gpus_per_node"])
        with dsl.Else(name="several-nodes"):
            # the launcher only creates and follows the TrainJob/PyTorchJob: no GPU
            launcher = with_secrets(c.train_launcher(**train_args).after(prov), "train-launcher")
            # the step's pod owns the job it creates: no training outlives the step
            kubernetes.use_field_path_as_env(launcher, "DELTAREC_POD_NAME", "metadata.name")
            kubernetes.use_field_path_as_env(launcher, "DELTAREC_POD_UID", "metadata.uid")
            # the one step that may create jobs: the launcher account's token, here alone
            kubernetes.use_secret_as_volume(
                launcher, LAUNCHER_TOKEN_SECRET, LAUNCHER_TOKEN_DIR, optional=True
            )
        generation = dsl.OneOf(train.outputs["Output"], launcher.outputs["Output"])
        base = compaction(params, generation)
        plan = with_secrets(
            c.verify_plan(params=params, generation=generation, base=base), "verify-plan"
        )
        with dsl.ParallelFor(plan.output, name="verify-partitions") as item:
            part = with_secrets(c.verify_partition(item=item), "verify-partition")
        verify = with_secrets(
            c.verify(params=params, generation=generation, partitions=dsl.Collected(part.output)),
            "verify",
        )
        with dsl.If(verify.outputs["Output"] == "PASS", name="verified"):
            promoted = with_secrets(c.promote(params=params, generation=generation), "promote")
            with dsl.If(args["gc_mode"] != "off", name="retention"):
                with_secrets(c.gc(params=params).after(promoted), "gc")
        with dsl.If(verify.outputs["Output"] == "FAIL", name="verify-failed"):
            with_secrets(
                c.verify_failed(params=params, report=verify.outputs["report"]), "verify-failed"
            )
        return Outputs(
            verdict=verify.outputs["Output"],
            generation=generation,
            metrics=verify.outputs["metrics"],
            report=verify.outputs["report"],
        )

    deltarec_pipeline.__signature__ = pipeline_signature(Outputs)  # type: ignore[attr-defined]
    return dsl.pipeline(
        name=PIPELINE_NAME,
        description="provision -> train (delta dumps, publishing) -> verify -> promote, or on "
        "a failed verify: drop staging / roll back, and fail",
    )(deltarec_pipeline)


def compile_pipeline(
    output: str = DEFAULT_OUTPUT, secrets: Sequence[SecretEnv] | None = None
) -> str:
    """Write the pipeline YAML to ``output``; returns the path."""
    from kfp import compiler

    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    compiler.Compiler().compile(build_pipeline(secrets), output)
    return output


def compile_component(name: str, output: str) -> str:
    """Write one component's YAML (``name`` as in ``components.COMPONENTS``) to ``output``."""
    from kfp import compiler

    from deltarec.orchestrate.components import COMPONENTS

    compiler.Compiler().compile(COMPONENTS[name], output)
    return output


def submit(
    params: PipelineParams,
    *,
    host: str | None,
    namespace: str | None = None,
    experiment: str = "deltarec",
    secrets: Sequence[SecretEnv] | None = None,
    run_label: str | None = None,
    package_path: str | None = None,
    pipeline_root: str | None = None,
    service_account: str | None = None,
    client_factory: Callable[..., Any] | None = None,
) -> str:
    """Compile the pipeline and start one run of it on a KFP endpoint; returns the run id.

    Args:
        params: the run's arguments (validated: no credential in any URL).
        host: the KFP API endpoint; None lets ``kfp.Client`` find it (in-cluster).
        namespace: the KFP (profile) namespace; None for the client's default.
        experiment: the experiment the run is filed under (created if missing).
        secrets: Secrets mounted into the steps (names only reach the YAML).
        run_label: the run's display name; default ``deltarec-<run_name>``.
        package_path: keep the compiled YAML there; default a temporary file.
        pipeline_root: where KFP keeps the steps' artifacts; None for the endpoint's default.
        service_account: the steps' Kubernetes service account (the chart's, which may create
            PyTorchJobs); None for the namespace's pipeline runner.
        client_factory: builds the client (``kfp.Client`` by default; tests pass a fake).
    """
    if client_factory is None:
        import kfp

        client_factory = kfp.Client
    with tempfile.TemporaryDirectory(prefix="deltarec-submit-") as tmp:
        path = compile_pipeline(package_path or os.path.join(tmp, DEFAULT_OUTPUT), secrets)
        try:
            client = client_factory(host=host, namespace=namespace)
            result = client.create_run_from_pipeline_package(
                pipeline_file=path,
                arguments=params.arguments(),
                run_name=run_label or f"deltarec-{params.run_name}",
                experiment_name=experiment,
                namespace=namespace,
                pipeline_root=pipeline_root,
                enable_caching=False,
                service_account=service_account,
            )
        except Exception as e:
            if not _unreachable(e):
                raise
            raise ConfigError(
                f"the KFP endpoint {host or '(in-cluster default)'} cannot be reached: "
                f"{_first_line(e)}"
            ) from e
    return str(getattr(result, "run_id", result))


def _unreachable(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) says the endpoint could not be reached."""
    seen: BaseException | None = e
    while seen is not None:
        name = type(seen).__name__
        if isinstance(seen, OSError) or name in ("MaxRetryError", "NewConnectionError"):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _first_line(e: BaseException) -> str:
    reason = getattr(e, "reason", None)
    text = str(reason if reason is not None else e).strip()
    return text.splitlines()[0] if text else type(e).__name__
