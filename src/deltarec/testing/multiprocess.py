"""Run one module-level function on N torch.distributed ranks (gloo on CPU) and collect results.

Multi-rank tests and benches use this instead of ``torchrun``::

    from deltarec.testing.multiprocess import run_on_ranks, spawn_ranks

    def _per_rank(rank: int, world_size: int, workdir: str) -> dict:
        # runs in a fresh process; the default process group is already initialized
        ...
        return {"rows": 3}          # anything picklable (plain data, numpy arrays, tensors)

    def test_something(tmp_path):
        results = run_on_ranks(_per_rank, world_size=2, args=(str(tmp_path),))
        assert results[0]["rows"] == 3          # results[r] is rank r's return value

Contract:

* ``fn`` must be a module-level function (it is located again in each child by module name, or
  by the module's file if that name cannot be imported there, e.g. under pytest's
  ``--import-mode=importlib``). It is called as ``fn(rank, world_size, *args, **kwargs)``.
* Each rank is a fresh ``spawn`` process with ``MASTER_ADDR=127.0.0.1``, a free
  ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` set, the
  default process group initialized (``backend``, default ``gloo``) and destroyed after ``fn``
  returns, and ``torch.set_num_threads(threads)`` applied (default 1: CI boxes are small).
  With ``backend="nccl"`` each rank also calls ``torch.cuda.set_device(rank)``.
* ``args`` / ``kwargs`` are pickled in the parent and unpickled in the child after ``fn``'s
  module is loaded, so they may be instances of classes defined in the test module.
* :func:`run_on_ranks` returns the per-rank return values in rank order, or raises
  :class:`RanksFailedError` naming every failed rank with its traceback. Use
  :func:`spawn_ranks` when failures are the expected outcome (e.g. "every rank raises
  ``DataExhaustedError``"): it returns one :class:`RankOutcome` per rank, never raises for a rank
  failure. Exceptions come back as the original type when they survive a pickle round trip,
  otherwise as :class:`RemoteRankError` carrying the type name and message.
* When one rank fails, the others get ``grace_s`` seconds to finish (they may be blocked in a
  collective with the failed rank) and are then killed; their outcome says so. The whole run
  is killed after ``timeout_s``. A rank that dies without reporting (segfault, ``os._exit``)
  gets a :class:`RemoteRankError` with its exit code.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltarec.ports import free_port

__all__ = [
    "RankOutcome",
    "RanksFailedError",
    "RemoteRankError",
    "free_port",
    "run_on_ranks",
    "spawn_ranks",
]


class RemoteRankError(Exception):
    """A rank failed with an exception that could not be sent back as itself, or died."""

    def __init__(self, type_name: str, message: str) -> None:
        self.type_name = type_name
        self.message = message
        super().__init__(f"{type_name}: {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (RemoteRankError, (self.type_name, self.message))


@dataclass
class RankOutcome:
    """What one rank produced.

    Attributes:
        rank: the rank.
        value: ``fn``'s return value (None if it failed).
        error: the exception ``fn`` raised (or a :class:`RemoteRankError`), None on success.
        traceback: the formatted traceback of ``error`` in the child ("" on success).
    """

    rank: int
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""

    @property
    def ok(self) -> bool:
        """True if ``fn`` returned normally on this rank."""
        return self.error is None


@dataclass
class RanksFailedError(Exception):
    """One or more ranks failed; ``outcomes`` holds every rank's outcome, in rank order."""

    outcomes: list[RankOutcome] = field(default_factory=list)

    def __str__(self) -> str:
        failed = [o for o in self.outcomes if not o.ok]
        parts = [f"{len(failed)} of {len(self.outcomes)} ranks failed"]
        for o in failed:
            parts.append(f"--- rank {o.rank}: {o.error!r}\n{o.traceback.rstrip()}")
        return "\n".join(parts)


def run_on_ranks(fn: Callable[..., Any], world_size: int = 2, **options: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return values.

    ``options`` are those of :func:`spawn_ranks` (``args``, ``kwargs``, ``backend``, ...).

    Returns:
        ``[value of rank 0, value of rank 1, ...]``.

    Raises:
        RanksFailedError: if any rank raised, died or timed out (every rank's outcome inside).
    """
    outcomes = spawn_ranks(fn, world_size, **options)
    if not all(o.ok for o in outcomes):
        raise RanksFailedError(outcomes)
    return [o.value for o in outcomes]


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    grace_s: float = 20.0,
    threads: int = 1,
    env: Mapping[str, str] | None = None,
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; every outcome.

    Unlike :func:`run_on_ranks` this never raises for a failed rank: each rank's
    :class:`RankOutcome` says how it ended.

    Args:
        fn: a module-level function.
        world_size: number of ranks (processes).
        args: positional arguments after ``rank, world_size`` (picklable).
        kwargs: keyword arguments (picklable).
        backend: the process group backend (``gloo`` on CPU, ``nccl`` on CUDA).
        timeout_s: the whole run is killed after this many seconds.
        grace_s: after a rank fails, the others are killed after this many seconds.
        threads: ``torch.set_num_threads`` in each rank.
        env: extra environment variables for the ranks.

    Raises:
        ValueError: if ``fn`` is not a module-level function or ``world_size < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    fn_ref = _function_ref(fn)
    payload = pickle.dumps((tuple(args), dict(kwargs or {})))
    port = free_port()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="deltarec-ranks-") as tmp:
        procs = []
        for rank in range(world_size):
            rank_env = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
                **dict(env or {}),
            }
            spec = _ChildSpec(rank, world_size, backend, threads, timeout_s, rank_env)
            p = ctx.Process(
                target=_child_main,
                args=(spec, fn_ref, payload, os.path.join(tmp, f"rank-{rank}.pkl")),
                name=f"deltarec-rank-{rank}",
            )
            p.start()
            procs.append(p)
        killed = _wait(procs, timeout_s, grace_s)
        out = Path(tmp)
        return [_outcome(r, p, out / f"rank-{r}.pkl", killed) for r, p in enumerate(procs)]


@dataclass(frozen=True)
class _ChildSpec:
    rank: int
    world_size: int
    backend: str
    threads: int
    timeout_s: float
    env: dict[str, str]


def _function_ref(fn: Callable[..., Any]) -> tuple[str, str, str]:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if not module or "<" in qualname or "." in qualname:
        raise ValueError(f"{fn!r} must be a module-level function to run on several ranks")
    mod = sys.modules.get(module)
    path = getattr(mod, "__file__", None) or ""
    return module, path, qualname


def _load_function(module: str, path: str, qualname: str) -> Callable[..., Any]:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        if not path:
            raise
        spec = importlib.util.spec_from_file_location(module, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load module {module!r} from {path}") from None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[module] = mod
        spec.loader.exec_module(mod)
    fn: Callable[..., Any] = getattr(mod, qualname)
    return fn


def _child_main(spec: _ChildSpec, fn_ref: tuple[str, str, str], payload: bytes, out: str) -> None:
    os.environ.update(spec.env)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(spec.threads)
        fn = _load_function(*fn_ref)
        args, kwargs = pickle.loads(payload)
        if spec.backend == "nccl":
            torch.cuda.set_device(spec.rank)
        dist.init_process_group(
            spec.backend,
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=spec.timeout_s),
        )
        try:
            value = fn(spec.rank, spec.world_size, *args, **kwargs)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        _write(out, ("ok", value, ""))
    except BaseException as e:
        _write(out, ("error", _picklable(e), traceback.format_exc()))
        sys.stderr.flush()
        os._exit(1)


def _picklable(e: BaseException) -> BaseException:
    try:
        back = pickle.loads(pickle.dumps(e))
    except Exception:
        return RemoteRankError(type(e).__name__, str(e))
    return back if isinstance(back, BaseException) else RemoteRankError(type(e).__name__, str(e))


def _write(path: str, record: tuple[str, Any, str]) -> None:
    tmp = path + ".tmp"
    try:
        data = pickle.dumps(record)
    except Exception as e:
        data = pickle.dumps(("error", RemoteRankError("UnpicklableResult", repr(e)), ""))
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _wait(procs: list[Any], timeout_s: float, grace_s: float) -> dict[int, str]:
    """Wait for the ranks; kill stragglers. Returns ``{rank: why it was killed}``."""
    deadline = time.monotonic() + timeout_s
    why_deadline = f"timed out after {timeout_s:.0f} s"
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed and deadline > now + grace_s:
            deadline = now + grace_s
            why_deadline = f"killed {grace_s:.0f} s after rank {failed[0]} failed"
        if now >= deadline:
            break
        time.sleep(0.05)
    killed = {}
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            killed[r] = why_deadline
        p.join()
    return killed


def _outcome(rank: int, proc: Any, path: Path, killed: dict[int, str]) -> RankOutcome:
    if rank in killed:
        return RankOutcome(rank, error=RemoteRankError("Killed", killed[rank]))
    if not path.exists():
        return RankOutcome(
            rank,
            error=RemoteRankError("Died", f"exited with code {proc.exitcode} without a result"),
        )
    status, value, tb = pickle.loads(path.read_bytes())
    if status == "ok":
        return RankOutcome(rank, value=value)
    return RankOutcome(rank, error=value, traceback=tb)
