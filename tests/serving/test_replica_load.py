"""The replica under attack on loopback: many clients, oversize and half-sent requests at once.

The server runs in a process of its own so that its memory and threads are measured alone
(``/proc/<pid>/status``): they stay bounded, every attacker gets a 4xx/503 answer (never a
dropped connection), and lookups and health checks are answered all along.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from deltarec.serving.limits import ServeLimits

from .conftest import RUN, T_EMB

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")

LIMITS = {
    "max_keys": 1 << 17,
    "max_ids": 1 << 12,
    "max_answer_bytes": 4 << 20,
    "max_inflight_bytes": 16 << 20,
    "max_connections": 512,
    "max_workers": 2,
    "header_timeout_s": 1.0,
    "request_timeout_s": 1.0,
    "queue_timeout_s": 0.5,
}
ATTACK_S = 3.0
MEMORY_BOUND = 8 * LIMITS["max_inflight_bytes"]
"""The most the server's peak resident memory may grow under the attack (bytes)."""

_SERVER = """
import sys
from deltarec.serving.follow import FixedPointer, Follower
from deltarec.serving.http import ReplicaServer
from deltarec.serving.limits import ServeLimits
from deltarec.serving.replica import Replica
from deltarec.stores.types import ServingPointer
import json
root, run, g, limits = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
follower = Follower(Replica(root, run), FixedPointer(ServingPointer(run, g, 1, 1.0)))
follower.poll()
server = ReplicaServer(follower, limits=ServeLimits(**limits))
print(server.port, flush=True)
server.serve_forever()
"""


def _proc_status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmHWM", "VmRSS", "Threads"):
                out[name] = int(value.split()[0]) * (1024 if name.startswith("Vm") else 1)
    return out


def _answer(sock: socket.socket) -> int:
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    body = resp.read()
    if resp.status != 200:
        assert "error" in json.loads(body), body[:200]
    return resp.status


def _request(port: int, head: str, body: bytes = b"", timeout: float = 10.0) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.encode() + body)
        return _answer(s)


def _post(port: int, path: str, body: bytes) -> int:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    return _request(port, head, body)


@pytest.fixture
def server_process(outbox, tmp_path):
    g = outbox.first_generation()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-c", _SERVER, outbox.root.uri, RUN, str(g), json.dumps(LIMITS)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
    try:
        port = int(proc.stdout.readline())
        yield proc, port
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def _loop(until: float, fn, results: Counter) -> None:
    while time.monotonic() < until:
        try:
            results[fn()] += 1
        except OSError as e:  # a dropped connection is a failure of the bound
            results[f"{type(e).__name__}"] += 1


def test_the_replica_keeps_answering_within_its_memory_under_many_hostile_clients(server_process):
    proc, port = server_process
    limits = ServeLimits(**LIMITS)
    most_rows = limits.max_answer_bytes // (9 + 8 * 4)  # T_EMB: dim 8 float32
    small = json.dumps({"table": T_EMB, "ids": list(range(16))}).encode()
    big_keys = b"\0" * (8 * most_rows)
    for _ in range(20):  # warm: torch's threads, the allocator, the JSON encoder
        assert _post(port, "/v1/lookup", small) == 200
        assert _post(port, f"/v1/rows?table={T_EMB}", big_keys) == 200
    before = _proc_status(proc.pid)

    # Connections that stall: half a head, a head and half a body.
    stalled = []
    for i in range(300):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        if i % 6:
            s.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        else:
            s.sendall(b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: 900\r\n\r\n{")
        stalled.append((i % 6 == 0, s))

    until = time.monotonic() + ATTACK_S
    small_ok, big, oversize, peaks = Counter(), Counter(), Counter(), []
    huge = "POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: 400000000\r\n\r\n"
    many = json.dumps({"table": T_EMB, "ids": list(range(300_000))}).encode()  # 2.3 MB
    workers = [
        *(
            threading.Thread(
                target=_loop, args=(until, lambda: _post(port, "/v1/lookup", small), small_ok)
            )
            for _ in range(4)
        ),
        *(
            threading.Thread(
                target=_loop,
                args=(until, lambda: _post(port, f"/v1/rows?table={T_EMB}", big_keys), big),
            )
            for _ in range(24)
        ),
        threading.Thread(target=_loop, args=(until, lambda: _request(port, huge), oversize)),
        threading.Thread(
            target=_loop, args=(until, lambda: _post(port, "/v1/lookup", many), oversize)
        ),
    ]
    for w in workers:
        w.start()
    while time.monotonic() < until:
        peaks.append(_proc_status(proc.pid)["Threads"])
        time.sleep(0.05)
    for w in workers:
        w.join(30)
    after = _proc_status(proc.pid)

    stalled_answers = Counter()
    for has_head, s in stalled:
        with s:
            stalled_answers[(has_head, _answer(s))] += 1
    assert stalled_answers == {(True, 408): 50, (False, 408): 250}
    assert set(small_ok) == {200} and small_ok[200] > 10, small_ok
    assert set(big) <= {200, 503} and big[200] > 0, big
    assert set(oversize) == {413}, oversize
    assert after["VmHWM"] - before["VmHWM"] < MEMORY_BOUND, (before, after)
    assert max(peaks) <= before["Threads"] + limits.max_workers, (before, peaks)
    assert _request(port, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n") == 200
    assert _request(port, "GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n") == 200
