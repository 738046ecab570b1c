"""``deltarec serve`` as a process: follows the promoted run, killed and restarted mid-run."""

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

import numpy as np
import pytest

from deltarec.cli import main as cli_main
from deltarec.promote import promote
from deltarec.verify import verify, write_record

from .conftest import RUN, T_EMB

pytestmark = pytest.mark.multiprocess


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=2) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError):
        return None


def _wait(port: int, proc: subprocess.Popen, until, timeout: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"deltarec serve exited {proc.returncode}"
        st = _status(port)
        if st is not None and until(st):
            return st
        time.sleep(0.2)
    raise AssertionError(f"replica status never matched; last: {_status(port)}")


def _serve(outbox, store_url, port, state_dir) -> subprocess.Popen:
    code = "import sys; from deltarec.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", code, "serve", "--artifacts", outbox.root.uri, "--run", RUN]
    cmd += ["--store", store_url, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--state-dir", state_dir, "--poll-seconds", "0.2", "--checkpoint-seconds", "0.2"]
    log = open(os.path.join(state_dir + ".log"), "ab")  # noqa: SIM115 - the child's stderr
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)


def test_a_killed_replica_restarts_from_its_state_and_verifies_against_the_artifacts(
    outbox, store, store_url, tmp_path
):
    g = outbox.first_generation()
    outbox.publish(store, g)
    write_record(outbox.root, verify(outbox.root, RUN, store, store_url=store.describe()))
    promote(outbox.root, RUN, store, g)
    port, state_dir = _free_port(), str(tmp_path / "state")
    proc = _serve(outbox, store_url, port, state_dir)
    try:
        _wait(port, proc, lambda st: st["ready"] and st["seq"] == 1)
        outbox.dump(g, 2, {T_EMB: (np.array([1, 2, 300]), 2.0)})
        _wait(port, proc, lambda st: st["seq"] == 2)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the state recorded at dump 2
            if json.loads((tmp_path / "state" / "replica.json").read_text())["seq"] == 2:
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    outbox.dump(g, 3, {T_EMB: (np.array([3]), 3.0)})
    snapshot = [  # away while the replica restarts: it must not need to re-read them
        os.path.join(outbox.root.dump_dir(RUN, g, 0), shard.path)
        for shard in outbox.root.read_manifest(RUN, g, 0).shards
    ]
    for path in snapshot:
        os.rename(path, path + ".away")
    proc = _serve(outbox, store_url, port, state_dir)
    try:
        st = _wait(port, proc, lambda st: st["ready"] and st["seq"] == 3)
        assert st["blocked"] is None and st["generation"] == g
        for path in snapshot:
            os.rename(path + ".away", path)
        url = f"replica://127.0.0.1:{port}"
        code = cli_main(
            ["verify", "--artifacts", outbox.root.uri, "--run", RUN, "--store", url,
             "--through-seq", "3", "--sample", "20", "--no-record"]
        )  # fmt: skip
        assert code == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()


def test_serve_refuses_a_device_torch_does_not_know(outbox, store_url, capsys):
    outbox.first_generation()
    code = cli_main(
        ["serve", "--artifacts", outbox.root.uri, "--run", RUN, "--store", store_url,
         "--device", "tpu", "--port", "0"]
    )  # fmt: skip
    assert code == 2 and "device 'tpu'" in capsys.readouterr().err
