"""Run the Airflow DAG on this machine: ``dag.test()`` with SQLite, no network, no scheduler.

:func:`run_airflow_local` writes the DAG file (``mode="local"``: the task functions run
in-process) into ``<workdir>/dags`` and starts a child Python process with ``AIRFLOW_HOME``,
the metadata database (``sqlite:///<workdir>/airflow/airflow.db``, created on first use) and
the DAGs folder pointing into ``workdir``, because Airflow reads its configuration once, when
it is first imported. The child parses the DAGs folder (a ``DagBag``; an import error fails
the run), runs one DAG run with the parameters as its conf, and writes the task states and
XCom values to a JSON file, which :func:`run_airflow_local` turns into the same
:class:`~deltarec.orchestrate.local.LocalRunResult` a kfp.local run gives.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from deltarec.errors import ConfigError
from deltarec.orchestrate.airflow_dag import DAG_ID, DEFAULT_DAG_FILE, write_dag_file
from deltarec.orchestrate.local import LocalRunResult
from deltarec.orchestrate.params import PipelineParams
from deltarec.orchestrate.trainjob_local import BACKEND_ENV, check_launcher
from deltarec.orchestrate.types import GenerationRecord, StepFailedError


def airflow_env(workdir: str) -> dict[str, str]:
    """The environment that points Airflow at ``workdir`` (SQLite, DAGs folder, no examples)."""
    home = os.path.join(os.path.abspath(workdir), "airflow")
    return {
        "AIRFLOW_HOME": home,
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "AIRFLOW__CORE__DAGS_FOLDER": os.path.join(os.path.abspath(workdir), "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": "http://127.0.0.1:1/execution/",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
    }


def run_airflow_local(
    params: PipelineParams,
    *,
    workdir: str,
    output: TextIO | None = None,
    timeout_s: float | None = None,
) -> LocalRunResult:
    """Run the DAG once with ``params`` and return what it produced.

    On a verify FAIL the ``verify_failed`` task ran (staging dropped or serving rolled back,
    webhook called) and the DAG run failed; the result then has verdict ``FAIL``.

    Args:
        params: the run's parameters (the DAG run's conf).
        workdir: Airflow's home, metadata database and DAGs folder live here (reused).
        output: where the child's output goes (line by line); None: this process's stdout.
        timeout_s: stop waiting after this long.

    Raises:
        ConfigError: Airflow is not installed (the ``airflow`` extra).
        StepFailedError: the DAG file did not parse, or a task other than ``verify_failed``
            failed (names it).
    """
    if importlib.util.find_spec("airflow") is None:
        raise ConfigError("the Airflow engine needs Airflow: pip install 'deltarec[airflow]'")
    workdir = os.path.abspath(workdir)
    write_dag_file(os.path.join(workdir, "dags", DEFAULT_DAG_FILE), (), mode="local")
    result_path = os.path.join(workdir, f"result-{time.time_ns()}.json")
    cmd = [sys.executable, "-m", "deltarec.orchestrate.airflow_local", "--workdir", workdir,
           "--conf", json.dumps(params.arguments()), "--result", result_path]  # fmt: skip
    check_launcher(params)
    env = {**os.environ, **airflow_env(workdir), BACKEND_ENV: "local"}
    target = output if output is not None else sys.stdout
    with subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as child:
        assert child.stdout is not None
        for line in child.stdout:
            target.write(line)
        code = child.wait(timeout=timeout_s)
    try:
        with open(result_path, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise StepFailedError("airflow", code, f"the local DAG run left no result: {e}") from e
    return _result(report, workdir)


def _result(report: dict[str, Any], workdir: str) -> LocalRunResult:
    if report.get("import_errors"):
        raise StepFailedError(
            "airflow", 1, f"the DAG file does not parse: {report['import_errors']}"
        )
    states: dict[str, str] = report["states"]
    failed = sorted(t for t, s in states.items() if s in ("failed", "upstream_failed"))
    if failed and failed != ["verify_failed"]:
        raise StepFailedError(failed[0], 1, f"DAG run {report['run_id']}: task states {states}")
    xcom = report["xcom"]
    outcome = xcom["verify"]
    failure = ""
    if failed:
        failure = (
            f"DAG run {report['run_id']} failed at task 'verify_failed': verify found "
            f"{outcome.get('failure') or 'a mismatch'}"
        )
    return LocalRunResult(
        verdict=str(outcome["verdict"]),
        generation=GenerationRecord.from_metadata(xcom["train"], "the train task's XCom"),
        metrics={k: float(v) for k, v in outcome["metrics"].items()},
        report_path=str(outcome.get("report_path") or ""),
        pipeline_root=workdir,
        failure=failure,
    )


# ---- the child process -------------------------------------------------------------------------
def _child(workdir: str, conf: dict[str, Any], result_path: str) -> int:
    from airflow.dag_processing.dagbag import DagBag
    from airflow.models.xcom import XComModel
    from airflow.utils import db
    from airflow.utils.session import create_session

    os.makedirs(os.environ["AIRFLOW_HOME"], exist_ok=True)
    if not os.path.exists(os.path.join(os.environ["AIRFLOW_HOME"], "airflow.db")):
        db.initdb()
    bag = DagBag(dag_folder=os.path.join(workdir, "dags"))
    report: dict[str, Any] = {"import_errors": dict(bag.import_errors)}
    dag = bag.get_dag(DAG_ID) if not bag.import_errors else None
    if dag is None:
        report["import_errors"] = report["import_errors"] or {DAG_ID: "no such DAG"}
        _write(result_path, report)
        return 1
    run = dag.test(run_conf=conf)
    states = {ti.task_id: str(ti.state) for ti in run.get_task_instances()}
    xcom: dict[str, Any] = {}
    with create_session() as session:
        rows = session.scalars(
            XComModel.get_many(run_id=run.run_id, dag_ids=DAG_ID, key="return_value")
        ).all()
        for row in rows:
            xcom[row.task_id] = XComModel.deserialize_value(row)  # type: ignore[attr-defined]
    report.update(run_id=run.run_id, state=str(run.state), states=states, xcom=xcom)
    _write(result_path, report)
    return 0 if str(run.state) == "success" else 1


def check_dag_folder(folder: str) -> dict[str, Any]:
    """Parse ``folder`` as Airflow's DAG processor does (a ``DagBag``).

    Returns the import errors and the deltarec DAG's tasks (id -> operator, image, arguments,
    upstream ids, trigger rule).

    Run in a process whose Airflow configuration points at a scratch home
    (:func:`airflow_env`), as ``python -m deltarec.orchestrate.airflow_local --check DIR``.
    """
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=folder)
    out: dict[str, Any] = {"import_errors": dict(bag.import_errors), "dags": sorted(bag.dag_ids)}
    dag = bag.dags.get(DAG_ID)
    if dag is not None:
        out["params"] = sorted(dag.params.keys())
        out["tasks"] = {
            t.task_id: {
                "operator": type(t).__name__,
                "image": getattr(t, "image", None),
                "cmds": getattr(t, "cmds", None),
                "arguments": getattr(t, "arguments", None),
                "env": [
                    [e.name, e.value_from.secret_key_ref.name, e.value_from.secret_key_ref.key]
                    for e in getattr(t, "env_vars", None) or []
                    if e.value_from is not None
                ],
                "service_account": getattr(t, "service_account_name", None),
                "automount_token": getattr(t, "automount_service_account_token", None),
                "upstream": sorted(t.upstream_task_ids),
                "trigger_rule": str(getattr(t.trigger_rule, "value", t.trigger_rule)),
                "gpus": _gpus(t),
            }
            for t in dag.tasks
        }
    return out


def _gpus(task: Any) -> str | None:
    resources = getattr(task, "container_resources", None)
    limits = getattr(resources, "limits", None) or {}
    return limits.get("nvidia.com/gpu")


def _write(path: str, report: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, default=str)


def main(argv: Sequence[str] | None = None) -> int:
    """The child process (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m deltarec.orchestrate.airflow_local")
    parser.add_argument("--workdir")
    parser.add_argument("--conf", help="the DAG run's conf (JSON)")
    parser.add_argument("--result", help="where the run's report is written")
    parser.add_argument("--check", metavar="DIR", help="only parse the DAG files in DIR")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.check:
        print(json.dumps(check_dag_folder(args.check), default=str))
        return 0
    if not (args.workdir and args.conf and args.result):
        parser.error("--workdir, --conf and --result are required")
    from deltarec.train.launch import exit_with_parent

    # the DAG run ends with the command that started it, even a kill -9 of it: the parent-death
    # signal, and a watchdog for a parent that died before the signal was set
    exit_with_parent()
    return _child(args.workdir, json.loads(args.conf), args.result)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
