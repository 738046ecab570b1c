"""A real Airflow 3 on 127.0.0.1 for the tests: api-server, scheduler and dag-processor with the
LocalExecutor and a SQLite metadata database of its own, started and stopped by
:class:`AirflowServer` (the processes are stopped before the database is removed)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from deltarec.orchestrate.airflow_local import airflow_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class AirflowServer:
    """Airflow's three services over ``workdir`` (its home, database and DAGs folder)."""

    def __init__(self, workdir: Path, extra_env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            **airflow_env(str(workdir)),
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API_AUTH__JWT_SECRET": "deltarec-tests",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1",
            # a loop with nothing to do sleeps 1 s by default: a task then waits that long for
            # the next one to be queued, a dozen times a run
            "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.2",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            **(extra_env or {}),
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = workdir / "logs"
        self._token = ""

    def start(self, timeout_s: float = 240) -> None:
        """Migrate the database, start the services and wait until the API answers."""
        self.logs.mkdir(parents=True, exist_ok=True)
        airflow = [sys.executable, "-m", "airflow"]
        subprocess.run([*airflow, "db", "migrate"], env=self.env, check=True, timeout=300,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        for service in ("api-server", "scheduler", "dag-processor"):
            log = open(self.logs / f"{service}.log", "wb")  # noqa: SIM115 (closed in stop)
            port = ["--port", str(self.port)] if service == "api-server" else []
            proc = subprocess.Popen(
                [*airflow, service, *port],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.procs.append(proc)
            log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"an Airflow service exited: {self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/v2/monitor/health", timeout=5):
                    return
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"Airflow did not answer within {timeout_s:.0f} s: {self.tail()}")

    def tail(self) -> str:
        """The end of every service's log."""
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
            for p in self.logs.glob("*.log")
        )

    def stop(self) -> None:
        """Stop every service (SIGTERM, then SIGKILL), the database stays until after."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)

    # ---- REST API -----------------------------------------------------------------------------
    def token(self) -> str:
        if not self._token:
            request = urllib.request.Request(f"{self.url}/auth/token", method="GET")
            with urllib.request.urlopen(request, timeout=30) as r:
                self._token = json.load(r)["access_token"]
        return self._token

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.url}/api/v2{path}", data=data, method=method,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.token()}"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.load(r)

    def wait_for_dag(self, dag_id: str, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.call("GET", f"/dags/{dag_id}")
                return
            except urllib.error.HTTPError as e:
                if e.code != 404:
                    raise
            time.sleep(0.5)
        raise RuntimeError(f"DAG {dag_id} was not parsed within {timeout_s:.0f} s: {self.tail()}")

    def trigger(self, dag_id: str, conf: dict[str, Any]) -> str:
        run = self.call("POST", f"/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf})
        return str(run["dag_run_id"])

    def wait_for_run(self, dag_id: str, run_id: str, timeout_s: float = 900) -> dict[str, Any]:
        """Poll the run to its end; returns it with ``tasks``: task id -> state(s)."""
        deadline = time.monotonic() + timeout_s
        quoted = urllib.request.quote(run_id, safe="")
        while time.monotonic() < deadline:
            run = self.call("GET", f"/dags/{dag_id}/dagRuns/{quoted}")
            if run["state"] in ("success", "failed"):
                tis = self.call("GET", f"/dags/{dag_id}/dagRuns/{quoted}/taskInstances")
                tasks: dict[str, list[str]] = {}
                for ti in tis["task_instances"]:
                    tasks.setdefault(ti["task_id"], []).append(str(ti["state"]))
                run["tasks"] = tasks
                return dict(run)
            time.sleep(0.5)
        raise RuntimeError(f"DAG run {run_id} did not end within {timeout_s:.0f} s")
