"""``kill -9`` of ``deltarec pipeline run --local`` (either engine) leaves no training process and
no held lease: the train step, torchrun and both ranks end with it, and a re-run right after
succeeds."""

import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.lease import current_holder

pytestmark = pytest.mark.integration  # a real training run per engine: minutes, not seconds


def _tree(root_pid):
    """Every live descendant of ``root_pid`` (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()
            if fields[0] not in ("Z", "X"):
                parents[int(entry)] = int(fields[1])
    found, frontier = set(), {root_pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pids):
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X"):
            out.add(pid)
    return out


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_rank(pid):
    """A training rank: ``python -m deltarec.train`` or, in a local TrainJob, the script the
    Kubeflow SDK writes (``train_deltarec-orphan-<digest>.py``)."""
    cmd = _cmdline(pid)
    return "deltarec.train" in cmd or "/train_deltarec-orphan-" in cmd


def _pipeline(tmp_path, engine, steps, *more):
    return [
        os.path.join(os.path.dirname(sys.executable), "deltarec"),
        "pipeline", "run", "--local", "--engine", engine,
        "--run", "orphan", "--artifacts", str(tmp_path / "art"),
        "--store", f"sqlite:///{tmp_path / 'store.db'}", "--steps", str(steps),
        "--dump-every-steps", "10", "--sample", "200",
        "--pipeline-root", str(tmp_path / f"{engine}-root"), *more,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("engine", "more"),
    [
        ("kfp", ()),
        ("airflow", ()),
        # two nodes: the train-launcher step's TrainJob through the SDK's local process backend
        ("kfp", ("--nodes", "2", "--ranks-per-node", "1")),
    ],
    ids=["kfp", "airflow", "kfp-trainjob"],
)
def test_kill_9_of_a_local_pipeline_run_leaves_no_trainer_and_a_rerun_succeeds(
    tmp_path, engine, more
):
    if engine == "airflow" and importlib.util.find_spec("airflow") is None:
        pytest.skip("the airflow extra is not installed")
    root = ArtifactRoot(str(tmp_path / "art"))
    jobs_tmp = tmp_path / "tmp"  # where a local TrainJob's venv is made
    jobs_tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(jobs_tmp)}
    run = subprocess.Popen(
        _pipeline(tmp_path, engine, 1_000_000, *more), env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 420
        ranks = set()
        while time.monotonic() < deadline and run.poll() is None:
            holder = current_holder(root, "orphan") if os.path.isdir(root.uri) else None
            tree = _tree(run.pid)
            ranks = {p for p in tree if _is_rank(p)}
            if holder is not None and holder.alive(time.time()) and len(ranks) >= 2:
                break
            time.sleep(1)
        assert run.poll() is None and len(ranks) >= 2, "training never started"
        tree = _tree(run.pid)
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        deadline = time.monotonic() + 60
        while _alive(tree) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = {p: _cmdline(p) for p in _alive(tree)}
        assert not left, f"left running after kill -9: {left}"
    finally:
        os.killpg(run.pid, signal.SIGKILL) if run.poll() is None else None
    holder = current_holder(root, "orphan")
    assert holder is not None and not holder.alive(time.time())  # its holder is gone
    again = subprocess.run(
        _pipeline(tmp_path, engine, 20, *more), env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "verify PASS" in again.stdout
    # the killed run's job folder (its venv) went with the re-run, which removed its own
    assert [p.name for p in jobs_tmp.glob("deltarec-trainjob-*")] == []
