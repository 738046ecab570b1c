import pytest

from deltarec.artifacts import ArtifactRoot, TableSpec
from deltarec.testing.dumps import new_generation, random_rows, write_dump


class FakeArtifact:
    """The attributes a step uses of a KFP artifact."""

    def __init__(self, path, metadata=None):
        self.path = str(path)
        self.uri = str(path)
        self.metadata = dict(metadata or {})
        self.metrics = {}

    def log_metric(self, name, value):
        self.metrics[name] = value
        self.metadata[name] = value


def check_dag_folder(folder, tmp_path):
    """What ``airflow_local --check`` reports of the DAG files in ``folder`` (a child process
    with a scratch AIRFLOW_HOME under ``tmp_path``, so this process never configures Airflow)."""
    import json
    import os
    import subprocess
    import sys

    from deltarec.orchestrate.airflow_local import airflow_env

    env = {**os.environ, **airflow_env(str(tmp_path / "scratch"))}
    done = subprocess.run(
        [sys.executable, "-m", "deltarec.orchestrate.airflow_local", "--check", str(folder)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_rolled_back_to_first(webhook, store_url, run="lt"):
    """Generation 2 of ``run`` failed: the webhook heard of the rollback (checked, and who
    served before and after), and serving points at generation 1 again with a note that says
    so."""
    from deltarec.stores import open_store

    (summary,) = webhook.received
    assert (summary["action"], summary["rolled_back_to"], summary["generation"]) == (
        "rolled-back", 1, 2,
    )  # fmt: skip
    assert summary["rollback_check"] == "passed"  # the rollback verified every key itself
    for when in ("serving_before", "serving_after"):  # who served: the failing run, at 1
        assert set(summary[when]["tables"].values()) == {run}, summary[when]
        assert summary[when]["runs"][run]["generation"] == 1
    with open_store(store_url) as s:
        pointer = s.registry.get_serving(run)
    assert pointer.generation == 1 and "rollback" in pointer.note


def write_generation(root_uri, run, dumps):
    """A generation with committed dumps; ``dumps`` = [(last_step, {table: rows})].

    Each dump holds that many rows of random values per table (rank 0's shard), committed
    through ``deltarec.testing.dumps.write_dump``: shards first, the manifest last.
    """
    root = ArtifactRoot(str(root_uri))
    names = sorted({t for _, tables in dumps for t in tables}) or ["sparse.ebc.t"]
    specs = {t: TableSpec(8) for t in names}
    info = new_generation(root, run, specs, world_size=2)
    first, keys = 1, 0
    for seq, (last_step, tables) in enumerate(dumps, start=1):
        rows = {}
        for t, n in tables.items():
            rows[t] = {0: random_rows(range(keys, keys + n), specs[t], seed=seq, step=last_step)}
            keys += n
        write_dump(root, info, seq, rows, first_step=first, last_step=last_step)
        first = last_step + 1
    return info.generation


@pytest.fixture
def fake_artifact():
    return FakeArtifact


LOSSY_TEAM = __import__("pathlib").Path(__file__).parent / "lossy_team"


@pytest.fixture
def lossy_team(monkeypatch):
    """tests/orchestrate/lossy_team importable here and in every step and rank process."""
    import os

    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(LOSSY_TEAM), os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.syspath_prepend(str(LOSSY_TEAM))
    import lossy_team

    return lossy_team


@pytest.fixture
def webhook():
    """A local HTTP server on 127.0.0.1 recording the JSON bodies POSTed to it."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    received = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append(json.loads(body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{server.server_port}/hook"
    server.received = received
    yield server
    server.shutdown()
    server.server_close()


def train_in_process(lossy_team, monkeypatch, params, *argv):
    """Run lossy_team's program in this process (one rank) as the train step would."""
    import sys

    from deltarec.orchestrate import steps

    for key, value in steps.train_settings_env(params).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", ["lossy_team", *argv])
    root = steps.ArtifactRoot(params.artifact_root)
    before = set(root.list_generations(params.run_name))
    assert lossy_team.main() == 0
    (gen,) = set(root.list_generations(params.run_name)) - before
    return steps.generation_record(root, params.run_name, gen)


def run_pipeline_locally(tmp_path, capsys, *params, expect=0):
    """``deltarec pipeline run --local`` with ``params`` (kfp.local, its outputs under
    ``tmp_path/kfp``): ``(the run's result JSON, what it printed)``. Asserts the exit code,
    showing the end of the output when it differs."""
    import json

    from deltarec.cli import main

    out = tmp_path / "result.json"
    code = main([
        "pipeline", "run", "--local", *params,
        "--pipeline-root", str(tmp_path / "kfp"), "--json", str(out),
    ])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == expect, printed[-3000:]
    return json.loads(out.read_text()), printed
