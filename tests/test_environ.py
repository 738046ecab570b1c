"""numpy's OpenBLAS pool in deltarec's own processes: one thread, unless the user set it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from deltarec.environ import ONE_BLAS_THREAD, environ_default, one_blas_thread
from deltarec.publish.probe import Probe, ProbeTarget

NAME, ONE = ONE_BLAS_THREAD


def _environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [p.split(b"=", 1) for p in f.read().split(b"\0") if b"=" in p]
    return {k.decode(): v.decode() for k, v in pairs}


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def _env_without_blas() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != NAME}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def test_a_command_that_runs_no_model_starts_numpy_with_one_blas_thread(tmp_path):
    code = (
        "import os, sys; from deltarec.cli import main; "
        f"rc = main(['inspect', '--artifacts', {str(tmp_path)!r}, '--run', 'r']); "
        f"print(os.environ.get({NAME!r}), 'numpy' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_env_without_blas(), capture_output=True, text=True
    )
    assert out.stdout.split()[-2:] == [ONE, "True"], out.stderr  # set before numpy came in


def test_a_users_own_blas_setting_is_kept(tmp_path):
    code = (
        "import os; from deltarec.cli import main; "
        f"main(['inspect', '--artifacts', {str(tmp_path)!r}, '--run', 'r']); "
        f"print(os.environ.get({NAME!r}))"
    )
    env = {**_env_without_blas(), NAME: "3"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split()[-1] == "3", out.stderr


def test_once_numpy_is_imported_nothing_is_set(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert "numpy" in sys.modules  # the tests import it
    assert one_blas_thread() is False and NAME not in os.environ


def test_a_default_leaves_a_set_variable_and_undoes_its_own(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    with environ_default(NAME, ONE):
        assert os.environ[NAME] == ONE
    assert NAME not in os.environ
    monkeypatch.setenv(NAME, "4")
    with environ_default(NAME, ONE):
        assert os.environ[NAME] == "4"
    assert os.environ[NAME] == "4"


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="Linux /proc only")
def test_the_read_probe_process_starts_with_one_blas_thread_and_this_process_is_unchanged(
    tmp_path, monkeypatch
):
    monkeypatch.delenv(NAME, raising=False)
    probe = Probe(ProbeTarget("sqlite", {"path": str(tmp_path / "none.db")}, "nothing"), 0.05)
    try:
        pid = probe._process.pid
        assert pid is not None
        deadline = time.monotonic() + 30
        while b"spawn_main" not in _cmdline(pid) and time.monotonic() < deadline:
            time.sleep(0.01)  # until the child runs its own program (its own environment)
        assert probe.alive() and _environ_of(pid).get(NAME) == ONE
    finally:
        probe.close()
    assert NAME not in os.environ
