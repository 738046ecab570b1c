"""numpy's OpenBLAS pool in deltarec's own processes: one thread, unless the user set it."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from deltarec.environ import ONE_BLAS_THREAD, call_with_one_blas_thread, one_blas_thread
from deltarec.publish.probe import Probe, ProbeTarget

NAME, ONE = ONE_BLAS_THREAD


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


def test_a_spawned_child_sets_one_blas_thread_itself_and_this_process_is_unchanged(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        got = pool.apply(call_with_one_blas_thread, ("os", "getenv", NAME))
    assert got == ONE and NAME not in os.environ


def _threads_named_like_the_main_one(pid: int) -> int:
    tasks = os.listdir(f"/proc/{pid}/task")
    names = []
    for t in tasks:
        with open(f"/proc/{pid}/task/{t}/comm") as f:
            names.append(f.read().strip())
    with open(f"/proc/{pid}/comm") as f:
        main = f.read().strip()
    return names.count(main)


@pytest.mark.skipif(
    not os.path.exists("/proc/self/task") or (os.cpu_count() or 1) < 2,
    reason="Linux /proc, and OpenBLAS starts no thread of its own on one core",
)
def test_the_read_probe_process_runs_without_numpys_thread_pool(tmp_path, monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    probe = Probe(ProbeTarget("sqlite", {"path": str(tmp_path / "none.db")}, "nothing"), 0.05)
    try:
        pid = probe._process.pid
        assert pid is not None
        deadline = time.monotonic() + 60
        while not _has_sqlite(pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # until it connects: its imports (numpy's among them) are done
        assert probe.alive()
        assert _threads_named_like_the_main_one(pid) == 1  # no OpenBLAS workers beside it
    finally:
        probe.close()
    assert NAME not in os.environ


def _has_sqlite(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "sqlite" in f.read()
