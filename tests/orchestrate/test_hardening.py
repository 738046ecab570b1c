"""Small trust boundaries: the webhook follows no redirect, metrics listen on loopback unless
told, table ids are never path steps, checkpoint hook state loads as plain data only."""

from __future__ import annotations

import http.server
import io
import threading
import urllib.request
from pathlib import Path

import pytest
import torch

from deltarec.errors import InvalidIdentifierError
from deltarec.ids import validate_table_id
from deltarec.orchestrate import steps
from deltarec.orchestrate.params import parse_params
from deltarec.publish.metrics import METRICS_HOST_ENV, PublishMetrics
from deltarec.train import checkpoint
from deltarec.train.errors import CheckpointError


class _Recorder(http.server.BaseHTTPRequestHandler):
    hits: list[tuple[str, str]] = []
    target = ""

    def do_POST(self):
        self.hits.append(("POST", self.path))
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(302 if self.path == "/hook" else 200)
        self.send_header("Location", self.target)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    _Recorder.hits = []
    _Recorder.target = f"http://127.0.0.1:{srv.server_port}/metadata"
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_the_webhook_does_not_follow_a_redirect_and_counts_it_as_a_failed_call(server):
    status = steps.call_webhook(f"http://127.0.0.1:{server.server_port}/hook", {"verdict": "FAIL"})
    assert status == 0
    assert _Recorder.hits == [("POST", "/hook")]  # /metadata was never asked for


def test_the_webhook_reports_the_status_of_a_plain_answer(server):
    assert steps.call_webhook(f"http://127.0.0.1:{server.server_port}/ok", {"v": 1}) == 200


def _listening_address(monkeypatch, host):
    calls = []
    monkeypatch.setattr(
        "deltarec.publish.metrics.start_http_server",
        lambda port, addr, registry: calls.append(addr),
    )
    if host is None:
        monkeypatch.delenv(METRICS_HOST_ENV, raising=False)
    else:
        monkeypatch.setenv(METRICS_HOST_ENV, host)
    PublishMetrics().serve(9400)
    return calls[0]


def test_metrics_listen_on_loopback_unless_the_environment_says_otherwise(monkeypatch):
    assert _listening_address(monkeypatch, None) == "127.0.0.1"
    assert _listening_address(monkeypatch, "0.0.0.0") == "0.0.0.0"


def test_metrics_of_a_real_server_are_not_reachable_on_another_interface(monkeypatch):
    import socket

    from deltarec.ports import free_port

    monkeypatch.delenv(METRICS_HOST_ENV, raising=False)
    port = free_port()
    PublishMetrics().serve(port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200
    listening = [
        line.split()[1]
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
        if line.split()[3] == "0A" and int(line.split()[1].split(":")[1], 16) == port
    ]
    assert listening == [f"{socket.htonl(0x7F000001):08X}:{port:04X}"]


def test_the_pipeline_tells_its_scraped_training_ranks_to_listen_on_every_interface():
    base = {"run_name": "r", "artifact_root": "/a", "store_url": "sqlite:///s.db"}
    _, env = steps.torchrun_command(parse_params(**base, metrics_port=9400))
    assert env == {METRICS_HOST_ENV: "0.0.0.0"}
    _, env = steps.torchrun_command(parse_params(**base))
    assert METRICS_HOST_ENV not in env


@pytest.mark.parametrize("table", [".", ".."])
def test_a_table_id_is_never_a_path_step(table):
    with pytest.raises(InvalidIdentifierError):
        validate_table_id(table)
    assert validate_table_id("a.b..c") == "a.b..c"


class _Hook:
    def __init__(self, state=None):
        self.state = state or {}

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


RAN: list[str] = []


def _run_code(what: str) -> None:
    """What a malicious checkpoint would make ``torch.load`` call (by reference: picklable even
    where a library has replaced ``builtins.print``)."""
    RAN.append(what)


class _Code:
    def __reduce__(self):
        return (_run_code, ("ran code from a checkpoint",))


def test_hook_state_round_trips_as_plain_data():
    state = {"version": 1, "run": "r", "generation": 3, "seq": 7, "step": 70, "x": None}
    blob = checkpoint._pack_hooks({checkpoint.hook_key(_Hook(), 0): state})
    restored = _Hook()
    checkpoint._unpack_hooks(blob, [restored], "/ck/step-70")
    assert restored.state == state


def test_hook_state_that_would_run_code_is_refused():
    buf = io.BytesIO()
    torch.save({checkpoint.hook_key(_Hook(), 0): {"evil": _Code()}}, buf)
    blob = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="not plain data"):
        checkpoint._unpack_hooks(blob, [_Hook()], "/ck/step-70")
    assert RAN == []
