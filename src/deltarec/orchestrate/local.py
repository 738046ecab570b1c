"""Run the pipeline on this machine with ``kfp.local`` (SubprocessRunner, no network).

The steps run as subprocesses of the current Python environment (``use_venv=False``, no
``packages_to_install``), so nothing is downloaded; images and Secrets are ignored locally.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from deltarec.orchestrate.params import PipelineParams
from deltarec.orchestrate.types import GenerationRecord, StepFailedError

log = logging.getLogger(__name__)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@contextlib.contextmanager
def _route_output(output: TextIO | None) -> Iterator[None]:
    """Send stdout and every log record to ``output`` while kfp.local runs (if given).

    The root logger's handlers and level are the caller's again afterwards, with or without
    ``output``: kfp.local swaps them for a handler of its own while it runs, and a fan-out
    (``dsl.ParallelFor``) can leave that handler behind, bound to the stdout of the time.
    """
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    if output is not None:
        root.handlers = [logging.StreamHandler(output)]
    try:
        with contextlib.redirect_stdout(output) if output is not None else contextlib.nullcontext():
            yield
    finally:
        root.handlers, root.level = handlers, level


@dataclass(frozen=True)
class LocalRunResult:
    """What a local pipeline run produced.

    Attributes:
        verdict: verify's verdict, ``"PASS"`` (then the generation was promoted) or ``"FAIL"``
            (then the FAIL branch ran and the run ended failed).
        generation: the generation the train step produced.
        metrics: verify's metrics (name -> value).
        report_path: the HTML report of verify.
        pipeline_root: where kfp.local kept every step's outputs and logs.
        failure: on FAIL, what kfp.local reported of the failed run (names the task).
    """

    verdict: str
    generation: GenerationRecord
    metrics: dict[str, float]
    report_path: str
    pipeline_root: str
    failure: str = ""

    @property
    def promoted(self) -> int | None:
        """The generation promote recorded, or None when verify failed (promote skipped)."""
        return self.generation.generation if self.verdict == "PASS" else None


def run_local(
    params: PipelineParams, *, pipeline_root: str, output: TextIO | None = None
) -> LocalRunResult:
    """Run the pipeline locally and return what it produced.

    provision -> train -> verify -> promote on PASS; on FAIL the ``verify-failed`` branch
    drops staging or rolls back, calls the webhook and fails the run: the result then has
    verdict ``FAIL`` and the verify report, read from the run's outputs on disk.

    Args:
        params: the pipeline's arguments.
        pipeline_root: where kfp.local keeps every step's outputs.
        output: where kfp.local's log and the steps' own output go (line by line); None
            keeps them on stdout.

    Raises:
        StepFailedError: a step other than the FAIL branch failed (names it).
    """
    from kfp import local

    from deltarec.orchestrate.pipeline import build_pipeline
    from deltarec.orchestrate.trainjob_local import local_backend

    os.makedirs(pipeline_root, exist_ok=True)
    before = set(os.listdir(pipeline_root))
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=os.path.abspath(pipeline_root),
        raise_on_error=True,
    )
    pipeline = build_pipeline(secrets=(), accelerators=False)
    failure = ""
    with warnings.catch_warnings(), _route_output(output), local_backend(params):
        # The runner warns that base images and accelerators are ignored locally: expected.
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="kfp")
        warnings.filterwarnings("ignore", category=UserWarning, module="kfp")
        try:
            pipeline(**params.arguments())
        except RuntimeError as e:
            failure = _ANSI.sub("", str(e))
            if "verify-failed" not in failure:
                raise StepFailedError("pipeline", 1, failure) from e
    runs = sorted(set(os.listdir(pipeline_root)) - before)
    if not runs:
        raise StepFailedError("pipeline", 1, f"kfp.local left no run under {pipeline_root}")
    run_dir = os.path.join(os.path.abspath(pipeline_root), runs[-1])
    verify_out = _executor_output(run_dir, "verify")
    artifacts = verify_out.get("artifacts", {})
    metrics = _artifact(artifacts, "metrics")
    return LocalRunResult(
        verdict=str(verify_out.get("parameterValues", {}).get("Output", "")),
        generation=_generation(run_dir),
        metrics={k: float(v) for k, v in metrics.get("metadata", {}).items()},
        report_path=os.path.join(run_dir, "verify", "report"),
        pipeline_root=os.path.abspath(pipeline_root),
        failure=failure,
    )


def _executor_output(run_dir: str, task: str) -> dict[str, Any]:
    path = os.path.join(run_dir, task, "executor_output.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise StepFailedError(task, 1, f"kfp.local left no output of {task!r}: {e}") from e
    return data if isinstance(data, dict) else {}


def _artifact(artifacts: dict[str, Any], name: str) -> dict[str, Any]:
    entries = artifacts.get(name, {}).get("artifacts", [])
    return entries[0] if entries else {}


def _generation(run_dir: str) -> GenerationRecord:
    """The train step's record: the one-node ``train`` task's, else the ``train-launcher``'s."""
    task = "train" if os.path.isdir(os.path.join(run_dir, "train")) else "train-launcher"
    entry = _artifact(_executor_output(run_dir, task).get("artifacts", {}), "generation")
    path = os.path.join(run_dir, task, "generation")
    return GenerationRecord.from_metadata(dict(entry.get("metadata") or {}), path)
