"""No planted secret in any output: every command runs with passwords in its environment and
in its store URL, and its stdout, stderr, ``--json`` files, reports, records, compiled
pipelines and (for training) the ranks' command lines are searched for them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.types import DumpKind, TableSpec
from deltarec.testing.dumps import new_generation, random_rows, write_dump

ENV_SECRETS = {
    "PGPASSWORD": "pg-env-S3CRET-0",
    "REDIS_PASSWORD": "redis-env-S3CRET-1",
    "AWS_SECRET_ACCESS_KEY": "aws-env-S3CRET-2",
    "AWS_SESSION_TOKEN": "aws-token-S3CRET-3",
    "ALIBABA_CLOUD_ACCESS_KEY_SECRET": "ali-env-S3CRET-4",
    "FEATUREDB_PASSWORD": "fdb-env-S3CRET-5",
}
URL_SECRET = "url-S3CRET-6"
QUERY_SECRET = "query-S3CRET-7"
NESTED_SECRET = "nested-S3CRET-8"
SECRETS = [*ENV_SECRETS.values(), URL_SECRET, QUERY_SECRET, NESTED_SECRET]
T = "sparse.ebc.user_id"
TABLES = {T: TableSpec(dim=4, num_embeddings=100)}
RUN = "nosecret"
"""Runs of their own on the session's PostgreSQL server (its registry is shared)."""
CLI = [sys.executable, "-c", "import sys; from deltarec.cli import main; sys.exit(main())"]


def _env() -> dict[str, str]:
    return {**os.environ, **ENV_SECRETS}


def _run(args, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=_env(), cwd=cwd, timeout=timeout
    )


def _files_text(folder: Path) -> str:
    """Every file under ``folder`` (the artifacts, --json files, reports, compiled YAML)."""
    return "\n".join(
        p.read_bytes().decode("utf-8", "replace") for p in sorted(folder.rglob("*")) if p.is_file()
    )


def _leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


@pytest.fixture
def stores(postgres_server, tmp_path):
    """The PostgreSQL server under URLs with a password: at the top level (works, masked), in
    a query option and nested in a FeatureStore URL's registry (both refused)."""
    host = f"127.0.0.1:{postgres_server.port}/postgres"
    user = postgres_server.user
    return {
        "url": f"postgresql://{user}:{URL_SECRET}@{host}?prefix=nosecret_",
        "query": f"postgresql://{user}@{host}?password={QUERY_SECRET}",
        "nested": "featurestore://proj/view?region=cn-hangzhou"
        f"&registry=postgresql://reg:{NESTED_SECRET}@db/reg",
    }


def test_no_command_prints_writes_or_logs_a_planted_secret(stores, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, RUN, TABLES, world_size=1)
    write_dump(root, info, 0, {T: {0: random_rows(range(50), TABLES[T])}}, kind=DumpKind.SNAPSHOT)
    at = ["--artifacts", root.uri, "--run", RUN]
    good = [*at, "--store", stores["url"]]
    other = new_generation(root, f"{RUN}_budget", TABLES, world_size=1)  # a run of its own
    write_dump(root, other, 0, {T: {0: random_rows(range(50), TABLES[T])}}, kind=DumpKind.SNAPSHOT)
    budgeted = ["--artifacts", root.uri, "--run", f"{RUN}_budget", "--store", stores["url"]]
    runs = {
        "provision": (["-v", "provision", *good, "--json", str(out / "prov.json")], 0),
        "publish": (["-v", "publish", *good, "--json", str(out / "pub.json")], 0),
        "publish under a read budget": (["-v", "publish", *budgeted, "--read-p99-ms", "0.001",
                                         "--json", str(out / "pub-budget.json")], 0),
        "verify": (["-v", "verify", *good, "--all", "--json", str(out / "v.json"),
                    "--report", str(out / "v.html"), "--metrics", str(out / "m.json")], 0),
        "promote": (["-v", "promote", *good, "--generation", "1"], 0),
        "rollback": (["-v", "rollback", *good, "--to-generation", "1"], 0),
        "inspect": (["-v", "inspect", *at, "--json"], 0),
        "verify-serving": (["-v", "pipeline", "verify-serving", *good, "--sample", "0"], 0),
        "query option": (["promote", *at, "--store", stores["query"], "--generation", "1"], 2),
        "nested URL": (["provision", *at, "--store", stores["nested"]], 2),
        "not a URL": (["provision", *at, "--store", f"u:{URL_SECRET}@db/emb"], 2),
        "unrecognized": (["inspect", *at, stores["url"], stores["nested"]], 2),
        "pipeline params": (["pipeline", "submit", "--host", "http://127.0.0.1:9", *at,
                             "--store", stores["nested"]], 2),
        "pipeline compile": (["pipeline", "compile", "--output", str(out / "p.yaml")], 0),
        "airflow compile": (["pipeline", "compile", "--engine", "airflow",
                             "--output", str(out / "dag.py")], 0),
    }  # fmt: skip
    for name, (args, code) in runs.items():
        done = _run(args, tmp_path)
        assert done.returncode == code, (name, done.stdout[-1500:], done.stderr[-3000:])
        assert not _leaks(done.stdout + done.stderr), (name, done.stdout, done.stderr)
        if code == 2:
            assert "error" in done.stderr, name  # one clear error, without the value
    echoed = _run(runs["unrecognized"][0], tmp_path).stderr
    assert "unrecognized arguments: postgresql://" in echoed and ":***@127.0.0.1" in echoed
    served = _serve_and_read(good, tmp_path / "replica")
    assert '"ready": true' in served and not _leaks(served), served
    written = _files_text(out) + _files_text(Path(root.path))
    assert '"passed": true' in written and "postgres" in written  # records and results are there
    assert '"held_back_s"' in written  # the budget's report is among them
    assert not _leaks(written)


def _serve_and_read(args, state: Path) -> str:
    """Run ``deltarec -v serve`` on the promoted generation, read its status, health and
    metrics, stop it; everything it answered and logged."""
    from deltarec.ports import free_port

    port = free_port()
    cmd = [*CLI, "-v", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--state-dir", str(state), "--poll-seconds", "0.2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    answers = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=2) as r:
                    status = r.read().decode()
                if json.loads(status).get("ready"):
                    break
            except OSError:
                pass
            time.sleep(0.3)
        for path in ("/v1/status", "/healthz", "/readyz", "/metrics", "/v1/tables"):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                    answers.append(r.read().decode())
            except urllib.error.HTTPError as e:
                answers.append(e.read().decode())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
    return "\n".join([*answers, stdout.decode(), stderr.decode()])


def _argv_of_children(pid: int) -> list[str]:
    """The command lines of ``pid``'s descendants (from /proc)."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            frontier.append(child)
            with contextlib.suppress(OSError):  # it may have ended meanwhile
                found.append(
                    Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                )
    return found


@pytest.mark.multiprocess
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_training_ranks_get_the_store_url_in_their_environment_not_their_command_lines(
    stores, tmp_path
):
    args = ["train", "--nproc-per-node", "2", "--steps", "4", "--batch-size", "16",
            "--log-every", "100", "--dump-every-steps", "2", "--artifacts",
            str(tmp_path / "art"), "--run", f"{RUN}-train", "--store", stores["url"]]  # fmt: skip
    proc = subprocess.Popen(
        [*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    seen: list[str] = []

    def watch() -> None:
        while proc.poll() is None:
            seen.extend(_argv_of_children(proc.pid))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    stdout, stderr = proc.communicate(timeout=600)
    watcher.join(timeout=5)
    assert proc.returncode == 0, [x for x in stderr.splitlines() if "rror" in x][:20]
    ranks = [argv for argv in seen if "deltarec.train" in argv]
    assert ranks, seen  # the ranks were seen, and
    assert not [argv for argv in ranks if URL_SECRET in argv or "--store" in argv]
    assert not _leaks(stdout + stderr + _files_text(tmp_path / "art"))
