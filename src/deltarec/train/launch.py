"""Process-group setup for ``deltarec train`` and the torchrun launcher.

``deltarec train --nproc-per-node N ...`` re-runs itself as
``python -m torch.distributed.run --standalone --nproc-per-node N -m deltarec.train ...``
(``--standalone`` picks a free rendezvous port on localhost). Under torchrun (``RANK`` and
``WORLD_SIZE`` set) or as a single process, :func:`init_distributed` joins or creates the
default process group: gloo for ``cpu``, nccl for ``cuda`` (rank ``r`` uses
``cuda:<LOCAL_RANK>``). CPU ranks use one intra-op thread unless ``OMP_NUM_THREADS`` is set.

No orphans: torchrun starts its workers in sessions of their own, so killing the launcher's
process group does not reach them. Every process of the chain therefore ends with its parent:
torchrun gets the parent-death signal ``SIGKILL`` from the launcher (``prctl(PR_SET_PDEATHSIG)``
set before exec), and each worker sets it for itself on start (:func:`exit_with_parent`),
backed by a watchdog thread that also ends the worker when its parent changes or the launcher
(``DELTAREC_LAUNCHER_PID``) is gone: a worker exits within about a second of its launcher,
however the launcher died.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

from deltarec.ports import free_port

log = logging.getLogger(__name__)

LAUNCHER_PID_ENV = "DELTAREC_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1
_watchdog: threading.Thread | None = None


RENDEZVOUS_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""The variables torchrun gives each rank, and :func:`init_distributed` a process of its own."""


def under_torchrun() -> bool:
    """True if this process was started by torchrun (or any launcher setting RANK/WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(device: str, timeout_s: float = 600.0) -> bool:
    """Join (torchrun) or create (single process) the default process group.

    Args:
        device: ``cpu`` (gloo) or ``cuda`` (nccl).
        timeout_s: collective timeout.

    Returns:
        True if this call created the group (the caller should destroy it), False if one
        already existed.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if not under_torchrun():
        os.environ.update(
            {
                "RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()),
            }
        )
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does for several ranks: small sparse steps lose more to intra-op thread
        # hand-offs than they gain, badly so on a busy machine (measured 3 vs 68 steps/s).
        torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def torchrun_command(nproc_per_node: int, train_args: Sequence[str]) -> list[str]:
    """The torchrun command line that runs ``deltarec train <train_args>`` on N local ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc_per_node}",
        "-m",
        "deltarec.train",
        # "--" keeps torchrun's parser off our flags (it would take --run for --run-path)
        "--",
        *train_args,
    ]


def launch_torchrun(
    nproc_per_node: int, train_args: Sequence[str], extra_env: Mapping[str, str] | None = None
) -> int:
    """Run ``deltarec train`` under torchrun on N local ranks; return torchrun's exit code.

    torchrun dies with this process (parent-death signal), and its workers with torchrun.
    ``extra_env`` reaches every rank's environment (a secret there stays out of ``ps``).
    """
    env = {**os.environ, **(extra_env or {})}
    env.setdefault("OMP_NUM_THREADS", "1")
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    return subprocess.call(
        torchrun_command(nproc_per_node, train_args), env=env, preexec_fn=die_with_parent
    )


def die_with_parent() -> None:
    """In a child before exec: receive SIGKILL when the parent dies (Linux; else nothing)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def process_gone(pid: int) -> bool:
    """True if process ``pid`` has exited (or is a zombie, exited but not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :][:1] in ("Z", "X")


def exit_with_parent(poll_s: float = 0.5) -> None:
    """Make this worker end when its launcher dies, however it dies (idempotent).

    Sets the parent-death signal (SIGKILL) and starts a watchdog thread that kills this
    process when its parent changes (the parent died before the signal was set, or on
    systems without it) or when ``DELTAREC_LAUNCHER_PID`` names a process that is gone.
    """
    global _watchdog
    if _watchdog is not None:
        return
    parent = os.getppid()
    die_with_parent()
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    launcher_pid = int(launcher) if launcher and launcher.isdigit() else None

    def watch() -> None:
        while True:
            orphaned = os.getppid() != parent
            if orphaned or (launcher_pid is not None and process_gone(launcher_pid)):
                log.error("the launcher of this training process is gone; exiting")
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Event().wait(poll_s)

    _watchdog = threading.Thread(target=watch, name="deltarec-parent-watchdog", daemon=True)
    _watchdog.start()
