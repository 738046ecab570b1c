"""Orchestration: the Kubeflow pipeline, its components and the entry points they call.

Modules:

* ``steps``: one entry point per pipeline step (provision, train, verify, promote, rollback);
  the components call exactly these. Plain Python, tested without KFP.
* ``components``: the KFP v2 components (thin bodies that call ``steps``); imports kfp.
* ``pipeline``: ``build_pipeline``, ``compile_pipeline``, ``compile_component``, ``submit``.
* ``local``: ``run_local`` (kfp.local SubprocessRunner, no network).
* ``pytorchjob``: the Training Operator PyTorchJob manifest and its create/wait logic.
* ``params``: ``PipelineParams`` (the pipeline's validated parameters).
* ``images``: the pinned container images (``TRAINER_IMAGE``, ``TOOLS_IMAGE``).
* ``types``: ``GenerationRecord``, ``SecretEnv``, ``StepFailedError``, ``TrainJobFailedError``.

Importing this package does not import kfp, kubernetes or torch.
"""

from deltarec.orchestrate.params import PipelineParams, parse_params
from deltarec.orchestrate.types import (
    GenerationRecord,
    SecretEnv,
    StepFailedError,
    TrainJobFailedError,
    default_secrets,
)

__all__ = [
    "GenerationRecord",
    "PipelineParams",
    "SecretEnv",
    "StepFailedError",
    "TrainJobFailedError",
    "default_secrets",
    "parse_params",
]
