"""A TrainJob on this machine: the Kubeflow SDK's local process backend runs the training.

``deltarec pipeline run --local`` (either engine) with ``nodes > 1`` and ``launcher=trainjob``
has no cluster to create a ``TrainJob`` in. Its train step hands the same job
(:class:`~deltarec.orchestrate.pytorchjob.TrainJobSpec`) to a real
``kubeflow.trainer.TrainerClient`` with ``LocalProcessBackendConfig``: the SDK creates a venv,
pip-installs the job's packages, runs ``<venv>/bin/torchrun`` over a script it writes from
:func:`_rank`'s source, and reports ``Complete`` or ``Failed``. One local node runs
``nodes * procs_per_node`` processes: the world size of the cluster job.

The SDK's venv has none of this environment's packages and would pip-install ``torch`` from
an index. Instead the job installs, offline (``PIP_NO_INDEX``, ``PIP_FIND_LINKS``), one small
wheel built on the fly (:func:`build_env_wheel`): a ``.pth`` file that adds this
environment's import path (site-packages, editable installs and ``PYTHONPATH`` entries) to the
venv, and the ``torchrun`` console script (:func:`torchrun_main`). The runtime's own ``torch``
requirement is replaced by one whose marker never holds (:data:`TORCH_FROM_ENVIRONMENT`), so
pip installs nothing but that wheel and torch is imported from this environment.

No orphans: ``torchrun`` and every rank end with the step that started them (parent-death
signal and the ``DELTAREC_LAUNCHER_PID`` watchdog of :mod:`deltarec.train.launch`), and a step
stopped by SIGTERM, SIGINT or SIGHUP, or timing out, deletes the job.
"""

from __future__ import annotations

import base64
import contextlib
import glob
import hashlib
import logging
import os
import re
import shutil
import signal
import site
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from typing import Any

from deltarec.environ import environ_set
from deltarec.errors import BadInputError, ConfigError
from deltarec.orchestrate.params import PipelineParams
from deltarec.orchestrate.pytorchjob import TrainJobSpec, _signals_raise
from deltarec.orchestrate.types import CREDENTIAL_ENV, TrainJobFailedError
from deltarec.train.launch import process_gone

log = logging.getLogger(__name__)

BACKEND_ENV = "DELTAREC_TRAINJOB_BACKEND"
"""``local``: a multi-node train step runs its TrainJob through the SDK's local process backend
(set by the local pipeline runs of both engines)."""
ENV_PACKAGE = "deltarec-job-env"
ENV_WHEEL = "deltarec_job_env-1.0-py3-none-any.whl"
TORCH_FROM_ENVIRONMENT = "torch; python_version < '3'"
"""Replaces the local runtime's ``torch`` requirement: torch comes from this environment."""
RUNTIME = "torch-distributed"  # the SDK's one local runtime
PASSED_ENV = ("HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "OMP_NUM_THREADS", *CREDENTIAL_ENV)
"""Variables of the step's environment the job's processes get (the SDK passes no other)."""
KIND = "TrainJob"


def local_backend_requested() -> bool:
    """True when this step is to run its TrainJob through the local process backend."""
    return os.environ.get(BACKEND_ENV, "").strip().lower() == "local"


def check_launcher(params: PipelineParams) -> None:
    """Refuse what a local run cannot train: several nodes through a PyTorchJob.

    Raises:
        BadInputError: ``nodes > 1`` with ``launcher=pytorchjob`` (it needs the Training
            Operator of a cluster).
    """
    if params.nodes > 1 and params.launcher == "pytorchjob":
        raise BadInputError(
            f"nodes={params.nodes} with launcher=pytorchjob needs a cluster's Training Operator; "
            "a local run trains several nodes as a TrainJob (launcher=trainjob) through the "
            "Kubeflow SDK's local process backend"
        )


@contextlib.contextmanager
def local_backend(params: PipelineParams) -> Iterator[None]:
    """While inside, train steps started from here run TrainJobs on this machine.

    Raises:
        BadInputError: see :func:`check_launcher` (before anything runs).
    """
    check_launcher(params)
    with environ_set(BACKEND_ENV, "local"):
        yield


def import_path() -> list[str]:
    """This environment's import path beyond the standard library, in order."""
    std = {os.path.realpath(p) for p in _stdlib_paths()}
    out: list[str] = []
    for p in [*sys.path, *site.getsitepackages()]:
        if not p or not os.path.isdir(p):
            continue
        real = os.path.realpath(p)
        if real not in std and real not in out:
            out.append(real)
    return out


def _stdlib_paths() -> list[str]:
    import sysconfig

    return [sysconfig.get_path(k) for k in ("stdlib", "platstdlib")] + [
        os.path.join(sysconfig.get_path("platstdlib"), "lib-dynload")
    ]


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_env_wheel(directory: str) -> str:
    """Write the wheel that makes a fresh venv see this environment; returns its path.

    It holds ``deltarec_job_env.pth`` (``site.addsitedir`` of every :func:`import_path`
    entry, so their own ``.pth`` files, editable installs among them, apply too) and the
    ``torchrun`` console script (:func:`torchrun_main`).
    """
    dist = "deltarec_job_env-1.0.dist-info"
    pth = "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in import_path())
    files = {
        "deltarec_job_env.pth": pth + "\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {ENV_PACKAGE}\nVersion: 1.0\n",
        f"{dist}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: deltarec\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
        f"{dist}/entry_points.txt": (
            "[console_scripts]\ntorchrun = deltarec.orchestrate.trainjob_local:torchrun_main\n"
        ),
    }
    path = os.path.join(directory, ENV_WHEEL)
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in files.items():
            data = text.encode()
            z.writestr(name, data)
            record.append(_record_line(name, data))
        z.writestr(f"{dist}/RECORD", "\n".join([*record, f"{dist}/RECORD,,"]) + "\n")
    return path


def torchrun_main() -> None:
    """The job's ``torchrun``: torch's launcher, ending with the step that started the job."""
    from deltarec.train.launch import exit_with_parent

    exit_with_parent()
    from torch.distributed.run import main

    main()


def run_rank(program: list[str], args: list[str], cwd: str) -> int:
    """Run the training program in this rank (a process torchrun started).

    In ``cwd``, the launcher step's directory (the SDK starts the job in its venv), so relative
    paths mean what they mean to the step. ``deltarec train`` and ``python -m
    deltarec.orchestrate.entry`` run in this process; any other command replaces it
    (``execvp``).
    """
    from deltarec.train.launch import exit_with_parent

    exit_with_parent()
    os.chdir(cwd)
    if program == ["deltarec", "train"]:  # python -m deltarec.train: the CLI sits above us
        import runpy
        import sys

        sys.argv = ["deltarec-train", *args]
        try:
            runpy.run_module("deltarec.train", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 1
        return 0
    if program[:3] == ["python", "-m", "deltarec.orchestrate.entry"]:
        from deltarec.orchestrate.entry import main as entry_main

        return entry_main([*program[3:], *args])
    os.execvp(program[0], [*program, *args])
    raise AssertionError("unreachable")  # pragma: no cover


def _rank(job: dict) -> None:  # type: ignore[type-arg]
    """What the SDK writes into the job's script (its source, then ``_rank(job)``)."""
    import sys

    from deltarec.orchestrate.trainjob_local import run_rank

    sys.exit(run_rank(job["program"], job["args"], job["cwd"]))


def job_env(spec: TrainJobSpec, wheels: str) -> dict[str, str]:
    """The whole environment of the job's processes (the SDK starts them with only this)."""
    from deltarec.train.launch import LAUNCHER_PID_ENV

    env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(dict(spec.env))
    env.update(
        {
            "PATH": os.environ.get("PATH", os.defpath),
            "PYTHONUNBUFFERED": "1",
            # the job's pip: offline, only the environment wheel, no user or site config
            "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": wheels,
            "PIP_NO_CACHE_DIR": "1",
            "PIP_CONFIG_FILE": os.devnull,
            # torchrun's settings (the cluster's torch runtime sets them per node)
            "PET_NNODES": "1",
            "PET_NPROC_PER_NODE": str(spec.nodes * spec.procs_per_node),
            "PET_STANDALONE": "1",
            "PET_TEE": "3",  # prefix each process's lines ([defaultN]:), see failure_reason
            "PET_LOG_DIR": os.path.join(wheels, "logs"),  # the tee's files, removed with it
            LAUNCHER_PID_ENV: str(os.getpid()),
        }
    )
    return env


@contextlib.contextmanager
def _python_on_path() -> Iterator[None]:
    """Put this interpreter first on ``PATH`` while the SDK looks for ``python``.

    The SDK creates the job's venv with the first ``python`` on ``PATH``; the ``.pth`` wheel
    only fits a venv of this same interpreter.

    Raises:
        ConfigError: there is no ``python`` next to this interpreter.
    """
    here = os.path.dirname(sys.executable)
    with environ_set("PATH", os.pathsep.join([here, os.environ.get("PATH") or os.defpath])):
        found = shutil.which("python")
        if found is None or not os.path.samefile(os.path.dirname(found), here):
            raise ConfigError(
                f"the local TrainJob backend needs a 'python' next to {sys.executable}"
            )
        yield


def _tail(client: Any, name: str, seen: int) -> int:
    """Log the job's output lines after the first ``seen``; returns the new count."""
    lines = list(client.get_job_logs(name))
    for line in lines[seen:]:
        log.info("[%s] %s", name, line.rstrip())
    return len(lines)


JOB_TMP_PREFIX = "deltarec-trainjob-"
"""The folders :func:`job_tempdir` makes: ``<tmp>/deltarec-trainjob-<random>-<launcher pid>``."""


@contextlib.contextmanager
def job_tempdir() -> Iterator[str]:
    """A folder of this process that is ``tempfile``'s default inside; removed on the way out.

    The SDK makes the job's venv (hundreds of MB, kept when a job fails) in ``tempfile``'s
    default folder, so inside this context it lands here and goes with it. A launcher killed
    with SIGKILL cleans nothing up: its folder is removed by the next launcher on this machine,
    which removes every such folder whose launcher process is gone (the job's ranks end with
    their launcher, so nothing runs from it).
    """
    base = tempfile.gettempdir()
    for old in glob.glob(os.path.join(base, JOB_TMP_PREFIX + "*")):
        pid = old.rsplit("-", 1)[-1]
        if pid.isdigit() and process_gone(int(pid)):
            log.info("removing %s, left by a launcher that is gone", old)
            shutil.rmtree(old, ignore_errors=True)
    ours = tempfile.mkdtemp(prefix=JOB_TMP_PREFIX, suffix=f"-{os.getpid()}", dir=base)
    saved = tempfile.tempdir
    tempfile.tempdir = ours
    try:
        yield ours
    finally:
        tempfile.tempdir = saved
        shutil.rmtree(ours, ignore_errors=True)


def run_local_train_job(spec: TrainJobSpec, *, poll_s: float = 1.0) -> str:
    """Run ``spec`` through ``TrainerClient`` with the local process backend, to its end.

    Returns:
        The job's final status, ``Complete``.

    Raises:
        TrainJobFailedError: the job failed (its last output lines) or ran past
            ``spec.timeout_s`` (then it was deleted).
        StepStopped: a signal stopped the step (after the job was deleted).
    """
    from kubeflow.trainer import CustomTrainer, LocalProcessBackendConfig, TrainerClient
    from kubeflow.trainer.options import Name

    client = TrainerClient(backend_config=LocalProcessBackendConfig(cleanup_venv=True))
    program, args = _program(spec)
    cwd = os.getcwd()
    with job_tempdir(), tempfile.TemporaryDirectory(prefix="deltarec-job-env-") as wheels:
        build_env_wheel(wheels)
        trainer = CustomTrainer(
            func=_rank,
            func_args={"program": program, "args": args, "cwd": cwd},
            packages_to_install=[TORCH_FROM_ENVIRONMENT, ENV_PACKAGE],
            num_nodes=1,
            env=job_env(spec, wheels),
        )
        with _signals_raise((signal.SIGTERM, signal.SIGINT, signal.SIGHUP)):
            with _python_on_path():
                name = client.train(runtime=RUNTIME, trainer=trainer, options=[Name(spec.name)])
            log.info(
                "TrainJob %s: %d processes through the local process backend",
                name, spec.nodes * spec.procs_per_node,
            )  # fmt: skip
            try:
                status = _follow(client, spec, name, poll_s)
            except BaseException:
                client.delete_job(name)
                raise
            finally:
                # the SDK's job thread chdirs this whole process into the venv while it runs
                os.chdir(cwd)
    if status != "Complete":
        reason = failure_reason(list(client.get_job_logs(name)))
        raise TrainJobFailedError("local", name, f"{status}: {reason}", KIND)
    return status


_ROOT_CAUSE = re.compile(
    r"Root Cause.*?rank\s*:\s*(\d+) \(local_rank: (\d+)\).*?exitcode\s*:\s*(-?\d+)", re.S
)


def failure_reason(lines: list[str]) -> str:
    """Why the job failed, from its output: torchrun's root cause and that rank's last line.

    ``"rank 0 exit code 3; last output: ..."``; without torchrun's report, the last lines.
    """
    match = _ROOT_CAUSE.search("\n".join(lines))
    if match is None:
        return " | ".join(x.strip() for x in lines[-3:] if x.strip()) or "no output"
    rank, local, code = match.groups()
    prefix = f"[default{local}]:"  # torchrun's --tee prefix of that process's lines
    said = [x[len(prefix) :].strip() for x in lines if x.startswith(prefix)]
    said = [x for x in said if x]
    return f"rank {rank} exit code {code}" + (f"; last output: {said[-1]}" if said else "")


def _program(spec: TrainJobSpec) -> tuple[list[str], list[str]]:
    from deltarec.orchestrate.trainjob import _command

    command, args = _command(spec)
    return command[3:], args  # after "torchrun --no-python --"


def _follow(client: Any, spec: TrainJobSpec, name: str, poll_s: float) -> str:
    """Poll the job to its end, logging its output as it comes; returns its final status."""
    deadline = time.monotonic() + spec.timeout_s
    seen = 0
    while True:
        status = client.get_job(name).status
        seen = _tail(client, name, seen)
        if status in ("Complete", "Failed"):
            return status
        if time.monotonic() >= deadline:
            raise TrainJobFailedError(
                "local", name, f"did not finish within {spec.timeout_s} s", KIND
            )
        time.sleep(poll_s)


__all__ = [
    "BACKEND_ENV",
    "build_env_wheel",
    "check_launcher",
    "failure_reason",
    "import_path",
    "job_env",
    "local_backend",
    "local_backend_requested",
    "run_local_train_job",
    "torchrun_main",
]
