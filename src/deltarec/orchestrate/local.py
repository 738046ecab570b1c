"""Run the pipeline on this machine with ``kfp.local`` (SubprocessRunner, no network).

The steps run as subprocesses of the current Python environment (``use_venv=False``, no
``packages_to_install``), so nothing is downloaded; images and Secrets are ignored locally.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from deltarec.orchestrate.params import PipelineParams
from deltarec.orchestrate.steps import read_record
from deltarec.orchestrate.types import GenerationRecord, StepFailedError

log = logging.getLogger(__name__)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@contextlib.contextmanager
def _route_output(output: TextIO | None) -> Iterator[None]:
    """Send stdout and every log record to ``output`` while kfp.local runs (if given)."""
    if output is None:
        yield
        return
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers = [logging.StreamHandler(output)]
    try:
        with contextlib.redirect_stdout(output):
            yield
    finally:
        root.handlers, root.level = handlers, level


@dataclass(frozen=True)
class LocalRunResult:
    """What a local pipeline run produced.

    Attributes:
        verdict: verify's verdict, ``"PASS"`` (then the generation was promoted) or ``"FAIL"``.
        generation: the generation the train step produced.
        metrics: verify's metrics (name -> value).
        report_path: the HTML report of verify.
        pipeline_root: where kfp.local kept every step's outputs and logs.
    """

    verdict: str
    generation: GenerationRecord
    metrics: dict[str, float]
    report_path: str
    pipeline_root: str

    @property
    def promoted(self) -> int | None:
        """The generation promote recorded, or None when verify failed (promote skipped)."""
        return self.generation.generation if self.verdict == "PASS" else None


def run_local(
    params: PipelineParams, *, pipeline_root: str, output: TextIO | None = None
) -> LocalRunResult:
    """Run provision -> train -> verify -> promote locally and return what it produced.

    Args:
        params: the pipeline's arguments.
        pipeline_root: where kfp.local keeps every step's outputs.
        output: where kfp.local's log and the steps' own output go (line by line); None
            keeps them on stdout.

    Raises:
        StepFailedError: a step failed (kfp.local names it in its log above the error).
    """
    from kfp import local

    from deltarec.orchestrate.pipeline import build_pipeline

    os.makedirs(pipeline_root, exist_ok=True)
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=os.path.abspath(pipeline_root),
        raise_on_error=True,
    )
    pipeline = build_pipeline(secrets=())
    with warnings.catch_warnings(), _route_output(output):
        # The runner warns that base images and accelerators are ignored locally: expected.
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="kfp")
        warnings.filterwarnings("ignore", category=UserWarning, module="kfp")
        try:
            task = pipeline(**params.arguments())
        except RuntimeError as e:
            raise StepFailedError("pipeline", 1, _ANSI.sub("", str(e))) from e
    outputs: dict[str, Any] = task.outputs
    metrics = outputs["metrics"]
    return LocalRunResult(
        verdict=str(outputs["verdict"]),
        generation=read_record(outputs["generation"]),
        metrics={k: float(v) for k, v in dict(metrics.metadata).items()},
        report_path=outputs["report"].path,
        pipeline_root=os.path.abspath(pipeline_root),
    )
