"""``deltarec pipeline compile | submit | run --local``: the pipeline on Kubeflow or Airflow.

* ``compile [--output PATH] [--components DIR]`` writes the pipeline YAML (default
  ``deltarec-pipeline.yaml`` in the current directory) and optionally every component's YAML;
  ``compile --engine airflow [--output PATH]`` writes the Airflow DAG file instead.
* ``submit --host URL [--namespace NS] [--experiment NAME] <parameters>`` compiles the pipeline
  and starts a run on a KFP endpoint.
* ``run --local [--engine kfp|airflow] <parameters>`` runs it on this machine: with kfp.local,
  or with Airflow's ``dag.test()`` on a SQLite metadata database (no network).
* ``verify-serving --artifacts ROOT --run RUN --store URL`` runs ``deltarec verify`` on the
  generation (and dump) that serving is promoted to: the chart's scheduled check.

Credentials reach the steps only from Kubernetes Secrets: ``--secret NAME`` mounts the Secret's
standard keys (``PGPASSWORD``, ``AWS_ACCESS_KEY_ID``, ...) as environment variables of the same
names, ``--secret NAME:KEY=ENV,...`` maps keys explicitly; by default the Secret
``deltarec-credentials`` is mounted (optional). A store URL or artifact root that carries a
password is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

from deltarec.cli.common import add_engine_argument, add_sample_argument
from deltarec.environ import environ_set
from deltarec.errors import BadInputError, CheckFailedError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``compile``, ``submit`` and ``run`` sub-commands."""
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    comp = sub.add_parser("compile", help="write the pipeline YAML (or the Airflow DAG file)")
    add_engine_argument(comp, "kfp (default) or airflow")
    comp.add_argument(
        "--output",
        default=None,
        help="output path (default: deltarec-pipeline.yaml, or deltarec_dag.py for airflow)",
    )
    comp.add_argument("--components", metavar="DIR", help="also write each component's YAML here")
    _secret_arguments(comp)

    sub_ = sub.add_parser("submit", help="compile and start a run on a KFP endpoint")
    sub_.add_argument("--host", help="KFP API endpoint (default: found in-cluster)")
    sub_.add_argument("--namespace", help="KFP namespace (multi-user profile)")
    sub_.add_argument("--experiment", default="deltarec", help="experiment name")
    sub_.add_argument("--run-label", help="the run's display name (default deltarec-<run>)")
    sub_.add_argument("--service-account", help="service account of the steps (see the chart)")
    sub_.add_argument("--pipeline-root", help="where KFP keeps step artifacts")
    sub_.add_argument("--output", help="also keep the compiled YAML here")
    _secret_arguments(sub_)
    _param_arguments(sub_)

    run = sub.add_parser("run", help="run the pipeline on this machine (--local)")
    run.add_argument("--local", action="store_true", help="run on this machine (required)")
    add_engine_argument(run, "kfp.local (default) or airflow")
    run.add_argument(
        "--pipeline-root",
        default=None,
        metavar="DIR",
        help="where the engine keeps step outputs (default ./kfp-local or ./airflow-local)",
    )
    run.add_argument("--json", metavar="PATH", help="write the run's result as JSON")
    _param_arguments(run)

    vs = sub.add_parser("verify-serving", help="verify what serving reads (scheduled check)")
    vs.add_argument("--artifacts", required=True, metavar="ROOT", help="artifact root")
    vs.add_argument(
        "--run",
        default=None,
        help="check this run, which must serve (default: every run that serves, at its pointer)",
    )
    vs.add_argument("--store", required=True, metavar="URL", help="store URL")
    add_sample_argument(vs, 10000, "keys per table (default: 10000)")
    vs.add_argument("--json", metavar="PATH", help="write verify's JSON document")
    vs.add_argument("--report", metavar="PATH", help="write verify's HTML report")


def _secret_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--secret",
        action="append",
        default=None,
        metavar="NAME[:KEY=ENV,...]",
        help="Kubernetes Secret mounted as environment into every step (repeatable; default "
        "deltarec-credentials with the standard credential keys)",
    )
    p.add_argument("--no-secrets", action="store_true", help="mount no Secret")


_PARAM_FLAGS: dict[str, tuple[str, str | None]] = {
    "run_name": ("--run", "NAME"),
    "artifact_root": ("--artifacts", "ROOT"),
    "store_url": ("--store", "URL"),
    "steps": ("--steps", "N"),
    "dump_every_steps": ("--dump-every-steps", "N"),
    "dump_every_minutes": ("--dump-every-minutes", "M"),
    "publish_mode": ("--publish-mode", None),
    "read_p99_ms": ("--read-p99-ms", "MS"),
    "dense_every": ("--dense-every", "N"),
    "sample_size": ("--sample", "N"),
    "ranks_per_node": ("--ranks-per-node", "R"),
    "nodes": ("--nodes", "N"),
    "gpus_per_node": ("--gpus-per-node", "G"),
    "launcher": ("--launcher", None),
    "training_runtime": ("--training-runtime", "NAME"),
    "metrics_port": ("--metrics-port", "PORT"),
    "verify_partitions": ("--verify-partitions", "N"),
    "compact_min_dumps": ("--compact-min-dumps", "N"),
    "compact_partition_rows": ("--compact-partition-rows", "N"),
    "gc_mode": ("--gc-mode", None),
    "gc_keep_promotions": ("--gc-keep-promotions", "N"),
    "checkpoint_dir": ("--checkpoint-dir", "DIR"),
    "row_encodings": ("--row-encodings", "SPEC"),
    "train_extra_args": ("--train-args", "ARGS"),
    "entry_point": ("--entry-point", "MODULE:FUNCTION|COMMAND"),
    "tables": ("--tables", "JSON"),
    "webhook_url": ("--webhook-url", "URL"),
}
"""``PipelineParams`` field -> (flag, metavar), in ``--help`` order. The flag's help is the
field's docstring; its type, default, choices and whether it is required come from the field
(:mod:`deltarec.cli.fields`)."""


def _param_arguments(p: argparse.ArgumentParser) -> None:
    """Add one flag per :class:`~deltarec.orchestrate.params.PipelineParams` field.

    The flag's ``dest`` is the field's name. A field without an entry in ``_PARAM_FLAGS``
    (or an entry without a field) is a programming error, raised when the parser is built.
    """
    from deltarec.cli.fields import FieldFlag, add_flags
    from deltarec.orchestrate.params import PipelineParams

    unflagged = sorted(set(PipelineParams.model_fields) ^ set(_PARAM_FLAGS))
    if unflagged:
        raise RuntimeError(f"_PARAM_FLAGS and PipelineParams differ in {unflagged}")
    flags = tuple(
        FieldFlag(flag, PipelineParams, field, metavar, name=field)
        for field, (flag, metavar) in _PARAM_FLAGS.items()
    )
    add_flags(p.add_argument_group("pipeline parameters"), flags)


def _param_names() -> tuple[str, ...]:
    from deltarec.orchestrate.params import PipelineParams

    return PipelineParams.names()


def parse_secret(text: str):  # type: ignore[no-untyped-def]
    """``NAME`` or ``NAME:KEY=ENV,KEY=ENV`` -> :class:`~deltarec.orchestrate.SecretEnv`."""
    from deltarec.orchestrate.types import CREDENTIAL_ENV, SecretEnv

    name, _, mapping = text.partition(":")
    if not mapping:
        return SecretEnv(name, {k: k for k in CREDENTIAL_ENV})
    pairs: dict[str, str] = {}
    for item in mapping.split(","):
        key, eq, env = item.partition("=")
        if not eq or not key or not env:
            raise BadInputError(f"--secret {text!r}: {item!r} is not KEY=ENV")
        pairs[key] = env
    return SecretEnv(name, pairs)


def _secrets(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    if args.no_secrets:
        return ()
    if not args.secret:
        return None  # the default Secret
    return tuple(parse_secret(s) for s in args.secret)


def _params(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from deltarec.orchestrate.params import parse_params

    return parse_params(**{n: getattr(args, n) for n in _param_names()})


def run(args: argparse.Namespace) -> int:
    """Dispatch to compile, submit or run."""
    if args.action == "compile":
        return _compile(args)
    if args.action == "submit":
        return _submit(args)
    if args.action == "verify-serving":
        return _verify_serving(args)
    return _run_local(args)


def _compile(args: argparse.Namespace) -> int:
    if args.engine == "airflow":
        from deltarec.orchestrate.airflow_dag import DEFAULT_DAG_FILE, write_dag_file

        if args.components:
            raise BadInputError("pipeline compile --engine airflow: --components is for kfp")
        path = write_dag_file(args.output or DEFAULT_DAG_FILE, _secrets(args))
        print(f"airflow DAG: {os.path.abspath(path)}")
        return 0
    from deltarec.orchestrate.components import COMPONENTS
    from deltarec.orchestrate.pipeline import DEFAULT_OUTPUT, compile_component, compile_pipeline

    path = compile_pipeline(args.output or DEFAULT_OUTPUT, _secrets(args))
    print(f"pipeline: {os.path.abspath(path)}")
    if args.components:
        os.makedirs(args.components, exist_ok=True)
        for name in COMPONENTS:
            out = compile_component(name, os.path.join(args.components, f"{name}.yaml"))
            print(f"component {name}: {os.path.abspath(out)}")
    return 0


def _submit(args: argparse.Namespace) -> int:
    from deltarec.orchestrate.pipeline import submit

    params = _params(args)
    run_id = submit(
        params,
        host=args.host,
        namespace=args.namespace,
        experiment=args.experiment,
        secrets=_secrets(args),
        run_label=args.run_label,
        package_path=args.output,
        pipeline_root=args.pipeline_root,
        service_account=args.service_account,
    )
    print(f"submitted run {run_id} (experiment {args.experiment})")
    return 0


def _run_local(args: argparse.Namespace) -> int:
    if not args.local:
        raise BadInputError("pipeline run: only --local is supported here; use submit for KFP")
    from deltarec.orchestrate.train_step import check_entry_point

    params = _params(args)
    check_entry_point(params)  # the steps run in this environment: refuse a bad one up front
    with _launcher_of_children():
        return _run_engine(args, params)


@contextlib.contextmanager
def _launcher_of_children() -> Iterator[None]:
    """Name this process as the launcher of every step process it starts.

    ``kill -9`` of this command then ends the train step, torchrun and every rank (their
    watchdogs), so the run's lease is free for an immediate re-run.
    """
    from deltarec.train.launch import LAUNCHER_PID_ENV

    with environ_set(LAUNCHER_PID_ENV, str(os.getpid())):
        yield


def _run_engine(args: argparse.Namespace, params: Any) -> int:
    if args.engine == "airflow":
        from deltarec.orchestrate.airflow_local import run_airflow_local

        result = run_airflow_local(params, workdir=args.pipeline_root or "airflow-local")
    else:
        from deltarec.orchestrate.local import run_local

        result = run_local(params, pipeline_root=args.pipeline_root or "kfp-local")
    record = result.generation
    print(
        f"run {record.run} generation {record.generation}: {record.dumps} dumps, "
        f"{record.rows} rows; verify {result.verdict}; "
        f"promoted {result.promoted if result.promoted is not None else '-'}"
    )
    print(f"report: {result.report_path}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "verdict": result.verdict,
                    "promoted": result.promoted,
                    "generation": record.to_metadata(),
                    "metrics": result.metrics,
                    "report": result.report_path,
                    "pipeline_root": result.pipeline_root,
                    "failure": result.failure,
                },
                f,
                indent=2,
            )
    if result.verdict != "PASS":
        raise CheckFailedError(
            f"verify of generation {record.generation} failed; not promoted ({result.failure})"
        )
    return 0


def _verify_serving(args: argparse.Namespace) -> int:
    from deltarec.cli.common import require_existing_store
    from deltarec.orchestrate.steps import verify_serving

    require_existing_store(args.store)
    check = verify_serving(
        args.artifacts, args.run, args.store, args.sample,
        json_path=args.json, report_path=args.report,
    )  # fmt: skip
    report = f"; report {args.report}" if args.report else ""
    for o in check.outcomes:  # one line per run that serves (several serve different tables)
        what = f"run {o.run!r} generation {o.generation} through dump {o.through_seq} (serving)"
        keys = int(o.metrics.get("keys_checked", 0))
        print(f"verify-serving: {what}: {o.verdict}, {keys:,} keys checked{report}")
    failed = [f"run {o.run!r} generation {o.generation}: {o.failure}" for o in check.outcomes]
    failed = [f for f, o in zip(failed, check.outcomes, strict=True) if not o.passed]
    if failed:
        raise CheckFailedError("what serves failed verify: " + "; ".join(failed))
    return 0
