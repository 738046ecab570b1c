"""Process-group setup for ``deltarec train`` and the torchrun launcher.

``deltarec train --nproc-per-node N ...`` re-runs itself as
``python -m torch.distributed.run --standalone --nproc-per-node N -m deltarec.train ...``
(``--standalone`` picks a free rendezvous port on localhost). Under torchrun (``RANK`` and
``WORLD_SIZE`` set) or as a single process, :func:`init_distributed` joins or creates the
default process group: gloo for ``cpu``, nccl for ``cuda`` (rank ``r`` uses
``cuda:<LOCAL_RANK>``). CPU ranks use one intra-op thread unless ``OMP_NUM_THREADS`` is set.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from collections.abc import Sequence

from deltarec.testing.multiprocess import free_port


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


def launch_torchrun(nproc_per_node: int, train_args: Sequence[str]) -> int:
    """Run ``deltarec train`` under torchrun on N local ranks; return torchrun's exit code."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(torchrun_command(nproc_per_node, train_args), env=env)
